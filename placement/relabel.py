"""New vertex ids that say where a vertex lives, and the graph rewritten in them.

Bins are laid out in id order: the GPU caches first, then the CPU caches, then one contiguous
range per SSD bin. Inside a bin the original id order is kept, so (1) a vertex's location is a
range lookup (no per-vertex index), and (2) all bins are written in one sequential pass over the
source features, each bin receiving sequential appends.

Memory: the two id maps are int32 where the ids fit (8 bytes per vertex together), computed by a
compiled counting sort; the CSR, labels and hotness are rewritten chunk by chunk into files
written front to back and checksummed on the way (:class:`placement.writer.NpyWriter`), so
nothing else of N entries is held and nothing is read back to checksum it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from moment.contracts.tiers import TIERS
from moment.progress import Update
from placement.writer import NpyWriter

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the kernels then run as Python
    numba = None

TIER_ORDER = {t: i for i, t in enumerate(TIERS)}
CHUNK_ROWS = 1 << 18  # rows rewritten at once


@dataclass
class Relabel:
    old_to_new: np.ndarray  # int32 (int64 past 2^31 - 1 vertices), N
    new_to_old: np.ndarray  # same type, N
    starts: np.ndarray  # int64, B+1: bin b holds new ids [starts[b], starts[b+1])
    order: list[int]  # bin indices in id order


def bin_order(tiers: list[str]) -> list[int]:
    """Bin indices sorted by tier (GPU, CPU, SSD), plan order kept within a tier."""
    return sorted(range(len(tiers)), key=lambda b: (TIER_ORDER[tiers[b]], b))


def id_type(n: int) -> type[np.integer]:
    """The narrowest signed type holding the ids 0..n (int32 up to 2^31 - 1 vertices)."""
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


def _maps_py(
    bin_of: np.ndarray, rank: np.ndarray, starts: np.ndarray, new_to_old: np.ndarray, old_to_new: np.ndarray
) -> None:
    """Stable counting sort of the vertices by their bin's rank: both id maps in one pass."""
    pos = starts.copy()
    for v in range(bin_of.size):
        k = rank[bin_of[v]]
        new_to_old[pos[k]] = v
        old_to_new[v] = pos[k]
        pos[k] += 1


_maps = numba.njit(cache=True)(_maps_py) if numba is not None else _maps_py


def relabel(bin_of: np.ndarray, tiers: list[str]) -> Relabel:
    """New ids: bins in tier order, original order inside each bin (a stable sort by bin rank)."""
    order = bin_order(tiers)
    rank = np.empty(len(tiers), dtype=np.int64)
    rank[order] = np.arange(len(tiers), dtype=np.int64)
    counts = np.bincount(bin_of, minlength=len(tiers))[order]
    starts = np.zeros(len(tiers) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    dtype = id_type(bin_of.size)
    new_to_old = np.empty(bin_of.size, dtype=dtype)
    old_to_new = np.empty(bin_of.size, dtype=dtype)
    _maps(bin_of, rank, starts, new_to_old, old_to_new)
    return Relabel(old_to_new, new_to_old, starts, order)


def _gather_rows_py(
    indices: np.ndarray, starts: np.ndarray, lens: np.ndarray, old_to_new: np.ndarray, out: np.ndarray
) -> None:
    """``out`` = the rows ``starts[i]:starts[i] + lens[i]`` of ``indices``, one after the other,
    each neighbour id mapped through ``old_to_new``."""
    p = 0
    for i in range(starts.size):
        s = starts[i]
        for e in range(s, s + lens[i]):
            out[p] = old_to_new[indices[e]]
            p += 1


_gather_rows = numba.njit(cache=True, nogil=True)(_gather_rows_py) if numba is not None else _gather_rows_py


def _rows(indptr: np.ndarray, indices: np.ndarray, r: Relabel, row: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """New rows [row, end): their degrees and their neighbour lists in new ids, one after the other."""
    olds = r.new_to_old[row:end].astype(np.int64)
    starts = np.asarray(indptr[olds], dtype=np.int64)
    lens = np.asarray(indptr[olds + 1], dtype=np.int64) - starts
    block = np.empty(int(lens.sum()), dtype=indices.dtype)
    _gather_rows(indices, starts, lens, r.old_to_new, block)
    return lens, block


def rewrite_csr(
    indptr: np.ndarray,
    indices: np.ndarray,
    r: Relabel,
    out_indptr: NpyWriter,
    out_indices: NpyWriter,
    chunk_rows: int = CHUNK_ROWS,
    progress: Update | None = None,
) -> None:
    """CSR in new ids: row r_new = old row new_to_old[r_new], neighbour ids mapped through
    old_to_new; both files written front to back, ``chunk_rows`` rows at a time. The next chunk
    is gathered in a thread (the compiled gather releases the GIL) while this one is checksummed
    and written: the gather is bound by memory latency (a random row, a random id per edge)."""
    n = r.new_to_old.size
    out_indptr.write(np.zeros(1, dtype=np.int64))
    end_of_last = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moment-csr") as pool:
        ahead = pool.submit(_rows, indptr, indices, r, 0, min(n, chunk_rows)) if n else None
        for row in range(0, n, chunk_rows):
            lens, block = ahead.result()
            end = min(n, row + chunk_rows)
            if end < n:
                ahead = pool.submit(_rows, indptr, indices, r, end, min(n, end + chunk_rows))
            ends = np.cumsum(lens) + end_of_last
            out_indptr.write(ends)
            end_of_last = int(ends[-1])
            out_indices.write(block)
            if progress:
                progress(end, n)


def permute(values: np.ndarray, new_to_old: np.ndarray, out: NpyWriter, chunk_rows: int = 1 << 22) -> None:
    """``values[new_to_old]`` written to ``out`` chunk by chunk (labels, hotness in the new ids)."""
    for row in range(0, new_to_old.size, chunk_rows):
        out.write(np.asarray(values[new_to_old[row : row + chunk_rows]]))
