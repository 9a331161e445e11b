"""The placed dataset: what ``moment place`` writes and the trainer and ``moment verify`` read.

A placed directory holds ``placed.json`` (written last: its presence with ``complete: true`` is
what makes the directory a placed dataset), the dataset's topology, labels and splits (hard
links of its files, or copies: the placed dataset numbers vertices as the dataset does), the row
map ``old_to_new``, the hotness it was placed by (dataset ids), and the GPU/CPU cache bins; SSD
bins live in the directory of their SSD (or ``bins/`` inside). Every file has its size and
checksum in the manifest, with the algorithm that took it (:mod:`placement.digests`).

A vertex's feature row is found in two steps: ``row = old_to_new[id]``, then a range lookup,
bin ``b`` holding rows ``[start, start + count)`` in a raw row-major file. In a packed placement
(``moment place --pack``: :mod:`placement.pack`) an SSD bin's rows lie in the order training
batches read them, and its slot map gives the file row of each: ``file row = slots[row -
start]``; packed within a budget (``--pack-budget``: :mod:`placement.chunks`) the bin stays in
row order and copies of its rows lie beside it in per-batch chunks and a shared cache, whose row
maps say which row is which. The row map and counts are int32 where the values fit; the linked
files have the dataset's types: readers take any of them, as the .npy header says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moment.contracts.placed import (
    FORMAT,
    MANIFEST,
    OLDER,
    BinEntry,
    FileEntry,
    PackFile,
    PlacedError,
    PlacedManifest,
    bin_file_name,
)
from moment.errors import UsageError
from placement.dataset import FeatureShape
from placement.digests import DigestError, check_digest, file_digest

__all__ = ["FORMAT", "MANIFEST", "Placed", "PlacedBin", "PlacedError", "open_placed", "verify"]


def chunk_starts(offsets: np.ndarray, row_bytes: int, align: int) -> np.ndarray:
    """The byte at which each replayed batch's chunk starts in a chunks file, and last the file's
    size: chunks of ``diff(offsets)`` rows in replay order, each padded with zeros to a multiple of
    ``align`` bytes (a page: a chunk read moves its own pages only; 1: back to back)."""
    sizes = np.diff(np.asarray(offsets, dtype=np.int64)) * row_bytes
    return np.concatenate(([0], np.cumsum(-(-sizes // align) * align))).astype(np.int64)


def chunk_row_bytes(offsets: np.ndarray, starts: np.ndarray, rows: np.ndarray, row_bytes: int) -> np.ndarray:
    """The byte in the chunks file at which each of its ``rows`` (positions in the chunk row map)
    starts: its chunk's start (:func:`chunk_starts`) plus the rows before it in the chunk."""
    rows = np.asarray(rows, dtype=np.int64)
    batch = np.searchsorted(offsets, rows, side="right") - 1
    return starts[batch] + (rows - np.asarray(offsets)[batch]) * row_bytes


@dataclass
class ChunkFiles:
    """An SSD bin's per-batch chunks and shared cache (``--pack-budget``: :mod:`placement.chunks`)
    and the .npy row maps saying which bin row each of their rows is."""

    chunks: Path
    shared: Path
    chunk_rows: Path
    chunk_offsets: Path
    shared_rows: Path
    align: int = 1  # each chunk starts on a multiple of this (PackChunks.align)


def pack_files(m: PlacedManifest, root: Path) -> list[tuple[Path, PackFile, str]]:
    """The chunk and shared files of a placement packed within a budget: where each lies, its
    entry, and the name this run gave it (what proves it is the run's)."""
    chunks = m.pack.chunks.bins.items() if m.pack and m.pack.chunks else ()
    return [
        (_abs(root, f.path), f, bin_file_name(f"{name}-{kind}", m.run_id))
        for name, c in chunks
        for kind, f in (("chunks", c.chunks), ("shared", c.shared))
    ]


