"""Batched preads in machine code, with the GIL released: the hot loop of the file reader.

A Python loop of ``os.preadv`` holds the GIL for about 2 µs per read, so one rank tops out near
0.5 M reads/s however many threads it has, a fraction of what a few NVMe SSDs deliver (about
1 M random 4 KiB reads/s each). :func:`pread_runs` is the same loop compiled by numba
(``nogil=True``) calling libc's ``pread`` directly: each of the reader's threads runs a whole
task of reads per call, and the threads really read in parallel. It stops at the first read
that fails or ends the file and says where, so the caller redoes that one read in Python, where
the error gets the file's name and O_DIRECT refusals fall back to buffered reads.

Without numba or a libc ``pread`` (:func:`native_preads` is None) the reader does every read
the Python way; the results are the same, only slower.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

# (fd, buffer address, file offsets, offsets in the buffer, sizes, first run) → (first run not
# read in full, bytes of it that were read). Arrays are int64.
PreadRuns = Callable[[int, int, np.ndarray, np.ndarray, np.ndarray, int], tuple[int, int]]

_lock = threading.Lock()
_compiled: list[PreadRuns | None] = []  # [] until the first call of native_preads


def native_preads() -> PreadRuns | None:
    """The compiled loop (compiled on first use, about 0.3 s, then loaded from numba's cache in
    about 0.1 s), or None where it cannot be built."""
    with _lock:
        if not _compiled:
            _compiled.append(_compile())
        return _compiled[0]


def _compile() -> PreadRuns | None:
    try:
        from moment import preads_kernel
    except ImportError:  # no numba
        return None
    return preads_kernel.compiled_or_none(preads_kernel.compiled)
