"""The Moment paper's model: a single-commodity max flow inside a time bisection.

The smallest T such that, every capacity scaled by T, each GPU receives its demand. Any GPU may
take its bytes from any bin, so GPU 0 may read only the SSDs near it. The max flow itself runs
on one of :data:`~moment.planner.flow.engines.MAX_FLOW_ENGINES`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from moment.errors import MomentError
from moment.planner.flow.engines import MAX_FLOW_ENGINES
from moment.planner.flow.prediction import FlowModel, Prediction, check_tiers, finish
from moment.planner.network import INF, LINK_EDGES, Network, edge_kind, gpu_node


def moved_demand_gb(net: Network) -> float:
    """Bytes moved to each GPU per iteration: its feature bytes, each tier's share times the
    bytes that tier moves per feature byte (whole pages from the SSDs)."""
    return net.demand_gb * sum(share * net.tier_moved(tier) for tier, share in net.shares.items())


def _paper_arcs(net: Network, t: float) -> tuple[list[tuple[str, str, float]], list[str | None]]:
    G, D = len(net.gpus), net.demand_gb
    arcs: list[tuple[str, str, float]] = []
    keys: list[str | None] = []
    for tier, share in net.shares.items():  # the flow is in bytes moved
        arcs.append(("src", f"T:{tier}", share * D * G * net.tier_moved(tier)))
        keys.append(None)
        for b in net.tier_bins(tier):
            arcs.append((f"T:{tier}", b.node, INF))
            keys.append(None)
    for key, (u, v, cap) in net.edges.items():
        arcs.append((u, v, INF if cap >= INF or (t >= INF and cap > 0) else cap * t))
        keys.append(key)
    for g in net.gpus:
        arcs.append((gpu_node(g), "sink", moved_demand_gb(net)))
        keys.append(None)
    return arcs, keys


def paper(net: Network, engine: str = "ortools", upper_s: float | None = None, rel_tol: float = 1e-6) -> Prediction:
    """Smallest T at which the max flow delivers every GPU's demand (bisection on T).

    The flow is in bytes moved: each tier supplies its share × the bytes it moves per feature
    byte (``net.tier_moved``), each GPU takes the moved bytes of its share of every tier. A GPU's
    moved bytes then hold its feature bytes exactly where it gets the tier mix (as the
    proportional model has it); where the flow gives one GPU more SSD bytes than another, their
    feature bytes differ by the pages' overhead, the price of keeping this a plain max flow."""
    check_tiers(net)
    flow_func = MAX_FLOW_ENGINES[engine]
    need = moved_demand_gb(net) * len(net.gpus)

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
    useful = net.demand_gb * len(net.gpus)
    share = {b.id: out_of[b.node] / net.moved(b.id) / useful if useful else 0.0 for b in net.bins}
    pred = finish(net, f"paper[{engine}]", hi, share, load, {g: set() for g in net.gpus})
    # A single-commodity flow does not say which bytes reach which GPU; each GPU's demand is
    # delivered exactly at T, so every GPU is credited with T.
    pred.per_gpu_s = {g: hi for g in net.gpus}
    return pred


def explain_difference(net: Network, paper_p: Prediction, prop: Prediction) -> str | None:
    """Why the proportional model is slower than the paper's, in one sentence (None if they agree)."""
    if prop.iteration_s <= paper_p.iteration_s * 1.01:
        return None
    slower = prop.iteration_s / paper_p.iteration_s - 1
    links = [e for e in prop.bottleneck if edge_kind(e) in LINK_EDGES]
    names = " and ".join(net.labels[e] for e in links[:2]) or "a shared link"
    return (
        f"proportional share is {slower:.0%} slower: random sampling makes every GPU read every bin, so "
        f"{names} fill(s) with traffic the paper's max flow routes around (it lets each GPU read only the "
        f"bins near it)"
    )


def _predict(net: Network, engine: str, known: Mapping[str, Prediction]) -> Prediction:
    """The proportional time, where known, is the bisection's first bracket (never faster than this)."""
    first = known.get("proportional")
    return paper(net, engine=engine, upper_s=first.iteration_s * 1.001 + 1e-9 if first else None)


MODEL = FlowModel("paper", "paper's max flow", _predict, explain=explain_difference)
