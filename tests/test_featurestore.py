"""The tiered feature store and the SSD readers: every row equals its source row, whatever tier
it is served from; stats add up; reads are coalesced; O_DIRECT falls back cleanly."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvikio_fake import FakeKvikio, real_kvikio_or_skip
from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.preads import native_preads
from moment.topology.profile_io import resolve_profile
from moment.uring import uring_reads
from placement.dataset import open_dataset
from placement.place import PlaceOptions, place
from placement.placed import PlacedError, open_placed
from placement.synth import synthesize
from trainer import file_reader
from trainer.featurestore import TieredFeatureStore
from trainer.pyg import PygFeatureStore
from trainer.readers import READ_ENGINES, FileReader, KvikioReader, coalesce, engine_refusal, kvikio_mode, make_reader
from trainer.shm import SharedMemoryFullError

DIM = 128  # float32: 512-byte rows, so the SSD bins are eligible for O_DIRECT


@pytest.fixture(scope="module")
def placed_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fs")
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    outcome = plan(machine, workload, 4, 8, top=1)
    save_plan(machine, workload, outcome, root / "plan.json")
    synthesize(root / "ds", nodes=20_000, avg_degree=8, dim=DIM, dtype="float32", seed=1, train_fraction=0.2)
    place(root / "plan.json", root / "ds", root / "placed", PlaceOptions(gpu_cache="3%", cpu_cache="4%"))
    return root / "placed"


@pytest.fixture(scope="module")
def truth(placed_dir: Path) -> np.ndarray:
    """Every feature row in the dataset's id order, from the source dataset (what ``get`` of
    those ids must give)."""
    placed = open_placed(placed_dir)
    return np.asarray(open_dataset(placed.meta["source"]["path"]).features())


def _vertex_at(placed_dir: Path) -> np.ndarray:
    """The dataset vertex at each row of the bins (the inverse of the row map)."""
    return np.argsort(np.asarray(open_placed(placed_dir).array("old_to_new")))


@pytest.fixture(scope="module")
def store(placed_dir: Path):
    with TieredFeatureStore(open_placed(placed_dir)) as s:
        yield s


def _ssd_range(placed_dir: Path) -> tuple[int, int]:
    placed = open_placed(placed_dir)
    ssd = [b for b in placed.bins if b.tier == "ssd"]
    return ssd[0].start, placed.num_nodes


def test_every_tier_is_in_play(placed_dir: Path) -> None:
    tiers = {b.tier for b in open_placed(placed_dir).bins}
    assert tiers == {"gpu", "cpu", "ssd"}


def test_random_ids_equal_the_source(store: TieredFeatureStore, truth: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(truth), 7_000)
    ids = np.concatenate([ids, ids[:500], [0, len(truth) - 1, 0]])  # repeats, both ends
    rng.shuffle(ids)
    got = store.get(torch.from_numpy(ids))
    assert got.dtype == torch.float32 and got.shape == (len(ids), DIM)
    assert np.array_equal(got.numpy(), truth[ids])


def test_all_ids_once_equal_the_source(store: TieredFeatureStore, truth: np.ndarray) -> None:
    ids = np.random.default_rng(1).permutation(len(truth))
    assert np.array_equal(store.get(torch.from_numpy(ids)).numpy(), truth[ids])
    assert np.array_equal(store.get(torch.arange(len(truth))).numpy(), truth)


def test_empty_and_bad_ids(store: TieredFeatureStore) -> None:
    assert store.get(torch.zeros(0, dtype=torch.int64)).shape == (0, DIM)
    with pytest.raises(IndexError, match="out of range"):
        store.get(torch.tensor([0, store.placed.num_nodes]))
    with pytest.raises(IndexError, match="out of range"):
        store.get(torch.tensor([-1]))
    with pytest.raises(TypeError, match="1-D integer"):
        store.get(torch.zeros(3))


def test_stats_add_up(store: TieredFeatureStore) -> None:
    store.reset_stats()
    ids = np.random.default_rng(2).integers(0, store.placed.num_nodes, 5_000)
    store.get(torch.from_numpy(ids))
    s = store.stats()
    tiers = s["tiers"]
    assert s["asked"] == len(ids) == sum(t["rows"] for t in tiers.values())
    ssd = tiers["ssd"]
    ssd_ids = ids[np.asarray(store.placed.array("old_to_new"))[ids] >= _ssd_range(store.placed.root)[0]]
    assert ssd["rows"] == ssd_ids.size
    assert ssd["unique_rows"] == np.unique(ssd_ids).size
    assert ssd["bytes"] == ssd["unique_rows"] * store.row_bytes
    bins = s["ssd_bins"].values()
    assert sum(b["rows"] for b in bins) == ssd["rows"]
    assert sum(b["bytes"] for b in bins) == ssd["bytes"]
    assert all(b["seconds"] >= 0 for b in bins)
    assert all(0 <= r <= 1 for r in s["hit_rate"].values())
    assert s["hit_rate"]["gpu"] == tiers["gpu"]["rows"] / len(ids) > 0
    assert s["io"]["preads"] > 0 and set(s["io"]["modes"].values()) <= {"direct", "buffered"}
    assert s["io"]["engine"] in READ_ENGINES
    store.reset_stats()
    assert store.stats()["asked"] == 0 and store.stats()["tiers"]["ssd"]["bytes"] == 0


def test_every_rank_holds_the_whole_gpu_cache(placed_dir: Path, truth: np.ndarray) -> None:
    """The GPU cache is replicated: one bin, all of it in the store's GPU tier, every row a hit."""
    with TieredFeatureStore(open_placed(placed_dir)) as s:
        gpu = [b for b in s.placed.bins if b.tier == "gpu"]
        assert len(gpu) == 1 and s.gpu.shape[0] == gpu[0].count > 0
        ids = _vertex_at(placed_dir)[np.arange(gpu[0].count)[::-1]]  # the vertices of the GPU bin's rows
        assert np.array_equal(s.get(torch.from_numpy(ids)).numpy(), truth[ids])
        assert s.stats()["tiers"]["gpu"]["rows"] == len(ids) and s.stats()["hit_rate"]["gpu"] == 1.0


