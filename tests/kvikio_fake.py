"""A strict stand-in for the kvikio module (26.x), reading into host memory, for CPU tests.

It keeps what the reader can get wrong, as kvikio 26.x does it (python/kvikio/kvikio/cufile.py,
_lib/arr.pyx, _lib/future.pyx, cpp/src/defaults.cpp, cpp/src/file_handle.cpp):

* ``CuFile(file, flags="r")``; ``pread(buf, size=None, file_offset=0, task_size=None)`` returns
  an ``IOFuture`` whose ``get()`` returns the bytes read. ``buf`` must expose a
  ``__cuda_array_interface__`` dict (``data``: (address, read-only), ``shape``, ``typestr``) and
  be contiguous; ``size`` larger than the buffer is a ValueError.
* No short reads: at the end of the file kvikio raises ``RuntimeError("POSIX error on pread:
  EOF")`` (from ``get``).
* A read below ``gds_threshold`` (16 KiB by default since 25.04) is deferred: it runs in the
  thread that calls ``get``. A read at or above it goes to kvikio's one global pool, which has
  ``num_threads`` threads (1 by default).
* ``defaults.set(key, value)`` / ``defaults.get(key)`` for ``num_threads``, ``gds_threshold``,
  ``task_size``, ``compat_mode``, ``auto_direct_io_read``; an unknown key is a KeyError.
  ``compat_mode`` is a ``CompatMode`` (``ON``, ``OFF``, ``AUTO``; AUTO by default), and
  ``defaults.is_compat_mode_preferred()`` is true for ON, and for AUTO where cuFile is not
  available (``cufile_available``).
* The compat mode is decided per file when ``CuFile`` opens it (compat_mode_manager.cpp): ON:
  POSIX; OFF: cuFile, and a file cuFile cannot register (``unregistrable``; or no cuFile at all)
  raises RuntimeError at open; AUTO: cuFile where available, POSIX for a file it cannot register.
  The Python ``CuFile`` does not say which a file got (26.x binds no
  ``get_compat_mode_manager``); this fake keeps it private too, and counts the ground truth in
  ``cufile_reads`` / ``posix_reads``: a read below ``gds_threshold`` is POSIX whatever the mode.

Addresses here are host addresses (the reader's tests use CPU tensors in place of CUDA ones).
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from trainer import readers

EOF_MESSAGE = "POSIX error on pread: EOF"


class CompatMode(enum.Enum):
    """kvikio.CompatMode."""

    OFF = 0
    ON = 1
    AUTO = 2


class _Defaults:
    def __init__(self, owner: FakeKvikio, version: str) -> None:
        self._owner = owner
        self._values: dict[str, Any] = {
            "num_threads": 1,
            "gds_threshold": 16 << 10,
            "task_size": 4 << 20,
            "compat_mode": CompatMode.AUTO,
            "auto_direct_io_read": False,
        }
        if version < "25.12":
            del self._values["auto_direct_io_read"]

    def set(self, key: str, value: Any) -> None:
        if key not in self._values:
            raise KeyError(key)
        if key == "num_threads":
            self._owner.resize_pool(int(value))
        if key == "compat_mode" and not isinstance(value, CompatMode):
            raise TypeError(f"compat_mode must be a kvikio.CompatMode, not {value!r}")
        self._values[key] = value

    def get(self, key: str) -> Any:
        return self._values[key]

    def is_compat_mode_preferred(self) -> bool:
        mode = self._values["compat_mode"]
        return mode is CompatMode.ON or (mode is CompatMode.AUTO and not self._owner.cufile_available)


class IOFuture:
    def __init__(self, run: Any = None, future: Future | None = None) -> None:
        self._run, self._future = run, future

    def get(self) -> int:
        if self._future is not None:
            return self._future.result()
        run, self._run = self._run, None
        return run()


class CuFile:
    def __init__(self, owner: FakeKvikio, file: str, flags: str = "r") -> None:
        if flags != "r":
            raise ValueError(f"this fake only reads, not flags={flags!r}")
        mode = owner.defaults.get("compat_mode")
        compat = owner.defaults.is_compat_mode_preferred()
        if not compat and (not owner.cufile_available or str(file) in owner.unregistrable):
            if mode is CompatMode.OFF:
                raise RuntimeError(f"cuFile error: cannot register {file} (CU_FILE_DRIVER_NOT_INITIALIZED)")
            compat = True  # AUTO: this file falls back to POSIX
        self._owner, self._fd, self.closed = owner, os.open(file, os.O_RDONLY), False
        self._cufile = not compat  # private, as in kvikio: no Python accessor

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0, task_size: int | None = None) -> IOFuture:
        iface = getattr(buf, "__cuda_array_interface__", None)
        if not isinstance(iface, dict):
            raise TypeError("buf must expose __cuda_array_interface__ (a device buffer)")
        ptr, _ = iface["data"]
        nbytes = _nbytes(iface)
        if iface.get("strides") is not None:
            raise ValueError("Array must be contiguous")
        if size is None:
            size = nbytes
        elif size > nbytes:
            raise ValueError("Size is greater than the size of the buffer")
        owner = self._owner
        owner.calls += 1
        small = size < owner.defaults.get("gds_threshold")
        cufile = self._cufile and not small

        def run() -> int:
            with owner.lock:
                owner.threads.add(threading.get_ident())
                if cufile:
                    owner.cufile_reads += 1
                else:
                    owner.posix_reads += 1
            time.sleep(owner.latency)
            view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
            got = os.preadv(self._fd, [view], file_offset)
            if got != size:
                raise RuntimeError(EOF_MESSAGE)
            return size

        if small:
            return IOFuture(run=run)
        return IOFuture(future=owner.pool().submit(run))

    def close(self) -> None:
        self._owner.close_calls += 1
        if not self.closed:
            os.close(self._fd)
            self.closed = True
            self._owner.closed += 1


def _nbytes(iface: dict[str, Any]) -> int:
    itemsize = {"|u1": 1, "|i1": 1, "<f2": 2, "<f4": 4, "<i8": 8}[iface["typestr"]]
    n = itemsize
    for dim in iface["shape"]:
        n *= dim
    return n


class FakeKvikio:
    """The module: ``kvikio.CuFile``, ``kvikio.defaults``, ``kvikio.CompatMode``. ``version``
    below "25.12" has no ``auto_direct_io_read``. ``cufile_available``: libcufile loads (AUTO then
    prefers cuFile); ``unregistrable``: paths cuFile cannot register. ``calls``: preads issued;
    ``cufile_reads`` / ``posix_reads``: how they were done; ``closed``: handles closed."""

    CompatMode = CompatMode

    def __init__(
        self,
        version: str = "26.10",
        latency: float = 0.0,
        cufile_available: bool = False,
        unregistrable: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.cufile_available = cufile_available
        self.unregistrable = {str(p) for p in unregistrable}
        self.lock = threading.Lock()
        self.cufile_reads = 0
        self.posix_reads = 0
        self.defaults = _Defaults(self, version)
        self.latency = latency
        self.threads: set[int] = set()  # threads that did a read
        self.calls = 0
        self.closed = 0  # handles closed
        self.close_calls = 0  # close() calls, a handle's repeated ones included
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 1

    def resize_pool(self, threads: int) -> None:
        if threads < 1:
            raise ValueError("number of threads must be a positive integer greater than zero")
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._pool_threads = threads

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._pool_threads, thread_name_prefix="kvikio-fake")
        return self._pool

    def CuFile(self, file: str, flags: str = "r") -> CuFile:  # noqa: N802 - kvikio's name
        return CuFile(self, file, flags)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def real_kvikio_or_skip() -> Any:
    """The installed kvikio, or a skip saying why it cannot be used (an incomplete wheel set
    fails inside libkvikio's loader with a RuntimeError, which pytest.importorskip lets through)."""
    try:
        return readers.import_kvikio()
    except ImportError as exc:
        pytest.skip(str(exc))
