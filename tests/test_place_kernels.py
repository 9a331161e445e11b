"""The compiled passes behind `moment place`'s speed give what the plain numpy ones gave:
grouping rows by bin, the row map's counting sort, checksummed .npy files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from placement import relabel as rl
from placement import writer
from placement.digests import PLACED_DIGEST, file_digest
from placement.writer import BinFile, NpyWriter, group_rows, save_npy, write_bins
from unregistered import interrupt_thread_start


@pytest.mark.parametrize("width", [1, 6, 12, 512])
def test_group_rows_is_a_stable_sort_by_bin(width: int) -> None:
    rng = np.random.default_rng(width)
    rows = rng.integers(0, 256, (5000, width), dtype=np.uint8)
    bins = rng.integers(0, 7, 5000).astype(np.uint8)
    got = group_rows(rows, bins, np.bincount(bins, minlength=7))
    assert np.array_equal(got, rows[np.argsort(bins, kind="stable")])


def test_the_row_map_is_the_stable_sort_by_tier() -> None:
    rng = np.random.default_rng(0)
    tiers = ["ssd", "gpu", "ssd", "cpu", "gpu"]
    bin_of = rng.integers(0, len(tiers), 10_000).astype(np.int16)
    r = rl.relabel(bin_of, tiers)
    rank = np.array([3, 0, 4, 2, 1])[bin_of]  # gpu bins 1 and 4 first (plan order), then cpu 3, ssd 0 and 2
    assert r.order == [1, 4, 3, 0, 2]
    assert r.old_to_new.dtype == np.int32
    assert np.array_equal(np.argsort(r.old_to_new), np.argsort(rank, kind="stable"))  # the vertex at each row
    assert np.array_equal(np.diff(r.starts), np.bincount(bin_of, minlength=5)[r.order])


def test_npy_writer_checksums_what_numpy_reads_back(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    w = save_npy(tmp_path / "a.npy", a)
    assert np.array_equal(np.load(tmp_path / "a.npy"), a)
    assert w.digest == file_digest(tmp_path / "a.npy", PLACED_DIGEST) and w.bytes == (tmp_path / "a.npy").stat().st_size
    short = NpyWriter(tmp_path / "b.npy", np.int64, (5,))
    short.write(np.arange(4))
    with pytest.raises(RuntimeError, match="header promises"):
        short.close()


def test_npy_writer_hashes_and_syncs_beside_its_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashed in its thread (in order, a few blocks behind) and fsynced every few blocks in
    another: the digest is still the file's, the content numpy's."""
    monkeypatch.setattr(writer, "SYNC_BYTES", 4000)
    monkeypatch.setattr(writer, "HASH_AHEAD_BYTES", 10_000)
    rng = np.random.default_rng(4)
    blocks = [rng.integers(0, 1 << 40, int(k)) for k in rng.integers(1, 3000, 40)]
    total = sum(b.size for b in blocks)
    out = NpyWriter(tmp_path / "a.npy", np.int64, (total,))
    for b in blocks:
        out.write(b)
    out.finish()
    assert out.close() == file_digest(tmp_path / "a.npy", PLACED_DIGEST) == out.digest
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.concatenate(blocks))
    assert out.fsync_s > 0 and out.hash_s > 0 and out.bytes == (tmp_path / "a.npy").stat().st_size


