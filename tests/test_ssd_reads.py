"""What an SSD moves and how fast: whole pages, IOPS, packed reads (moment/planner/ssd_reads.py),
in both flow models, worked out by hand."""

from __future__ import annotations

import pytest

from moment.planner import flow
from moment.planner.layout import apply_layout
from moment.planner.network import build_network
from moment.planner.plan import resolve_layout
from moment.planner.scoring import score
from moment.planner.workload import Workload, load_workload
from moment.ssd_reads import amplification, pack_amplification, page_counts, random_read_gbps
from moment.topology.model import Machine
from moment.topology.profile_io import resolve_profile
from planner_fixtures import SSD_ONLY, one_switch

P5510_DATASHEET = {"read_gbps": 5.15, "iops": 700_000}  # the drive's datasheet random reads, Moment's GB/s


def with_ssds(machine: Machine, **figures: float) -> Machine:
    for d in machine.devices():
        if d.kind == "nvme":
            for k, v in figures.items():
                setattr(d, k, v)
    return machine


def sparse(dim: int, gb_per_gpu: float) -> Workload:
    """Every byte from the SSDs, a billion rows of which a batch reads few (no two in a page)."""
    rows = gb_per_gpu * 1e9 / (dim * 4)
    return SSD_ONLY.model_copy(update={"nodes": 1_000_000_000, "feature_dim": dim, "unique_per_batch": rows})


@pytest.mark.parametrize(
    ("row", "moved"),
    [(4096, 1.0), (512, 8.0), (256, 16.0), (8192, 1.0), (1536, 10 / 3), (6144, 4 / 3)],
)
def test_a_row_read_alone_moves_its_pages(row: int, moved: float) -> None:
    """512 B (papers100M): one page for 512 B, 8×. 1536 B (MAG240M float16): of every 8 rows
    (3 pages), 2 straddle a page boundary, so 10 pages for 8 rows: 10 × 4096 / (8 × 1536).
    6144 B: each row touches 2 pages of 4 KiB."""
    assert amplification(row) == pytest.approx(moved, rel=1e-12)


def test_page_counts_by_hand() -> None:
    assert page_counts(1536).tolist() == [3, 4, 3]  # rows 0-2 | 2-5 | 5-7 of one period
    assert page_counts(512).tolist() == [8]


def test_dense_reads_share_pages() -> None:
    """Each 512 B row read with probability f: a page moves with probability 1 - (1 - f)^8, so
    the bytes moved per byte read are (1 - (1 - f)^8) / f; every row read moves each page once."""
    for f in (0.001, 0.1, 0.5):
        assert amplification(512, f) == pytest.approx((1 - (1 - f) ** 8) / f, rel=1e-12)
    assert amplification(512, 1.0) == pytest.approx(1.0)
    assert amplification(4096, 0.3) == pytest.approx(1.0)


def test_random_reads_are_bound_by_iops() -> None:
    """A P5510 by its datasheet: 700k × 4096 B = 2.87 GB/s of random pages, below 5.15 GB/s."""
    assert random_read_gbps(5.15, 700_000) == pytest.approx(2.8672, rel=1e-12)
    assert random_read_gbps(5.15, 2_000_000) == 5.15  # IOPS to spare: the GB/s bounds it
    assert random_read_gbps(5.15, None) == 5.15  # unknown IOPS cap nothing
    assert pack_amplification(1 << 20) == 1.0 and pack_amplification(5000) == pytest.approx(8192 / 5000)


def test_4k_rows_are_iops_bound_on_a_p5510() -> None:
    """2 GPUs × 1 GB of 4 KiB rows from 2 SSDs: each SSD serves 2.8672 GB/s, not 5.15, so
    T = 2 GB / 5.7344 GB/s = 0.3488 s; the same in both models, and the SSDs are the bottleneck."""
    net = build_network(with_ssds(one_switch(), **P5510_DATASHEET), SSD_ONLY)
    assert net.edges["read:nvme0"][2] == pytest.approx(2.8672)
    prop = flow.proportional(net)
    assert prop.iteration_s == pytest.approx(2 / (2 * 2.8672), rel=1e-6)
    assert set(prop.bottleneck) == {"read:nvme0", "read:nvme1"}
    for engine in flow.MAX_FLOW_ENGINES:
        assert flow.paper(net, engine).iteration_s == pytest.approx(prop.iteration_s, rel=1e-5)
    assert any("bound by random-read IOPS" in n for n in net.notes)


