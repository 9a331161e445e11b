"""The kvikio reader against a strict kvikio 26.x fake (tests/kvikio_fake.py), on CPU tensors:
configuration, end of file, kvikio's pool, the Python cost per run, and how ``io=auto`` chooses."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvikio_fake import FakeKvikio, real_kvikio_or_skip
from moment.errors import MomentError
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
    kvikio = FakeKvikio(cufile_available=True)
    kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF)
    rows = np.concatenate([np.arange(0, 8), [20, 30, 40]])  # one run of 32 KiB, three of 4 KiB
    out = torch.empty((rows.size, 4096), dtype=torch.uint8)
    with _CpuKvikioReader(threads=2, module=kvikio) as reader:
        reader.read(path, rows, out)
        assert reader.modes == {str(path): "kvikio-gds"}
        assert reader.routes == {"posix": 3, "gds": 1}
        assert reader.read_bytes == {str(path): 11 * 4096}  # 11 rows of one page each, as FileReader counts
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

    monkeypatch.setitem(readers.READERS, "kvikio", readers.ReaderKind(fake_reader, "installed"))
    with make_reader("cuda", io="auto", threads=2) as reader:
        assert isinstance(reader, FileReader) and not made
    with make_reader("cuda", io="auto", threads=2, probe=[(path, 4096)]) as reader:
        assert isinstance(reader, FileReader)  # 2 ms per kvikio read: the file reader wins
        assert set(reader.probe) == {"posix", "kvikio"} and reader.probe["posix"] < reader.probe["kvikio"]


@pytest.mark.parametrize("cufile", [False, True])
def test_asking_for_kvikio_without_gpudirect_storage_warns_that_posix_is_faster(
    cufile: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first GPU run: kvikio in compat mode read 128-byte rows at 0.05 of raw random reads
    (posix: 0.57). Asked for by name it is still made, with a warning; with cuFile, no warning."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = FakeKvikio(cufile_available=cufile)
    kind = readers.ReaderKind(lambda threads, direct: _CpuKvikioReader(threads=threads, module=fake), "fake")
    monkeypatch.setitem(readers.READERS, "kvikio", kind)
    with make_reader("cuda", io="kvikio", threads=2) as reader:
        assert isinstance(reader, KvikioReader) and reader.route == ("direct" if cufile else "host")
    err = capsys.readouterr().err
    assert ("no GPUDirect Storage here" in err) != cufile and ("--io auto measures both" in err) != cufile
    fake.shutdown()


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
def test_real_kvikio_reads_rows_at_and_above_the_gds_threshold(tmp_path: Path) -> None:
    """The real library, with 16 KiB rows (4096-dim float32): runs of one row and of several go
    to kvikio's pool / GDS path, which the 512-byte rows of the store test never reach."""
    real_kvikio_or_skip()
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


@pytest.mark.parametrize(
    "cufile, mode, modes, routes",
    [
        (False, "AUTO", "kvikio-compat", {"posix": 8, "gds": 0}),  # AUTO without cuFile: every file compat
        (True, "OFF", "kvikio-gds", None),  # OFF: cuFile for every file (or it fails to open)
        (True, "AUTO", "kvikio-auto", {"posix": 6, "gds": 0, "gds_or_posix": 2}),
    ],
)
def test_routes_claim_no_gds_read_kvikio_does_not_report(
    tmp_path: Path, cufile: bool, mode: str, modes: str, routes: dict[str, int] | None
) -> None:
    """kvikio decides per file at open whether cuFile reads it (under AUTO, not a file cuFile
    cannot register) and its Python CuFile does not say which (26.x): the stats count such a
    file's large reads as gds_or_posix, never as gds; reads below the threshold are posix in every
    mode. Where the mode is known, the counts are what kvikio did (the fake's ground truth)."""
    a, data_a = _file(tmp_path, 64, 4096, "ssd0.bin")
    b, data_b = _file(tmp_path, 64, 4096, "ssd1.bin")
    kvikio = FakeKvikio(cufile_available=cufile, unregistrable={str(b)} if mode == "AUTO" else set())
    kvikio.defaults.set("compat_mode", kvikio.CompatMode[mode])
    rows = np.concatenate([np.arange(0, 8), [20, 30, 40]])  # one run of 32 KiB, three of 4 KiB
    outs = [torch.empty((rows.size, 4096), dtype=torch.uint8) for _ in range(2)]
    with _CpuKvikioReader(threads=2, module=kvikio) as reader:
        reader.read_batch([ReadRequest(a, rows, outs[0]), ReadRequest(b, rows, outs[1])])
        assert reader.modes == {str(a): modes, str(b): modes}
        got = dict(reader.routes)
    kvikio.shutdown()
    assert np.array_equal(outs[0].numpy(), data_a[rows]) and np.array_equal(outs[1].numpy(), data_b[rows])
    truth = {"posix": kvikio.posix_reads, "gds": kvikio.cufile_reads}
    assert got == (routes or truth)
    assert got["gds"] <= truth["gds"] and got["posix"] <= truth["posix"] and sum(got.values()) == sum(truth.values())
    if mode == "AUTO" and cufile:
        assert truth == {"posix": 7, "gds": 1}  # ssd1.bin fell back to POSIX: counting it as gds would be wrong


