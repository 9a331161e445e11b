"""Small hand-made profiles with answers that can be worked out on paper."""

from __future__ import annotations

from moment.planner.workload import Workload
from moment.topology.model import Machine

# Every byte from the SSDs, 1 GB per GPU per iteration: predictions are easy to do by hand. Rows
# of one 4 KiB page, so the SSDs move exactly the feature bytes (moment/planner/ssd_reads.py).
SSD_ONLY = Workload(
    nodes=1_000_000,
    feature_dim=1024,
    feature_dtype="float32",
    unique_per_batch=1e9 / 4096,
    gpu_cache_gb=0.0,
    cpu_cache_fraction=0.0,
)


def gpu(i: int) -> dict:
    return {"id": f"gpu{i}", "kind": "gpu", "model": "test GPU", "memory_gb": 16, "max_gen": 4, "max_width": 16}


def ssd(i: int, read: float) -> dict:
    return {"id": f"nvme{i}", "kind": "nvme", "model": "test SSD", "read_gbps": read, "max_gen": 4, "max_width": 4}


def gpu_slot(pid: str, device: dict | None = None) -> dict:
    port = {
        "id": pid,
        "kind": "downstream",
        "link": {"gen": 4, "width": 16},
        "slot": {"name": pid, "form": "pcie-double", "width": 16, "gen": 4},
    }
    if device:
        port["device"] = device
    return port


def bay(pid: str, device: dict | None = None, kind: str = "downstream") -> dict:
    port = {
        "id": pid,
        "kind": kind,
        "link": {"gen": 4, "width": 4},
        "slot": {"name": pid, "form": "u2", "width": 4, "gen": 4},
    }
    if device:
        port["device"] = device
    return port


def one_switch(read: float = 2.0, extra_slots: bool = False) -> Machine:
    """One socket, one switch: 2 GPUs and 2 SSDs (symmetric: every GPU sees every SSD alike)."""
    ports = [gpu_slot("g0", gpu(0)), gpu_slot("g1", gpu(1)), bay("s0", ssd(0, read)), bay("s1", ssd(1, read))]
    if extra_slots:
        ports += [gpu_slot("g2"), bay("s2")]
    root = {
        "id": "rp0",
        "kind": "root_port",
        "link": {"gen": 4, "width": 16},
        "switch": {"id": "sw0", "model": "test switch", "ports": ports},
    }
    sockets = [{"id": "cpu0", "dram_gbps": 100, "ports": [root]}]
    if extra_slots:
        sockets[0]["ports"] += [bay("rb0", kind="root_port"), bay("rb1", kind="root_port")]
    return Machine.model_validate({"name": "one-switch", "sockets": sockets})


def two_sockets(upi: float = 1.0, read: float = 10.0) -> Machine:
    """Each socket: a GPU and an SSD on root ports; a slow inter-socket link between them."""
    sockets = []
    for s in (0, 1):
        sockets.append(
            {
                "id": f"cpu{s}",
                "dram_gbps": 100,
                "ports": [
                    {**gpu_slot(f"c{s}g"), "kind": "root_port", "device": gpu(s)},
                    bay(f"c{s}s", ssd(s, read), kind="root_port"),
                ],
            }
        )
    return Machine.model_validate(
        {
            "name": "two-sockets",
            "sockets": sockets,
            "socket_links": [{"between": ["cpu0", "cpu1"], "gbps": upi}],
        }
    )
