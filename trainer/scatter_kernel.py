"""The compiled loops of :mod:`trainer.broadcast` (imported only when first needed: numba): the
scatter-add on the CPU — one pass over the edges, no E × width gather materialised, sums added in
edge order (so the bytes are fixed by the edge order alone) — and the bucketing of a slab of
in-edges by source block (a counting sort: stable, linear, no 8-byte temporaries per edge)."""

from __future__ import annotations

from typing import Any

import numba

SIGNATURE = "void(float32[:, ::1], int32[::1], int32[::1], float32[:, ::1])"


def scatter_add(acc: Any, dst: Any, src: Any, msg: Any) -> None:
    """``acc[dst[e]] += msg[src[e]]`` for every edge ``e``, in order."""
    width = acc.shape[1]
    for e in range(dst.size):
        a = acc[dst[e]]
        m = msg[src[e]]
        for j in range(width):
            a[j] += m[j]


def bucket(ptr: Any, src: Any, block: int, blocks: int, first: int, local: Any, dst: Any, starts: Any) -> None:
    """Edges ``src`` of destinations ``first + d`` (``ptr``: their CSR offsets, from 0) grouped by
    source block, each block's edges in CSR order: ``local`` (the source's row in its block),
    ``dst`` (the destination) and ``starts`` (block ``k``'s edges are ``starts[k]:starts[k + 1]``)."""
    starts[:] = 0
    for e in range(src.size):
        starts[src[e] // block + 1] += 1
    for k in range(blocks):
        starts[k + 1] += starts[k]
    cursor = starts[:blocks].copy()
    for d in range(ptr.size - 1):
        for e in range(ptr[d], ptr[d + 1]):
            k = src[e] // block
            at = cursor[k]
            cursor[k] = at + 1
            local[at] = src[e] - k * block
            dst[at] = first + d


def bucket_compiled() -> Any:
    """``bucket`` compiled lazily for the index dtype it meets (int32 or int64), cached on disk
    where numba can; None where numba cannot build it (the caller sorts with numpy)."""
    for cache in (True, False):
        try:
            return numba.njit(nogil=True, cache=cache)(bucket)
        except Exception:  # noqa: BLE001 - as compiled()
            continue
    return None


def compiled() -> Any:
    """``scatter_add`` compiled (GIL released), cached on disk where numba finds a writable
    folder; None where it cannot be built (the caller uses torch's ``index_add_``)."""
    for cache in (True, False):
        try:
            return numba.njit(SIGNATURE, nogil=True, cache=cache)(scatter_add)
        except Exception:  # noqa: BLE001 - no cache folder, or no compiler: try without, then give up
            continue
    return None
