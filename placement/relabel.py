"""The row map: where each dataset vertex's feature row lies in the bins.

The bins' rows are numbered in one order, the GPU caches first, then the CPU caches, then one
contiguous range per SSD bin; inside a bin the dataset's id order is kept. So (1) a row's bin is
a range lookup (no per-vertex bin index), and (2) all bins are written in one sequential pass
over the source features, each bin receiving sequential appends. ``old_to_new[v]`` is dataset
vertex ``v``'s row in that order: the one per-vertex array a placement adds. The graph, labels
and splits stay in the dataset's ids (the trainer translates at the feature store), so nothing
of the graph is rewritten.

Memory: the map is int32 where the ids fit (4 bytes per vertex), computed by a compiled counting
sort over ranges of vertices in threads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from moment.contracts.tiers import TIERS
from moment.cores import usable_cores

numba: ModuleType | None  # None: not installed (the same functions then run as Python)
try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the kernels then run as Python
    numba = None

TIER_ORDER: dict[str, int] = {t: i for i, t in enumerate(TIERS)}
GATHER_THREADS = 4  # the most threads filling the map at once (memory-latency bound: more cores help)


@dataclass
class Relabel:
    old_to_new: np.ndarray  # int32 (int64 past 2^31 - 1 vertices), N: each dataset vertex's row
    starts: np.ndarray  # int64, B+1: bin b holds rows [starts[b], starts[b+1])
    order: list[int]  # bin indices in id order


def bin_order(tiers: list[str]) -> list[int]:
    """Bin indices sorted by tier (GPU, CPU, SSD), plan order kept within a tier."""
    return sorted(range(len(tiers)), key=lambda b: (TIER_ORDER[tiers[b]], b))


def id_type(n: int) -> type[np.integer]:
    """The narrowest signed type holding the ids 0..n (int32 up to 2^31 - 1 vertices)."""
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


def _count_py(bin_of: np.ndarray, rank: np.ndarray, lo: int, hi: int, counts: np.ndarray) -> None:
    """``counts[k]`` += the vertices of ``lo:hi`` in the bin of rank ``k`` (no N-sized temporary,
    which ``np.bincount`` of a narrow ``bin_of`` makes)."""
    for v in range(lo, hi):
        counts[rank[bin_of[v]]] += 1


def _fill_py(
    bin_of: np.ndarray,
    rank: np.ndarray,
    lo: int,
    hi: int,
    pos: np.ndarray,
    old_to_new: np.ndarray,
) -> None:
    """Stable counting sort of the vertices ``lo:hi`` by their bin's rank, rows from ``pos``
    (by rank) on."""
    for v in range(lo, hi):
        k = rank[bin_of[v]]
        p = pos[k]
        old_to_new[v] = p
        pos[k] = p + 1


_count = numba.njit(cache=True, nogil=True)(_count_py) if numba is not None else _count_py
_fill = numba.njit(cache=True, nogil=True)(_fill_py) if numba is not None else _fill_py


def relabel(bin_of: np.ndarray, tiers: list[str], threads: int | None = None) -> Relabel:
    """Rows: bins in tier order, dataset order inside each bin (a stable sort by bin rank).

    The vertices are cut into ``threads`` ranges (default: the usable cores, at most
    ``GATHER_THREADS``), each counted per bin and then filled at once (the compiled passes
    release the GIL); a range's vertices of a bin follow those of the ranges before it, so the
    sort stays stable."""
    order = bin_order(tiers)
    rank = np.empty(len(tiers), dtype=np.int64)
    rank[order] = np.arange(len(tiers), dtype=np.int64)
    bin_of = np.asarray(bin_of)  # a memory map as a plain array over the same pages (what the kernels take)
    n = bin_of.size
    parts = max(1, min(threads or usable_cores(GATHER_THREADS), n >> 16))  # small graphs: one range
    cuts = [n * t // parts for t in range(parts + 1)]
    counts = np.zeros((parts, len(tiers)), dtype=np.int64)  # by rank
    dtype = id_type(n)
    old_to_new = np.empty(n, dtype=dtype)
    with ThreadPoolExecutor(max_workers=parts, thread_name_prefix="moment-relabel") as pool:
        list(pool.map(lambda t: _count(bin_of, rank, cuts[t], cuts[t + 1], counts[t]), range(parts)))
        starts = np.zeros(len(tiers) + 1, dtype=np.int64)
        np.cumsum(counts.sum(axis=0), out=starts[1:])
        pos = starts[:-1] + np.cumsum(counts, axis=0) - counts  # where range t's vertices of each bin begin
        fill = [pool.submit(_fill, bin_of, rank, cuts[t], cuts[t + 1], pos[t], old_to_new) for t in range(parts)]
        for job in fill:
            job.result()
    return Relabel(old_to_new, starts, order)
