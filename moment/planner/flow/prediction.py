"""What a flow model answers for one layout, and the bookkeeping every model shares."""

from __future__ import annotations

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


def check_tiers(net: Network) -> None:
    for tier, share in net.shares.items():
        if share > 1e-9 and not net.tier_bins(tier):
            where = {"gpu": "GPUs", "cpu": "CPU sockets", "ssd": "SSDs"}[tier]
            raise MomentError(f"the workload needs the {tier} tier ({share:.1%} of reads) but the layout has no {where}")
    if not net.gpus:
        raise MomentError("the layout has no GPU")


def finish(net: Network, model: str, t: float, share: dict[str, float], load: dict[str, float],
            gpu_edges: dict[str, set[str]]) -> Prediction:
    util = {k: load.get(k, 0.0) / (cap * t) for k, (_, _, cap) in net.edges.items() if cap < INF and t > 0}
    per_gpu = {
        g: max((load.get(e, 0.0) / net.edges[e][2] for e in gpu_edges[g] if net.edges[e][2] < INF), default=0.0)
        for g in net.gpus
    }
    bottleneck = sorted((k for k, u in util.items() if u >= TIGHT), key=lambda k: -util[k])
    return Prediction(model, t, share, load, util, per_gpu, bottleneck)