def test_512_byte_rows_move_8x_over_the_ssds_and_links() -> None:
    """0.125 GB of 512 B rows per GPU: ~8 × 0.125 = ~1 GB of pages per GPU through the IOPS-bound
    SSDs (2 × 2.8672 GB/s) and each GPU's link; the feature shares stay the feature bytes'."""
    w = sparse(128, 0.125)
    f = w.ssd_density()
    moved = (1 - (1 - f) ** 8) / f  # by hand: pages per row read, a page holding 8 rows
    assert moved == pytest.approx(8.0, rel=1e-3) and w.ssd_amplification() == pytest.approx(moved, rel=1e-12)
    net = build_network(with_ssds(one_switch(), **P5510_DATASHEET), w)
    prop = flow.proportional(net)
    t = 2 * 0.125 * moved / (2 * 2.8672)
    assert prop.iteration_s == pytest.approx(t, rel=1e-6)
    assert prop.edge_load_gb["down:g0"] == pytest.approx(0.125 * moved, rel=1e-6)  # pages cross the link
    assert prop.bin_share["nvme0"] == pytest.approx(0.5)  # of the feature bytes
    assert prop.gbps_per_gpu(net)[0] == pytest.approx(0.125 / t, rel=1e-6)  # feature GB/s
    for engine in flow.MAX_FLOW_ENGINES:
        paper = flow.paper(net, engine)
        assert paper.iteration_s == pytest.approx(t, rel=1e-5)
        assert sum(paper.bin_share.values()) == pytest.approx(1.0, rel=1e-5)


def test_packed_reads_are_bandwidth_bound() -> None:
    """The same 512 B rows packed into 1 MiB reads: no pages wasted and no IOPS bound, each SSD at
    its 5.15 GB/s: T = 0.25 GB / 10.3 GB/s."""
    w = sparse(128, 0.125).model_copy(update={"ssd_pack_bytes": 1 << 20})
    assert w.ssd_amplification() == 1.0
    net = build_network(with_ssds(one_switch(), **P5510_DATASHEET), w)
    assert net.edges["read:nvme0"][2] == 5.15
    for pred in (flow.proportional(net), flow.paper(net)):
        assert pred.iteration_s == pytest.approx(0.25 / 10.3, rel=1e-5)


def test_the_models_agree_with_pages_and_cpu_reads() -> None:
    """Amplified SSD reads beside unamplified CPU-cache reads over a shared uplink: on a
    symmetric machine both models give the same time, and the paper's stays a relaxation of the
    proportional one on the reference machines."""
    w = sparse(128, 0.5).model_copy(update={"cpu_cache_fraction": 0.3})
    for read in (0.5, 2.0, 50.0):
        net = build_network(with_ssds(one_switch(read=read), iops=300_000), w)
        assert flow.proportional(net).iteration_s == pytest.approx(flow.paper(net).iteration_s, rel=1e-4)
    machine = resolve_profile("moment-machine-a")
    small = load_workload(machine.workload, feature_dim=128)  # IGB-sized with papers100M's 512 B rows
    assert 7.8 < small.ssd_amplification() < 8.0  # a batch reads 0.3 % of the SSD rows: few share a page
    for layout in machine.layouts.values():
        net = build_network(apply_layout(machine, layout), small)
        paper = flow.paper(net, "ortools").iteration_s
        assert paper == pytest.approx(flow.paper(net, "networkx").iteration_s, rel=1e-4)
        assert paper <= flow.proportional(net).iteration_s * (1 + 1e-6)


def test_machine_a_with_the_datasheet_iops_ties_a_and_c() -> None:
    """Why the bundled P5510s carry Moment's measured 4 KiB rate as IOPS (1,258,291/s), not the
    datasheet's 700k: with 700k, classic-a and -c are both bound by the 8 SSDs' IOPS, the same
    time by hand (SSD bytes / (8 × 2.8672 GB/s)), while the paper measured (c) 14.9 s against (a)
    15.9 s. With the measured figure the SSDs serve 5.15 GB/s of 4 KiB rows as before, and the
    classic ranking stays the paper's (tests/test_reference_ranking.py)."""
    machine = resolve_profile("moment-machine-a")
    w = Workload.model_validate(machine.workload or {})
    ssd_gb = w.demand_gb() * 4 * w.tier_shares()["ssd"]
    datasheet = with_ssds(machine.model_copy(deep=True), iops=700_000)
    times = {
        n: score(datasheet, n, resolve_layout(datasheet, n)[1], w).prop.iteration_s for n in ("classic-a", "classic-c")
    }
    assert times["classic-a"] == pytest.approx(ssd_gb / (8 * 2.8672), rel=1e-6)
    assert times["classic-c"] == pytest.approx(times["classic-a"], rel=1e-6)
    measured = score(machine, "classic-c", resolve_layout(machine, "classic-c")[1], w)
    assert measured.net.edges["read:nvme0"][2] == pytest.approx(1_258_291 * 4096 / 1e9)
    assert measured.prop.iteration_s < times["classic-c"] * 0.6