def test_read_ahead_asks_for_the_rows_of_the_source_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel is asked for the source's rows (past the .npy header), front first, at most
    the budget; an array in memory needs nothing."""
    feats = np.zeros((1000, 8), dtype=np.float32)
    np.save(tmp_path / "f.npy", feats)
    mapped = np.load(tmp_path / "f.npy", mmap_mode="r")
    asked: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        writer.os, "posix_fadvise", lambda fd, offset, size, advice: asked.append((offset, size, advice))
    )
    for budget in (1 << 30, 4096):
        thread = writer.read_ahead(mapped, budget)
        assert thread is not None
        thread.join()
    header = (tmp_path / "f.npy").stat().st_size - feats.nbytes
    assert asked == [
        (header, feats.nbytes, writer.os.POSIX_FADV_WILLNEED),
        (header, 4096, writer.os.POSIX_FADV_WILLNEED),
    ]
    assert writer.read_ahead(feats, 1 << 30) is None and writer.read_ahead(mapped, 0) is None


def test_write_bins_reads_a_memory_map_by_pread_as_numpy_would(tmp_path: Path) -> None:
    """The same bins, byte for byte, whether the rows come from a memory-mapped .npy (read with
    preadv into reused buffers) or from an array in memory; many small chunks."""
    rng = np.random.default_rng(3)
    feats = rng.standard_normal((1000, 6)).astype(np.float32)
    np.save(tmp_path / "f.npy", feats)
    bin_of = rng.integers(0, 3, 1000).astype(np.int16)
    digests = []
    for name, source in (("mem", feats), ("map", np.load(tmp_path / "f.npy", mmap_mode="r"))):
        work = tmp_path / name
        work.mkdir()
        files = [BinFile(f"b{b}", work / f"b{b}.bin", int((bin_of == b).sum())) for b in range(3)]
        done = write_bins(source, bin_of, files, work, "k", chunk_rows=37)
        for b, f in enumerate(files):
            assert np.array_equal(np.fromfile(f.path, dtype=np.float32).reshape(-1, 6), feats[bin_of == b])
        digests.append([w.digest for w in done.files])
    assert digests[0] == digests[1]


def test_write_bins_waits_for_a_reading_thread_the_executor_never_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal that lands while the bin pass starts its read-ahead thread (``Thread.start``
    waits for it to begin, interruptibly) leaves a thread that took the read but that a
    ThreadPoolExecutor never registered, so its shutdown does not wait for it: ``write_bins``
    still waits for that read before it closes the source (else the read goes to a closed, or
    reused, descriptor after ``write_bins`` returned)."""
    feats = np.arange(600, dtype=np.float32).reshape(100, 6)
    np.save(tmp_path / "f.npy", feats)
    source = np.load(tmp_path / "f.npy", mmap_mode="r")
    bin_of = (np.arange(100) % 2).astype(np.int16)
    files = [BinFile(f"b{b}", tmp_path / f"b{b}.bin", 50) for b in range(2)]
    running, release = threading.Event(), threading.Event()
    closed_under: list[OSError] = []
    read_chunk = writer._read_chunk  # noqa: SLF001 - the read the pool runs

    def held(src: Any, *args: Any) -> Any:
        running.set()
        release.wait(timeout=10)
        try:
            os.fstat(src.fd)
        except OSError as exc:
            closed_under.append(exc)
        return read_chunk(src, *args)

    monkeypatch.setattr(writer, "_read_chunk", held)
    interrupt_thread_start(monkeypatch, "moment-write", running)
    raised: list[BaseException] = []

    def write() -> None:
        try:
            write_bins(source, bin_of, files, tmp_path, "k", chunk_rows=10)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            raised.append(exc)

    writing = threading.Thread(target=write)
    writing.start()
    assert running.wait(timeout=10)
    time.sleep(0.3)
    assert writing.is_alive()  # waiting for the read in flight, the source still open
    release.set()
    writing.join(timeout=10)
    assert not writing.is_alive() and not closed_under, closed_under
    assert len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_relabel_in_ranges_is_the_same_stable_sort(threads: int) -> None:
    """The row map built by ``threads`` ranges of vertices at once: the same stable sort by bin
    rank as one pass, whatever the ranges' shares of each bin (a bin absent from a range too)."""
    rng = np.random.default_rng(threads)
    tiers = ["ssd", "gpu", "ssd", "cpu"]
    n = 300_000  # at least 2^16 vertices per range
    bin_of = rng.choice(4, n, p=[0.6, 0.05, 0.3, 0.05]).astype(np.int16)
    bin_of[: n // 4] = 0  # the first range holds bin 0 only
    r = rl.relabel(bin_of, tiers, threads=threads)
    rank = np.array([2, 0, 3, 1])[bin_of]
    assert np.array_equal(np.argsort(r.old_to_new), np.argsort(rank, kind="stable"))
    assert np.array_equal(np.diff(r.starts), np.bincount(bin_of, minlength=4)[r.order])
