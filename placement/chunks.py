"""Per-batch chunks and a shared cache within a disk budget (``moment place --pack
--pack-budget``): DiskGNN's hybrid packing.

Ordering an SSD bin's rows by their first reader (:mod:`placement.pack`) lets a row lie next to
one batch's other rows only; where many batches read the same rows, the others still read whole
pages for a few rows each. DiskGNN instead copies, for every batch, the SSD rows it needs into a
contiguous chunk (one large read per batch), and keeps the rows many batches read in one shared,
page-reordered cache so that replicating them does not blow the disk budget. Here, per SSD bin:

* ``chunks``: the replayed batches' chunks in replay order, each starting on a page (zeros pad
  the one before: :func:`placement.placed.chunk_starts`), so a chunk read moves
  ceil(chunk bytes / 4 KiB) pages, no more; each chunk holds the bin rows its batch reads that are
  read by at most ``threshold`` replayed batches, in id order;
* ``shared``: the bin rows read by more than ``threshold`` batches, once, ordered so that rows
  read together share pages: in HashOrder (sorted by the MinHash signatures of their sets of
  readers, :func:`placement.pack.minhash_order`) or by their first and second reader, whichever
  makes the replayed batches read fewer pages (:data:`SHARED_ORDERS`);
* row maps (``chunk_rows``, ``chunk_offsets``, ``shared_rows``) saying which bin row each file
  row is and which rows each batch's chunk holds.

``threshold`` is the largest for which chunks, their padding and shared caches together fit the
budget: the fewer rows shared, the fewer pages a batch reads beyond its one chunk read. The
padding is first counted at its most (each chunk's last page nearly empty, :func:`pad_bound`; a
chunk per (batch, bin) pair with rows, or per row stored in chunks where those are fewer); where
that bound refuses thresholds whose rows alone would fit, one more pass over the batches counts
the padding as the chunks would lay it out (:func:`laid_out_space`), so small bins, whose
chunks are a few pages and whose bound is far from the padding, share no more rows than they
must; either way the files never exceed the budget. The smallest space is every row read at
least once, stored once (threshold 1), its chunks padded; a budget below it is refused. The bins
stay whole and in id order: batches other than the replayed ones (evaluation, another seed) read
them as before. Both files of a bin are written in one sequential pass over the bin
(:func:`write_gathered`: "batched packing"): each slice of the bin read is scattered to every
place it is copied to (a chunk's rows from one slice are consecutive in it: one write each).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moment.errors import UsageError
from moment.progress import Update
from moment.sizes import parse_size
from moment.ssd_reads import PAGE_BYTES, pages_read, span_pages
from placement.digests import PLACED_DIGEST, file_digest
from placement.pack import (
    Readers,
    SsdRows,
    batch_counted,
    counted,
    first_reader_order,
    minhash_order,
    pages_and_runs,
    readers,
)
from placement.placed import chunk_row_bytes, chunk_starts
from placement.writer import CHUNK_BYTES, Written

ALIGN = PAGE_BYTES  # each chunk starts on a page (PackChunks.align)
MINHASHES = 4  # hashes in a shared row's signature (HashOrder)


def parse_budget(text: str, bin_bytes: int) -> int:
    """``--pack-budget`` in bytes: a size ('20GB', '512MiB') or a multiple of the SSD bins'
    bytes ('1.5x'; 1x always holds the smallest packing: every row read, once)."""
    return parse_size(text, "--pack-budget", ("bytes", "multiple")).bytes_of(bin_bytes)


@dataclass
class ChunkPlan:
    """Per SSD bin the rows of its pack files, and what the replayed batches move from them."""

    threshold: int  # rows read by more batches than this are shared
    chunk_rows: list[np.ndarray]  # per bin: the bin row at each row of the chunk row map
    chunk_offsets: list[np.ndarray]  # per bin: each batch's first row in the chunk row map (batches + 1)
    shared_rows: list[np.ndarray]  # per bin: the bin row at each shared-file row
    bytes: int  # disk space of the chunks and shared files, padding included
    align: int = ALIGN  # each chunk starts on a multiple of this many bytes
    order: str = ""  # the shared caches' order (a key of SHARED_ORDERS): the one moving the fewest pages
    shared_pages: dict[str, int] = field(default_factory=dict)  # per order counted: bytes of the shared pages read
    batches: int = 0
    useful_bytes: int = 0  # feature bytes of the SSD rows the replayed batches read
    unpacked_bytes: int = 0  # pages those reads move from the bins in id order
    packed_bytes: int = 0  # ... and move reading each batch's chunk and its shared rows
    reads: int = 0  # chunk reads and runs of shared rows


def space(count: np.ndarray, row_bytes: int, pairs: int = 0, align: int = ALIGN) -> np.ndarray:
    """Bytes of the chunks and shared files for each threshold 0, 1, ... max(count): rows read by
    at most T batches once per batch, the others once; with the chunks' padding at its most
    (``pairs``: the (batch, bin) pairs with rows, of which each chunk is one; 0: no padding)."""
    read = count[count > 0]
    h = np.bincount(read, minlength=2).astype(np.int64)
    replicated = np.cumsum(np.arange(h.size) * h)  # rows in chunks: a chunk holds at least one
    shared = read.size - np.cumsum(h)
    return (replicated + shared) * row_bytes + pad_bound(np.minimum(pairs, replicated), row_bytes, align)


def pad_bound(chunks: np.ndarray | int, row_bytes: int, align: int = ALIGN) -> np.ndarray:
    """The most padding ``chunks`` chunks take: a chunk's bytes (a multiple of the row) fall short
    of a multiple of ``align`` by at most ``align - gcd(row, align)`` (none for whole pages)."""
    return np.asarray(chunks, dtype=np.int64) * (align - math.gcd(row_bytes, align))


def threshold_for(
    count: np.ndarray,
    row_bytes: int,
    budget: int,
    what: str,
    pairs: int = 0,
    exact: Callable[[np.ndarray], np.ndarray] | None = None,
) -> int:
    """The largest threshold whose files fit ``budget`` bytes; ``what`` (the option and its
    value) names the budget in the refusal when even threshold 1 does not fit. The padding is
    counted at its most (:func:`space`), except that ``exact`` (thresholds -> their files' bytes
    with the padding the chunks would take, :func:`laid_out_space`), where given, settles the
    thresholds the bound refuses but the rows alone would fit: on small bins, where the bound
    is far from the padding laid out, more rows go to chunks."""
    need, rows_only = space(count, row_bytes, pairs), space(count, row_bytes)
    fits = np.flatnonzero(need[1:] <= budget) + 1
    t = int(fits[-1]) if fits.size else 0
    could = np.flatnonzero(rows_only[1:] <= budget) + 1  # the padding takes space: none fits past these
    least = int(need[1]) if need.size > 1 else 0
    if exact is not None and could.size and int(could[-1]) > t:
        candidates = np.arange(t + 1, int(could[-1]) + 1)
        laid = exact(candidates)
        fit = candidates[laid <= budget]
        t = int(fit[-1]) if fit.size else t
        least = int(laid[0]) if candidates[0] == 1 else least
    if t == 0:
        raise UsageError(
            f"{what}: {budget:,} bytes cannot hold even the shared cache: the replayed batches read "
            f"{int(rows_only[1]):,} bytes of distinct SSD rows, which take up to {least:,} bytes with "
            f"chunks padded to pages; give at least that (e.g. {-(-least // 2**20)}MiB) "
            "or leave --pack-budget out to order the bins' rows in place"
        )
    return t


def laid_out_space(
    batches: Iterable[np.ndarray], rows: SsdRows, count: np.ndarray, row_bytes: int, align: int = ALIGN
) -> Callable[[np.ndarray], np.ndarray]:
    """Thresholds -> bytes of the chunks and shared files as :func:`plan_chunks` would lay them
    out, the padding as it falls, by a pass over ``batches``: at threshold T a batch's chunk in a
    bin holds its rows there that at most T batches read, padded to ``align``."""

    def at(thresholds: np.ndarray) -> np.ndarray:
        t = np.asarray(thresholds, dtype=np.int64)
        chunks = np.zeros(t.size, dtype=np.int64)
        for nodes in batches:
            for b, part in rows.split(rows.of(nodes)):
                held = np.searchsorted(np.sort(count[part + rows.local[b]]), t, side="right")
                chunks += -(-held * row_bytes // align) * align
        read = np.sort(count[count > 0])
        return chunks + (read.size - np.searchsorted(read, t, side="right")) * row_bytes

    return at


# How a shared cache may order its rows (rows read together should share pages); the replay
# counts the pages each order makes its batches read and the placement keeps the fewer (ties:
# the first). HashOrder wins where many batches read each shared row (3.47x against 3.54x the
# feature bytes on bench_pack's high-reuse preset at 1x); first-then-second reader where most
# are read by two (1.371x against 1.389x on its 512 B default at 0.18x).
SHARED_ORDERS: dict[str, Callable[[Readers, np.ndarray], np.ndarray]] = {
    "minhash": minhash_order,
    "first-reader": first_reader_order,
}


def plan_chunks(
    batches: Callable[[], Iterable[np.ndarray]],
    starts: Sequence[int],
    counts: Sequence[int],
    row_bytes: int,
    budget: int,
    what: str,
    progress: Update | None = None,
    total: int = 0,
    seed: int = 0,
    orders: Sequence[str] = tuple(SHARED_ORDERS),
) -> ChunkPlan:
    """The pack files of the SSD bins (consecutive id ranges ``starts``/``counts``) for the
    batches ``batches()`` yields (twice: once to count readers, once to lay out the chunks and
    count the pages of each of the shared caches' ``orders``: the fewest is kept). ``seed``
    draws the MinHash functions."""
    rows = SsdRows(starts, counts)
    who, done = readers(batches(), rows, progress, total, MINHASHES if "minhash" in orders else 0, seed)
    t = threshold_for(
        who.count, row_bytes, budget, what, who.pairs, laid_out_space(batches(), rows, who.count, row_bytes)
    )
    shared_ids = [np.flatnonzero(who.count[lo : lo + n] > t) + lo for lo, n in zip(rows.local, rows.sizes)]
    n_shared = sum(r.size for r in shared_ids)
    index = np.full(rows.total, -1, dtype=np.int64)  # each row's place among the shared rows, -1: not shared
    index[np.concatenate([np.zeros(0, dtype=np.int64), *shared_ids])] = np.arange(n_shared)
    laid = {name: [SHARED_ORDERS[name](who, r) for r in shared_ids] for name in orders}
    slot = {}  # per order: each shared row's row in its bin's shared file
    for name, bins in laid.items():
        slot[name] = np.empty(n_shared, dtype=np.int64)
        for ordered in bins:
            slot[name][index[ordered]] = np.arange(ordered.size)
    nbins = len(rows.sizes)
    pieces: list[list[np.ndarray]] = [[] for _ in range(nbins)]
    lengths = []  # per batch: its chunk's rows in each bin
    plan = ChunkPlan(t, [], [], [], 0)
    shared_pages = dict.fromkeys(orders, (0, 0))  # per order: (bytes, runs) the batches read of the shared caches
    at = np.zeros(nbins, dtype=np.int64)  # bytes of the chunks file so far (padded to ALIGN), per bin
    for nodes in batches():
        ids = rows.of(nodes)
        lengths.append(np.zeros(nbins, dtype=np.int64))
        for b, part in rows.split(ids):
            where = index[part + rows.local[b]]
            mine = part[where < 0]
            pieces[b].append(mine)
            lengths[-1][b] = mine.size
            plan.unpacked_bytes += pages_and_runs(part, row_bytes)[0]
            if mine.size:  # the chunk: one read from its page on
                size = mine.size * row_bytes
                counted(plan, (pages_read(np.array([at[b]]), np.array([size])), 1))
                at[b] += -(-size // plan.align) * plan.align
            for name in orders:
                moved, runs = pages_and_runs(np.sort(slot[name][where[where >= 0]]), row_bytes)
                shared_pages[name] = (shared_pages[name][0] + moved, shared_pages[name][1] + runs)
        batch_counted(plan, ids.size * row_bytes, progress, done, total)
    plan.order = min(orders, key=lambda name: shared_pages[name][0])  # stable: ties keep the first
    plan.shared_rows = [ordered - lo for ordered, lo in zip(laid[plan.order], rows.local)]
    plan.shared_pages = {name: moved for name, (moved, _) in shared_pages.items()}
    counted(plan, shared_pages[plan.order])
    per_bin = np.array(lengths, dtype=np.int64).reshape(-1, nbins)
    for b in range(nbins):
        plan.chunk_rows.append(np.concatenate(pieces[b]) if pieces[b] else np.zeros(0, dtype=np.int64))
        plan.chunk_offsets.append(np.concatenate(([0], np.cumsum(per_bin[:, b]))))
    plan.bytes = int(at.sum()) + n_shared * row_bytes
    assert plan.bytes <= budget, f"{plan.bytes} bytes of chunks exceed the budget's {budget}: pad_bound is wrong"
    return plan


def row_map_pages(path: Path, offsets: np.ndarray) -> int:
    """Bytes of the pages of the chunk row map ``path`` (.npy, mapped by the trainer) that the
    replayed batches read, each its own chunk's slice (``offsets``: :class:`ChunkPlan`'s
    ``chunk_offsets``): the trainer compares it with the batch's rows before reading the chunk."""
    mapped = np.load(path, mmap_mode="r")
    offsets = np.asarray(offsets, dtype=np.int64)
    return int(
        span_pages(int(mapped.offset) + offsets[:-1] * mapped.itemsize, np.diff(offsets) * mapped.itemsize).sum()
    )


