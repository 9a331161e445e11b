"""What a flow model is (:class:`FlowModel`) and answers for one layout (:class:`Prediction`), and
the bookkeeping every model shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

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


def check_tiers(net: Network) -> None:
    for tier, share in net.shares.items():
        if share > 1e-9 and not net.tier_bins(tier):
            where = {"gpu": "GPUs", "cpu": "CPU sockets", "ssd": "SSDs"}[tier]
            raise MomentError(
                f"the workload needs the {tier} tier ({share:.1%} of reads) but the layout has no {where}"
            )
    if not net.gpus:
        raise MomentError("the layout has no GPU")


def finish(
    net: Network, model: str, t: float, share: dict[str, float], load: dict[str, float], gpu_edges: dict[str, set[str]]
) -> Prediction:
    util = {k: load.get(k, 0.0) / (cap * t) for k, (_, _, cap) in net.edges.items() if cap < INF and t > 0}
    per_gpu = {
        g: max((load.get(e, 0.0) / net.edges[e][2] for e in gpu_edges[g] if net.edges[e][2] < INF), default=0.0)
        for g in net.gpus
    }
    bottleneck = sorted((k for k, u in util.items() if u >= TIGHT), key=lambda k: -util[k])
    return Prediction(model, t, share, load, util, per_gpu, bottleneck)


class Predict(Protocol):
    """How :func:`~moment.planner.scoring.score` runs a flow model: on the layout's network, with
    the max-flow engine asked for (a model without a max flow ignores it) and the predictions of
    the models before it in the registry (a model may take a bound from them)."""

    def __call__(self, net: Network, engine: str, known: Mapping[str, Prediction]) -> Prediction: ...


@dataclass(frozen=True)
class FlowModel:
    """One entry of :data:`moment.planner.flow.FLOW_MODELS`."""

    name: str  # the registry key; plan.json and --json prefix the model's figures with it (paper_iteration_s)
    title: str  # how a report names its time ("paper's max flow")
    predict: Predict
    # Why its time differs from the primary model's, in one sentence (None where they agree):
    # called as explain(net, own prediction, primary prediction).
    explain: Callable[[Network, Prediction, Prediction], str | None] | None = None
