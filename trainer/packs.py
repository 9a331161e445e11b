"""Reading a placement packed within a disk budget (``moment place --pack-budget``,
:mod:`placement.chunks`): a replayed training batch's SSD rows of one bin come from its chunk,
in one large read, and the shared cache's pages it needs; any other batch (evaluation, another
seed, an epoch past the replayed ones without ``--reuse-samples``) reads the bin as usual.

Which batch a feature request is for is said by the caller (``TieredFeatureStore.get(ids,
batch=)``: its index in the replay, :meth:`BatchChunks.first_batch` onwards); the chunk is used
only when the rows it holds are exactly the batch's rows the shared cache does not hold, so a
batch that is not the replayed one still reads the right rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moment.ssd_reads import span_pages
from placement.placed import ChunkFiles, Placed, PlacedBin, chunk_starts
from trainer.read_base import ReadRequest

# What a rank's reads of bins with chunks did, summed per epoch into metrics.json (EpochRecord.chunks):
# (batch, bin) reads served by the bin's chunk and shared cache; ... read from the bin instead; of
# those, a replayed batch's whose rows were not its chunk's; batches that read such bins; of
# those, the ones none of whose reads went to a bin.
CHUNK_COUNTS = ("chunk_reads", "bin_reads", "missed", "batches", "batches_from_chunks")


@dataclass
class _Bin:
    chunks: Path
    shared: Path
    offsets: np.ndarray  # each replayed batch's first row in the chunk row map (in memory: batches + 1)
    starts: np.ndarray  # ... and the byte its chunk starts at in ``chunks`` (a page; old placements: packed)
    rows: np.ndarray  # the bin row at each row of the chunk row map (mapped: read one chunk's worth per batch)
    shared_sorted: np.ndarray  # the shared rows, sorted (in memory)
    shared_at: np.ndarray  # ... and the shared-file row of each
    rows_key: str  # the chunk row map's key in placed.json ``files`` (its file's name, less .npy)
    rows_at: int  # the byte in its file where ``rows`` start (after the .npy header)

    @classmethod
    def open(cls, files: ChunkFiles, row_bytes: int) -> _Bin:
        shared = np.load(files.shared_rows).astype(np.int64)
        order = np.argsort(shared)
        mapped = np.load(files.chunk_rows, mmap_mode="r")
        rows = np.asarray(mapped)  # a plain view: slicing a memmap costs µs
        offsets = np.load(files.chunk_offsets)
        starts = chunk_starts(offsets, row_bytes, files.align)
        key = files.chunk_rows.name.removesuffix(".npy")
        return cls(files.chunks, files.shared, offsets, starts, rows, shared[order], order, key, int(mapped.offset))

    def rows_read(self, lo: int, hi: int) -> int:
        """Bytes of the pages of the chunk row map that reading its rows ``lo:hi`` touches."""
        return int(span_pages(self.rows_at + lo * self.rows.itemsize, (hi - lo) * self.rows.itemsize))


class BatchChunks:
    """The chunk files of a placement's SSD bins (``ssd``, in the store's order)."""

    def __init__(self, placed: Placed, ssd: list[PlacedBin]) -> None:
        """Every bin without chunks where the placement is not packed within a budget."""
        pack = placed.manifest.pack
        self.epochs, self.ranks = (pack.epochs, pack.ranks) if pack is not None else (0, 1)
        self.per_rank = pack.batches // (pack.epochs * pack.ranks) if pack is not None else 0  # one rank's, an epoch
        self.bins = [None if b.chunks is None else _Bin.open(b.chunks, placed.row_bytes) for b in ssd]
        # What the reads did (:meth:`since`): keys of CHUNK_COUNTS, counted since the store opened.
        self.counted = dict.fromkeys(CHUNK_COUNTS, 0)
        # Bytes of the pages read of each chunk row map (by its key in placed.json ``files``): a
        # replayed batch's slice, compared with its rows (metrics.json ``placed_read_bytes``).
        self.read_bytes = {c.rows_key: 0 for c in self.bins if c is not None}

    def first_batch(self, epoch: int, rank: int, world: int) -> int | None:
        """The replay index of ``rank``'s first training batch of ``epoch`` (the epoch whose
        batches it draws); None where the replay has no such batches."""
        if epoch >= self.epochs or world != self.ranks or rank >= self.ranks:
            return None
        return (epoch * self.ranks + rank) * self.per_rank

    def counts(self) -> dict[str, int]:
        return dict(self.counted)

    def since(self, before: dict[str, int]) -> dict[str, int] | None:
        """What :data:`CHUNK_COUNTS` counts since ``before`` (:meth:`counts`); None without chunks."""
        if all(c is None for c in self.bins):
            return None
        return {k: self.counted[k] - before[k] for k in CHUNK_COUNTS}

    def batch_read(self, before: dict[str, int]) -> None:
        """One batch's SSD reads are planned (since ``before``): count it where it read a bin
        with chunks, and as served by chunks where none of those reads went to the bin."""
        c = self.counted
        if c["chunk_reads"] + c["bin_reads"] > before["chunk_reads"] + before["bin_reads"]:
            c["batches"] += 1
            c["batches_from_chunks"] += c["bin_reads"] == before["bin_reads"]

    def requests(
        self, k: int, batch: int | None, rows: np.ndarray, out: Any
    ) -> tuple[list[ReadRequest], np.ndarray | None] | None:
        """Reads filling ``out`` with bin ``k``'s sorted rows ``rows`` of replayed batch ``batch``:
        its chunk, then its shared rows in file order; and where each of ``rows`` lands in ``out``
        (None: in their order, the chunk's alone). None when the batch's rows are not the chunk's,
        or it has none (read the bin instead)."""
        c = self.bins[k]
        if c is None:
            return None
        if batch is None or not 0 <= batch < c.offsets.size - 1:
            self.counted["bin_reads"] += 1
            return None
        lo, hi = int(c.offsets[batch]), int(c.offsets[batch + 1])
        if c.shared_sorted.size:
            pos = np.searchsorted(c.shared_sorted, rows)
            shared = pos < c.shared_sorted.size
            shared[shared] = c.shared_sorted[pos[shared]] == rows[shared]
            mine = rows[~shared]
        else:  # nothing shared (the budget held every row in chunks): the rows are the chunk's or not
            pos, shared, mine = None, None, rows
        if mine.size == hi - lo:
            self.read_bytes[c.rows_key] += c.rows_read(lo, hi)
        if mine.size != hi - lo or not np.array_equal(mine, c.rows[lo:hi]):
            self.counted["missed"] += 1
            self.counted["bin_reads"] += 1
            return None
        self.counted["chunk_reads"] += 1
        reads = [ReadRequest(c.chunks, np.arange(mine.size), out[: mine.size], base=int(c.starts[batch]))]
        if pos is None or shared is None or mine.size == rows.size:
            return (reads if mine.size else []), None
        at = c.shared_at[pos[shared]]
        order = np.argsort(at)
        landed = np.empty(rows.size, dtype=np.int64)
        landed[~shared] = np.arange(mine.size)
        landed[np.flatnonzero(shared)[order]] = mine.size + np.arange(at.size)
        reads = reads if mine.size else []
        reads.append(ReadRequest(c.shared, at[order], out[mine.size :]))
        return reads, landed

    def files(self, k: int) -> list[Path]:
        """Bin ``k``'s chunk and shared files (what its reads may touch besides the bin)."""
        c = self.bins[k]
        return [] if c is None else [c.chunks, c.shared]


def index_bytes(placed: Placed) -> int:
    """Host memory a rank holds for the chunk files' row maps (the offsets and chunk starts, the
    shared rows sorted and their file rows); the chunks' own row maps are mapped, not held."""
    held = [c for b in placed.bins if (c := getattr(b, "chunks", None)) is not None]
    return sum(
        16 * np.load(c.chunk_offsets, mmap_mode="r").size + 16 * np.load(c.shared_rows, mmap_mode="r").size
        for c in held
    )
