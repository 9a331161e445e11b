"""The planner's result for one layout: every flow model's prediction (:class:`Scored`), and the
plain records plan.json and ``--json`` carry (per-layout record, link loads, bin targets).

No presentation here (that is :mod:`moment.planner.report`), so the stages that act on a plan
load the model, not rich.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moment.planner.flow import FLOW_MODELS, PRIMARY, Prediction
from moment.planner.layout import apply_layout, assign_devices, names_fixed_gpus, pick_devices, slot_space
from moment.planner.network import INF, Network, skeleton_for
from moment.planner.workload import Workload
from moment.topology.model import Device, Machine

if TYPE_CHECKING:
    from moment.contracts.plan import PlanDoc


@dataclass
class Scored:
    """One layout, predicted by every flow model of :data:`~moment.planner.flow.FLOW_MODELS`."""

    name: str
    layout: dict[str, str]
    machine: Machine  # the profile with this layout installed
    net: Network
    predictions: dict[str, Prediction]  # flow model name -> its prediction, in registry order

    @property
    def prop(self) -> Prediction:
        """The primary (proportional-share) prediction: layouts are ranked by it, bin targets are its."""
        return self.predictions[PRIMARY]

    @property
    def explanation(self) -> str | None:
        """Why the other models' times differ from the primary one's (None where they agree)."""
        why = []
        for name, pred in self.predictions.items():
            explain = FLOW_MODELS[name].explain if name != PRIMARY else None
            if explain is not None and (text := explain(self.net, pred, self.prop)):
                why.append(text)
        return "; ".join(why) or None

    def bin_shares(self) -> dict[str, float]:
        """Share of all feature reads each bin should serve (stage 3's targets), by bin name."""
        return {b.id: round(self.prop.bin_share[b.id], 8) for b in self.net.bins}

    def imbalance(self) -> float:
        times = [t for t in self.prop.per_gpu_s.values() if t > 0]
        return max(times) / min(times) if times else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The per-layout record of ``plan --json``/``score --json`` and plan.json."""
        slots = []
        for port, socket in self.machine.iter_ports():
            if port.id in self.layout and port.device is not None:
                slots.append(
                    {
                        "port": port.id,
                        "slot": port.slot.name if port.slot else None,
                        "device": port.device.id,
                        "kind": port.device.kind,
                        "bdf": port.device.bdf,
                        "socket": socket.id,
                    }
                )
        record: dict[str, Any] = {
            "name": self.name,
            "layout": dict(self.layout),
            "slots": slots,
            "predicted_iteration_s": self.prop.iteration_s,
            "gbps_per_gpu": [round(x, 4) for x in self.prop.gbps_per_gpu(self.net)],
            "bottleneck": [self.net.labels[e] for e in self.prop.bottleneck],
            "bottleneck_edges": list(self.prop.bottleneck),
            "imbalance": round(self.imbalance(), 4),
        }
        for name, pred in self.predictions.items():  # the other models' figures, prefixed with their names
            if name != PRIMARY:
                record[f"{name}_iteration_s"] = pred.iteration_s
                record[f"{name}_gbps_per_gpu"] = [round(x, 4) for x in pred.gbps_per_gpu(self.net)]
                record[f"{name}_bottleneck"] = [self.net.labels[e] for e in pred.bottleneck]
        record["models_differ"] = self.explanation
        return record


def score(
    machine: Machine,
    name: str,
    layout: dict[str, str],
    workload: Workload,
    devices: list[Device] | None = None,
    engine: str = "ortools",
) -> Scored:
    """Every flow model's prediction for one layout of ``machine`` (``engine``: the max-flow
    engine of the models that run one)."""
    placed = assign_devices(machine, layout, devices)
    net = skeleton_for(machine, names_fixed_gpus(machine, layout)).network(placed, workload)
    predictions: dict[str, Prediction] = {}
    for key, model in FLOW_MODELS.items():
        predictions[key] = model.predict(net, engine, predictions)
    return Scored(name, layout, apply_layout(machine, layout, devices), net, predictions)


def links_table(s: Scored) -> list[dict[str, Any]]:
    """Every finite link with its load, busiest first (plan.json's per-link utilisation)."""
    rows = []
    for key, (_, _, cap) in s.net.edges.items():
        if cap == INF:
            continue
        rows.append(
            {
                "edge": key,
                "label": s.net.labels[key],
                "capacity_gbps": cap,
                "load_gb": round(s.prop.edge_load_gb.get(key, 0.0), 6),
                "utilisation": round(s.prop.utilisation.get(key, 0.0), 6),
            }
        )
    return sorted(rows, key=lambda r: -r["utilisation"])


def bin_targets(s: Scored, workload: Workload) -> list[dict[str, Any]]:
    """Share of all feature reads each bin should serve (stage 3's targets) and its size: the
    caches' from the workload (one copy per GPU / per socket), an SSD's its capacity."""
    where = {p.device.id: (p.id, sock.id, p.device) for p, sock in s.machine.iter_ports() if p.device is not None}
    caches = dict(zip(("gpu", "cpu"), (rows * workload.row_bytes / 1e9 for rows in workload.cache_rows())))
    shares = s.bin_shares()
    out = []
    for b in s.net.bins:
        if b.tier in caches:
            port, socket, capacity = None, None, caches[b.tier]
        else:
            port, socket, dev = where[b.id]
            capacity = dev.capacity_gb
        out.append(
            {
                "bin": b.id,
                "tier": b.tier,
                "share": shares[b.id],
                "port": port,
                "socket": socket,
                "capacity_gb": capacity,
            }
        )
    return out


def rescore(plan: PlanDoc, machine: Machine, workload: Workload) -> Scored:
    """The plan's layout of ``machine`` (the profile it was made for) scored again for another
    ``workload`` (``moment place``'s measured one): the plan's devices, what-if ones included,
    picked as the planner picks them."""
    layout = {s.port: s.device for s in plan.layout.slots}
    space = slot_space(machine)
    n_gpus = sum(s.kind == "gpu" for s in plan.layout.slots)
    n_ssds = sum(s.kind == "nvme" for s in plan.layout.slots)
    devices = (
        pick_devices(space, "gpu", max(n_gpus, len(space.gpus)))  # what-if devices the plan may have added
        + pick_devices(space, "nvme", max(n_ssds, len(space.ssds)))
    )
    return score(machine, plan.layout.name, layout, workload, devices)
