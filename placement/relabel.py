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

import itertools
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from moment.contracts.tiers import TIERS
from moment.cores import usable_cores
from moment.progress import Update
from placement.writer import NpyWriter

numba: ModuleType | None  # None: not installed (the same functions then run as Python)
try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the kernels then run as Python
    numba = None

TIER_ORDER: dict[str, int] = {t: i for i, t in enumerate(TIERS)}
CHUNK_ROWS = 1 << 18  # rows rewritten at once, at most ...
CHUNK_EDGES = 1 << 21  # ... and at most this many edges (a row longer than that: alone), bounding memory
GATHER_THREADS = 4  # the most threads gathering rows at once (memory-latency bound: more cores help)


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
    new_to_old: np.ndarray,
    old_to_new: np.ndarray,
) -> None:
    """Stable counting sort of the vertices ``lo:hi`` by their bin's rank, new ids from ``pos``
    (by rank) on: both id maps in one pass."""
    for v in range(lo, hi):
        k = rank[bin_of[v]]
        p = pos[k]
        new_to_old[p] = v
        old_to_new[v] = p
        pos[k] = p + 1


_count = numba.njit(cache=True, nogil=True)(_count_py) if numba is not None else _count_py
_fill = numba.njit(cache=True, nogil=True)(_fill_py) if numba is not None else _fill_py


def relabel(bin_of: np.ndarray, tiers: list[str], threads: int | None = None) -> Relabel:
    """New ids: bins in tier order, original order inside each bin (a stable sort by bin rank).

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
    new_to_old = np.empty(n, dtype=dtype)
    old_to_new = np.empty(n, dtype=dtype)
    with ThreadPoolExecutor(max_workers=parts, thread_name_prefix="moment-relabel") as pool:
        list(pool.map(lambda t: _count(bin_of, rank, cuts[t], cuts[t + 1], counts[t]), range(parts)))
        starts = np.zeros(len(tiers) + 1, dtype=np.int64)
        np.cumsum(counts.sum(axis=0), out=starts[1:])
        pos = starts[:-1] + np.cumsum(counts, axis=0) - counts  # where range t's vertices of each bin begin
        fill = [
            pool.submit(_fill, bin_of, rank, cuts[t], cuts[t + 1], pos[t], new_to_old, old_to_new) for t in range(parts)
        ]
        for job in fill:
            job.result()
    return Relabel(old_to_new, new_to_old, starts, order)


def mapped_rows_py(
    indices: np.ndarray, starts: np.ndarray, lens: np.ndarray, old_to_new: np.ndarray, out: np.ndarray
) -> None:
    """``out`` = the rows ``starts[i]:starts[i] + lens[i]`` of ``indices``, one after the other,
    each neighbour id mapped through ``old_to_new``. In two passes: the rows copied, then every id
    mapped in one flat loop. The random reads of ``old_to_new`` then overlap each other; inside
    the rows a mispredicted branch at every row's end (rows are short) kept few in flight: the
    flat loop takes half the time."""
    p = 0
    for i in range(starts.size):
        s, n = starts[i], lens[i]
        out[p : p + n] = indices[s : s + n]
        p += n
    for j in range(out.size):
        out[j] = old_to_new[out[j]]


mapped_rows = numba.njit(cache=True, nogil=True)(mapped_rows_py) if numba is not None else mapped_rows_py


def row_extents_py(new_to_old: np.ndarray, indptr: np.ndarray, lo: int, starts: np.ndarray, lens: np.ndarray) -> None:
    """Each new row ``lo + i``'s first edge in the old CSR and its degree (one random read of
    ``indptr`` per row: the two ends share a cache line)."""
    for i in range(starts.size):
        old = new_to_old[lo + i]
        s = indptr[old]
        starts[i] = s
        lens[i] = indptr[old + 1] - s


row_extents = numba.njit(cache=True, nogil=True)(row_extents_py) if numba is not None else row_extents_py


def _extents(
    indptr: np.ndarray, r: Relabel, max_rows: int, max_edges: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The chunks of new rows, front to back: (the row after the chunk, each row's first edge in
    the old CSR, its degree). A chunk has at most ``max_rows`` rows and ``max_edges`` edges, one
    row at least (hot vertices have huge rows, and the hottest come first). Each row's extent is
    looked up once: ``max_rows`` rows at a time, then handed out in chunks, so a run of rows each
    over ``max_edges`` (hubs) costs a lookup per row, not ``max_rows`` lookups per row."""
    n, row = r.new_to_old.size, 0
    indptr = np.asarray(indptr)  # a memory map as a plain array over the same pages (what the kernel takes)
    while row < n:
        starts = np.empty(min(max_rows, n - row), dtype=np.int64)
        lens = np.empty_like(starts)
        row_extents(r.new_to_old, indptr, row, starts, lens)
        ends = np.cumsum(lens)
        at = 0
        while at < lens.size:
            before = int(ends[at - 1]) if at else 0
            take = max(at + 1, int(np.searchsorted(ends, before + max_edges, side="right")))
            row += take - at
            yield row, starts[at:take], lens[at:take]
            at = take


def _gather(indices: np.ndarray, r: Relabel, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The rows' neighbour lists in new ids, one after the other."""
    block = np.empty(int(lens.sum()), dtype=indices.dtype)
    mapped_rows(indices, starts, lens, r.old_to_new, block)
    return block


def rewrite_csr(
    indptr: np.ndarray,
    indices: np.ndarray,
    r: Relabel,
    out_indptr: NpyWriter,
    out_indices: NpyWriter,
    chunk_rows: int = CHUNK_ROWS,
    progress: Update | None = None,
    chunk_edges: int = CHUNK_EDGES,
    threads: int | None = None,
) -> None:
    """CSR in new ids: row r_new = old row new_to_old[r_new], neighbour ids mapped through
    old_to_new; both files written front to back, at most ``chunk_rows`` rows and
    ``chunk_edges`` edges at a time. The gather is bound by memory latency (a random row, a
    random id per edge) and releases the GIL, so ``threads`` (default: the usable cores, at most
    ``GATHER_THREADS``) gather the next chunks while this one is checksummed and written; at most
    ``threads + 1`` chunks are held."""
    n = r.new_to_old.size
    threads = threads or usable_cores(GATHER_THREADS)
    out_indptr.write(np.zeros(1, dtype=np.int64))
    end_of_last = 0
    chunks = _extents(indptr, r, chunk_rows, chunk_edges)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moment-csr") as pool:
        ahead: deque[tuple[int, np.ndarray, Future[np.ndarray]]] = deque()

        def submit() -> None:
            for end, starts, lens in itertools.islice(chunks, 1):
                ahead.append((end, lens, pool.submit(_gather, indices, r, starts, lens)))

        for _ in range(threads + 1):
            submit()
        while ahead:
            end, lens, block = ahead.popleft()
            submit()
            ends = np.cumsum(lens) + end_of_last
            out_indptr.write(ends)
            end_of_last = int(ends[-1])
            out_indices.write(block.result())
            if progress:
                progress(end, n)


def permute(values: np.ndarray, new_to_old: np.ndarray, out: NpyWriter, chunk_rows: int = 1 << 20) -> None:
    """``values[new_to_old]`` written to ``out`` chunk by chunk (labels, hotness in the new ids)."""
    for row in range(0, new_to_old.size, chunk_rows):
        out.write(np.asarray(values[new_to_old[row : row + chunk_rows]]))
