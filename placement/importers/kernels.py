"""The import's compiled loops (numba, GIL released): degree counting, the scatter that places each
neighbour at its row's cursor, grouping a chunk by window, and the finite check of feature rows.

Scattering at a cursor replaces the sort of a window: ``ptr[v]`` starts at row v's first slot and
moves one slot per neighbour placed, so neighbours keep the order in which they are offered (the
self-loop, then the edges in input order, then the reverses). Threads split the destinations of a
window into disjoint vertex ranges; each scans the whole chunk and places only its own rows, so no
two threads touch one cursor or one slot.
"""

from __future__ import annotations

import numba
import numpy as np

FORWARD, REVERSE = 0, 1


def threads() -> int:
    """Threads the parallel loops use (``NUMBA_NUM_THREADS``; all cores by default)."""
    return numba.get_num_threads()


@numba.njit(nogil=True, cache=True)
def count_degrees(src, dst, ptr, drop_loops, undirected, kept, at):  # pragma: no cover - compiled
    """In-degrees into ``ptr[v + 1]`` (so that a running sum makes ``ptr`` the row pointers), each
    id checked against N = ``ptr.size - 1``; the edges copied to ``kept[at:]`` unless it is empty.
    Returns the index of the first edge naming a vertex outside [0, N), or -1."""
    n = ptr.shape[0] - 1
    keep = kept.shape[0] > 0
    for i in range(src.shape[0]):
        s = src[i]
        d = dst[i]
        if s < 0 or s >= n or d < 0 or d >= n:
            return i
        if keep:
            kept[at + i, 0] = s
            kept[at + i, 1] = d
        if s == d:
            if not drop_loops:
                ptr[d + 1] += 1
        else:
            ptr[d + 1] += 1
            if undirected:
                ptr[s + 1] += 1
    return -1


@numba.njit(nogil=True, parallel=True, cache=True)
def scatter(src, dst, lo, hi, ptr, out, base, drop_loops, part, nthreads):  # pragma: no cover - compiled
    """Place the entries of a chunk whose destination is in [lo, hi): ``part`` FORWARD places src
    into dst's row (a self-loop skipped with ``drop_loops``), REVERSE places dst into src's row (self-
    loops never). Returns how many entries fell outside ``out`` (the input changed since counted)."""
    outside = np.zeros(nthreads, dtype=np.int64)
    span = hi - lo
    for t in numba.prange(nthreads):
        a = lo + span * t // nthreads
        b = lo + span * (t + 1) // nthreads
        for i in range(src.shape[0]):
            s = src[i]
            d = dst[i]
            if part == FORWARD:
                v = d
                u = s
                if drop_loops and s == d:
                    continue
            else:
                v = s
                u = d
                if s == d:
                    continue
            if v < a or v >= b:
                continue
            p = ptr[v] - base
            if p < 0 or p >= out.shape[0]:
                outside[t] += 1
                continue
            out[p] = u
            ptr[v] += 1
    return outside.sum()


@numba.njit(nogil=True, cache=True)
def place_loops(lo, hi, ptr, out, base):  # pragma: no cover - compiled
    """Every vertex of [lo, hi) as the first neighbour of its own row."""
    for v in range(lo, hi):
        out[ptr[v] - base] = v
        ptr[v] += 1


@numba.njit(nogil=True, cache=True)
def group(src, dst, n, starts, drop_loops, part, records, sizes):  # pragma: no cover - compiled
    """A chunk's entries as (neighbour, destination) records grouped by the destination's window
    (``starts``: each window's first vertex), input order kept within a window; ``sizes`` gets the
    count per window. Returns the number of records, or -1 if an id is outside [0, n) (the input
    changed since it was counted)."""
    w = starts.shape[0]
    which = np.empty(src.shape[0], dtype=np.int32)
    for i in range(src.shape[0]):
        s = src[i]
        d = dst[i]
        if s < 0 or s >= n or d < 0 or d >= n:
            return -1
        which[i] = -1
        if part == FORWARD:
            if drop_loops and s == d:
                continue
            v = d
        else:
            if s == d:
                continue
            v = s
        k = np.searchsorted(starts, v, side="right") - 1
        which[i] = k
        sizes[k] += 1
    at = np.empty(w, dtype=np.int64)
    total = 0
    for k in range(w):
        at[k] = total
        total += sizes[k]
    for i in range(src.shape[0]):
        k = which[i]
        if k < 0:
            continue
        j = at[k]
        if part == FORWARD:
            records[j, 0] = src[i]
            records[j, 1] = dst[i]
        else:
            records[j, 0] = dst[i]
            records[j, 1] = src[i]
        at[k] = j + 1
    return total


@numba.njit(nogil=True, parallel=True, cache=True)
def nonfinite_rows(bits, mask):  # pragma: no cover - compiled
    """Per row of an N × d block viewed as unsigned integers: whether a value has every exponent bit
    set (inf or NaN; ``mask`` is the exponent field of the float type)."""
    bad = np.zeros(bits.shape[0], dtype=np.bool_)
    for r in numba.prange(bits.shape[0]):
        for c in range(bits.shape[1]):
            if (bits[r, c] & mask) == mask:
                bad[r] = True
                break
    return bad


EXPONENT = {2: np.uint16(0x7C00), 4: np.uint32(0x7F800000), 8: np.uint64(0x7FF0000000000000)}
UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def first_nonfinite_row(block: np.ndarray) -> int:
    """Index of the first row of a float block holding NaN or inf, or -1 (threads over rows)."""
    size = block.dtype.itemsize
    bits = np.ascontiguousarray(block).reshape(block.shape[0], -1).view(UNSIGNED[size])
    if not block.dtype.isnative:
        bits = bits.byteswap()
    bad = nonfinite_rows(bits, EXPONENT[size])
    return int(np.argmax(bad)) if bad.any() else -1
