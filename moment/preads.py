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

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# (fd, buffer address, file offsets, offsets in the buffer, sizes, first run) → (first run not
# read in full, bytes of it that were read). Arrays are int64.
PreadRuns = Callable[[int, int, np.ndarray, np.ndarray, np.ndarray, int], tuple[int, int]]

_lock = threading.Lock()
_compiled: list[PreadRuns | None] = []  # [] until the first call of native_preads


def native_preads() -> PreadRuns | None:
    """The compiled loop (compiled on first use, about 0.3 s), or None where it cannot be built."""
    with _lock:
        if not _compiled:
            _compiled.append(_compile())
        return _compiled[0]


def _compile() -> PreadRuns | None:
    try:
        import numba

        pread = ctypes.CDLL(None, use_errno=True).pread
    except (ImportError, OSError, AttributeError):
        return None
    pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
    pread.restype = ctypes.c_ssize_t

    # Compiled here, for one signature, not at the first read; not cached on disk: the function
    # embeds the address of libc's pread in this process.
    @numba.njit("UniTuple(int64, 2)(int64, int64, int64[:], int64[:], int64[:], int64)", nogil=True)
    def pread_runs(fd: int, base: int, offsets: Any, dests: Any, sizes: Any, start: int) -> tuple[int, int]:
        for i in range(start, offsets.size):
            done = 0
            size = sizes[i]
            while done < size:
                got = pread(fd, base + dests[i] + done, size - done, offsets[i] + done)
                if got <= 0:  # an error (errno is lost here) or the end of the file
                    return i, done
                done += got
        return offsets.size, 0

    return pread_runs
