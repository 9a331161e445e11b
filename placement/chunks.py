"""Per-batch chunks and a shared cache within a disk budget (``moment place --pack
--pack-budget``): DiskGNN's hybrid packing.

Ordering an SSD bin's rows by their first reader (:mod:`placement.pack`) lets a row lie next to
one batch's other rows only; where many batches read the same rows, the others still read whole
pages for a few rows each. DiskGNN instead copies, for every batch, the SSD rows it needs into a
contiguous chunk (one large read per batch), and keeps the rows many batches read in one shared,
page-reordered cache so that replicating them does not blow the disk budget. Here, per SSD bin:

* ``chunks``: the replayed batches' chunks back to back, in replay order; each chunk holds the
  bin rows its batch reads that are read by at most ``threshold`` replayed batches, in id order;
* ``shared``: the bin rows read by more than ``threshold`` batches, once, ordered by their first
  and second reader (rows read together share pages);
* row maps (``chunk_rows``, ``chunk_offsets``, ``shared_rows``) saying which bin row each file
  row is and where each batch's chunk starts.

``threshold`` is the largest for which chunks and shared caches together fit the budget: the
fewer rows shared, the fewer pages a batch reads beyond its one chunk read. The smallest space is
every row read at least once, stored once (threshold 1); a budget below it is refused. The bins
stay whole and in id order: batches other than the replayed ones (evaluation, another seed) read
them as before. Both files of a bin are written in one sequential pass over the bin
(:func:`write_gathered`: "batched packing"): each slice of the bin read is scattered to every
place it is copied to (a chunk's rows from one slice are consecutive in it: one write each).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moment.errors import UsageError
from moment.progress import Update
from moment.sizes import parse_size
from moment.ssd_reads import pages_read
from placement.pack import SsdRows, batch_counted, counted, first_reader_order, pages_and_runs, readers
from placement.writer import CHUNK_BYTES, Written, file_digest


def parse_budget(text: str, bin_bytes: int) -> int:
    """``--pack-budget`` in bytes: a size ('20GB', '512MiB') or a multiple of the SSD bins'
    bytes ('1.5x'; 1x always holds the smallest packing: every row read, once)."""
    return parse_size(text, "--pack-budget", ("bytes", "multiple")).bytes_of(bin_bytes)


@dataclass
class ChunkPlan:
    """Per SSD bin the rows of its pack files, and what the replayed batches move from them."""

    threshold: int  # rows read by more batches than this are shared
    chunk_rows: list[np.ndarray]  # per bin: the bin row at each chunk-file row
    chunk_offsets: list[np.ndarray]  # per bin: each batch's first chunk-file row (batches + 1)
    shared_rows: list[np.ndarray]  # per bin: the bin row at each shared-file row
    bytes: int  # disk space of the chunks and shared files
    batches: int = 0
    useful_bytes: int = 0  # feature bytes of the SSD rows the replayed batches read
    unpacked_bytes: int = 0  # pages those reads move from the bins in id order
    packed_bytes: int = 0  # ... and move reading each batch's chunk and its shared rows
    reads: int = 0  # chunk reads and runs of shared rows


def space(count: np.ndarray, row_bytes: int) -> np.ndarray:
    """Bytes of the chunks and shared files for each threshold 0, 1, ... max(count): rows read by
    at most T batches once per batch, the others once."""
    read = count[count > 0]
    h = np.bincount(read, minlength=2).astype(np.int64)
    replicated = np.cumsum(np.arange(h.size) * h)
    shared = read.size - np.cumsum(h)
    return (replicated + shared) * row_bytes


def threshold_for(count: np.ndarray, row_bytes: int, budget: int, what: str) -> tuple[int, int]:
    """The largest threshold whose files fit ``budget`` bytes, and their bytes; ``what`` (the
    option and its value) names the budget in the refusal when even threshold 1 does not fit."""
    need = space(count, row_bytes)
    fits = np.flatnonzero(need[1:] <= budget) + 1
    if fits.size == 0:
        raise UsageError(
            f"{what}: {budget:,} bytes cannot hold even the shared cache: the replayed batches read "
            f"{int(need[1]):,} bytes of distinct SSD rows; give at least that (e.g. {-(-int(need[1]) // 2**20)}MiB) "
            "or leave --pack-budget out to order the bins' rows in place"
        )
    t = int(fits[-1])
    return t, int(need[t])


def plan_chunks(
    batches: Callable[[], Iterable[np.ndarray]],
    starts: Sequence[int],
    counts: Sequence[int],
    row_bytes: int,
    budget: int,
    what: str,
    progress: Update | None = None,
    total: int = 0,
) -> ChunkPlan:
    """The pack files of the SSD bins (consecutive id ranges ``starts``/``counts``) for the
    batches ``batches()`` yields (twice: once to count readers, once to lay out the chunks)."""
    rows = SsdRows(starts, counts)
    who, done = readers(batches(), rows, progress, total)
    t, used = threshold_for(who.count, row_bytes, budget, what)
    shared_at = np.full(rows.total, -1, dtype=np.int64)  # each row's shared-file row, -1: not shared
    shared = []
    for lo, n in zip(rows.local, rows.sizes):
        mine = np.arange(lo, lo + n)
        order = first_reader_order(who, mine[who.count[lo : lo + n] > t])
        shared_at[order] = np.arange(order.size)
        shared.append(order - lo)
    nbins = len(rows.sizes)
    pieces: list[list[np.ndarray]] = [[] for _ in range(nbins)]
    lengths = []  # per batch: its chunk's rows in each bin
    plan = ChunkPlan(t, [], [], shared, used)
    at = np.zeros(nbins, dtype=np.int64)  # chunk-file rows so far, per bin
    for nodes in batches():
        ids = rows.of(nodes)
        lengths.append(np.zeros(nbins, dtype=np.int64))
        for b, part in rows.split(ids):
            whole = part + rows.local[b]
            mine = part[shared_at[whole] < 0]
            pieces[b].append(mine)
            lengths[-1][b] = mine.size
            plan.unpacked_bytes += pages_and_runs(part, row_bytes)[0]
            if mine.size:  # the chunk: one read
                counted(plan, (pages_read(np.array([at[b] * row_bytes]), np.array([mine.size * row_bytes])), 1))
                at[b] += mine.size
            counted(plan, pages_and_runs(np.sort(shared_at[whole[shared_at[whole] >= 0]]), row_bytes))
        batch_counted(plan, ids.size * row_bytes, progress, done, total)
    per_bin = np.array(lengths, dtype=np.int64).reshape(-1, nbins)
    for b in range(nbins):
        plan.chunk_rows.append(np.concatenate(pieces[b]) if pieces[b] else np.zeros(0, dtype=np.int64))
        plan.chunk_offsets.append(np.concatenate(([0], np.cumsum(per_bin[:, b]))))
    return plan


def write_gathered(
    src: Path,
    rows: int,
    row_bytes: int,
    outputs: Sequence[tuple[str, Path, np.ndarray]],
    progress: Update | None = None,
    slice_rows: int = 0,
) -> list[Written]:
    """Files ``outputs`` (name, path, the ``src`` row at each of its rows), written in one
    sequential pass over ``src`` (``rows`` rows): each slice read is scattered to every output
    row copying one of its rows, one write per run of consecutive output rows; then fsync'ed and
    checksummed (read back: the writes are not in file order). ``slice_rows``: source rows read
    at a time (0: CHUNK_BYTES' worth)."""
    step = slice_rows or max(1, CHUNK_BYTES // row_bytes)
    sort = [np.argsort(at, kind="stable") for _, _, at in outputs]
    keys = [at[order] for (_, _, at), order in zip(outputs, sort)]
    fds = []
    try:
        for _, path, at in outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            os.ftruncate(fds[-1], at.size * row_bytes)
        buf = np.empty((step, row_bytes), dtype=np.uint8)
        with open(src, "rb", buffering=0) as fh:
            for lo in range(0, rows, step):
                hi = min(rows, lo + step)
                _read_full(fh, memoryview(buf[: hi - lo].reshape(-1)), src)
                for fd, (_, _, at), order, key in zip(fds, outputs, sort, keys):
                    a, b = np.searchsorted(key, [lo, hi])
                    _scatter(fd, buf, np.sort(order[a:b]), at, lo, step, row_bytes)
                if progress is not None:
                    progress(hi, rows)
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    written = []
    for name, path, at in outputs:
        size = path.stat().st_size
        if size != at.size * row_bytes:
            raise RuntimeError(f"{path}: wrote {size} bytes, expected {at.size * row_bytes}")
        written.append(Written(name, path, size, file_digest(path)))
    return written


def _scatter(fd: int, buf: np.ndarray, pos: np.ndarray, at: np.ndarray, lo: int, step: int, row_bytes: int) -> None:
    """Output rows ``pos`` (ascending) from the slice ``buf`` of source rows from ``lo``."""
    for p in range(0, pos.size, step):
        part = pos[p : p + step]
        block = buf[at[part] - lo]
        breaks = np.concatenate(([0], np.flatnonzero(np.diff(part) != 1) + 1, [part.size]))
        for s, e in zip(breaks[:-1], breaks[1:]):
            view, offset = memoryview(block[s:e].reshape(-1)), int(part[s]) * row_bytes
            while len(view):
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n


def _read_full(fh: io.RawIOBase, view: memoryview, path: Path) -> None:
    while len(view):
        got = fh.readinto(view)
        if not got:
            raise RuntimeError(f"{path}: shorter than its rows")
        view = view[got:]
