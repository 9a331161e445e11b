"""This machine's PCI and NUMA facts as the processes on it see them: which CUDA device sits at a
PCI address, which CPUs a NUMA node has, and pinning a process to them.

Shared by ``moment bench`` (it matches CUDA devices to the profile's GPUs) and the trainer (each
rank takes the GPU the plan gives it and runs on that GPU's socket). torch is imported lazily:
planning does not need it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moment.topology.pci import bdf_or_none

SYSFS = Path("/sys")


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
            # torch's stubs omit the pci_* properties, which exist at run time (an old torch lacks them: below)
            out.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")  # type: ignore[attr-defined]
        return out
    except (ImportError, AttributeError, RuntimeError):
        return []


def cuda_index_of(bdf: str | None) -> int | None:
    """The CUDA device at PCI address ``bdf`` (function ignored), or None."""
    want = parse_bdf(bdf) if bdf else None
    if want is None:
        return None
    return next((i for i, got in enumerate(cuda_bus_ids()) if parse_bdf(got) == want), None)


def node_cpus(node: int, sysfs: Path = SYSFS) -> set[int]:
    """CPUs of NUMA node ``node`` (empty when the machine has no such node)."""
    return parse_cpulist(_read(sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist") or "")


def pin_to_socket(socket: Any, sysfs: Path = SYSFS) -> str | None:
    """Best effort: restrict this process to the CPUs of physical package ``socket`` ('cpu1' or
    1) — every NUMA node of it: under SNC/NPS a socket has several, and socket N is not node N —
    or, on a machine whose sysfs has no package topology, to NUMA node N; what was done."""
    m = re.search(r"(\d+)$", str(socket))
    if m is None or not hasattr(os, "sched_setaffinity"):
        return None
    n, allowed = int(m.group(1)), os.sched_getaffinity(0)
    nodes = ", ".join(map(str, socket_nodes(n, sysfs)))
    cpus, what = socket_cpus(n, sysfs) & allowed, f"socket {n} (NUMA nodes {nodes})"
    if not cpus:
        cpus, what = node_cpus(n, sysfs) & allowed, f"node {n}"
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return f"{len(cpus)} CPUs of {what}"


def distinct_devices(matched: Sequence[int | None], count: int) -> list[tuple[int, str]]:
    """The CUDA device of each local rank and why, computed for the whole node at once so that a
    rank whose plan GPU was found (``matched[r]``: its index) and a rank that falls back never
    share a device (NCCL: "Duplicate GPU detected"): a fallback rank takes ``LOCAL_RANK`` modulo
    the devices, or, when a found rank has that device, the first device nobody has. (With more
    ranks than devices some must share; the launcher refuses that before.)"""
    taken = {m for m in matched if m is not None}
    free = [i for i in range(count) if i not in taken]
    out: list[tuple[int, str]] = []
    for r, m in enumerate(matched):
        if m is not None:
            out.append((m, "plan"))
            continue
        i, why = r % max(count, 1), "LOCAL_RANK"
        if i in taken and free:
            i, why = free[0], f"LOCAL_RANK {r}'s device is another rank's plan GPU: first free device"
        if i in free:
            free.remove(i)
        taken.add(i)
        out.append((i, why))
    return out


def assign_devices(wanted: Sequence[str | None], present: Sequence[str], count: int) -> list[tuple[int, str]]:
    """:func:`distinct_devices` for plan GPU addresses ``wanted`` (per local rank) among the
    devices' addresses ``present`` (CUDA order; empty where torch cannot say)."""

    def index(bdf: str | None) -> int | None:
        want = parse_bdf(bdf) if bdf else None
        return next((i for i, got in enumerate(present) if want is not None and parse_bdf(got) == want), None)

    return distinct_devices([index(b) for b in wanted], max(count, len(present)))


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a sysfs cpulist such as '0-3,8,10-11' (empty for an empty list)."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def device_cpus(bdf: str | None, sysfs: Path = SYSFS) -> set[int]:
    """CPUs local to the PCI device at ``bdf``: its ``local_cpulist``, else the cpulist of its
    ``numa_node`` (empty when sysfs does not say)."""
    full = bdf_or_none(bdf) if bdf else None
    if full is None:
        return set()
    dev = sysfs / "bus" / "pci" / "devices" / full
    text = _read(dev / "local_cpulist")
    if text:
        return parse_cpulist(text)
    node = _read(dev / "numa_node")
    if node is not None and node.lstrip("-").isdigit() and int(node) >= 0:
        return node_cpus(int(node), sysfs)
    return set()


def socket_cpus(socket: int, sysfs: Path = SYSFS) -> set[int]:
    """CPUs of physical package ``socket``, from each CPU's topology (several NUMA nodes per
    socket under SNC/NPS: all of them)."""
    cpus: set[int] = set()
    for pkg in (sysfs / "devices" / "system" / "cpu").glob("cpu[0-9]*/topology/physical_package_id"):
        if _read(pkg) == str(socket):
            cpus.add(int(pkg.parent.parent.name[3:]))
    return cpus


def socket_nodes(socket: int, sysfs: Path = SYSFS) -> list[int]:
    """NUMA nodes whose CPUs are all on physical package ``socket``."""
    mine = socket_cpus(socket, sysfs)
    out = []
    for path in sorted((sysfs / "devices" / "system" / "node").glob("node[0-9]*")):
        node = int(path.name[4:])
        cpus = node_cpus(node, sysfs)
        if cpus and cpus <= mine:
            out.append(node)
    return out