def test_the_reader_counts_the_pages_it_reads(tmp_path) -> None:
    """FileReader.read_bytes: per file, the bytes of the distinct 4 KiB pages a batch's reads
    touch. 512 B rows 0,1 | 9 | 17 | 63 are pages 0, 1, 2, 7: 16 KiB for 2.5 KiB of rows; rows 0
    and 3 share page 0; a 1536 B row at byte 3072 straddles pages 0 and 1."""
    import numpy as np

    from trainer.readers import FileReader, ReadRequest

    small, wide = tmp_path / "small.bin", tmp_path / "wide.bin"
    small.write_bytes(np.arange(64 * 512, dtype=np.uint8).tobytes())
    wide.write_bytes(np.arange(8 * 1536, dtype=np.uint8).tobytes())
    with FileReader(threads=2) as reader:
        rows = np.array([0, 1, 9, 17, 63])
        out = np.empty((rows.size, 512), dtype=np.uint8)
        reader.read_batch([ReadRequest(small, rows, out)])
        assert reader.read_bytes == {str(small): 4 * 4096}
        assert np.array_equal(out, np.frombuffer(small.read_bytes(), dtype=np.uint8).reshape(64, 512)[rows])
        reader.read_batch(
            [
                ReadRequest(small, np.array([0, 3]), np.empty((2, 512), dtype=np.uint8)),
                ReadRequest(wide, np.array([2]), np.empty((1, 1536), dtype=np.uint8)),
            ]
        )
        assert reader.read_bytes == {str(small): 5 * 4096, str(wide): 2 * 4096}


def test_rows_counted_from_a_base_byte_read_and_count_from_there(tmp_path) -> None:
    """A packed chunk's read (``ReadRequest.base``: the byte its row 0 starts at): four 1536 B
    rows from page 1 move 2 pages (from byte 3584: 3 pages); O_DIRECT only for a base aligned
    to the device's block."""
    import numpy as np

    from trainer.readers import FileReader, ReadRequest

    path = tmp_path / "chunks.bin"
    data = np.arange(4 * 4096, dtype=np.uint32).view(np.uint8)[: 4 * 4096]
    path.write_bytes(data.tobytes())
    with FileReader(threads=1) as reader:
        for base, pages in ((4096, 2), (3584, 3), (4100, 2)):
            out = np.empty((4, 1536), dtype=np.uint8)
            before = reader.read_bytes.get(str(path), 0)
            reader.read_batch([ReadRequest(path, np.arange(4), out, base=base)])
            assert out.tobytes() == data[base : base + 4 * 1536].tobytes()
            assert reader.read_bytes[str(path)] - before == pages * 4096
            task = reader.plan_task(0, ReadRequest(path, np.arange(4), _aligned(4 * 1536).reshape(4, 1536), base=base))
            assert task.direct == (base % 512 == 0 and reader.opens_direct(path))


def _aligned(nbytes: int):
    import numpy as np

    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    at = -raw.ctypes.data % 4096
    return raw[at : at + nbytes]


@pytest.mark.parametrize(
    ("name", "gpus", "ssds"),
    [pytest.param("moment-machine-b", 4, 8, marks=pytest.mark.slow), ("moment-machine-a-nvlink", 2, 3)],
)
def test_the_search_charges_pages_too(name: str, gpus: int, ssds: int) -> None:
    """512 B rows on the reference machines: the search's cut bounds stay below every layout's
    time, and the MILP (SSD counts per slot class, a class's rate in pages) finds the time of the
    best enumerated layout."""
    from moment.planner import search
    from moment.planner.bounds import LayoutBound
    from moment.planner.layout import slot_space

    machine = resolve_profile(name)
    workload = load_workload(machine.workload, feature_dim=128)
    space = slot_space(machine)
    classes = search.slot_classes(machine, space)
    bound = LayoutBound(
        machine, search.skeleton_for(machine), [c.ports for c in classes], workload, space.gpus[0], space.ssds[0], gpus
    )
    enum = search.search(machine, workload, gpus, ssds, keep=0)
    for cand in enum.ranked:
        assert bound(*cand.counts) <= cand.prediction.iteration_s * (1 + 1e-6)
    milp = search.search_milp(machine, workload, gpus, ssds, keep=1)
    assert milp.ranked[0].prediction.iteration_s == pytest.approx(enum.ranked[0].prediction.iteration_s, rel=1e-6)
