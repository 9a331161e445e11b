"""Flow models on topologies with answers worked out by hand, engines cross-checked."""

from __future__ import annotations

import pytest

from moment.errors import MomentError
from moment.planner import flow
from moment.planner.network import build_network
from moment.planner.workload import Workload
from moment.topology.model import NvLink
from moment.topology.profile_io import resolve_profile
from planner_fixtures import SSD_ONLY, one_switch, two_sockets


def test_demand_is_one_gb() -> None:
    assert SSD_ONLY.demand_gb() == pytest.approx(1.0)
    assert SSD_ONLY.tier_shares() == {"gpu": 0.0, "cpu": 0.0, "ssd": 1.0}


def test_one_switch_by_hand() -> None:
    """2 GPUs × 1 GB from 2 SSDs of 2 GB/s: T = 2 GB / 4 GB/s = 0.5 s, SSD-bound, both flow."""
    net = build_network(one_switch(read=2.0), SSD_ONLY)
    prop = flow.proportional(net)
    assert prop.iteration_s == pytest.approx(0.5, rel=1e-6)
    assert set(prop.bottleneck) == {"read:nvme0", "read:nvme1"}
    assert prop.bin_share["nvme0"] == pytest.approx(0.5)
    for engine in flow.MAX_FLOW_ENGINES:
        assert flow.paper(net, engine).iteration_s == pytest.approx(0.5, rel=1e-5)
    # Each GPU's link carries 1 GB in 0.5 s: 2 GB/s of 24.
    assert prop.utilisation["down:g0"] == pytest.approx(2.0 / 24.0, rel=1e-6)
    assert prop.gbps_per_gpu(net) == pytest.approx([2.0, 2.0], rel=1e-6)


def test_ssd_link_caps_a_fast_ssd() -> None:
    """A 10 GB/s SSD behind a Gen4 x4 link (6 GB/s) delivers 6: paper T = 1 GB / 6 GB/s."""
    net = build_network(two_sockets(upi=1.0, read=10.0), SSD_ONLY)
    assert flow.paper(net).iteration_s == pytest.approx(1 / 6, rel=1e-5)


def test_two_sockets_by_hand() -> None:
    """Paper: each GPU reads its own socket's SSD, 1 GB at 5 GB/s = 0.2 s. Proportional: each GPU
    reads half of its bytes across the 1 GB/s link: x_A + x_B = 1 ≤ 2T, so T = 0.5 s."""
    net = build_network(two_sockets(upi=1.0, read=5.0), SSD_ONLY)
    prop = flow.proportional(net)
    assert prop.iteration_s == pytest.approx(0.5, rel=1e-6)
    assert set(prop.bottleneck) == {"upi:cpu0>cpu1", "upi:cpu1>cpu0"}
    for engine in flow.MAX_FLOW_ENGINES:
        assert flow.paper(net, engine).iteration_s == pytest.approx(0.2, rel=1e-5)
    why = flow.explain_difference(net, flow.paper(net), prop)
    assert why is not None and "every GPU read every bin" in why and "cpu0→cpu1" in why


@pytest.mark.parametrize("name", ["moment-machine-a", "moment-machine-a-nvlink", "moment-machine-b"])
def test_engines_agree_on_reference_machines(name: str) -> None:
    from moment.planner.layout import apply_layout
    from moment.planner.workload import load_workload

    machine = resolve_profile(name)
    workload = load_workload(machine.workload)
    for layout in machine.layouts.values():
        net = build_network(apply_layout(machine, layout), workload)
        a = flow.paper(net, "ortools").iteration_s
        b = flow.paper(net, "networkx").iteration_s
        prop = flow.proportional(net).iteration_s
        assert a == pytest.approx(b, rel=1e-4)
        assert a <= prop * (1 + 1e-6)  # the paper's model is a relaxation of the proportional one


def test_symmetric_topologies_agree() -> None:
    for read in (0.5, 2.0, 50.0):  # SSD-bound, and link-bound (switch uplink never used: P2P)
        net = build_network(one_switch(read=read), SSD_ONLY)
        assert flow.proportional(net).iteration_s == pytest.approx(flow.paper(net).iteration_s, rel=1e-4)
        assert flow.explain_difference(net, flow.paper(net), flow.proportional(net)) is None


