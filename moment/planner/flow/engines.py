"""Interchangeable max-flow engines for the paper model, chosen by name as networkx's own
``flow_func`` is: ortools on scaled integers (fast), networkx preflow-push on floats (the
reference). Each takes ``(arcs, source, sink)`` and returns the flow value and each arc's flow."""

from __future__ import annotations

from collections.abc import Callable

from moment.errors import MomentError
from moment.planner.network import INF

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

    graph: nx.DiGraph[str | tuple[str, int]] = nx.DiGraph()
    mids: list[tuple[str, int]] = []
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


MAX_FLOW_ENGINES: dict[str, MaxFlow] = {"ortools": ortools_max_flow, "networkx": networkx_max_flow}
