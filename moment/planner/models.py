"""Two flow models that predict the time of one iteration's feature reads.

* ``paper``: the Moment paper's model — a single-commodity max flow inside a time bisection:
  the smallest T such that, every capacity scaled by T, each GPU receives its demand. Any GPU may
  take its bytes from any bin, so GPU 0 may read only the SSDs near it.
* ``proportional``: what random neighbour sampling does — every GPU reads the same share of its
  bytes from each bin; the shares are chosen by an LP that minimises T.

Both work on the same :class:`~moment.planner.network.Network`. The paper model has two
interchangeable max-flow engines (ortools on scaled integers, networkx as the reference), chosen
by a parameter as networkx's own ``flow_func`` is.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from moment.errors import MomentError
from moment.planner.network import INF, Network

TIGHT = 0.995  # an edge this full at the optimum is a bottleneck


@dataclass
class Prediction:
    """One model's answer for one layout."""

    model: str
    iteration_s: float
    bin_share: dict[str, float]  # share of all feature bytes each bin serves (sums to 1)
    edge_load_gb: dict[str, float]  # GB per iteration over each edge
    utilisation: dict[str, float]  # load / (capacity × T)
    per_gpu_s: dict[str, float]  # time each GPU's own reads need at these loads
    bottleneck: list[str] = field(default_factory=list)
    link_load: float = 0.0  # Σ load/capacity over links, per unit T: lower = more headroom
    ssd_counts: dict[str, int] = field(default_factory=dict)  # MILP: SSDs per slot class

    def gbps_per_gpu(self, net: Network) -> list[float]:
        return [net.demand_gb / self.per_gpu_s[g] if self.per_gpu_s[g] > 0 else INF for g in net.gpus]


def _check_tiers(net: Network) -> None:
    for tier, share in net.shares.items():
        if share > 1e-9 and not net.tier_bins(tier):
            where = {"gpu": "GPUs", "cpu": "CPU sockets", "ssd": "SSDs"}[tier]
            raise MomentError(f"the workload needs the {tier} tier ({share:.1%} of reads) but the layout has no {where}")
    if not net.gpus:
        raise MomentError("the layout has no GPU")


def _finish(net: Network, model: str, t: float, share: dict[str, float], load: dict[str, float],
            gpu_edges: dict[str, set[str]]) -> Prediction:
    util = {k: load.get(k, 0.0) / (cap * t) for k, (_, _, cap) in net.edges.items() if cap < INF and t > 0}
    per_gpu = {
        g: max((load.get(e, 0.0) / net.edges[e][2] for e in gpu_edges[g] if net.edges[e][2] < INF), default=0.0)
        for g in net.gpus
    }
    bottleneck = sorted((k for k, u in util.items() if u >= TIGHT), key=lambda k: -util[k])
    return Prediction(model, t, share, load, util, per_gpu, bottleneck)


# --- proportional-share LP ------------------------------------------------------------------


THETA_MAX = 1e9  # iterations per second beyond which an answer counts as "no time at all"


def _solved(solver) -> bool:
    """Solve; on a failure, again from scratch, then from scratch without presolve.

    GLOP misreports some small, well-posed LPs: ABNORMAL from its presolve, or INFEASIBLE when
    re-solving warm from the previous pass (machine B with its switch uplink measured at 0.9-1.2
    or 2.7 GB/s, say). Answers that solve at once stay exactly as they were."""
    from ortools.linear_solver import pywraplp

    if solver.Solve() == pywraplp.Solver.OPTIMAL:
        return True
    fresh = pywraplp.MPSolverParameters()
    fresh.SetIntegerParam(fresh.INCREMENTALITY, fresh.INCREMENTALITY_OFF)
    if solver.Solve(fresh) == pywraplp.Solver.OPTIMAL:
        return True
    fresh.SetIntegerParam(fresh.PRESOLVE, fresh.PRESOLVE_OFF)
    return solver.Solve(fresh) == pywraplp.Solver.OPTIMAL


@dataclass
class SsdClass:
    """SSDs a layout may put in one slot class, stood for by one representative bin."""

    max_count: int
    rate_gbps: float  # one SSD's deliverable rate: min(read rate, its link)
    uplink: str  # the representative's own link edge (per SSD, so it scales with the count)


