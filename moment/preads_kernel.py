"""The compiled read loop of :mod:`moment.preads` (imported only when first needed: numba)."""

from __future__ import annotations

from typing import Any

import numba
from numba import types

# libc's pread(fd, buf, count, offset), linked by name; the buffer is passed as its address.
_pread = types.ExternalFunction("pread", types.int64(types.int32, types.int64, types.uintp, types.int64))
SIGNATURE = "UniTuple(int64, 2)(int64, int64, int64[:], int64[:], int64[:], int64)"


def pread_runs(fd: int, base: int, offsets: Any, dests: Any, sizes: Any, start: int) -> tuple[int, int]:
    """Read runs ``start``… in full; stop at the first read that fails or returns 0 (the end of
    the file): its index and the bytes of it read. ``(len(offsets), 0)`` when all are in."""
    for i in range(start, offsets.size):
        done = 0
        size = sizes[i]
        while done < size:
            got = _pread(fd, base + dests[i] + done, size - done, offsets[i] + done)
            if got <= 0:  # an error (errno is not kept here) or the end of the file
                return i, done
            done += got
    return offsets.size, 0


def compiled(cache: bool) -> Any:
    """``pread_runs`` compiled for :data:`SIGNATURE`, GIL released; ``cache``: kept on disk."""
    return numba.njit(SIGNATURE, nogil=True, cache=cache)(pread_runs)
