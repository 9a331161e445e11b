"""New vertex ids that say where a vertex lives, and the graph rewritten in them.

Bins are laid out in id order: the GPU caches first, then the CPU caches, then one contiguous
range per SSD bin. Inside a bin the original id order is kept, so (1) a vertex's location is a
range lookup (no per-vertex index), and (2) all bins are written in one sequential pass over the
source features, each bin receiving sequential appends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moment.contracts.tiers import TIERS
from moment.progress import Update

TIER_ORDER = {t: i for i, t in enumerate(TIERS)}


@dataclass
class Relabel:
    old_to_new: np.ndarray  # int64, N
    new_to_old: np.ndarray  # int64, N
    starts: np.ndarray  # int64, B+1: bin b holds new ids [starts[b], starts[b+1])
    order: list[int]  # bin indices in id order


def bin_order(tiers: list[str]) -> list[int]:
    """Bin indices sorted by tier (GPU, CPU, SSD), plan order kept within a tier."""
    return sorted(range(len(tiers)), key=lambda b: (TIER_ORDER[tiers[b]], b))


def relabel(bin_of: np.ndarray, tiers: list[str]) -> Relabel:
    """New ids: bins in tier order, original order inside each bin (a stable sort by bin rank)."""
    order = bin_order(tiers)
    rank = np.empty(len(tiers), dtype=np.int16)
    rank[order] = np.arange(len(tiers), dtype=np.int16)
    key = rank[bin_of]
    new_to_old = np.argsort(key, kind="stable").astype(np.int64)  # radix sort: key is int16
    old_to_new = np.empty_like(new_to_old)
    old_to_new[new_to_old] = np.arange(new_to_old.size, dtype=np.int64)
    counts = np.bincount(key, minlength=len(tiers))
    starts = np.zeros(len(tiers) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return Relabel(old_to_new, new_to_old, starts, order)


def rewrite_csr(
    indptr: np.ndarray,
    indices: np.ndarray,
    r: Relabel,
    out_indptr: Path,
    out_indices: Path,
    chunk_edges: int = 1 << 24,
    progress: Update | None = None,
) -> None:
    """CSR in new ids: row r_new = old row new_to_old[r_new], neighbour ids mapped through
    old_to_new. Written in chunks of about ``chunk_edges`` edges into .npy memmaps."""
    n = r.new_to_old.size
    deg = np.diff(np.asarray(indptr))
    new_indptr = np.lib.format.open_memmap(out_indptr, mode="w+", dtype=np.int64, shape=(n + 1,))
    new_indptr[0] = 0
    np.cumsum(deg[r.new_to_old], out=new_indptr[1:])
    e = int(new_indptr[-1])
    new_indices = np.lib.format.open_memmap(out_indices, mode="w+", dtype=indices.dtype, shape=(e,))
    row = 0
    while row < n:
        # As many rows as fit in the chunk (at least one).
        end = int(np.searchsorted(new_indptr, new_indptr[row] + chunk_edges, side="right")) - 1
        end = max(end, row + 1)
        olds = r.new_to_old[row:end]
        starts = np.asarray(indptr[olds])
        lens = deg[olds]
        total = int(lens.sum())
        if total:
            offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
            positions = offsets + np.arange(total, dtype=np.int64)
            new_indices[new_indptr[row] : new_indptr[end]] = r.old_to_new[np.asarray(indices[positions])]
        row = end
        if progress:
            progress(row, n)
    new_indptr.flush()
    new_indices.flush()
    del new_indptr, new_indices
