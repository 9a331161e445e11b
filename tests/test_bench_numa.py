"""`moment bench`'s host→GPU figures come from host memory on each GPU's own NUMA node, and GPUs
without peer access get no "peer" figure (GPU review #15)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from moment import hw
from moment.topology import measure

GPUS = ["0000:17:00.0", "0000:b1:00.0"]


class _FakeTensor:
    def __init__(self, log: list, where: str) -> None:
        self.log, self.where = log, where

    def pin_memory(self) -> _FakeTensor:
        self.log.append(("pin", frozenset(os.sched_getaffinity(0))))
        return self

    def copy_(self, other: _FakeTensor, non_blocking: bool = False) -> None:
        self.log.append(("copy", other.where, self.where))


def _fake_torch(log: list, peer_ok: bool) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.uint8 = "uint8"
    torch.empty = lambda n, dtype=None, device="cpu": _FakeTensor(log, device)
    torch.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        synchronize=lambda i=None: None,
        can_device_access_peer=lambda i, j: peer_ok,
    )
    return torch


def test_each_gpus_buffer_is_pinned_near_it_and_host_staged_peers_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs = tmp_path / "sys" / "bus" / "pci" / "devices"
    for bdf, cpus in zip(GPUS, ("0-7", "8-15")):
        (sysfs / bdf).mkdir(parents=True)
        (sysfs / bdf / "local_cpulist").write_text(cpus + "\n")
    real = hw.device_cpus
    monkeypatch.setattr(hw, "device_cpus", lambda bdf, sysfs=tmp_path / "sys": real(bdf, sysfs))
    affinity = {"now": frozenset(range(16))}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity["now"]))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: affinity.update(now=frozenset(cpus)))
    monkeypatch.setattr(measure, "cuda_bus_ids", lambda: GPUS)
    log: list = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(log, peer_ok=False))
    h2d, peer = measure.gpu_copies(megabytes=1)
    assert set(h2d) == {0, 1} and peer == {}  # no P2P: a copy would go through host memory
    assert [e[1] for e in log if e[0] == "pin"] == [frozenset(range(8)), frozenset(range(8, 16))]
    assert affinity["now"] == frozenset(range(16))  # restored
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(log, peer_ok=True))
    _, peer = measure.gpu_copies(megabytes=1)
    assert set(peer) == {(0, 1), (1, 0)}
