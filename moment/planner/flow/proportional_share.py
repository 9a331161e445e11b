"""The proportional-share model: what random neighbour sampling does.

Every GPU reads the same share of its bytes from each bin; the shares are chosen by an LP that
minimises the iteration time T. With ``ssd_classes`` it is a MILP that also chooses how many
SSDs go in each slot class (the layout search's ``milp`` method).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moment.errors import MomentError
from moment.planner.flow.milp import MILP_SOLVERS
from moment.planner.flow.prediction import FlowModel, Prediction, check_tiers, finish
from moment.planner.network import INF, Network, read_edge

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
    rate_gbps: float  # one SSD's deliverable rate of bytes moved: min(its read rate, IOPS bound, its link)
    uplink: str  # the representative's own link edge (per SSD, so it scales with the count)


def proportional(
    net: Network,
    second_pass: bool = True,
    ssd_classes: dict[str, SsdClass] | None = None,
    n_ssds: int = 0,
    milp_solver: str = "ortools",
) -> Prediction:
    """Min T such that every GPU reads share x_b of its bytes from bin b (same x for all GPUs).

    Bin b's share moves x_b × its ``net.moved(b)`` (whole SSD pages) over every edge of its path.

    Solved as "max θ = 1/T" with u_b = x_b·θ, which keeps every constraint linear even when the
    number of SSDs per slot class is a variable too (``ssd_classes``: a MILP choosing how many
    of ``n_ssds`` SSDs go in each class, each class's representative bin scaled by its count).
    The LP runs on GLOP, the MILP on ``milp_solver`` (:data:`~moment.planner.flow.milp.MILP_SOLVERS`:
    ortools' SCIP, or CBC through PuLP). A second pass keeps θ and minimises the total of
    load/capacity, so that among equally fast answers the one that spreads traffic and uses
    short paths is reported (the search ranks with the first pass and details what it keeps).
    Coefficients are summed per edge before they reach the solver: one row per link, one column
    per bin, quick to build.
    """
    from ortools.linear_solver import pywraplp

    ssd_classes = ssd_classes or {}
    if not ssd_classes:
        check_tiers(net)
    D, G = net.demand_gb, len(net.gpus)
    solver = MILP_SOLVERS[milp_solver]() if ssd_classes else pywraplp.Solver.CreateSolver("GLOP")
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
            row = solver.Constraint(-inf, 0.0)  # G·D·u·moved ≤ n·rate
            row.SetCoefficient(u[bin_id], G * D * net.moved(bin_id))
            row.SetCoefficient(count[bin_id], -cls.rate_gbps)
            skip |= {read_edge(bin_id), cls.uplink}
    # (gpu, path, variable, bytes moved per feature byte) for every route; a variable per path
    # only where there is a choice.
    # The variables are the solver's (ortools' or the PuLP adapter's), untyped: Any.
    routes: list[tuple[str, list[str], Any, float]] = []
    for (bin_id, g), alts in net.paths.items():
        if len(alts) == 1:
            routes.append((g, alts[0], u[bin_id], net.moved(bin_id)))
            continue
        split = solver.Constraint(0.0, 0.0)
        split.SetCoefficient(u[bin_id], -1.0)
        for i, path in enumerate(alts):
            v = solver.NumVar(0.0, inf, f"f[{bin_id},{g},{i}]")
            split.SetCoefficient(v, 1.0)
            routes.append((g, path, v, net.moved(bin_id)))
    coef: dict[str, dict[Any, float]] = defaultdict(lambda: defaultdict(float))
    for _, path, var, moved in routes:
        for e in path:
            if net.edges[e][2] < INF and e not in skip:
                coef[e][var] += D * moved
    spread: dict[Any, float] = defaultdict(float)
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
    value = {var: var.solution_value() / th for _, _, var, _ in routes}
    load = {e: sum(c * value[var] for var, c in terms.items()) for e, terms in coef.items()}
    for bin_id, cls in ssd_classes.items():  # per-SSD edges of a class, as carried by all of it
        load[read_edge(bin_id)] = load[cls.uplink] = G * D * net.moved(bin_id) * u[bin_id].solution_value() / th
    gpu_edges: dict[str, set[str]] = defaultdict(set)
    for g, path, var, _ in routes:
        if value[var] > 1e-12:
            gpu_edges[g].update(path)
    shares = {b.id: u[b.id].solution_value() / th for b in net.bins}
    pred = finish(net, "proportional", t, shares, load, gpu_edges)
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


def _predict(net: Network, engine: str, known: Mapping[str, Prediction]) -> Prediction:
    return proportional(net)


MODEL = FlowModel("proportional", "proportional share", _predict)
