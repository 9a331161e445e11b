"""The compiled scatter-add of :mod:`trainer.broadcast` on the CPU (imported only when first
needed: numba): one pass over the edges, no E × width gather materialised, sums added in edge
order (so the bytes are fixed by the edge order alone)."""

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


def compiled() -> Any:
    """``scatter_add`` compiled (GIL released), cached on disk where numba finds a writable
    folder; None where it cannot be built (the caller uses torch's ``index_add_``)."""
    for cache in (True, False):
        try:
            return numba.njit(SIGNATURE, nogil=True, cache=cache)(scatter_add)
        except Exception:  # noqa: BLE001 - no cache folder, or no compiler: try without, then give up
            continue
    return None
