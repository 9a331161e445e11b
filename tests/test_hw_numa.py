"""NUMA pinning and device assignment on a fake machine (GPU review #12, #13, #14): a socket is
not a NUMA node under SNC/NPS, and two ranks must never share a GPU when the plan's PCI
addresses are only partly found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moment import hw

GPU0, GPU1, GPU2, GPU3 = "0000:17:00.0", "0000:31:00.0", "0000:b1:00.0", "0000:ca:00.0"


@pytest.fixture
def snc2(tmp_path: Path) -> Path:
    """Two sockets of 16 CPUs, each split in two NUMA nodes (Intel SNC2): nodes 0-1 on socket 0,
    2-3 on socket 1; GPU2 hangs off node 3, GPU0 off node 0 (numa_node only, no local_cpulist)."""
    sysfs = tmp_path / "sys"
    for cpu in range(32):
        topo = sysfs / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{cpu // 16}\n")
    for node in range(4):
        d = sysfs / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(f"{node * 8}-{node * 8 + 7}\n")
    dev = sysfs / "bus" / "pci" / "devices"
    (dev / GPU2).mkdir(parents=True)
    (dev / GPU2 / "local_cpulist").write_text("24-31\n")
    (dev / GPU2 / "numa_node").write_text("3\n")
    (dev / GPU0).mkdir(parents=True)
    (dev / GPU0 / "numa_node").write_text("0\n")
    return sysfs


def test_a_socket_is_its_cpus_package_not_the_node_of_that_number(snc2: Path) -> None:
    assert hw.socket_cpus(1, snc2) == set(range(16, 32))
    assert hw.socket_nodes(1, snc2) == [2, 3] and hw.socket_nodes(0, snc2) == [0, 1]
    assert hw.node_cpus(1, snc2) == set(range(8, 16))  # node 1 is half of socket 0
    assert hw.device_cpus(GPU2, snc2) == set(range(24, 32))
    assert hw.device_cpus(GPU0, snc2) == set(range(0, 8))  # from numa_node
    assert hw.device_cpus(GPU1, snc2) == set()


@pytest.fixture
def affinity(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    pinned: list[set[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)))
    return pinned


def test_a_rank_is_pinned_to_its_whole_socket_not_the_node_of_that_number(snc2: Path, affinity: list[set[int]]) -> None:
    """Under SNC2 "cpu1" is socket 1 (CPUs 16-31, nodes 2 and 3), never node 1 (CPUs 8-15, on
    socket 0)."""
    said = hw.pin_to_socket("cpu1", sysfs=snc2)
    assert affinity[-1] == set(range(16, 32)) and said == "16 CPUs of socket 1 (NUMA nodes 2, 3)"


def test_without_package_topology_the_node_of_that_number_is_the_fallback(
    tmp_path: Path, affinity: list[set[int]]
) -> None:
    node = tmp_path / "sys" / "devices" / "system" / "node" / "node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("4-7\n")
    hw.pin_to_socket("cpu1", sysfs=tmp_path / "sys")
    assert affinity[-1] == {4, 5, 6, 7}


PLAN = [GPU0, GPU1, GPU2, GPU3]


@pytest.mark.parametrize(
    "present, count",
    [
        (PLAN, 4),  # every plan address found
        (["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"], 4),  # none found (another machine)
        ([GPU0, GPU2, "0000:e1:00.0"], 3),  # one GPU hidden (CUDA_VISIBLE_DEVICES): 2 match, 1 does not
        ([], 4),  # torch too old to report PCI addresses
    ],
)
def test_every_rank_gets_a_distinct_gpu(present: list[str], count: int) -> None:
    ranks = min(4, count)
    got = hw.assign_devices(PLAN[:ranks], present, count)
    indices = [i for i, _ in got]
    assert len(set(indices)) == ranks and all(0 <= i < count for i in indices), got
    for r, (i, why) in enumerate(got):
        if PLAN[r] in present:
            assert i == present.index(PLAN[r]) and why == "plan"
        else:
            assert "LOCAL_RANK" in why


def test_the_old_collision_case() -> None:
    """Ranks 0 and 2 match devices 0 and 1; rank 1's GPU is hidden: LOCAL_RANK 1 % 3 = 1 would
    have taken rank 2's device (NCCL: "Duplicate GPU detected")."""
    got = hw.assign_devices([GPU0, GPU1, GPU2], [GPU0, GPU2, "0000:e1:00.0"], 3)
    assert [i for i, _ in got] == [0, 2, 1]


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from moment.errors import MomentError
    from trainer.dist import DistEnv, select_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(MomentError, match="3 ranks on this node, 2 CUDA devices"):
        select_device("cuda", DistEnv(0, 3, 0, True), None)


def test_select_device_gives_each_local_rank_its_own_gpu(plan_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three local ranks of the Machine B plan; the machine shows plan GPUs 0 and 2 and a GPU
    the plan does not know: ranks 0 and 2 take theirs, rank 1 the remaining one."""
    import torch

    from moment.contracts.plan import read_plan
    from trainer.dist import DistEnv, select_device

    plan = read_plan(plan_file)
    plan = plan.model_copy(update={"ranks": [r.model_copy(update={"bdf": b}) for r, b in zip(plan.ranks, PLAN)]})
    bdfs = [r.bdf for r in plan.ranks]
    monkeypatch.setattr(hw, "cuda_bus_ids", lambda: [bdfs[0], bdfs[2], "0000:e1:00.0"])
    monkeypatch.setattr(hw, "pin_to_socket", lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    got = [select_device("cuda", DistEnv(r, 3, r, True), plan) for r in range(3)]
    assert [d.index for d, _ in got] == [0, 2, 1]
    assert "first free device" in got[1][1] and bdfs[2] in got[2][1]


def test_infer_ranks_take_the_plans_gpus_as_training_does(plan_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`moment infer` hands its ranks the plan, and each rank takes the GPU the plan gives it
    (found by PCI address), not GPU LOCAL_RANK."""
    import torch

    from moment.contracts.plan import read_plan
    from trainer.dist import DistEnv
    from trainer.infer import InferOptions, device_for, torchrun_command

    plan = read_plan(plan_file)
    plan = plan.model_copy(update={"ranks": [r.model_copy(update={"bdf": b}) for r, b in zip(plan.ranks, PLAN)]})
    bdfs = [r.bdf for r in plan.ranks]
    monkeypatch.setattr(hw, "cuda_bus_ids", lambda: [bdfs[1], bdfs[0]])  # CUDA lists them the other way round
    monkeypatch.setattr(hw, "pin_to_socket", lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [device_for(DistEnv(r, 2, r, True), plan).index for r in range(2)] == [1, 0]
    opts = InferOptions(data=Path("d"), checkpoint=Path("c"), out=Path("o"), plan=plan_file, nproc=2, device="cuda")
    cmd = torchrun_command(opts, Path("w"))
    assert cmd[cmd.index("--plan") + 1] == str(plan_file) and cmd[cmd.index("--device") + 1] == "cuda"
