"""The file reader: rows of plain files into host memory, coalesced preads from a thread pool.

:class:`FileReader` reads into host memory from a thread pool, each thread with the GIL
released: through its own io_uring ring, many reads in flight (:mod:`moment.uring`), or where
io_uring is blocked in a compiled loop of libc ``pread`` (:mod:`moment.preads`), or as a last
resort ``os.preadv`` per read (its ``engine``). With ``direct=True`` it uses ``O_DIRECT`` —
bypassing the page cache, whose memory the plan gave to the CPU tier — when the file system
accepts it and the rows are 512-byte aligned in size and buffer address; otherwise, or if the
kernel then refuses a read, it reads buffered. ``modes`` records what each file got.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moment.preads import native_preads
from moment.uring import Ring, uring_reads
from trainer.read_base import (
    DIRECT_ALIGN,
    MAX_RUN_BYTES,
    FileRef,
    ReadError,
    ReadRequest,
    ReadTask,
    _File,
    _finish_times,
    _pread_full,
    _Reader,
    _row_bytes,
    plan_runs,
)


class FileReader(_Reader):
    """Reads rows of plain files into host memory: coalesced preads from a thread pool.

    ``engine`` is how each thread reads a task's runs, all with the GIL released except the last:
    ``"io_uring"`` (a ring per thread, :data:`moment.uring.RING_ENTRIES` reads in flight each,
    :mod:`moment.uring`), ``"pread"`` (a compiled loop of blocking ``pread``, one in flight per
    thread, :mod:`moment.preads`) or ``"python"`` (``os.preadv`` per run). ``"auto"`` takes the
    first of them that works here (:func:`engine_refusal` says why one does not). A read that
    fails or comes up short is finished with ``os.preadv``, so its error names the file.
    ``preads`` counts the reads issued (a run of consecutive rows is one); ``modes`` maps each file
    to ``"direct"`` or ``"buffered"``, the mode its latest read used. Files are opened once and
    kept open until :meth:`close`."""

    route = "host"  # how SSD bytes reach a GPU: through host memory (the plan's ssd_reads: host)

    def __init__(
        self, threads: int = 16, direct: bool = True, max_run_bytes: int = MAX_RUN_BYTES, engine: str = "auto"
    ) -> None:
        super().__init__(threads, max_run_bytes, "moment-read")
        self.engine = pick_engine(engine)
        self._pread = native_preads() if self.engine == "pread" else None
        self._uring = uring_reads()[0] if self.engine == "io_uring" else None
        self._rings: list[Ring] = []
        self._local = threading.local()
        self.direct = direct
        self._files: dict[FileRef, _File] = {}

    def read(self, file: FileRef, rows: np.ndarray, out: np.ndarray) -> float:
        """Read ``rows`` (sorted, unique) of ``file`` into ``out``; returns the seconds taken."""
        return self.read_batch([ReadRequest(file, rows, out)])[0]

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[float]:
        """Serve all requests with their reads in flight together; returns, per request, the
        seconds from the start of the batch until its last row was in."""
        start = time.perf_counter()
        tasks = self._plan(requests)
        results = self._pool.run(self.issue, tasks)
        modes: dict[str, str] = {}
        for task, (_, _, _, mode) in zip(tasks, results):
            modes[task.name] = "buffered" if modes.get(task.name) == "buffered" else mode
        self.modes.update(modes)
        seconds, preads = _finish_times(start, len(requests), [r[:3] for r in results])
        self.preads += preads
        return seconds

    def close(self) -> None:
        """Stop its threads, then close the files this reader opened and its rings."""
        self._pool.shutdown()  # first: no read may be in flight on a file closed below
        for f in self._files.values():
            if f.owned:
                os.close(f.fd)
            if f.direct_fd is not None and f.direct_fd != f.fd:
                os.close(f.direct_fd)
        self._files.clear()
        for ring in self._rings:
            ring.close()
        self._rings.clear()
        self._local = threading.local()

    def opens_direct(self, file: FileRef) -> bool:
        """Whether ``file`` is open for O_DIRECT reads (the file system accepted the flag)."""
        return self._open(file).direct_fd is not None

    def _open(self, file: FileRef) -> _File:
        key = file if isinstance(file, int) else str(file)
        if key in self._files:
            return self._files[key]
        if isinstance(file, int):
            direct = bool(fcntl.fcntl(file, fcntl.F_GETFL) & os.O_DIRECT)
            f = _File(f"fd {file}", file, file if direct else None, owned=False)
        else:
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError as exc:
                raise ReadError(exc.errno, f"{file}: cannot open it: {exc.strerror}") from None
            f = _File(str(file), fd, self._open_direct(file), owned=True)
        self._files[key] = f
        return f

    def _open_direct(self, path: str | Path) -> int | None:
        if not self.direct or not hasattr(os, "O_DIRECT"):
            return None
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return None  # e.g. tmpfs: EINVAL; read buffered

    def plan_task(self, i: int, req: ReadRequest) -> ReadTask:
        """One request's reads, and whether they can go O_DIRECT."""
        rows = np.asarray(req.rows, dtype=np.int64)
        out = req.out
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise TypeError("out must be a writeable C-contiguous numpy array")
        row_bytes = _row_bytes(out.nbytes, rows.size)
        offsets, dests, sizes, pages = plan_runs(rows, row_bytes, self.max_run_bytes, req.base)
        f = self._open(req.file)
        address = out.ctypes.data
        direct = (
            f.direct_fd is not None
            and not f.direct_failed
            and row_bytes % DIRECT_ALIGN == 0
            and req.base % DIRECT_ALIGN == 0
            and address % DIRECT_ALIGN == 0
        )
        buffer = (memoryview(out.reshape(-1).view(np.uint8)), address)
        return ReadTask(i, f, f.name, direct, offsets, dests, sizes, buffer, pages)

    def issue(self, task: ReadTask) -> tuple[int, float, int, str]:
        """One task's preads: the compiled loop reads runs until one fails or comes up short;
        that run is finished here, where errors get the file's name; then the loop goes on."""
        f, native = task.file, self._pread
        direct = task.direct and not f.direct_failed
        i, n = 0, len(task.sizes)
        if self._uring is not None and n:
            got = self._ring_read(task, f.direct_fd if direct else f.fd)
            for k in np.flatnonzero(got != task.sizes).tolist():
                direct = self._finish_run(task, k, int(got[k]), direct)
            i = n
        while i < n:
            done = 0
            if native is not None:
                fd = f.direct_fd if direct else f.fd
                i, done = native(fd, task.buffer[1], task.offsets, task.dests, task.sizes, i)
                if i == n:
                    break
            direct = self._finish_run(task, i, done, direct)
            i += 1
        return task.request, time.perf_counter(), n, "direct" if direct else "buffered"

    def _ring_read(self, task: ReadTask, fd: int) -> np.ndarray:
        """All of a task's runs through this thread's ring: bytes each run got."""
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = Ring()
            self._rings.append(ring)  # list.append is atomic: threads may add at once
        if self._uring is None or ring.args is None:  # another engine, or the reader was closed
            raise ReadError(errno.EBADF, f"{task.name}: no open io_uring ring to read with")
        got = np.zeros(len(task.sizes), dtype=np.int64)
        if self._uring(*ring.args, fd, task.buffer[1], task.offsets, task.dests, task.sizes, got) != 0:
            self._local.ring = None
            ring.close()  # the kernel finishes or cancels what is in flight before the buffer is reused
            raise ReadError(errno.EIO, f"{task.name}: io_uring_enter kept failing; reads stopped")
        return got

    @staticmethod
    def _finish_run(task: ReadTask, i: int, done: int, direct: bool) -> bool:
        """Read run ``i`` of ``task`` from its byte ``done`` on, with ``os.preadv``; an error names
        the file, and an O_DIRECT refusal switches the file to buffered reads (returns whether
        reads stay direct)."""
        f = task.file
        fd = f.direct_fd if direct else f.fd
        dest, size, offset = int(task.dests[i]) + done, int(task.sizes[i]) - done, int(task.offsets[i]) + done
        view = task.buffer[0][dest : dest + size]
        try:
            got = os.preadv(fd, [view], offset)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise ReadError(exc.errno, f"{f.name}: {exc.strerror}") from None
            f.direct_failed, direct, fd = True, False, f.fd  # the device wants a larger alignment
            got = os.preadv(fd, [view], offset)
        if got != size:
            _pread_full(fd, view[got:], offset + got, f.name)
        return direct


