"""This machine's PCI and NUMA facts as the processes on it see them: which CUDA device sits at a
PCI address, which CPUs a NUMA node has, and pinning a process to them.

Shared by ``moment bench`` (it matches CUDA devices to the profile's GPUs) and the trainer (each
rank takes the GPU the plan gives it and runs on that GPU's socket). torch is imported lazily:
planning does not need it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from moment.topology.pci import bdf_or_none


def parse_bdf(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI address such as '0000:1b:00.0' or '1b:00.0'; None for
    anything else."""
    bdf = bdf_or_none(text)
    if bdf is None:
        return None
    dom, bus, dev = bdf.partition(".")[0].split(":")
    return int(dom, 16), int(bus, 16), int(dev, 16)


def cuda_bus_ids() -> list[str]:
    """PCI address of each CUDA device, in CUDA order (empty without CUDA, or with a torch too
    old to report addresses)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
        return out
    except (ImportError, AttributeError, RuntimeError):
        return []


def cuda_index_of(bdf: str | None) -> int | None:
    """The CUDA device at PCI address ``bdf`` (function ignored), or None."""
    want = parse_bdf(bdf) if bdf else None
    if want is None:
        return None
    return next((i for i, got in enumerate(cuda_bus_ids()) if parse_bdf(got) == want), None)


def node_cpus(node: int) -> set[int]:
    """CPUs of NUMA node ``node`` (empty when the machine has no such node)."""
    try:
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_to_socket(socket: Any) -> str | None:
    """Best effort: restrict this process to the CPUs of ``socket`` ('cpu1' or 1); what was done."""
    m = re.search(r"(\d+)$", str(socket))
    if m is None or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = node_cpus(int(m.group(1))) & os.sched_getaffinity(0)
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return f"{len(cpus)} CPUs of node {m.group(1)}"
