"""The file reader's compiled read loop (moment/preads.py): same bytes as the Python loop, no
Python call per read, and errors that still name the file."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.readers import READ_ENGINES, FileReader, ReadRequest, engine_refusal
from unregistered import interrupt_thread_start

# Each engine that can run here; io_uring is refused where seccomp blocks it (Docker's default).
RUNNABLE = [
    pytest.param(e, marks=pytest.mark.skipif(bool(engine_refusal(e)), reason=str(engine_refusal(e))))
    for e in READ_ENGINES
]


def _file(tmp_path: Path, name: str, rows: int, row_bytes: int, seed: int) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    path = tmp_path / name
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("engine", RUNNABLE)
@pytest.mark.parametrize("threads", [1, 3])
def test_every_row_read_back_equals_the_file(tmp_path: Path, engine: str, threads: int) -> None:
    """Three files of different row sizes (512-aligned ones may go O_DIRECT, 100-byte rows read
    buffered), runs split by a small max_run_bytes, all in one batch."""
    files = [_file(tmp_path, f"bin{k}", 3_000, rb, k) for k, rb in enumerate((512, 4096, 100))]
    rng = np.random.default_rng(7)
    with FileReader(threads=threads, max_run_bytes=8192, engine=engine) as reader:
        requests = []
        for path, data in files:
            rows = np.unique(rng.integers(0, len(data), 1_500))
            requests.append(ReadRequest(path, rows, np.empty((rows.size, data.shape[1]), dtype=np.uint8)))
        seconds = reader.read_batch(requests)
        assert reader.engine == engine
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    for (_, data), req in zip(files, requests):
        assert np.array_equal(req.out, data[req.rows])


def test_compiled_engines_make_no_python_call_per_read(tmp_path: Path) -> None:
    """The point of the compiled loops: a healthy batch of 4,000 runs calls ``os.preadv`` never
    (the Python loop calls it once per run, holding the GIL each time)."""
    path, data = _file(tmp_path, "bin", 8_000, 512, 0)
    rows = np.arange(0, 8_000, 2)  # 4,000 one-row runs
    calls = {e: 0 for e in READ_ENGINES if engine_refusal(e) is None}
    assert "python" in calls and "pread" in calls
    for engine in calls:

        def count(frame: object, event: str, arg: object, engine: str = engine) -> None:
            if event == "c_call" and getattr(arg, "__name__", "") == "preadv":
                calls[engine] += 1

        out = np.empty((rows.size, 512), dtype=np.uint8)
        with FileReader(threads=1, engine=engine) as reader:
            sys.setprofile(count)
            try:
                reader.read(path, rows, out)
            finally:
                sys.setprofile(None)
            assert reader.preads == rows.size
        assert np.array_equal(out, data[rows])
    assert calls == {e: rows.size if e == "python" else 0 for e in calls}


@pytest.mark.parametrize("engine", RUNNABLE)
def test_end_of_file_mid_task_names_the_file_and_the_byte(tmp_path: Path, engine: str) -> None:
    """Rows past the end: the loop stops at the short read; Python finishes it and raises."""
    path, _ = _file(tmp_path, "short.bin", 100, 512, 1)
    rows = np.array([0, 5, 99, 100, 101])  # 100 and 101 are not in the file
    with (
        FileReader(threads=1, direct=False, engine=engine) as reader,
        pytest.raises(OSError, match=rf"short\.bin: unexpected end of file at byte {100 * 512}"),
    ):
        reader.read(path, rows, np.empty((rows.size, 512), dtype=np.uint8))


@pytest.mark.parametrize("engine", RUNNABLE)
def test_a_failing_read_is_an_error_naming_the_file(tmp_path: Path, engine: str) -> None:
    """A descriptor opened write-only fails every read (EBADF): the error names it."""
    path, _ = _file(tmp_path, "bin", 10, 512, 2)
    fd = os.open(path, os.O_WRONLY)
    try:
        with (
            FileReader(threads=1, direct=False, engine=engine) as reader,
            pytest.raises(OSError, match=rf"fd {fd}: Bad file descriptor"),
        ):
            reader.read(fd, np.array([1, 2]), np.empty((2, 512), dtype=np.uint8))
    finally:
        os.close(fd)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(bool(engine_refusal("io_uring")), reason=str(engine_refusal("io_uring")))
def test_rings_are_one_per_thread_and_closed_with_the_reader(tmp_path: Path) -> None:
    """Each reading thread gets its own ring (a ring has one submitter); close releases them all
    (each ring is a descriptor): none left behind, and reading goes on after a reader is closed."""
    path, data = _file(tmp_path, "bin", 4_000, 512, 3)
    rows = np.arange(0, 4_000, 3)
    before = _open_fds()
    reader = FileReader(threads=3, engine="io_uring")
    out = np.empty((rows.size, 512), dtype=np.uint8)
    reader.read(path, rows, out)
    assert np.array_equal(out, data[rows])
    rings = len(reader._rings)  # noqa: SLF001 - the count is the point
    assert 1 <= rings <= 3
    assert _open_fds() >= before + rings + 2  # the rings (CPython's mmap holds a dup of each), the file twice
    reader.close()
    assert _open_fds() == before


@pytest.mark.parametrize("engine", RUNNABLE)
def test_close_waits_for_reads_in_flight_before_closing_their_files(tmp_path: Path, engine: str) -> None:
    """A command interrupted while its reader's threads read closes the reader at once: the
    files must stay open until those reads are done. A descriptor closed under a read in flight
    can be reused meanwhile (a pipe, say) and the read then waits forever, and the interpreter
    with it at exit (the CI hang of the SIGTERM test)."""
    files = [_file(tmp_path, f"bin{k}", 500, 512, k) for k in range(2)]
    reader = FileReader(threads=2, engine=engine)
    started, release = threading.Barrier(3), threading.Event()
    issue = reader.issue

    def held(task: Any) -> Any:
        started.wait(timeout=10)
        release.wait(timeout=10)
        os.fstat(task.file.fd)  # EBADF if the reader closed it meanwhile
        return issue(task)

    reader.issue = held  # type: ignore[method-assign]
    requests = [ReadRequest(p, np.array([k + 5]), np.empty((1, 512), dtype=np.uint8)) for k, (p, _) in enumerate(files)]
    failed: list[BaseException] = []

    def read() -> None:
        try:
            reader.read_batch(requests)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    reading = threading.Thread(target=read)
    reading.start()
    started.wait(timeout=10)  # both tasks in flight, one per thread
    closing = threading.Thread(target=reader.close)
    closing.start()
    time.sleep(0.3)
    assert closing.is_alive()  # waiting for the reads
    release.set()
    reading.join(timeout=10)
    closing.join(timeout=10)
    assert not failed, failed
    for (_, data), req in zip(files, requests):
        assert np.array_equal(req.out, data[req.rows])
    assert not reader._files  # noqa: SLF001 - closed once the reads were done


def test_close_waits_for_a_reading_thread_the_executor_never_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal that lands while the pool starts a worker (``Thread.start`` waits for it to
    begin, interruptibly) leaves a thread that took a task but that ThreadPoolExecutor never
    registered, so its shutdown does not wait for it: close still waits for that read before
    it closes the files (the CI hang: the files' descriptors went to new io_uring rings, and the
    read waited on its own ring forever)."""
    files = [_file(tmp_path, f"bin{k}", 500, 512, k) for k in range(2)]
    requests = [ReadRequest(p, np.array([k + 5]), np.empty((1, 512), dtype=np.uint8)) for k, (p, _) in enumerate(files)]
    reader = FileReader(threads=2, engine="python")
    running, release = threading.Event(), threading.Event()
    closed_under: list[OSError] = []
    issue = reader.issue

    def held(task: Any) -> Any:
        running.set()
        release.wait(timeout=10)
        try:
            os.fstat(task.file.fd)
        except OSError as exc:
            closed_under.append(exc)
        return issue(task)

    reader.issue = held  # type: ignore[method-assign]
    interrupt_thread_start(monkeypatch, "moment-read", running)
    with pytest.raises(KeyboardInterrupt):
        reader.read_batch(requests)
    closing = threading.Thread(target=reader.close)
    closing.start()
    time.sleep(0.3)
    assert closing.is_alive()  # waiting for the read in flight
    release.set()
    closing.join(timeout=10)
    assert not closing.is_alive() and not closed_under, closed_under


