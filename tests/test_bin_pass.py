"""The bin pass on several threads (placement.writer.write_bins): each chunk grouped by ranges of
its rows and appended by sets of bins gives the bytes one thread gives, every bin file has one
writer at a time, and an interrupted pass resumes from a checkpoint that claims only bytes on disk."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moment.gated_pool import GatedPool
from placement import direct_io, writer
from placement.writer import BinFile, group_rows, range_starts, write_bins


@pytest.mark.parametrize("width, threads", [(6, 2), (512, 3), (8, 5), (6, 16)])
def test_group_rows_in_ranges_is_the_stable_sort(width: int, threads: int) -> None:
    rng = np.random.default_rng(width * threads)
    n = 40 if threads == 16 else 5000  # more ranges than rows: some ranges empty of a bin, or of rows
    rows = rng.integers(0, 256, (n, width), dtype=np.uint8)
    bins = rng.integers(0, 7, n).astype(np.uint8)
    bins[bins == 3] = 2  # a bin with no rows
    pool = GatedPool(threads - 1, "test-group")
    try:
        got = group_rows(rows, bins, np.bincount(bins, minlength=7), pool=pool, threads=threads)
    finally:
        pool.close()
    assert np.array_equal(got, rows[np.argsort(bins, kind="stable")])


def test_range_starts_put_each_ranges_rows_after_the_earlier_ranges_of_the_bin() -> None:
    starts = range_starts([np.array([2, 0, 1]), np.array([1, 3, 0])])
    # bin 0 holds rows 0-2 (range 0: 0-1, range 1: 2), bin 1 rows 3-5 (all range 1), bin 2 row 6
    assert starts.tolist() == [[0, 3, 6], [2, 3, 7]]


def _source(tmp_path: Path, rows: int = 3000, dim: int = 6, nbins: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    np.save(tmp_path / "f.npy", rng.standard_normal((rows, dim)).astype(np.float32))
    bin_of = rng.integers(0, nbins, rows).astype(np.int16)
    bin_of[bin_of == 4] = 0  # an empty bin
    return np.load(tmp_path / "f.npy", mmap_mode="r"), bin_of


def _files(work: Path, bin_of: np.ndarray, nbins: int = 5) -> list[BinFile]:
    work.mkdir(parents=True, exist_ok=True)
    return [BinFile(f"b{b}", work / f"b{b}.bin", int((bin_of == b).sum())) for b in range(nbins)]


def test_every_thread_count_writes_the_same_bytes_one_writer_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, bin_of = _source(tmp_path)
    write = direct_io.AppendFile.write
    locks: dict[Path, threading.Lock] = {}
    overlapped: list[Path] = []
    writers: set[str] = set()

    def one_writer(self: direct_io.AppendFile, data: memoryview | bytes) -> None:
        lock = locks.setdefault(self.path, threading.Lock())
        if not lock.acquire(blocking=False):
            overlapped.append(self.path)
            lock.acquire()
        try:
            writers.add(threading.current_thread().name)
            time.sleep(0.001)  # widen the window a second writer would hit
            write(self, data)
        finally:
            lock.release()

    monkeypatch.setattr(direct_io.AppendFile, "write", one_writer)
    results = {}
    for threads in (1, 2, 3):
        writers.clear()
        files = _files(tmp_path / f"t{threads}", bin_of)
        done = write_bins(source, bin_of, files, tmp_path / f"t{threads}", "k", chunk_rows=211, threads=threads)
        results[threads] = ([f.path.read_bytes() for f in files], [w.digest for w in done.files])
        assert len(writers) == threads  # the caller and threads - 1 of the pool appended
    assert not overlapped
    feats = np.asarray(source)
    for b, data in enumerate(results[1][0]):
        assert np.array_equal(np.frombuffer(data, dtype=np.float32).reshape(-1, 6), feats[bin_of == b])
    assert results[2] == results[1] and results[3] == results[1]


def test_an_interrupted_threaded_pass_resumes_from_flushed_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, bin_of = _source(tmp_path)
    whole = _files(tmp_path / "whole", bin_of)
    ref = write_bins(source, bin_of, whole, tmp_path / "whole", "k", chunk_rows=97, threads=1)
    monkeypatch.setattr(writer, "CHECKPOINT_BYTES", 4 << 10)
    work = tmp_path / "cut"
    files = _files(work, bin_of)

    class StopError(Exception):
        pass

    def stop_after_a_checkpoint(done: int, total: int) -> None:
        if 0 < done < total // 2 and (work / writer.STATE).exists():
            raise StopError

    with pytest.raises(StopError):
        write_bins(source, bin_of, files, work, "k", chunk_rows=97, progress=stop_after_a_checkpoint, threads=3)
    state = json.loads((work / writer.STATE).read_text())
    assert 0 < state["next_row"] < bin_of.size // 2
    for f, w in zip(files, whole):
        claimed = state["bytes"].get(f.name, 0)
        assert f.path.stat().st_size >= claimed  # the checkpoint claims only bytes written
        assert f.path.read_bytes()[:claimed] == w.path.read_bytes()[:claimed]
    seen: list[int] = []
    done = write_bins(source, bin_of, files, work, "k", chunk_rows=97, progress=lambda d, t: seen.append(d), threads=2)
    assert seen[0] == state["next_row"]  # resumed, not restarted
    assert [f.path.read_bytes() for f in files] == [w.path.read_bytes() for w in whole]
    assert [w.digest for w in done.files] == [w.digest for w in ref.files]
