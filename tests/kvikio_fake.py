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

Addresses here are host addresses (the reader's tests use CPU tensors in place of CUDA ones).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

EOF_MESSAGE = "POSIX error on pread: EOF"


class _Defaults:
    def __init__(self, owner: FakeKvikio, version: str) -> None:
        self._owner = owner
        self._values: dict[str, Any] = {
            "num_threads": 1,
            "gds_threshold": 16 << 10,
            "task_size": 4 << 20,
            "compat_mode": "ON",
            "auto_direct_io_read": False,
        }
        if version < "25.12":
            del self._values["auto_direct_io_read"]

    def set(self, key: str, value: Any) -> None:
        if key not in self._values:
            raise KeyError(key)
        if key == "num_threads":
            self._owner.resize_pool(int(value))
        self._values[key] = value

    def get(self, key: str) -> Any:
        return self._values[key]

    def is_compat_mode_preferred(self) -> bool:
        return self._values["compat_mode"] == "ON"


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
        self._owner, self._fd, self.closed = owner, os.open(file, os.O_RDONLY), False

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

        def run() -> int:
            owner.threads.add(threading.get_ident())
            time.sleep(owner.latency)
            view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
            got = os.preadv(self._fd, [view], file_offset)
            if got != size:
                raise RuntimeError(EOF_MESSAGE)
            return size

        if size < owner.defaults.get("gds_threshold"):
            return IOFuture(run=run)
        return IOFuture(future=owner.pool().submit(run))

    def close(self) -> None:
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
    """The module: ``kvikio.CuFile``, ``kvikio.defaults``. ``version`` below "25.12" has no
    ``auto_direct_io_read``. ``calls``: preads issued."""

    def __init__(self, version: str = "26.10", latency: float = 0.0) -> None:
        self.defaults = _Defaults(self, version)
        self.latency = latency
        self.threads: set[int] = set()  # threads that did a read
        self.calls = 0
        self.closed = 0
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