def test_auto_falls_back_when_io_uring_is_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's default seccomp profile blocks io_uring: auto takes pread; asking for io_uring
    by name says why it cannot."""
    from trainer import file_reader

    monkeypatch.setattr(file_reader, "uring_reads", lambda: (None, "io_uring is not available here (EPERM)"))
    with FileReader(engine="auto") as reader:
        assert reader.engine == ("pread" if engine_refusal("pread") is None else "python")
    with pytest.raises(ValueError, match=r"io_uring is not available here \(EPERM\)"):
        FileReader(engine="io_uring")
    with pytest.raises(ValueError, match="engine must be auto or one of io_uring, pread, python"):
        FileReader(engine="aio")


def test_a_probe_read_that_never_completes_is_a_refusal_not_a_hang() -> None:
    """A runtime that takes io_uring submissions and never completes them must not hang every
    reader: the probe gives up after its timeout and says so."""
    from moment import uring

    release = threading.Event()
    closed: list[bool] = []

    class StuckRing:
        args = ()

        def close(self) -> None:
            closed.append(True)

    start = time.perf_counter()
    why = uring.read_back(lambda *a: release.wait(), StuckRing(), timeout=0.2)
    assert why == "io_uring probe read did not complete in 0.2 s: not used"
    assert time.perf_counter() - start < 2 and not closed  # the thread may still use the ring
    release.set()

    def short_read(*args: Any) -> int:
        args[-1][0] = 3  # got: 3 bytes
        return 0

    assert uring.read_back(short_read, StuckRing(), timeout=2) == "io_uring read back 3 of 21 bytes (rc 0): not used"
    assert closed == [True]


def test_moment_read_engine_replaces_auto_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOMENT_READ_ENGINE forces the engine "auto" picks (no io_uring probe); a name that is not
    an engine is one line naming the variable; an engine asked for by name is kept."""
    from trainer import file_reader

    monkeypatch.setattr(file_reader, "uring_reads", lambda: pytest.fail("auto must not probe io_uring"))
    monkeypatch.setenv("MOMENT_READ_ENGINE", "python")
    with FileReader(engine="auto") as reader:
        assert reader.engine == "python"
    monkeypatch.setenv("MOMENT_READ_ENGINE", "aio")
    with pytest.raises(ValueError, match="^MOMENT_READ_ENGINE=aio: must be one of io_uring, pread, python$"):
        file_reader.pick_engine("auto")
    assert file_reader.pick_engine("python") == "python"