@dataclass
class PlacedBin:
    name: str
    tier: str
    start: int
    count: int
    path: Path
    bytes: int
    digest: str
    target: float
    achieved: float
    slots: Path | None = None  # packed: the .npy of each row's file row (None: rows in id order)
    chunks: ChunkFiles | None = None  # packed within a budget: its chunks and shared cache

    def file_rows(self, local: np.ndarray) -> np.ndarray:
        """File rows of the bin's rows ``local`` (ids minus ``start``)."""
        if self.slots is None:
            return local
        return np.asarray(np.load(self.slots, mmap_mode="r")[local], dtype=np.int64)

    def copies(self, row_bytes: int) -> list[tuple[Path, np.ndarray, Callable[[np.ndarray], np.ndarray]]]:
        """Files holding copies of the bin's rows (a budget's chunks and shared cache), each with
        the bin row at each of its rows and what gives the byte where its rows ``k`` start."""
        if self.chunks is None:
            return []
        c = self.chunks
        offsets = np.load(c.chunk_offsets)
        starts = chunk_starts(offsets, row_bytes, c.align)
        return [
            (c.chunks, np.load(c.chunk_rows, mmap_mode="r"), lambda k: chunk_row_bytes(offsets, starts, k, row_bytes)),
            (c.shared, np.load(c.shared_rows, mmap_mode="r"), lambda k: np.asarray(k, dtype=np.int64) * row_bytes),
        ]


@dataclass
class Placed(FeatureShape):
    root: Path
    meta: dict[str, Any]  # the manifest as plain data (what FeatureShape reads)
    bins: list[PlacedBin]
    manifest: PlacedManifest

    def file(self, key: str) -> Path:
        return self.root / self.meta["files"][key]["path"]

    def array(self, key: str) -> np.ndarray:
        return np.load(self.file(key), mmap_mode="r")

    def bin_of_new(self, new_ids: np.ndarray) -> np.ndarray:
        """Bin index of each row (``old_to_new`` of a vertex: a range lookup)."""
        starts = np.array([b.start for b in self.bins], dtype=np.int64)
        return np.searchsorted(starts, new_ids, side="right") - 1

    def read_vertices(self, ids: np.ndarray) -> np.ndarray:
        """Feature rows of dataset vertex ids: :meth:`read_rows` of their rows (``old_to_new``)."""
        return self.read_rows(np.asarray(self.array("old_to_new")[np.asarray(ids, dtype=np.int64)], dtype=np.int64))

    def read_rows(self, new_ids: np.ndarray) -> np.ndarray:
        """Feature rows by row (``old_to_new`` of the vertices), read from the bins (plain file
        reads; the trainer has faster readers). Used by verify and tests."""
        out = np.empty((len(new_ids), self.feature_dim), dtype=self.feature_dtype)
        which = self.bin_of_new(new_ids)
        for b in np.unique(which):
            pb = self.bins[b]
            mask = which == b
            rows = np.memmap(pb.path, dtype=self.feature_dtype, mode="r", shape=(pb.count, self.feature_dim))
            out[mask] = rows[pb.file_rows(new_ids[mask] - pb.start)]
        return out