@dataclass
class Gathered:
    """One file :func:`write_gathered` writes: the source row at each of its rows, and the byte
    where each of them lies (None: back to back from byte 0) and the file's size (None: its rows')."""

    name: str
    path: Path
    rows: np.ndarray
    at_bytes: np.ndarray | None = None
    size: int | None = None

    def bytes_of(self, pos: np.ndarray, row_bytes: int) -> np.ndarray:
        return pos * row_bytes if self.at_bytes is None else self.at_bytes[pos]

    def file_bytes(self, row_bytes: int) -> int:
        return self.rows.size * row_bytes if self.size is None else self.size


def chunk_file(name: str, path: Path, rows: np.ndarray, offsets: np.ndarray, row_bytes: int, align: int) -> Gathered:
    """A chunks file to write: its rows ``rows`` at the bytes their chunks (``offsets``) start at."""
    starts = chunk_starts(offsets, row_bytes, align)
    at = chunk_row_bytes(offsets, starts, np.arange(rows.size), row_bytes)
    return Gathered(name, path, rows, at, int(starts[-1]))


def write_gathered(
    src: Path,
    rows: int,
    row_bytes: int,
    outputs: Sequence[Gathered],
    progress: Update | None = None,
    slice_rows: int = 0,
) -> list[Written]:
    """Files ``outputs`` written in one sequential pass over ``src`` (``rows`` rows): each slice
    read is scattered to every output row copying one of its rows, one write per run of output
    rows that lie back to back; then fsync'ed and checksummed (read back: the writes are not in
    file order; padding reads as zeros). ``slice_rows``: source rows read at a time (0:
    CHUNK_BYTES' worth)."""
    step = slice_rows or max(1, CHUNK_BYTES // row_bytes)
    sort = [np.argsort(g.rows, kind="stable") for g in outputs]
    keys = [g.rows[order] for g, order in zip(outputs, sort)]
    fds = []
    try:
        for g in outputs:
            g.path.parent.mkdir(parents=True, exist_ok=True)
            fds.append(os.open(g.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            os.ftruncate(fds[-1], g.file_bytes(row_bytes))
        buf = np.empty((step, row_bytes), dtype=np.uint8)
        with open(src, "rb", buffering=0) as fh:
            for lo in range(0, rows, step):
                hi = min(rows, lo + step)
                _read_full(fh, memoryview(buf[: hi - lo].reshape(-1)), src)
                for fd, g, order, key in zip(fds, outputs, sort, keys):
                    a, b = np.searchsorted(key, [lo, hi])
                    _scatter(fd, buf, np.sort(order[a:b]), g, lo, step, row_bytes)
                if progress is not None:
                    progress(hi, rows)
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    written = []
    for g in outputs:
        size = g.path.stat().st_size
        if size != g.file_bytes(row_bytes):
            raise RuntimeError(f"{g.path}: wrote {size} bytes, expected {g.file_bytes(row_bytes)}")
        written.append(Written(g.name, g.path, size, file_digest(g.path, PLACED_DIGEST), PLACED_DIGEST))
    return written


def _scatter(fd: int, buf: np.ndarray, pos: np.ndarray, g: Gathered, lo: int, step: int, row_bytes: int) -> None:
    """Output rows ``pos`` (ascending) of ``g`` from the slice ``buf`` of source rows from ``lo``."""
    for p in range(0, pos.size, step):
        part = pos[p : p + step]
        block = buf[g.rows[part] - lo]
        where = g.bytes_of(part, row_bytes)
        breaks = np.concatenate(([0], np.flatnonzero(np.diff(where) != row_bytes) + 1, [part.size]))
        for s, e in zip(breaks[:-1], breaks[1:]):
            view, offset = memoryview(block[s:e].reshape(-1)), int(where[s])
            while len(view):
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n


def _read_full(fh: io.RawIOBase, view: memoryview, path: Path) -> None:
    while len(view):
        got = fh.readinto(view)
        if not got:
            raise RuntimeError(f"{path}: shorter than its rows")
        view = view[got:]