def proportional(net: Network, second_pass: bool = True, ssd_classes: dict[str, SsdClass] | None = None,
                 n_ssds: int = 0) -> Prediction:
    """Min T such that every GPU reads share x_b of its bytes from bin b (same x for all GPUs).

    Solved as "max θ = 1/T" with u_b = x_b·θ, which keeps every constraint linear even when the
    number of SSDs per slot class is a variable too (``ssd_classes``: a MILP choosing how many
    of ``n_ssds`` SSDs go in each class, each class's representative bin scaled by its count).
    The LP runs on GLOP, the MILP on SCIP. A second pass keeps θ and minimises the total of
    load/capacity, so that among equally fast answers the one that spreads traffic and uses
    short paths is reported (the search ranks with the first pass and details what it keeps).
    Coefficients are summed per edge before they reach the solver: one row per link, one column
    per bin, quick to build.
    """
    from ortools.linear_solver import pywraplp

    ssd_classes = ssd_classes or {}
    if not ssd_classes:
        _check_tiers(net)
    D, G = net.demand_gb, len(net.gpus)
    solver = pywraplp.Solver.CreateSolver("SCIP" if ssd_classes else "GLOP")
    inf = solver.infinity()
    theta = solver.NumVar(0.0, THETA_MAX, "theta")
    u = {b.id: solver.NumVar(0.0, inf, f"u[{b.id}]") for b in net.bins}
    for tier, share in net.shares.items():
        bins = net.tier_bins(tier)
        if bins:
            row = solver.Constraint(0.0, 0.0)
            row.SetCoefficient(theta, -share)
            for b in bins:
                row.SetCoefficient(u[b.id], 1.0)
    count = {}
    skip = set()
    if ssd_classes:
        total = solver.Constraint(n_ssds, n_ssds)
        for bin_id, cls in ssd_classes.items():
            count[bin_id] = solver.IntVar(0, cls.max_count, f"n[{bin_id}]")
            total.SetCoefficient(count[bin_id], 1.0)
            row = solver.Constraint(-inf, 0.0)  # G·D·u ≤ n·rate
            row.SetCoefficient(u[bin_id], G * D)
            row.SetCoefficient(count[bin_id], -cls.rate_gbps)
            skip |= {f"read:{bin_id}", cls.uplink}
    # (gpu, path, variable) for every route; a variable per path only where there is a choice.
    routes: list[tuple[str, list[str], object]] = []
    for (b, g), alts in net.paths.items():
        if len(alts) == 1:
            routes.append((g, alts[0], u[b]))
            continue
        split = solver.Constraint(0.0, 0.0)
        split.SetCoefficient(u[b], -1.0)
        for i, path in enumerate(alts):
            v = solver.NumVar(0.0, inf, f"f[{b},{g},{i}]")
            split.SetCoefficient(v, 1.0)
            routes.append((g, path, v))
    coef: dict[str, dict[object, float]] = defaultdict(lambda: defaultdict(float))
    for _, path, var in routes:
        for e in path:
            if net.edges[e][2] < INF and e not in skip:
                coef[e][var] += D
    spread: dict[object, float] = defaultdict(float)
    for e, terms in coef.items():
        cap = net.edges[e][2]
        row = solver.Constraint(-inf, cap)
        for var, c in terms.items():
            row.SetCoefficient(var, c)
            spread[var] += c / cap
    objective = solver.Objective()
    objective.SetCoefficient(theta, 1.0)
    objective.SetMaximization()
    if not _solved(solver):
        raise MomentError("proportional-share model found no solution (is every GPU reachable from every bin?)")
    theta_star = theta.solution_value()
    if theta_star <= 0:
        raise MomentError("proportional-share model: the demand cannot be delivered")
    if spread and second_pass:  # same θ, least total normalised load
        for var in count.values():  # keep the counts the first pass chose
            var.SetBounds(var.solution_value(), var.solution_value())
        for give in (1e-7, 1e-6, 1e-5, 1e-4):  # GLOP's θ can sit a tolerance above the true optimum
            theta.SetLb(theta_star * (1 - give))
            if _minimise_load(solver, objective, spread):
                break
        else:
            raise MomentError("proportional-share model: second pass failed")
        _balance(solver, objective, spread, net, u)
    th = theta.solution_value()
    t = 0.0 if th >= THETA_MAX * (1 - 1e-6) else 1.0 / th  # (the second pass may give up 1e-7..1e-4 of θ)
    value = {var: var.solution_value() / th for _, _, var in routes}  # type: ignore[attr-defined]
    load = {e: sum(c * value[var] for var, c in terms.items()) for e, terms in coef.items()}
    for bin_id, cls in ssd_classes.items():  # per-SSD edges of a class, as carried by all of it
        load[f"read:{bin_id}"] = load[cls.uplink] = G * D * u[bin_id].solution_value() / th
    gpu_edges: dict[str, set[str]] = defaultdict(set)
    for g, path, var in routes:
        if value[var] > 1e-12:
            gpu_edges[g].update(path)
    share = {b.id: u[b.id].solution_value() / th for b in net.bins}
    pred = _finish(net, "proportional", t, share, load, gpu_edges)
    pred.link_load = sum(load[e] / net.edges[e][2] for e in load if e in coef) / max(t, 1e-12)
    pred.ssd_counts = {b: round(v.solution_value()) for b, v in count.items()}
    return pred