def test_monotone_in_bandwidth_and_devices() -> None:
    slow = flow.proportional(build_network(two_sockets(upi=1.0), SSD_ONLY)).iteration_s
    fast = flow.proportional(build_network(two_sockets(upi=4.0), SSD_ONLY)).iteration_s
    assert fast <= slow
    m = one_switch(read=2.0)
    full = flow.proportional(build_network(m, SSD_ONLY)).iteration_s
    m.sockets[0].ports[0].switch.ports[3].device = None  # pull one SSD
    fewer = flow.proportional(build_network(m, SSD_ONLY)).iteration_s
    assert fewer >= full
    assert fewer == pytest.approx(1.0, rel=1e-6)  # 2 GB from one 2 GB/s SSD


def test_cache_hits_never_cross_a_link() -> None:
    """The trainer's caches are replicated: each GPU reads its own copy of the GPU cache and its
    own socket's copy of the CPU cache. With every feature in the GPU cache nothing moves (T = 0,
    NVLink or not); with every feature in the CPU cache each GPU reads 1 GB over its own 24 GB/s
    link and nothing crosses the 1 GB/s socket link."""
    in_gpu = SSD_ONLY.model_copy(update={"gpu_cache_gb": 4.096})  # all 4.096 GB of features in each GPU
    assert in_gpu.tier_shares()["gpu"] == pytest.approx(1.0)
    m = two_sockets(upi=1.0)
    m.nvlinks = [NvLink(between=("gpu0", "gpu1"), links=12, arch="ampere")]
    for model in (flow.proportional, flow.paper):
        assert model(build_network(m, in_gpu)).iteration_s == 0.0
    in_cpu = SSD_ONLY.model_copy(update={"cpu_cache_fraction": 1.0})
    pred = flow.proportional(build_network(m, in_cpu))
    assert pred.iteration_s == pytest.approx(1.0 / 24, rel=1e-6)
    assert not any(pred.edge_load_gb.get(e, 0.0) for e in ("upi:cpu0>cpu1", "upi:cpu1>cpu0"))
    with pytest.raises(MomentError, match="gpu_cache_gb: 20 GB per GPU does not fit in gpu0 .16 GB."):
        build_network(m, SSD_ONLY.model_copy(update={"gpu_cache_gb": 20.0}))
    in_rows = Workload.model_validate({**SSD_ONLY.model_dump(), "gpu_cache_gb": None, "gpu_cache_rows": 5_000_000})
    with pytest.raises(MomentError, match=r"gpu_cache_rows: 5,000,000 rows \(20.5 GB\) per GPU does not fit in gpu0"):
        build_network(m, in_rows)  # the size in the unit the workload gives it


def test_a_layout_without_ssds_needing_them_is_a_clear_error() -> None:
    m = one_switch()
    for port in m.sockets[0].ports[0].switch.ports[2:]:
        port.device = None
    with pytest.raises(MomentError, match="needs the ssd tier"):
        flow.proportional(build_network(m, SSD_ONLY))


def test_ssd_reads_through_host_memory_cross_the_uplink() -> None:
    """One switch, 2 GPUs, 2 SSDs at 2 GB/s, a 1 GB/s uplink. Direct (GPUDirect Storage) reads
    stay under the switch: 2 GB / 4 GB/s = 0.5 s. Through host memory every byte goes up the
    uplink and down again: 2 GB / 1 GB/s = 2 s. GeForce boards take the host route anyway."""
    m = one_switch()
    m.sockets[0].ports[0].link.gbps = 1.0
    assert flow.proportional(build_network(m, SSD_ONLY)).iteration_s == pytest.approx(0.5, rel=1e-6)
    host = SSD_ONLY.model_copy(update={"ssd_reads": "host"})
    assert flow.proportional(build_network(m, host)).iteration_s == pytest.approx(2.0, rel=1e-6)
    for port in m.sockets[0].ports[0].switch.ports[:2]:
        port.device.model = "NVIDIA Corporation GA102 [GeForce RTX 3090]"
    net = build_network(m, SSD_ONLY)
    assert flow.proportional(net).iteration_s == pytest.approx(2.0, rel=1e-6)
    assert any("GeForce" in n for n in net.notes)
