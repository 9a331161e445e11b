"""What more servers buy (``moment plan --nodes N``): the iteration time with N identical servers.

Data parallel over nodes: every node holds its own placement, so its feature reads stay on its
own PCIe tree and take the one-node prediction's time; what crosses the network is DDP's gradient
all-reduce. A ring all-reduce of ``B`` bytes over ``N`` nodes sends ``2(N-1)/N × B`` bytes over
each node's slowest link, the NIC (inside a node the GPUs talk over PCIe or NVLink, both faster
than the NIC this planner assumes). The prediction is the local data time plus that all-reduce:

* compute is left out of the max(data, compute): the planner has no compute model (the flow
  models predict the time to move a batch's features), so the data time stands for the max;
* the sum is an upper side: DDP overlaps the all-reduce of early buckets with the backward pass.
"""

from __future__ import annotations

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


def check_nodes(value: str) -> int:
    """``--nodes``: a whole number ≥ 1 (argparse's ``type``; a bad one is one line, exit 2)."""
    try:
        nodes = int(value)
    except ValueError:
        raise UsageError(f"--nodes {value!r}: expected a whole number of servers, 1 or more") from None
    if nodes < 1:
        raise UsageError(f"--nodes {value!r}: expected a whole number of servers, 1 or more")
    return nodes


def ring_allreduce_s(param_bytes: float, nodes: int, gbps: float) -> float:
    """Seconds of a ring all-reduce of ``param_bytes`` over ``nodes`` at ``gbps`` GB/s a link."""
    return 2 * (nodes - 1) / nodes * param_bytes / (gbps * 1e9)


def nodes_prediction(machine: Machine, params: int, iteration_s: float, nodes: int) -> dict:
    """The plan's ``nodes`` record: ``iteration_s`` (one node's prediction) plus the all-reduce of
    ``params`` gradients (the CLI counts them with the trainer's own count: the planner sits
    below the trainer and imports none of it)."""
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
        "allreduce_s": allreduce,
        "iteration_s": iteration_s + allreduce,
    }
