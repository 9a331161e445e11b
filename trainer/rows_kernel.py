"""The compiled row copy of :mod:`trainer.featurestore` (imported only when first needed: numba):
each feature row put straight where it goes in the output, from wherever it is (a host tier, the
SSD staging buffer), once, with the GIL released and on the calling thread alone.

Why not numpy or torch: ``out[pos] = src[idx]`` materialises ``src[idx]`` first (every row copied
twice), and torch's ``index_select``/``index_copy_`` split a copy over the intra-op threads,
which on a machine whose cores are busy training spin at their barrier; the prefetch thread
then takes CPU from the step it is meant to hide behind."""

from __future__ import annotations

from typing import Any

import numba
from numba import types

from moment.preads_kernel import compiled_or_none


def _signature(word: Any) -> Any:
    """The output writable, the rest read-only (a mapped tier is), so either kind is taken."""
    index = types.Array(types.int64, 1, "C", readonly=True)
    return types.void(types.Array(word, 2, "C"), index, types.Array(word, 2, "C", readonly=True), index)


# Rows as 8-byte words where the row size allows (fewer iterations), else as bytes.
SIGNATURES = [_signature(types.uint64), _signature(types.uint8)]


def copy_rows(dst: Any, dst_at: Any, src: Any, src_at: Any) -> None:
    """``dst[dst_at[i]] = src[src_at[i]]`` for every ``i`` (2-D arrays of one row width)."""
    width = dst.shape[1]
    for i in range(dst_at.size):
        d = dst[dst_at[i]]
        s = src[src_at[i]]
        for j in range(width):
            d[j] = s[j]


def compiled(cache: bool) -> Any:
    """``copy_rows`` compiled for :data:`SIGNATURES`, GIL released; ``cache``: kept on disk."""
    return numba.njit(SIGNATURES, nogil=True, cache=cache)(copy_rows)


def copier() -> Any:
    """The compiled ``copy_rows``; None where numba cannot build it (the caller copies with numpy)."""
    return compiled_or_none(compiled)
