"""The compiled planning of a read request (:func:`trainer.read_base.plan_runs`; imported only
when first needed: numba): the rows checked, cut into runs of consecutive rows (split at a
maximum), in bytes, and the pages those runs touch, in two passes over the rows.

Why compiled: numpy's version (:func:`trainer.read_base.coalesce`, then
:func:`moment.ssd_reads.pages_read`) makes a dozen temporaries per request and was the largest
Python cost left on the prefetch thread of a packed run (issue #25), where every batch plans
several requests of a few hundred rows each."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types

from moment.preads_kernel import compiled_or_none

# What plan_runs returns as its status: the request is good, its rows are not sorted and unique,
# its first row is negative (read_base turns the last two into its ValueErrors).
OK, UNSORTED, NEGATIVE = 0, 1, 2

_ROWS = types.Array(types.int64, 1, "A", readonly=True)  # any int64 rows: a view, a mapping
_RUNS = types.Array(types.int64, 1, "C")
SIGNATURE = types.Tuple((_RUNS, _RUNS, _RUNS, types.int64, types.int64))(
    _ROWS, types.int64, types.int64, types.int64, types.int64
)


def plan_runs(rows: Any, row_bytes: int, max_rows: int, base: int, page: int) -> tuple[Any, Any, Any, int, int]:
    """Runs of consecutive ``rows`` (sorted, unique), each at most ``max_rows`` rows, as (file
    offsets from ``base``, offsets in the buffer, sizes) in bytes; the bytes of the distinct
    ``page``-byte pages they touch (a page two runs share counted once); and the status
    (:data:`OK`, or what is wrong with ``rows``: then no runs)."""
    n = rows.size
    runs = 0
    i = 0
    while i < n:  # count the runs (split ones as their pieces) and check the rows
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1:
            j += 1
        if j < n and rows[j] <= rows[j - 1]:
            none = np.zeros(0, dtype=np.int64)
            return none, none, none, 0, UNSORTED
        runs += (j - i + max_rows - 1) // max_rows
        i = j
    if n and rows[0] < 0:
        none = np.zeros(0, dtype=np.int64)
        return none, none, none, 0, NEGATIVE
    offsets = np.empty(runs, dtype=np.int64)
    dests = np.empty(runs, dtype=np.int64)
    sizes = np.empty(runs, dtype=np.int64)
    pages, last, k = 0, -1, 0
    i = 0
    while i < n:
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1:
            j += 1
        at = i
        while at < j:  # the run [i, j), in pieces of at most max_rows
            count = min(j - at, max_rows)
            offset, size = base + rows[at] * row_bytes, count * row_bytes
            offsets[k], dests[k], sizes[k] = offset, at * row_bytes, size
            first = offset // page
            pages += (offset + size - 1) // page - first + 1 - (1 if k and first == last else 0)
            last = (offset + size - 1) // page
            k += 1
            at += count
        i = j
    return offsets, dests, sizes, pages * page, OK


def compiled(cache: bool) -> Any:
    """``plan_runs`` compiled for :data:`SIGNATURE`; ``cache``: kept on disk."""
    return numba.njit(SIGNATURE, cache=cache)(plan_runs)


def planner() -> Any:
    """The compiled ``plan_runs``; None where numba cannot build it (the caller plans with numpy)."""
    return compiled_or_none(compiled)