def _balance(solver, objective, spread: dict, net: Network, u: dict) -> None:
    """Third pass: at the same time and (nearly) the same link load, spread each tier's share as
    evenly as its bins allow (min of the largest share in each tier). Symmetric bins then get
    equal targets instead of whatever vertex of the LP's optimal face the solver returned.
    If the solver balks at the added rows (GLOP can, on tight tolerances), the second pass's
    answer is restored."""
    best = sum(c * var.solution_value() for var, c in spread.items())
    keep = solver.Constraint(-solver.infinity(), best * (1 + 1e-4) + 1e-9)
    for var, c in spread.items():
        keep.SetCoefficient(var, c)
    objective.Clear()
    for tier in net.shares:
        bins = net.tier_bins(tier)
        if len(bins) < 2:
            continue
        z = solver.NumVar(0.0, solver.infinity(), f"z[{tier}]")
        for b in bins:
            row = solver.Constraint(-solver.infinity(), 0.0)
            row.SetCoefficient(u[b.id], 1.0)
            row.SetCoefficient(z, -1.0)
        objective.SetCoefficient(z, 1.0)
    objective.SetMinimization()
    for slack in (1e-4, 1e-3, 1e-2):
        keep.SetUb(best * (1 + slack) + 1e-9)
        if _solved(solver):
            return
    keep.SetUb(solver.infinity())
    if not _minimise_load(solver, objective, spread):
        raise MomentError("proportional-share model: second pass failed")


def _minimise_load(solver, objective, spread: dict) -> bool:
    """Second pass: least total normalised link load (the time is held by the caller); False
    when the solver finds no answer."""
    objective.Clear()
    for var, c in spread.items():
        objective.SetCoefficient(var, c)
    objective.SetMinimization()
    return _solved(solver)


# --- paper model: max flow inside a time bisection ------------------------------------------

MaxFlow = Callable[[list[tuple[str, str, float]], str, str], tuple[float, list[float]]]


def ortools_max_flow(arcs: list[tuple[str, str, float]], source: str, sink: str) -> tuple[float, list[float]]:
    """Max flow with ortools SimpleMaxFlow on integer capacities.

    No arc can carry more than leaves the source, so every capacity is first capped at that
    supply; the integer unit is then 1e-12 of the supply. Scaling by the largest capacity instead
    made the rounding grow with T (a 100 GB/s DRAM edge × T), until a slow link never reached
    the demand's tolerance and the bisection gave up ("cut off").
    """
    from ortools.graph.python import max_flow

    supply = sum(c for u, _, c in arcs if u == source)
    if supply <= 0:
        return 0.0, [0.0] * len(arcs)
    cap_limit = supply if supply < INF else max((c for _, _, c in arcs if c < INF), default=1.0) * 1e3
    unit = cap_limit / 1e12
    index: dict[str, int] = {}
    mf = max_flow.SimpleMaxFlow()
    for u, v, cap in arcs:
        iu, iv = index.setdefault(u, len(index)), index.setdefault(v, len(index))
        mf.add_arc_with_capacity(iu, iv, round(min(cap, cap_limit) / unit))
    if source not in index or sink not in index:
        return 0.0, [0.0] * len(arcs)
    status = mf.solve(index[source], index[sink])
    if status != mf.OPTIMAL:
        raise MomentError(f"ortools max flow failed with status {status}")
    return mf.optimal_flow() * unit, [mf.flow(i) * unit for i in range(len(arcs))]


