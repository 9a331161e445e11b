"""What more servers buy (``moment plan --nodes N``): the iteration time with N identical servers.

Data parallel over nodes: every node holds its own placement, so its feature reads stay on its
own PCIe tree and take the one-node prediction's time, and every rank computes its own batch, so
its compute takes what it takes on one node; what crosses the network is DDP's gradient
all-reduce. A ring all-reduce of ``B`` bytes over ``N`` nodes sends ``2(N-1)/N × B`` bytes over
each node's slowest link, the NIC (inside a node the GPUs talk over PCIe or NVLink, both faster
than the NIC this planner assumes). The prediction is max(local data time, compute) plus that
all-reduce:

* the max: the trainer's prefetcher prepares the next batches (sampling, feature reads) while
  the GPU computes this one, so the slower of the two sets the pace (``bound``);
* compute per iteration is measured (``--compute-from`` an earlier run's metrics.json: its
  training time not spent waiting for data, per iteration) or else estimated: the step's FLOPs
  (the trainer's count for the workload's model, batch and fan-outs) over the slowest planned
  GPU's sustained rate (:mod:`moment.topology.gpu_flops`);
* the sum is an upper side: DDP overlaps the all-reduce of early buckets with the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moment.errors import UsageError

if TYPE_CHECKING:
    from moment.topology.model import Machine

# 200 Gb/s per node, one direction: one NVIDIA ConnectX-6 HDR InfiniBand (or 200 GbE RoCE) adapter,
# "up to 200Gb/s connectivity per port" (nvidia.com, ConnectX-6 VPI adapter card product brief),
# the common NIC of GPU training servers today. A profile's ``nic_gbps`` replaces it.
DEFAULT_NIC_GBPS = 200 / 8
# ``moment train`` has no --classes; the profiles' paper workloads are IGB's 19 classes (as in
# trainer.memory.shape_of_workload), and the last layer's width moves the count little.
DEFAULT_CLASSES = 19
GRADIENT_BYTES = 4  # DDP all-reduces float32 gradients, one per parameter


@dataclass(frozen=True)
class Compute:
    """One training iteration's compute on one GPU, and where the figure came from."""

    seconds: float
    source: str
    step_flops: float | None = None  # the estimate's FLOPs of a step (None: measured)
    gpu_tflops: float | None = None  # ... and the GPU rate it divided them by


def check_nodes(value: str) -> int:
    """``--nodes``: a whole number ≥ 1 (argparse's ``type``; a bad one is one line, exit 2)."""
    try:
        nodes = int(value)
    except ValueError:
        raise UsageError(f"--nodes {value!r}: expected a whole number of servers, 1 or more") from None
    if nodes < 1:
        raise UsageError(f"--nodes {value!r}: expected a whole number of servers, 1 or more")
    return nodes


def estimated_compute(machine: Machine, gpus: list[str], step_flops: float) -> Compute:
    """``step_flops`` over the slowest of ``gpus`` (the plan's GPUs: DDP goes at its slowest rank's pace)."""
    from moment.topology.gpu_flops import gpu_tflops

    rates = [gpu_tflops(d) for d in machine.devices() if d.id in gpus]
    if not rates:
        raise UsageError(f"{machine.name}: the layout has no GPU to estimate the compute on")
    tflops, source = min(rates)
    return Compute(
        step_flops / (tflops * 1e12),
        f"estimated: {step_flops / 1e9:.4g} GFLOP a step (forward and backward) at {tflops:.4g} TFLOP/s ({source})",
        step_flops,
        tflops,
    )


def measured_compute(path: str | Path) -> Compute:
    """An earlier training run's compute per iteration (``moment train --metrics-json``): its
    training time not spent waiting for data (:meth:`MetricsDoc.compute_s_per_iteration`)."""
    from moment.contracts.metrics import MetricsDoc, MetricsError

    doc = MetricsDoc.read(path)
    seconds = doc.compute_s_per_iteration()
    if seconds is None:
        raise MetricsError(f"{path}: no training iteration recorded: no compute time to take")
    iterations = sum(e.iterations for e in doc.epochs)
    nodes = len(doc.nodes) if doc.nodes else 1
    network = f"; with that run's gradient all-reduce over its {nodes} nodes" if nodes > 1 else ""
    return Compute(
        seconds,
        f"measured: {path}, {iterations:,} iterations of {doc.world_size} rank(s), not waiting for data{network}",
    )


def ring_allreduce_s(param_bytes: float, nodes: int, gbps: float) -> float:
    """Seconds of a ring all-reduce of ``param_bytes`` over ``nodes`` at ``gbps`` GB/s a link."""
    return 2 * (nodes - 1) / nodes * param_bytes / (gbps * 1e9)


def nodes_prediction(machine: Machine, params: int, iteration_s: float, nodes: int, compute: Compute) -> dict:
    """The plan's ``nodes`` record: the longer of ``iteration_s`` (one node's data time) and
    ``compute``, plus the all-reduce of ``params`` gradients (the CLI counts them, and the
    estimate's FLOPs, with the trainer's own count: the planner sits below the trainer and
    imports none of it)."""
    gbps, source = (
        (machine.nic_gbps, "the profile's nic_gbps")
        if machine.nic_gbps is not None
        else (DEFAULT_NIC_GBPS, "default: a 200 Gb/s InfiniBand/RoCE NIC per node (ConnectX-6 HDR)")
    )
    allreduce = ring_allreduce_s(params * GRADIENT_BYTES, nodes, gbps)
    return {
        "nodes": nodes,
        "parameters": params,
        "classes": DEFAULT_CLASSES,
        "nic_gbps": gbps,
        "nic_source": source,
        "data_iteration_s": iteration_s,
        "compute_s": compute.seconds,
        "compute_source": compute.source,
        "step_flops": compute.step_flops,
        "gpu_tflops": compute.gpu_tflops,
        "bound": "compute" if compute.seconds > iteration_s else "data",
        "allreduce_s": allreduce,
        "iteration_s": max(iteration_s, compute.seconds) + allreduce,
    }
