"""io_uring rings for the file reader: many reads in flight from one thread, few system calls.

Reading with one blocking ``pread`` per thread keeps as many reads in flight as there are
threads, and NVMe SSDs need dozens each to reach their random-read rate (a read takes ~80 µs:
1 M reads/s needs ~80 in flight). An io_uring ring (io_uring(7)) takes a whole batch of reads per
``io_uring_enter`` and completes them as the device does. No liburing is needed: the ring is set up
here with two system calls and three mmaps, and :func:`moment.preads_kernel.uring_read_runs`
(compiled, GIL released) fills and drains it.

A ring belongs to one thread. :func:`uring_reads` says whether rings work here — Linux ≥ 5.6 on
x86-64 or arm64, and not blocked by a seccomp profile, as Docker's default blocks io_uring —
by reading a few bytes of a memfd through one.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# System call numbers (the same on x86-64 and arm64) and mmap offsets of io_uring(7).
IO_URING_SETUP = 425
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000
# Reads in flight per ring (per reader thread); the completion ring gets twice as many slots.
RING_ENTRIES = 64

# (ring fd, sq, cq, sqes, layout, fd, buffer address, offsets, dests, sizes, got) → 0 or -1
UringRuns = Callable[..., int]


class Ring:
    """One io_uring instance, mapped: ``args`` are the ring arguments of ``uring_read_runs``."""

    def __init__(self, entries: int = RING_ENTRIES) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        fd = libc.syscall(IO_URING_SETUP, entries, params)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        raw = params.raw
        sq_entries, cq_entries = struct.unpack_from("<2I", raw, 0)
        sq_head, sq_tail, sq_mask, _, _, _, sq_array = struct.unpack_from("<7I", raw, 40)
        cq_head, cq_tail, cq_mask, _, _, cqes = struct.unpack_from("<6I", raw, 80)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        try:
            self._maps = [
                mmap.mmap(fd, sq_array + 4 * sq_entries, flags, rw, offset=IORING_OFF_SQ_RING),
                mmap.mmap(fd, cqes + 16 * cq_entries, flags, rw, offset=IORING_OFF_CQ_RING),
                mmap.mmap(fd, 64 * sq_entries, flags, rw, offset=IORING_OFF_SQES),
            ]
        except OSError:
            os.close(fd)
            raise
        sq = np.frombuffer(self._maps[0], dtype=np.uint32)
        cq = np.frombuffer(self._maps[1], dtype=np.uint32)
        sqes = np.frombuffer(self._maps[2], dtype=np.uint64)
        layout = np.array(
            [sq_head // 4, sq_tail // 4, sq[sq_mask // 4], sq_array // 4, cq_head // 4, cq_tail // 4,
             cq[cq_mask // 4], cqes // 4, sq_entries],
            dtype=np.int64,
        )  # fmt: skip
        self.args: tuple[Any, ...] | None = (fd, sq, cq, sqes, layout)

    def close(self) -> None:
        """Unmap and close; reads still in flight are cancelled or waited for by the kernel."""
        if self.args is None:
            return
        self.args = None  # the numpy views go first: a mapping cannot close while exported
        for m in self._maps:
            m.close()
        os.close(self.fd)


_lock = threading.Lock()
_usable: list[tuple[UringRuns | None, str]] = []


def uring_reads() -> tuple[UringRuns | None, str]:
    """The compiled ring loop and "" where io_uring reads work here; else None and why not."""
    with _lock:
        if not _usable:
            _usable.append(_probe())
        return _usable[0]


def _probe() -> tuple[UringRuns | None, str]:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None, f"io_uring reads are built for Linux on x86-64 and arm64, not {sys.platform} {platform.machine()}"
    try:
        from moment import preads_kernel

        runs = preads_kernel.compiled_or_none(preads_kernel.uring_compiled)
    except ImportError:
        runs = None
    if runs is None:
        return None, "io_uring reads need numba"
    try:
        ring = Ring(8)
    except OSError as exc:  # ENOSYS: old kernel; EPERM: seccomp or io_uring_disabled
        return None, f"io_uring is not available here ({exc.strerror})"
    why = read_back(runs, ring)
    return (runs, "") if why is None else (None, why)


# Seconds the probe waits for its one read. io_uring_enter waits for completions without a
# timeout, and a runtime that accepts submissions but never completes them (a sandbox emulating
# part of io_uring) would otherwise hang every reader that probes.
PROBE_TIMEOUT_S = 5.0


def read_back(runs: UringRuns, ring: Any, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Read a few bytes of a memfd through ``ring`` with ``runs`` in a thread of its own; None
    when they came back right, else why rings are not used. A read still waiting after
    ``timeout`` seconds leaves the thread, the ring and the
    memfd behind (the thread may still touch them): a few descriptors, once per process."""
    fd = os.memfd_create("moment-uring-probe")
    payload = b"moment io_uring probe"
    os.write(fd, payload)
    out = np.zeros(len(payload), dtype=np.uint8)
    got = np.zeros(1, dtype=np.int64)
    z = np.zeros(1, dtype=np.int64)
    rc: list[int] = []
    thread = threading.Thread(
        target=lambda: rc.append(runs(*ring.args, fd, out.ctypes.data, z, z, np.array([len(payload)]), got)),
        name="moment-uring-probe",
        daemon=True,
    )
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"io_uring probe read did not complete in {timeout:g} s: not used"
    os.close(fd)
    ring.close()
    if not rc or rc[0] != 0 or got[0] != len(payload) or out.tobytes() != payload:
        return f"io_uring read back {int(got[0])} of {len(payload)} bytes (rc {rc[0] if rc else 'none'}): not used"
    return None


def ring_error(path: str) -> OSError:
    """The error when a ring stopped accepting reads (io_uring_enter kept failing)."""
    return OSError(errno.EIO, f"{path}: io_uring_enter kept failing; reads stopped")