READ_ENGINES = ("io_uring", "pread", "python")


def engine_refusal(engine: str) -> str | None:
    """Why the file reader's ``engine`` cannot run here, or None."""
    if engine == "io_uring":
        return uring_reads()[1] or None
    if engine == "pread" and native_preads() is None:
        return "the compiled pread loop cannot be built here (numba)"
    return None


# Replaces "auto" everywhere (trainer, feature store, benches): one of READ_ENGINES, e.g. pread where a
# sandbox's io_uring misbehaves in ways the probe cannot see.
ENGINE_ENV = "MOMENT_READ_ENGINE"


def pick_engine(engine: str) -> str:
    """``engine`` if it can run here (a ValueError saying why not otherwise); for "auto" the
    engine :data:`ENGINE_ENV` names where it is set, else the first of :data:`READ_ENGINES` that can."""
    if engine == "auto" and (forced := os.environ.get(ENGINE_ENV, "").strip()):
        if forced not in READ_ENGINES:
            raise ValueError(f"{ENGINE_ENV}={forced}: must be one of {', '.join(READ_ENGINES)}")
        return pick_engine(forced)
    if engine == "auto":
        return next(e for e in READ_ENGINES if engine_refusal(e) is None)
    if engine not in READ_ENGINES:
        raise ValueError(f"engine must be auto or one of {', '.join(READ_ENGINES)}, not {engine!r}")
    if (why := engine_refusal(engine)) is not None:
        raise ValueError(why)
    return engine