def networkx_max_flow(arcs: list[tuple[str, str, float]], source: str, sink: str) -> tuple[float, list[float]]:
    """Max flow with networkx (preflow-push) on float capacities: the reference engine."""
    import networkx as nx

    graph = nx.DiGraph()
    mids = []
    for i, (u, v, cap) in enumerate(arcs):
        # A middle node per arc keeps parallel arcs apart and lets flows be read back per arc.
        mid = ("arc", i)
        mids.append(mid)
        graph.add_edge(u, mid, **({} if cap >= INF else {"capacity": cap}))
        graph.add_edge(mid, v)
    if source not in graph or sink not in graph:
        return 0.0, [0.0] * len(arcs)
    value, flow = nx.maximum_flow(graph, source, sink)
    return value, [flow[u][mid] for (u, _, _), mid in zip(arcs, mids)]


ENGINES: dict[str, MaxFlow] = {"ortools": ortools_max_flow, "networkx": networkx_max_flow}


def _paper_arcs(net: Network, t: float) -> tuple[list[tuple[str, str, float]], list[str | None]]:
    G, D = len(net.gpus), net.demand_gb
    arcs: list[tuple[str, str, float]] = []
    keys: list[str | None] = []
    for tier, share in net.shares.items():
        arcs.append(("src", f"T:{tier}", share * D * G))
        keys.append(None)
        for b in net.tier_bins(tier):
            arcs.append((f"T:{tier}", b.node, INF))
            keys.append(None)
    for key, (u, v, cap) in net.edges.items():
        arcs.append((u, v, INF if cap >= INF or (t >= INF and cap > 0) else cap * t))
        keys.append(key)
    for g in net.gpus:
        arcs.append((f"G:{g}", "sink", D))
        keys.append(None)
    return arcs, keys


def paper(net: Network, engine: str = "ortools", upper_s: float | None = None, rel_tol: float = 1e-6) -> Prediction:
    """Smallest T at which the max flow delivers every GPU's demand (bisection on T)."""
    _check_tiers(net)
    flow_func = ENGINES[engine]
    need = net.demand_gb * len(net.gpus)

    def feasible(t: float) -> tuple[bool, list[float]]:
        arcs, _ = _paper_arcs(net, t)
        value, flows = flow_func(arcs, "src", "sink")
        return value >= need * (1 - 1e-7), flows

    ok, flows = feasible(0.0)
    if ok:  # only unlimited edges needed (e.g. every GPU reads its own cache): no time at all
        hi = 0.0
    elif not feasible(INF)[0]:  # not even with all the time there is: no path, however slow
        raise MomentError("paper model: the demand cannot be delivered (a GPU is cut off from the bins)")
    else:  # some time delivers it: double until it does, however slow the links
        hi = upper_s or 1.0
        ok, flows = feasible(hi)
    while not ok:
        hi *= 2
        ok, flows = feasible(hi)
    lo = 0.0
    while hi - lo > rel_tol * hi and hi > 0:
        mid = (lo + hi) / 2
        ok, f = feasible(mid)
        if ok:
            hi, flows = mid, f
        else:
            lo = mid
    arcs, keys = _paper_arcs(net, hi)
    load = {k: fl for k, fl in zip(keys, flows) if k is not None and fl > 1e-12}
    out_of: dict[str, float] = defaultdict(float)
    for (u, _, _), fl in zip(arcs, flows):
        out_of[u] += fl
    share = {b.id: out_of[b.node] / need for b in net.bins}
    pred = _finish(net, f"paper[{engine}]", hi, share, load, {g: set() for g in net.gpus})
    # A single-commodity flow does not say which bytes reach which GPU; each GPU's demand is
    # delivered exactly at T, so every GPU is credited with T.
    pred.per_gpu_s = {g: hi for g in net.gpus}
    return pred


def explain_difference(net: Network, paper_p: Prediction, prop: Prediction) -> str | None:
    """Why the proportional model is slower than the paper's, in one sentence (None if they agree)."""
    if prop.iteration_s <= paper_p.iteration_s * 1.01:
        return None
    slower = prop.iteration_s / paper_p.iteration_s - 1
    links = [e for e in prop.bottleneck if e.split(":", 1)[0] in ("up", "down", "upi", "nv")]
    names = " and ".join(net.labels[e] for e in links[:2]) or "a shared link"
    return (
        f"proportional share is {slower:.0%} slower: random sampling makes every GPU read every bin, so "
        f"{names} fill(s) with traffic the paper's max flow routes around (it lets each GPU read only the "
        f"bins near it)"
    )


def close(a: float, b: float, rel: float = 1e-3) -> bool:
    return math.isclose(a, b, rel_tol=rel)