def _abs(root: Path, p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else root / path


def open_placed(path: str | Path, checksums: bool = False) -> Placed:
    """Open a placed dataset; refuse an incomplete or damaged one with the file it is about.

    Sizes are always checked (cheap); ``checksums`` re-reads every file."""
    root = Path(path)
    manifest = root / MANIFEST
    if not manifest.exists():
        partial = root.with_name(root.name + ".partial")
        hint = f" (an interrupted `moment place` left {partial}: re-run it to resume)" if partial.exists() else ""
        raise PlacedError(f"{root}: not a placed dataset: {MANIFEST} missing{hint}")
    m = PlacedManifest.read(manifest)
    if m.format == OLDER:  # its graph and labels in row ids, which nothing reads any more
        raise PlacedError(f"{manifest}: format {m.format!r}: placed by an older moment: run `moment place` again")
    slots = {name: root / m.files[key].path for name, key in m.pack.slots.items()} if m.pack else {}
    align = m.pack.chunks.align if m.pack and m.pack.chunks else 1
    chunks = {
        name: ChunkFiles(
            _abs(root, c.chunks.path),
            _abs(root, c.shared.path),
            root / m.files[c.chunk_rows].path,
            root / m.files[c.chunk_offsets].path,
            root / m.files[c.shared_rows].path,
            align,
        )
        for name, c in (m.pack.chunks.bins.items() if m.pack and m.pack.chunks else ())
    }
    bins = [
        PlacedBin(
            b.name,
            b.tier,
            b.start,
            b.count,
            _abs(root, b.path),
            b.bytes,
            b.digest,
            b.target,
            b.achieved,
            slots.get(b.name),
            chunks.get(b.name),
        )
        for b in m.bins
    ]
    placed = Placed(root, m.model_dump(mode="json"), bins, m)
    checks: list[tuple[Path, BinEntry | FileEntry | PackFile]] = [(b.path, e) for b, e in zip(bins, m.bins)]
    checks += [(root / f.path, f) for f in m.files.values()]
    checks += [(path, f) for path, f, _ in pack_files(m, root)]
    for file, entry in checks:
        try:
            check_digest(entry.digest_algorithm, entry.digest)
        except DigestError as exc:
            raise PlacedError(f"{manifest}: the entry of {file}: {exc}") from None
    for file, entry in checks:
        if not file.is_file():
            raise PlacedError(f"{file}: missing (listed in {manifest})")
        if file.stat().st_size != entry.bytes:
            raise PlacedError(
                f"{file}: {file.stat().st_size} bytes, manifest says {entry.bytes}: truncated or replaced"
            )
        if checksums and file_digest(file, entry.digest_algorithm) != entry.digest:
            raise PlacedError(f"{file}: checksum mismatch ({entry.digest_algorithm}): the file is damaged")
    return placed


def verify(path: str | Path, source: str | Path | None = None, sample: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Checksums of every file, counts, and a random sample of features compared with the source
    byte for byte (a NaN equals itself here: the bytes were copied, not the values)."""
    from placement.dataset import DatasetError, open_dataset

    if sample < 0:
        raise UsageError(f"--sample {sample}: must be 0 or more")
    from placement.samples import check as check_samples

    placed = open_placed(path, checksums=True)
    check_samples(placed)  # the stored samples are the trainer's draws
    if sample == 0:  # the placement alone: it never depends on the source once written
        return {"files": len(placed.bins) + len(placed.manifest.files), "rows": placed.num_nodes, "sampled": 0}
    try:
        src = open_dataset(source or placed.manifest.source.path)
    except DatasetError as exc:
        raise PlacedError(
            f"{exc} (`moment verify {path} --sample 0` checks the placement without the source)"
        ) from None
    if (
        src.num_nodes != placed.num_nodes
        or src.feature_dim != placed.feature_dim
        or src.feature_dtype != placed.feature_dtype
    ):
        raise PlacedError(
            f"{src.root}: the source has {src.num_nodes}×{src.feature_dim} {src.feature_dtype} features, "
            f"the placement {placed.num_nodes}×{placed.feature_dim} {placed.feature_dtype}"
        )
    rng = np.random.default_rng(seed)
    old = np.unique(rng.integers(0, placed.num_nodes, size=min(sample, placed.num_nodes)))
    got = placed.read_vertices(old).view(np.uint8)
    want = np.ascontiguousarray(src.features()[old]).view(np.uint8)
    bad = np.flatnonzero((got != want).any(axis=1))
    if bad.size:
        raise PlacedError(
            f"{placed.root}: feature of vertex {int(old[bad[0]])} differs from the source ({bad.size} of {old.size} sampled)"
        )
    rb = placed.row_bytes
    for b in placed.bins:  # copies of bin rows (--pack-budget's chunks and shared caches) against the bin
        for path, at, where in b.copies(rb):
            if at.size == 0:
                continue
            k = np.unique(rng.integers(0, at.size, size=min(sample, at.size)))
            copy = np.memmap(path, dtype=np.uint8, mode="r")[where(k)[:, None] + np.arange(rb)]
            if not np.array_equal(copy, placed.read_rows(b.start + np.asarray(at[k], dtype=np.int64)).view(np.uint8)):
                raise PlacedError(f"{path}: rows differ from their bin {b.name}'s ({k.size} sampled)")
    return {"files": len(placed.bins) + len(placed.manifest.files), "rows": placed.num_nodes, "sampled": int(old.size)}