def test_host_tiers_are_one_copy_across_processes(placed_dir: Path, truth: np.ndarray, tmp_path: Path) -> None:
    """Stores naming the same host_shm file map one copy of the GPU and CPU bins: a write
    through one mapping (here, from another process) is seen by the others; features still
    equal the source."""
    shm = tmp_path / "shm" / "moment-host"
    shm.parent.mkdir()
    with TieredFeatureStore(open_placed(placed_dir), host_shm=shm) as a:
        host = [b for b in a.placed.bins if b.tier != "ssd"]
        assert shm.stat().st_size == sum(b.count for b in host) * a.row_bytes
        assert [p.name for p in shm.parent.iterdir()] == ["moment-host"]  # no temporary left behind
        storage = a.cpu.untyped_storage().data_ptr()
        assert a.gpu.untyped_storage().data_ptr() == storage  # one mapping (on a CPU device the gpu tier too)
        ids = np.random.default_rng(3).integers(0, len(truth), 20_000)
        assert np.array_equal(a.get(torch.from_numpy(ids)).numpy(), truth[ids])
        assert all(a.stats()["tiers"][t]["rows"] > 0 for t in ("gpu", "cpu", "ssd"))
        script = (
            f"import torch; from trainer.featurestore import TieredFeatureStore as S; "
            f"from placement.placed import open_placed as o; "
            f"s = S(o({str(placed_dir)!r}), host_shm={str(shm)!r}); s.cpu[0] = 7; s.gpu[0] = 5"
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        assert (a.cpu[0] == 7).all() and (a.gpu[0] == 5).all()  # the other process wrote into this one's tiers
        with TieredFeatureStore(open_placed(placed_dir), host_shm=shm) as b:
            assert (b.cpu[0] == 7).all()
    shm.write_bytes(b"\0" * 64)
    with pytest.raises(PlacedError, match="another placement"):
        TieredFeatureStore(open_placed(placed_dir), host_shm=shm)


def test_shared_host_tiers_need_room(placed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    with pytest.raises(SharedMemoryFullError, match=f"{tmp_path}: 0.00 GiB free, the GPU and CPU cache bins need"):
        TieredFeatureStore(open_placed(placed_dir), host_shm=tmp_path / "moment-host")
    assert list(tmp_path.iterdir()) == []


def test_truncated_ssd_bin_is_refused(placed_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "placed"
    shutil.copytree(placed_dir, copy)
    victim = [b for b in open_placed(copy).bins if b.tier == "ssd"][-1].path
    os.truncate(victim, victim.stat().st_size - 8)
    with pytest.raises(PlacedError, match=victim.name):
        TieredFeatureStore(open_placed(copy))
    victim.unlink()
    with pytest.raises(PlacedError, match="missing"):
        TieredFeatureStore(open_placed(copy))


def test_pyg_feature_store(store: TieredFeatureStore, truth: np.ndarray) -> None:
    fs = PygFeatureStore(store)
    idx = torch.from_numpy(np.random.default_rng(4).integers(0, len(truth), 300))
    assert np.array_equal(fs.get_tensor(group_name=None, attr_name="x", index=idx).numpy(), truth[idx.numpy()])
    assert np.array_equal(fs[None, "x", idx].numpy(), truth[idx.numpy()])
    assert np.array_equal(fs[None, "x", 5:9].numpy(), truth[5:9])
    assert np.array_equal(fs.get_tensor(None, "x", 7).numpy(), truth[7])
    assert fs.get_tensor_size(None, "x") == (len(truth), DIM)
    assert fs.get_tensor_size(None, "y") is None
    [attr] = fs.get_all_tensor_attrs()
    assert (attr.group_name, attr.attr_name) == (None, "x")
    attr.index = idx
    assert np.array_equal(fs.multi_get_tensor([attr])[0].numpy(), truth[idx.numpy()])
    with pytest.raises(KeyError):
        fs.get_tensor(None, "y", idx)
    with pytest.raises(NotImplementedError, match="read-only"):
        fs.put_tensor(torch.zeros(1, DIM), None, "x", torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="read-only"):
        fs.remove_tensor(None, "x", None)


@pytest.mark.gpu
@pytest.mark.parametrize("io", ["posix", "kvikio"])
def test_cuda_store_equals_the_source(placed_dir: Path, truth: np.ndarray, tmp_path: Path, io: str) -> None:
    if io == "kvikio":
        real_kvikio_or_skip()
    ids = np.random.default_rng(5).integers(0, len(truth), 20_000)
    for shm in (None, tmp_path / "moment-host"):  # host tiers private, then node-shared
        with TieredFeatureStore(open_placed(placed_dir), device="cuda", host_shm=shm, io=io) as s:
            assert s.gpu.is_cuda and s.reader.on_device == (io == "kvikio")
            for _ in range(3):  # the staging buffers are reused
                got = s.get(torch.from_numpy(ids).cuda())
                assert got.is_cuda
                assert np.array_equal(got.cpu().numpy(), truth[ids])


# Readers #####################################################################


@pytest.fixture()
def raw_file(tmp_path: Path) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(6).integers(0, 256, size=(1_000, 512), dtype=np.uint8)
    path = tmp_path / "rows.bin"
    data.tofile(path)
    return path, data


def _aligned(rows: int, row_bytes: int, skew: int = 0) -> np.ndarray:
    """A C-contiguous (rows, row_bytes) buffer whose address is 4096-aligned plus ``skew``."""
    raw = np.empty(rows * row_bytes + 8192, dtype=np.uint8)
    at = -raw.ctypes.data % 4096 + skew
    return raw[at : at + rows * row_bytes].reshape(rows, row_bytes)


def test_coalesce_runs() -> None:
    first, pos, counts = coalesce(np.array([3, 4, 5, 9, 11, 12]))
    assert first.tolist() == [3, 9, 11] and pos.tolist() == [0, 3, 4] and counts.tolist() == [3, 1, 2]
    first, pos, counts = coalesce(np.arange(10, 20), max_rows=4)
    assert first.tolist() == [10, 14, 18] and pos.tolist() == [0, 4, 8] and counts.tolist() == [4, 4, 2]
    assert [a.size for a in coalesce(np.zeros(0, dtype=np.int64))] == [0, 0, 0]


def test_file_reader_coalesces_and_equals_memmap(raw_file: tuple[Path, np.ndarray]) -> None:
    path, data = raw_file
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
    with FileReader(threads=4, direct=False) as reader:
        rows = np.arange(100, 300)
        out = np.empty((rows.size, 512), dtype=np.uint8)
        reader.read(path, rows, out)
        assert reader.preads == 1 and np.array_equal(out, mm[rows])
        rows = np.unique(np.random.default_rng(7).integers(0, 1_000, 600))
        runs = int((np.diff(rows) != 1).sum()) + 1
        out = np.empty((rows.size, 512), dtype=np.uint8)
        reader.preads = 0
        reader.read(path, rows, out)
        assert reader.preads == runs < rows.size
        assert np.array_equal(out, mm[rows]) and reader.modes[str(path)] == "buffered"
        with pytest.raises(ValueError, match="sorted"):
            reader.read(path, rows[::-1].copy(), out)


def test_file_reader_batch_spreads_over_threads(raw_file: tuple[Path, np.ndarray]) -> None:
    path, data = raw_file
    with FileReader(threads=4, direct=False, max_run_bytes=4096) as reader:
        rows = [np.arange(0, 1_000, 2), np.arange(1_000)]  # 500 single rows; one long run, split
        outs = [np.empty((r.size, 512), dtype=np.uint8) for r in rows]
        seconds = reader.read_batch([_req(path, r, o) for r, o in zip(rows, outs)])
        assert len(seconds) == 2 and min(seconds) >= 0
        assert reader.preads == 500 + 1_000 // 8
        for r, o in zip(rows, outs):
            assert np.array_equal(o, data[r])


def _req(path: Path, rows: np.ndarray, out: np.ndarray):
    from trainer.readers import ReadRequest

    return ReadRequest(path, rows, out)


def test_o_direct_when_aligned_buffered_otherwise(raw_file: tuple[Path, np.ndarray]) -> None:
    path, data = raw_file
    rows = np.array([1, 2, 3, 50, 999])
    with FileReader(threads=2) as reader:
        out = _aligned(rows.size, 512)
        reader.read(path, rows, out)
        assert np.array_equal(out, data[rows])
        assert reader.modes[str(path)] in ("direct", "buffered")  # buffered where the file system refuses O_DIRECT
        skewed = _aligned(rows.size, 512, skew=8)
        reader.read(path, rows, skewed)
        assert np.array_equal(skewed, data[rows]) and reader.modes[str(path)] == "buffered"


@pytest.mark.parametrize("engine", [e for e in READ_ENGINES if engine_refusal(e) is None])
def test_o_direct_refused_at_read_falls_back(raw_file: tuple[Path, np.ndarray], monkeypatch, engine: str) -> None:
    """A device with a larger logical block than 512 refuses the read (EINVAL): read buffered.
    The compiled loops stop at a refused read (without its errno); Python redoes it and learns why."""
    path, data = raw_file
    real, real_runs = os.preadv, native_preads()
    real_ring = uring_reads()[0]

    def direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    def picky(fd: int, buffers: list, offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    def picky_runs(fd: int, base: int, offsets, dests, sizes, start: int) -> tuple[int, int]:
        return (start, 0) if direct(fd) else real_runs(fd, base, offsets, dests, sizes, start)

    def picky_ring(*args) -> int:  # (ring..., fd, base, offsets, dests, sizes, got): every read refused
        return 0 if direct(args[5]) else real_ring(*args)

    monkeypatch.setattr(os, "preadv", picky)
    monkeypatch.setattr(file_reader, "native_preads", lambda: picky_runs)
    monkeypatch.setattr(file_reader, "uring_reads", lambda: (picky_ring, ""))
    with FileReader(threads=1, engine=engine) as reader:
        assert reader.engine == engine
        if not reader.opens_direct(path):
            pytest.skip("this file system refuses O_DIRECT at open")
        rows = np.array([0, 1, 7, 8, 9])
        out = _aligned(rows.size, 512)
        reader.read(path, rows, out)
        assert np.array_equal(out, data[rows]) and reader.modes[str(path)] == "buffered"


def test_short_file_is_an_error_naming_it(raw_file: tuple[Path, np.ndarray]) -> None:
    path, _ = raw_file
    with FileReader(direct=False) as reader, pytest.raises(OSError, match=path.name):
        reader.read(path, np.array([999, 1_000]), np.empty((2, 512), dtype=np.uint8))


class _CpuKvikioReader(KvikioReader):
    device_type = "cpu"


def test_kvikio_reader_plans_like_the_file_reader_and_reads_in_parallel(tmp_path: Path) -> None:
    """The kvikio path's planning and threading, on CPU tensors: every row equals the source,
    one pread per run (runs split at max_run_bytes), several threads issuing them."""
    rng = np.random.default_rng(11)
    files, datas = [], []
    for k in range(3):
        data = rng.integers(0, 256, size=(2_000, 256), dtype=np.uint8)
        files.append(tmp_path / f"ssd{k}.bin")
        data.tofile(files[-1])
        datas.append(data)
    rows = [np.unique(rng.integers(0, 2_000, 700)), np.arange(100, 1_100), np.zeros(0, dtype=np.int64)]
    outs = [torch.empty((r.size, 256), dtype=torch.uint8) for r in rows]
    kvikio = FakeKvikio(latency=0.001)  # a slow device: reads of other threads overlap this one
    with _CpuKvikioReader(threads=4, max_run_bytes=64 * 256, module=kvikio) as reader:
        seconds = reader.read_batch([_req(f, r, o) for f, r, o in zip(files, rows, outs)])
        assert len(seconds) == 3 and min(seconds) >= 0
        for data, r, out in zip(datas, rows, outs):
            assert np.array_equal(out.numpy(), data[r])
        runs = int((np.diff(rows[0]) != 1).sum()) + 1 + 1_000 // 64 + 1
        assert reader.preads == runs
        assert len(kvikio.threads) > 1
        assert reader.modes == {str(files[0]): "kvikio-compat", str(files[1]): "kvikio-compat"}
        with pytest.raises(TypeError, match="contiguous CPU tensor"):
            reader.read(files[0], rows[0], outs[0].t())
        with pytest.raises(OSError, match="ssd1.bin"):  # past the end: a short read names the file
            reader.read(files[1], np.array([1_999, 2_000]), torch.empty((2, 256), dtype=torch.uint8))
    assert kvikio.closed == 2


@pytest.mark.parametrize(
    "setting, mode",
    [
        (True, "kvikio-compat"),
        (False, "kvikio-gds"),
        ("ON", "kvikio-compat"),
        ("OFF", "kvikio-gds"),
        ("AUTO", "kvikio-auto"),
    ],
)
def test_kvikio_mode_across_versions(setting: bool | str, mode: str) -> None:
    """kvikio ≥ 24.10 answers an enum (ON, OFF, AUTO); before, a bool."""
    value = setting if isinstance(setting, bool) else type("CompatMode", (), {"name": setting})()
    module = type("kvikio", (), {"defaults": type("defaults", (), {"compat_mode": staticmethod(lambda: value)})})
    assert kvikio_mode(module) == mode


def test_kvikio_is_not_imported_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvikio", raising=False)  # a GPU test before may have imported it
    with make_reader("cpu") as reader:
        assert isinstance(reader, FileReader)
    assert "kvikio" not in sys.modules


# Performance (printed, loosely checked) ######################################


def test_get_is_faster_than_a_pread_loop(placed_dir: Path) -> None:
    """50,000 random SSD ids through ``get`` against one pread per id in a single thread, both
    reading through the page cache."""
    lo, hi = _ssd_range(placed_dir)
    rows = np.random.default_rng(8).integers(lo, hi, 50_000)
    ids = _vertex_at(placed_dir)[rows]
    with TieredFeatureStore(open_placed(placed_dir), reader=FileReader(direct=False)) as s:
        s.get(torch.from_numpy(ids))  # warm the page cache and the staging buffer
        t_get = _best(lambda: s.get(torch.from_numpy(ids)))
        placed, row_bytes = s.placed, s.row_bytes
    ssd = [b for b in placed.bins if b.tier == "ssd"]
    fds = [os.open(b.path, os.O_RDONLY) for b in ssd]
    starts = np.array([b.start for b in ssd])
    which = np.searchsorted(starts, rows, side="right") - 1
    offsets = ((rows - starts[which]) * row_bytes).tolist()
    fd_of = [fds[k] for k in which.tolist()]

    def loop() -> None:
        for fd, off in zip(fd_of, offsets):
            os.pread(fd, row_bytes, off)

    t_loop = _best(loop)
    for fd in fds:
        os.close(fd)
    print(
        f"\nget of 50,000 random SSD ids: {t_get * 1e3:.1f} ms; single-thread pread loop: {t_loop * 1e3:.1f} ms; "
        f"ratio loop/get {t_loop / t_get:.2f}"
    )
    assert t_get < 5 * t_loop


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_stage_reserved_once_for_growing_batches(
    placed_dir: Path, truth: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a bound known before training the pinned stage is allocated once, however batches grow;
    a batch beyond it grows it once (review finding 10)."""
    from trainer import staging

    sizes: list[int] = []
    real = staging.allocate
    monkeypatch.setattr(staging, "allocate", lambda n, d, p: sizes.append(n) or real(n, d, p))
    placed = open_placed(placed_dir)
    rng = np.random.default_rng(5)
    with TieredFeatureStore(placed, stage_reserve=staging.stage_bytes(4000, placed.row_bytes)) as s:
        for n in (100, 500, 1000, 2000, 4000, 6000, 5000):
            ids = rng.choice(len(truth), n, replace=False)
            assert np.array_equal(s.get(torch.from_numpy(ids)).numpy(), truth[ids])
        assert len(sizes) == 2 and s.stats()["staging"]["grown"] == 1
        assert sizes[0] == 4000 * placed.row_bytes + staging.PAGE


def test_a_cpu_store_stages_only_ssd_rows(placed_dir: Path, truth: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU device every row is put straight into the output: rows of the host tiers are not
    gathered into the staging buffer first (torch's gather is not called), which holds the
    distinct SSD rows only; the rows are the source's."""
    from trainer import featurestore, staging

    monkeypatch.setattr(featurestore, "gather_rows", lambda *a: pytest.fail("host rows staged"))
    ids = np.random.default_rng(6).integers(0, len(truth), 3_000)
    with TieredFeatureStore(open_placed(placed_dir)) as s:
        got = s.get(torch.from_numpy(ids)).numpy()
        st = s.stats()
    assert np.array_equal(got, truth[ids])
    assert st["tiers"]["gpu"]["rows"] > 0 and st["tiers"]["cpu"]["rows"] > 0
    assert st["staging"]["bytes"] == st["tiers"]["ssd"]["unique_rows"] * s.row_bytes + staging.PAGE
