"""The file reader's compiled read loop (moment/preads.py): same bytes as the Python loop, no
Python call per read, and errors that still name the file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from moment.preads import native_preads
from trainer.readers import FileReader, ReadRequest

pytestmark = pytest.mark.skipif(native_preads() is None, reason="numba or libc pread unavailable")


def _file(tmp_path: Path, name: str, rows: int, row_bytes: int, seed: int) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    path = tmp_path / name
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("threads", [1, 3])
def test_every_row_read_back_equals_the_file(tmp_path: Path, native: bool, threads: int) -> None:
    """Three files of different row sizes (512-aligned ones may go O_DIRECT, 100-byte rows read
    buffered), runs split by a small max_run_bytes, all in one batch."""
    files = [_file(tmp_path, f"bin{k}", 3_000, rb, k) for k, rb in enumerate((512, 4096, 100))]
    rng = np.random.default_rng(7)
    with FileReader(threads=threads, max_run_bytes=8192, native=native) as reader:
        requests = []
        for path, data in files:
            rows = np.unique(rng.integers(0, len(data), 1_500))
            requests.append(ReadRequest(path, rows, np.empty((rows.size, data.shape[1]), dtype=np.uint8)))
        seconds = reader.read_batch(requests)
        assert reader.engine == ("native" if native else "python")
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    for (_, data), req in zip(files, requests):
        assert np.array_equal(req.out, data[req.rows])


def test_the_native_loop_makes_no_python_call_per_read(tmp_path: Path) -> None:
    """The point of the compiled loop: a healthy batch of 4,000 runs calls ``os.preadv`` never
    (the Python loop calls it once per run, holding the GIL each time)."""
    path, data = _file(tmp_path, "bin", 8_000, 512, 0)
    rows = np.arange(0, 8_000, 2)  # 4,000 one-row runs
    calls = {"native": 0, "python": 0}
    for engine in calls:

        def count(frame: object, event: str, arg: object, engine: str = engine) -> None:
            if event == "c_call" and getattr(arg, "__name__", "") == "preadv":
                calls[engine] += 1

        out = np.empty((rows.size, 512), dtype=np.uint8)
        with FileReader(threads=1, native=engine == "native") as reader:
            sys.setprofile(count)
            try:
                reader.read(path, rows, out)
            finally:
                sys.setprofile(None)
            assert reader.preads == rows.size
        assert np.array_equal(out, data[rows])
    assert calls == {"native": 0, "python": rows.size}


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_end_of_file_mid_task_names_the_file_and_the_byte(tmp_path: Path, native: bool) -> None:
    """Rows past the end: the loop stops at the short read; Python finishes it and raises."""
    path, _ = _file(tmp_path, "short.bin", 100, 512, 1)
    rows = np.array([0, 5, 99, 100, 101])  # 100 and 101 are not in the file
    with (
        FileReader(threads=1, direct=False, native=native) as reader,
        pytest.raises(OSError, match=rf"short\.bin: unexpected end of file at byte {100 * 512}"),
    ):
        reader.read(path, rows, np.empty((rows.size, 512), dtype=np.uint8))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_failing_read_is_an_error_naming_the_file(tmp_path: Path, native: bool) -> None:
    """A descriptor opened write-only fails every read (EBADF): the error names it."""
    path, _ = _file(tmp_path, "bin", 10, 512, 2)
    fd = os.open(path, os.O_WRONLY)
    try:
        with (
            FileReader(threads=1, direct=False, native=native) as reader,
            pytest.raises(OSError, match=rf"fd {fd}: Bad file descriptor"),
        ):
            reader.read(fd, np.array([1, 2]), np.empty((2, 512), dtype=np.uint8))
    finally:
        os.close(fd)
