"""The kvikio reader against a strict kvikio 26.x fake (tests/kvikio_fake.py), on CPU tensors:
configuration, end of file, kvikio's pool, the Python cost per run, and how ``io=auto`` chooses."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvikio_fake import FakeKvikio
from trainer import readers
from trainer.readers import GDS_THRESHOLD, FileReader, KvikioReader, ReadRequest, choose_reader, make_reader


class _CpuKvikioReader(KvikioReader):
    device_type = "cpu"


def _file(tmp_path: Path, rows: int, row_bytes: int, name: str = "ssd0.bin") -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(3).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    path = tmp_path / name
    data.tofile(path)
    return path, data


def test_the_reader_configures_kvikio_explicitly() -> None:
    """Threads, GDS threshold and direct compat reads are set, not left to kvikio's defaults
    (1 thread; 16 KiB since 25.04, 1 MiB before; buffered compat reads); a version without
    auto_direct_io_read says so in the config instead of failing."""
    kvikio = FakeKvikio()
    with _CpuKvikioReader(threads=8, module=kvikio) as reader:
        assert kvikio.defaults.get("num_threads") == 8
        assert kvikio.defaults.get("gds_threshold") == GDS_THRESHOLD == 16 << 10
        assert kvikio.defaults.get("auto_direct_io_read") is True
        assert reader.config == {"num_threads": 8, "gds_threshold": 16 << 10, "auto_direct_io_read": True}
    with _CpuKvikioReader(threads=4, module=FakeKvikio(version="25.06")) as reader:
        assert reader.config == {"num_threads": 4, "gds_threshold": 16 << 10, "auto_direct_io_read": False}


def test_end_of_file_names_the_file(tmp_path: Path) -> None:
    """kvikio raises RuntimeError at EOF (it never reads short): the reader says which file."""
    path, _ = _file(tmp_path, 10, 512)
    with _CpuKvikioReader(threads=2, module=FakeKvikio()) as reader, pytest.raises(OSError, match="ssd0.bin"):
        reader.read(path, np.array([9, 10]), torch.empty((2, 512), dtype=torch.uint8))


def test_runs_above_the_gds_threshold_are_not_serialised(tmp_path: Path) -> None:
    """Rows of 16 KiB go to kvikio's pool; with its default single thread 16 reads of 20 ms would
    take 320 ms. The reader sizes the pool to its threads."""
    path, data = _file(tmp_path, 64, GDS_THRESHOLD)
    rows = np.arange(0, 64, 4)  # 16 separate runs, each one row
    out = torch.empty((rows.size, GDS_THRESHOLD), dtype=torch.uint8)
    kvikio = FakeKvikio(latency=0.02)
    with _CpuKvikioReader(threads=8, module=kvikio) as reader:
        start = time.perf_counter()
        reader.read(path, rows, out)
        elapsed = time.perf_counter() - start
        assert np.array_equal(out.numpy(), data[rows])
        assert reader.routes == {"posix": 16, "gds": 0}  # compat mode: every read is POSIX
    kvikio.shutdown()
    assert len(kvikio.threads) > 1 and elapsed < 0.16, f"{elapsed:.3f} s for 16 reads of 20 ms"


def test_routes_count_the_reads_gds_would_take(tmp_path: Path) -> None:
    """In GDS mode only reads of gds_threshold or more take cuFile: the stats say how many."""
    path, data = _file(tmp_path, 64, 4096)
    kvikio = FakeKvikio()
    kvikio.defaults.set("compat_mode", "OFF")
    rows = np.concatenate([np.arange(0, 8), [20, 30, 40]])  # one run of 32 KiB, three of 4 KiB
    out = torch.empty((rows.size, 4096), dtype=torch.uint8)
    with _CpuKvikioReader(threads=2, module=kvikio) as reader:
        reader.read(path, rows, out)
        assert reader.modes == {str(path): "kvikio-gds"}
        assert reader.routes == {"posix": 3, "gds": 1}
    kvikio.shutdown()
    assert np.array_equal(out.numpy(), data[rows])


class _NoopCuFile:
    """kvikio's Python-side work per pread (the buffer's interface parsed), no I/O."""

    def pread(self, buf: object, size: int, file_offset: int = 0) -> _NoopCuFile:
        iface = buf.__cuda_array_interface__  # type: ignore[attr-defined]
        ptr, _ = iface["data"]
        _ = iface["shape"], iface["typestr"], ptr
        return self

    def get(self) -> int:
        return 0


def test_python_cost_per_kvikio_run_stays_near_the_file_readers(tmp_path: Path) -> None:
    """Issuing a run through kvikio may cost at most twice the file reader's preadv per run
    (a tensor slice plus torch's __cuda_array_interface__ per run cost ~4×)."""
    path, _ = _file(tmp_path, 4_096, 512)
    rows = np.arange(0, 4_096, 2)  # 2,048 one-row runs
    posix = FileReader(threads=1, direct=False)
    host = np.empty((rows.size, 512), dtype=np.uint8)
    posix.read(path, rows, host)  # page cache warm
    file_task = posix.plan_task(0, ReadRequest(path, rows, host))
    kvikio = _CpuKvikioReader(threads=1, module=FakeKvikio())
    kv_task = kvikio.plan_task(0, ReadRequest(path, rows, torch.from_numpy(host)))
    kv_task.file = _NoopCuFile()

    def best(do: object, task: object) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            do(task)  # type: ignore[operator]
            times.append(time.perf_counter() - start)
        return min(times) / rows.size * 1e6

    us_file, us_kvikio = best(posix.issue, file_task), best(kvikio.issue, kv_task)
    posix.close()
    kvikio.close()
    print(f"\nPython per run: file reader {us_file:.2f} µs (with its preadv), kvikio issue {us_kvikio:.2f} µs")
    assert us_kvikio <= 2 * us_file


def test_auto_is_posix_unless_a_probe_measured_kvikio_faster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed kvikio is not a reason: without probe files auto is the file reader; with
    them, whichever read them faster, its figures kept."""
    path, _ = _file(tmp_path, 512, 4096)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    made: list[FakeKvikio] = []

    def fake_reader(threads: int, direct: bool) -> _CpuKvikioReader:
        made.append(FakeKvikio(latency=0.002))
        return _CpuKvikioReader(threads=threads, module=made[-1])

    monkeypatch.setitem(readers.READERS, "kvikio", readers.ReaderKind(fake_reader, True, "installed"))
    with make_reader("cuda", io="auto", threads=2) as reader:
        assert isinstance(reader, FileReader) and not made
    with make_reader("cuda", io="auto", threads=2, probe=[(path, 4096)]) as reader:
        assert isinstance(reader, FileReader)  # 2 ms per kvikio read: the file reader wins
        assert set(reader.probe) == {"posix", "kvikio"} and reader.probe["posix"] < reader.probe["kvikio"]


def test_choose_reader_takes_the_faster(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, 512, 4096)

    class SlowFileReader(FileReader):
        def read_batch(self, requests):  # type: ignore[no-untyped-def]
            time.sleep(0.05)
            return super().read_batch(requests)

    kvikio = FakeKvikio()
    chosen = choose_reader(
        {"posix": SlowFileReader(threads=2), "kvikio": _CpuKvikioReader(2, module=kvikio)}, [(path, 4096)]
    )
    with chosen:
        assert isinstance(chosen, KvikioReader) and chosen.probe["kvikio"] < chosen.probe["posix"]
    kvikio.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_kvikio_reads_rows_at_and_above_the_gds_threshold(tmp_path: Path) -> None:
    """The real library, with 16 KiB rows (4096-dim float32): runs of one row and of several go
    to kvikio's pool / GDS path, which the 512-byte rows of the store test never reach."""
    pytest.importorskip("kvikio")
    path, data = _file(tmp_path, 256, GDS_THRESHOLD)
    rows = np.unique(np.concatenate([np.arange(10, 20), np.random.default_rng(5).integers(0, 256, 60)]))
    out = torch.empty((rows.size, GDS_THRESHOLD), dtype=torch.uint8, device="cuda")
    with KvikioReader(threads=4) as reader:
        reader.read(path, rows, out)
        assert reader.config["gds_threshold"] == GDS_THRESHOLD and reader.config["num_threads"] == 4
        print(f"\nkvikio {reader.mode}: config {reader.config}, routes {reader.routes}")
        with pytest.raises(OSError, match="ssd0.bin"):
            reader.read(path, np.array([255, 256]), torch.empty((2, GDS_THRESHOLD), dtype=torch.uint8, device="cuda"))
    assert np.array_equal(out.cpu().numpy(), data[rows])


def test_a_reader_that_fails_its_probe_is_not_chosen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kvikio ≤ 24.12 raises at CuFile() where cuFile cannot register the file: io=auto then
    keeps the file reader, with a warning, instead of failing the run."""
    path, _ = _file(tmp_path, 64, 4096)

    class Refusing(FakeKvikio):
        def CuFile(self, file: str, flags: str = "r"):  # type: ignore[no-untyped-def]  # noqa: N802
            raise RuntimeError("cuFile error: CU_FILE_DRIVER_NOT_INITIALIZED")

    chosen = choose_reader(
        {"posix": FileReader(threads=2), "kvikio": _CpuKvikioReader(2, module=Refusing())}, [(path, 4096)]
    )
    with chosen:
        assert isinstance(chosen, FileReader) and chosen.probe["kvikio"] == float("inf")
    assert "kvikio reader failed its probe" in capsys.readouterr().err
