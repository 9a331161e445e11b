"""The import's compiled loops (numba, GIL released): spreading a chunk of edges into buckets of
destinations, filling a bucket's rows (a stable counting sort), and the finite check of feature rows.

Both parallel loops split their input into contiguous slices, one per thread, count per thread
first, then give each thread its own output cursors (after the slices before it): every thread
reads only its slice, no two threads touch one slot, and the order of the input is kept (the
self-loop, then the edges in input order, then the reverses), whatever the number of threads.
"""

from __future__ import annotations

import numba
import numpy as np


def threads() -> int:
    """Threads the parallel loops use (``NUMBA_NUM_THREADS``; all cores by default)."""
    return numba.get_num_threads()


@numba.njit(nogil=True, cache=True)
def _slice(m, t, nthreads):  # pragma: no cover - compiled
    """Thread t's contiguous share [a, b) of m items."""
    return m * t // nthreads, m * (t + 1) // nthreads


@numba.njit(nogil=True, parallel=True, cache=True)
def spread(src, dst, n, fine, table, drop_loops, undirected, records, sizes, nthreads):  # pragma: no cover
    """A chunk's entries as (neighbour, destination) ``records`` grouped by segment: the forward
    entries of bucket k (``table[d >> fine]`` = k) are segment k, the reverses (``undirected``:
    d into the row of s, never for a self-loop) segment ``buckets + k``; ``sizes`` gets each
    segment's count. Input order is kept within a segment: threads take contiguous slices of the
    chunk and each writes its slice's records after those of the slices before it. Every id is
    checked against N = ``n``; returns the index of the first edge naming a vertex outside [0, n),
    or -1. ``drop_loops``: self-loops are dropped (the builder adds one per vertex)."""
    m = src.shape[0]
    segs = sizes.shape[0]
    buckets = segs // 2 if undirected else segs
    counts = np.zeros((nthreads, segs), dtype=np.int64)
    bad = np.full(nthreads, m, dtype=np.int64)
    for t in numba.prange(nthreads):
        a, b = _slice(m, t, nthreads)
        for i in range(a, b):
            s = src[i]
            d = dst[i]
            if s < 0 or s >= n or d < 0 or d >= n:
                bad[t] = i
                break
            if s == d:
                if not drop_loops:
                    counts[t, table[d >> fine]] += 1
            else:
                counts[t, table[d >> fine]] += 1
                if undirected:
                    counts[t, buckets + table[s >> fine]] += 1
    first = bad.min()
    if first < m:
        return first
    at = np.empty((nthreads, segs), dtype=np.int64)
    total = 0
    for k in range(segs):
        sizes[k] = 0
        for t in range(nthreads):
            at[t, k] = total
            total += counts[t, k]
            sizes[k] += counts[t, k]
    for t in numba.prange(nthreads):
        a, b = _slice(m, t, nthreads)
        for i in range(a, b):
            s = src[i]
            d = dst[i]
            if s == d and drop_loops:
                continue
            k = table[d >> fine]
            j = at[t, k]
            records[j, 0] = s
            records[j, 1] = d
            at[t, k] = j + 1
            if undirected and s != d:
                k = buckets + table[s >> fine]
                j = at[t, k]
                records[j, 0] = d
                records[j, 1] = s
                at[t, k] = j + 1
    return -1


@numba.njit(nogil=True, parallel=True, cache=True)
def fill(forward, reverse, lo, span, loops, out, starts, nthreads):  # pragma: no cover - compiled
    """A bucket's rows [lo, lo + span) from its records (neighbour, destination), ``forward`` then
    ``reverse`` (either may be empty), a stable counting sort: ``starts[v - lo]`` gets row v's first
    slot in ``out`` (``starts[span]`` the end), the row holds v itself first (``loops``), then its
    neighbours in record order. Threads take contiguous slices of the records, each with its own
    cursors (its rows' slots after the slices before it). Returns how many records name a
    destination outside the bucket, or 1 if ``out`` is not their size (a damaged scratch file:
    then nothing is placed)."""
    m1 = forward.shape[0]
    m = m1 + reverse.shape[0]
    hist = np.zeros((nthreads, span), dtype=np.int64)
    outside = np.zeros(nthreads, dtype=np.int64)
    for t in numba.prange(nthreads):
        a, b = _slice(m, t, nthreads)
        for i in range(a, b):
            v = (forward[i, 1] if i < m1 else reverse[i - m1, 1]) - lo
            if v < 0 or v >= span:
                outside[t] += 1
            else:
                hist[t, v] += 1
    wrong = outside.sum()
    pos = 0
    for v in range(span):
        starts[v] = pos
        pos += 1 if loops else 0
        for t in range(nthreads):
            c = hist[t, v]
            hist[t, v] = pos
            pos += c
    starts[span] = pos
    if wrong or pos != out.shape[0]:
        return max(wrong, 1)
    if loops:
        for v in range(span):
            out[starts[v]] = lo + v
    for t in numba.prange(nthreads):
        a, b = _slice(m, t, nthreads)
        for i in range(a, b):
            if i < m1:
                v = forward[i, 1] - lo
                u = forward[i, 0]
            else:
                v = reverse[i - m1, 1] - lo
                u = reverse[i - m1, 0]
            j = hist[t, v]
            out[j] = u
            hist[t, v] = j + 1
    return 0


@numba.njit(nogil=True, cache=True)
def degrees(records, lo, deg):  # pragma: no cover - compiled
    """Add each record's destination to ``deg[d - lo]``; returns how many fall outside ``deg``."""
    outside = 0
    for i in range(records.shape[0]):
        v = records[i, 1] - lo
        if v < 0 or v >= deg.shape[0]:
            outside += 1
        else:
            deg[v] += 1
    return outside


@numba.njit(nogil=True, cache=True)
def place(records, lo, a, b, cursor, out):  # pragma: no cover - compiled
    """Records whose destination d has ``a <= d - lo < b`` placed at their row's cursor
    (``cursor[d - lo - a]``, a slot of ``out``), which moves on; returns how many fell outside ``out``."""
    outside = 0
    for i in range(records.shape[0]):
        v = records[i, 1] - lo
        if v < a or v >= b:
            continue
        p = cursor[v - a]
        if p < 0 or p >= out.shape[0]:
            outside += 1
            continue
        out[p] = records[i, 0]
        cursor[v - a] = p + 1
    return outside


@numba.njit(nogil=True, cache=True)
def first_nonfinite(bits, mask):  # pragma: no cover - compiled
    """The first row of an N × d block viewed as unsigned integers holding a value with every
    exponent bit set (inf or NaN; ``mask`` is the exponent field of the float type), or -1. One
    thread: it runs beside the CSR fill's threads (placement.importers.publish)."""
    for r in range(bits.shape[0]):
        for c in range(bits.shape[1]):
            if (bits[r, c] & mask) == mask:
                return r
    return -1


EXPONENT = {2: np.uint16(0x7C00), 4: np.uint32(0x7F800000), 8: np.uint64(0x7FF0000000000000)}
UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def first_nonfinite_row(block: np.ndarray) -> int:
    """Index of the first row of a float block holding NaN or inf, or -1."""
    size = block.dtype.itemsize
    bits = np.ascontiguousarray(block).reshape(block.shape[0], -1).view(UNSIGNED[size])
    if not block.dtype.isnative:
        bits = bits.byteswap()
    return int(first_nonfinite(bits, EXPONENT[size]))
