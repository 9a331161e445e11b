"""Files appended front to back around the page cache (``O_DIRECT``), where the file system allows.

Why: a buffered write makes the kernel copy every byte into freshly allocated page-cache pages
and write them back later. On the 2-core benchmark VM that cost about 1 CPU-second per GB
(``copy_folio_from_iter_atomic`` was 29% of ``moment place``'s samples after pre-sampling; 1.2 GB
written buffered took 0.8-2.5 s of CPU, ``O_DIRECT`` 0.05 s), as much as the CSR rewrite's compute.
An ``O_DIRECT`` write moves the bytes from the caller's buffer to the device; the placed files are
``fsync``'ed before the manifest names them anyway, and the trainer reads SSD bins with
``O_DIRECT`` (so caching them helped no one; it only evicted other pages).

``O_DIRECT`` needs the buffer's address, the file offset and the length aligned to the device's
logical block (:data:`ALIGN` covers 512 B and 4 KiB devices): appended bytes are gathered into
page-aligned buffers, each full one written by the file's own thread while the next fills. At a
:meth:`AppendFile.flush` the aligned part goes direct and the tail (under one block) through an
ordinary descriptor, and stays in the buffer so the next direct write rewrites that block with
what follows. Where the file system refuses ``O_DIRECT`` (tmpfs), writes go straight through the
ordinary descriptor, as before.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from moment.gated_pool import GatedPool

ALIGN = 4096  # a multiple of every logical block size O_DIRECT may ask for
BUFFER_BYTES = 4 << 20  # each of a file's two buffers (a multiple of ALIGN)


def _open_direct(path: Path) -> int | None:
    """``path`` opened for O_DIRECT writes; None where the platform or file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


class AppendFile:
    """A file written front to back from byte ``start`` on (what is past it is cut off; a resumed
    bin keeps its first ``start`` bytes). :meth:`write` copies the bytes (the caller may reuse its
    buffer at once); :meth:`flush` writes everything appended so far; :meth:`sync` also makes it
    durable; :meth:`close` flushes and releases the buffers. ``size``: the bytes appended so far,
    ``start`` included. Not thread-safe: one writer."""

    def __init__(self, path: Path, start: int = 0, buffer_bytes: int = BUFFER_BYTES) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        os.ftruncate(self.fd, start)
        self.size = start
        self.direct = _open_direct(path)
        self.refused = False  # the file system took O_DIRECT at open, then refused a write
        self.direct_bytes = 0  # bytes written around the page cache
        self.base = start - start % ALIGN if self.direct is not None else start  # the buffer's file offset
        self.fill = 0  # bytes in the current buffer
        self._io: GatedPool | None = None
        self._pending: list[Future[None] | None] = [None, None]
        self._cur = 0
        self._buffers: list[mmap.mmap] = []
        if self.direct is not None:
            size = max(ALIGN, buffer_bytes - buffer_bytes % ALIGN)
            self._buffers = [mmap.mmap(-1, size) for _ in range(2)]  # page-aligned, as O_DIRECT wants
            self._io = GatedPool(1, "moment-direct")
            self.fill = start - self.base
            if self.fill:  # the partial block before `start`: rewritten whole with what follows
                with open(path, "rb", buffering=0) as fh:
                    fh.seek(self.base)
                    got = fh.readinto(memoryview(self._buffers[0])[: self.fill])
                if got != self.fill:
                    raise OSError(f"{path}: shorter than the {start} bytes it had")

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self.direct is None:
            _pwrite_all(self.fd, view, self.size - len(view))
            return
        src = np.frombuffer(view, dtype=np.uint8)
        while len(src):
            buf = self._buffers[self._cur]
            take = min(len(src), len(buf) - self.fill)
            into = np.frombuffer(buf, dtype=np.uint8)[self.fill : self.fill + take]
            into[...] = src[:take]  # numpy copies without the GIL: bins are filled by several threads at once
            del into  # the mmap stays closable
            self.fill += take
            src = src[take:]
            if self.fill == len(buf):
                self._write_buffer()

    def _write_buffer(self) -> None:
        """The full current buffer written by the file's thread; the other one becomes current
        once its own write is done."""
        assert self._io is not None and self.direct is not None
        self._pending[self._cur] = self._io.submit(self._put, memoryview(self._buffers[self._cur]), self.base)
        self.base += self.fill
        self.fill = 0
        self._cur ^= 1
        self._wait(self._cur)

    def _put(self, data: memoryview, offset: int) -> None:
        """Aligned bytes written direct; through the ordinary descriptor from the first time the
        file system refuses (EINVAL: it took the flag at open but not the write)."""
        if not self.refused:
            try:
                _pwrite_all(self.direct or self.fd, data, offset)
                self.direct_bytes += len(data)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.refused = True
        _pwrite_all(self.fd, data, offset)

    def _wait(self, which: int) -> None:
        job, self._pending[which] = self._pending[which], None
        if job is not None:
            job.result()

    def flush(self) -> None:
        """Every byte appended so far handed to the file system (not yet durable: :meth:`sync`)."""
        if self.direct is None:
            return
        self._wait(self._cur ^ 1)
        buf = memoryview(self._buffers[self._cur])
        whole = self.fill - self.fill % ALIGN
        if whole:
            self._put(buf[:whole], self.base)
        if self.fill > whole:  # under one block: through the page cache, kept for the next direct write
            _pwrite_all(self.fd, buf[whole : self.fill], self.base + whole)
            buf[: self.fill - whole] = bytes(buf[whole : self.fill])
        self.base += whole
        self.fill -= whole

    def sync(self) -> None:
        """Flush, then fsync (the buffered tails and the file's size)."""
        self.flush()
        os.fsync(self.fd)

    def close(self, flush: bool = True) -> None:
        """Flush (unless told not to: a run given up, which resumes from its last sync) and close,
        without an fsync; idempotent."""
        if self.fd < 0:
            return
        try:
            if flush:
                self.flush()
        finally:
            if self._io is not None:
                self._io.close()  # no write runs once the descriptors are closed (signals too)
            for fd in (self.fd, self.direct):
                if fd is not None:
                    os.close(fd)
            self.fd, self.direct = -1, None
            for buf in self._buffers:
                with contextlib.suppress(BufferError):  # a view still held (an exception's traceback): freed with it
                    buf.close()
            self._buffers = []
