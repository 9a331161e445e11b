"""The compiled read loop of :mod:`moment.preads` (imported only when first needed: numba)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

# libc's pread(fd, buf, count, offset), linked by name; the buffer is passed as its address. Any:
# numba types its calls in compiled code.
_pread: Any = types.ExternalFunction("pread", types.int64(types.int32, types.int64, types.uintp, types.int64))
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


def compiled_or_none(factory: Callable[[bool], Any]) -> Any:
    """``factory(cache)``'s function, cached on disk where numba finds a writable folder; None
    where it cannot be built (no symbol to link, say)."""
    for cache in (True, False):
        try:
            return factory(cache)
        except Exception:  # noqa: BLE001 - no cache folder, or nothing to link: try without, then give up
            continue
    return None


# -- io_uring -------------------------------------------------------------------------------------


@intrinsic
def _fence_intrinsic(typingctx: Any) -> Any:
    """A sequentially consistent memory fence: orders this thread's ring accesses against the
    kernel's (the ring head/tail protocol of io_uring(7)), for the compiler and the CPU."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


# What compiled code calls, with no arguments (numba passes the typing context): Any to a checker.
_fence: Any = _fence_intrinsic


# syscall(number, six arguments); io_uring_enter is 426 on x86-64 and arm64 (moment.uring checks).
_syscall: Any = types.ExternalFunction("syscall", types.int64(*[types.int64] * 7))
IO_URING_ENTER, IORING_OP_READ, IORING_ENTER_GETEVENTS = 426, 22, 1
U32 = 0xFFFFFFFF
URING_SIGNATURE = (
    "int64(int64, uint32[:], uint32[:], uint64[:], int64[:], int64, int64, int64[:], int64[:], int64[:], int64[:])"
)


def uring_read_runs(
    ring_fd: int,
    sq: Any,
    cq: Any,
    sqes: Any,
    layout: Any,
    fd: int,
    base: int,
    offsets: Any,
    dests: Any,
    sizes: Any,
    got: Any,
) -> int:
    """Read every run through the ring, up to its entries in flight: ``got[i]`` = bytes run i
    read (its size when in full; less at the end of the file, 0 after an error, for the caller to
    redo). ``sq``/``cq`` are the rings as uint32, ``sqes`` the entries as uint64; ``layout`` holds
    the uint32 indices of sq head, tail, array, cq head, tail, cqes and the masks and entries.
    Returns 0, or -1 when io_uring_enter kept failing (reads may still be in flight: close the ring
    before reusing the buffer)."""
    sq_head, sq_tail, sq_mask, sq_array, cq_head, cq_tail, cq_mask, cqes, entries = (
        layout[0],
        layout[1],
        layout[2],
        layout[3],
        layout[4],
        layout[5],
        layout[6],
        layout[7],
        layout[8],
    )
    n = offsets.size
    nxt, inflight, failures = 0, 0, 0
    tail = np.int64(sq[sq_tail])  # this thread is the ring's only submitter
    while nxt < n or inflight > 0:
        while nxt < n and inflight < entries:
            idx = tail & sq_mask
            w = idx * 8
            sqes[w] = IORING_OP_READ | ((fd & U32) << 32)
            sqes[w + 1] = offsets[nxt]
            sqes[w + 2] = base + dests[nxt]
            sqes[w + 3] = sizes[nxt]
            sqes[w + 4] = nxt
            sqes[w + 5] = 0
            sqes[w + 6] = 0
            sqes[w + 7] = 0
            sq[sq_array + idx] = idx
            tail = (tail + 1) & U32
            nxt += 1
            inflight += 1
        _fence()
        sq[sq_tail] = tail
        _fence()
        pending = (tail - np.int64(sq[sq_head])) & U32
        if _syscall(IO_URING_ENTER, ring_fd, pending, 1, IORING_ENTER_GETEVENTS, 0, 0) < 0:
            failures += 1  # EINTR, EAGAIN, EBUSY: try again; anything else a thousand times: give up
            if failures > 1000:
                return -1
        else:
            failures = 0
        _fence()
        head, ctail = np.int64(cq[cq_head]), np.int64(cq[cq_tail])
        _fence()
        while head != ctail:
            c = cqes + (head & cq_mask) * 4  # a completion is 16 bytes: user_data (u64), res (s32), flags
            i = np.int64(cq[c]) | (np.int64(cq[c + 1]) << 32)
            res = np.int64(cq[c + 2])
            got[i] = res if res < 2**31 else 0  # a negative res is -errno: redone by the caller
            head = (head + 1) & U32
            inflight -= 1
        _fence()
        cq[cq_head] = head
    return 0


def uring_compiled(cache: bool) -> Any:
    """``uring_read_runs`` compiled for :data:`URING_SIGNATURE`, GIL released."""
    return numba.njit(URING_SIGNATURE, nogil=True, cache=cache)(uring_read_runs)