def test_a_file_cufile_cannot_open_is_one_line_naming_it(tmp_path: Path) -> None:
    """Compat mode OFF (or kvikio ≤ 24.12) raises at CuFile() for a file cuFile cannot register;
    that happens in the prefetch thread, inside read_batch: a MomentError (the trainer prints one
    line) that is also an OSError (io=auto's probe drops the reader)."""
    path, _ = _file(tmp_path, 64, 4096)
    kvikio = FakeKvikio(cufile_available=True, unregistrable={str(path)})
    kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF)
    with _CpuKvikioReader(threads=2, module=kvikio) as reader, pytest.raises(readers.ReadError) as caught:
        reader.read(path, np.arange(4), torch.empty((4, 4096), dtype=torch.uint8))
    assert isinstance(caught.value, MomentError) and isinstance(caught.value, OSError)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: kvikio cannot open it: cuFile error")


def test_every_cufile_handle_is_closed_once(tmp_path: Path) -> None:
    """close() deregisters and closes each file kvikio opened, once: a second close (the store's
    and the context manager's, say) closes nothing again."""
    files = [_file(tmp_path, 32, 512, f"ssd{k}.bin")[0] for k in range(3)]
    kvikio = FakeKvikio()
    reader = _CpuKvikioReader(threads=2, module=kvikio)
    reader.read_batch([ReadRequest(f, np.arange(4), torch.empty((4, 512), dtype=torch.uint8)) for f in files])
    assert kvikio.closed == 0
    reader.close()
    assert (kvikio.closed, kvikio.close_calls) == (3, 3)
    reader.close()
    assert (kvikio.closed, kvikio.close_calls) == (3, 3)


def test_auto_keeps_posix_when_the_kvikio_reader_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Importing kvikio can fail other than with ImportError (libkvikio's loader is ctypes:
    OSError); io=auto then keeps the file reader and says why."""
    path, _ = _file(tmp_path, 64, 4096)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(threads: int, direct: bool) -> KvikioReader:
        raise OSError("libcufile.so.0: cannot open shared object file")

    monkeypatch.setitem(readers.READERS, "kvikio", readers.ReaderKind(broken, "installed"))
    with make_reader("cuda", io="auto", threads=2, probe=[(path, 4096)]) as reader:
        assert isinstance(reader, FileReader)
    assert "kvikio reader cannot be made (libcufile.so.0" in capsys.readouterr().err


def test_a_kvikio_that_fails_to_load_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incomplete kvikio wheel set fails inside libkvikio's loader with a RuntimeError (no
    libcufile): the reader's import turns any failure into an ImportError, so tests skip and
    ``--io kvikio`` is one line instead of a traceback."""
    pkg = tmp_path / "kvikio"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('Unable to load cufile')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvikio", raising=False)
    with pytest.raises(ImportError, match="^kvikio cannot be loaded: RuntimeError: Unable to load cufile$"):
        readers.import_kvikio()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="^kvikio cannot be imported: kvikio cannot be loaded: RuntimeError"):
        make_reader("cuda", io="kvikio")
