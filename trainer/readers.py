"""Readers of feature rows from SSD bin files, for the tiered feature store.

A read is a batch of requests, each "these rows of this file into this buffer": ``rows`` are row
numbers within the bin file, sorted ascending and unique, and the buffer holds ``len(rows)``
rows back to back. Runs of consecutive rows become one read, and the requests of all bins are in
flight together, so every SSD has work queued at once (the plan counts on the SSDs reading in
parallel).

* :class:`FileReader` reads into host memory from a thread pool, each thread with the GIL
  released: through its own io_uring ring, many reads in flight (:mod:`moment.uring`), or where
  io_uring is blocked in a compiled loop of libc ``pread`` (:mod:`moment.preads`), or as a last
  resort ``os.preadv`` per read (its ``engine``). With ``direct=True`` it uses ``O_DIRECT`` —
  bypassing the page cache, whose memory the plan gave to the CPU tier — when the file system
  accepts it and the rows are 512-byte aligned in size and buffer address; otherwise, or if the
  kernel then refuses a read, it reads buffered. ``modes`` records what each file got.
* :class:`KvikioReader` reads straight into GPU memory with kvikio (GPUDirect Storage when the
  system has it, kvikio's POSIX compat mode otherwise). kvikio is imported only when one is made,
  and configured explicitly (:func:`configure_kvikio`), because its defaults changed under us:
  since 25.04 a read of ``gds_threshold`` = 16 KiB or more (not 1 MiB) goes to kvikio's own
  thread pool, which has ``num_threads`` = 1 thread unless told otherwise, and compat-mode reads
  go through the page cache unless ``auto_direct_io_read`` (kvikio ≥ 25.12) is on. The reader
  sets ``num_threads`` to its own thread count, ``gds_threshold`` to :data:`GDS_THRESHOLD` and
  ``auto_direct_io_read`` on; ``config`` records what kvikio then reports. Its reads are planned
  as the file reader's and issued from a thread pool too: a read below the threshold runs in the
  calling thread when its future is waited for (``IOFuture.get`` releases the GIL). Each run is
  passed as a raw device pointer (:class:`DeviceSpan`), not a tensor slice: a slice plus torch's
  ``__cuda_array_interface__`` cost ~5 µs of GIL per run.

:class:`Reader` is what the feature store needs of a reader; :data:`READERS` names each reader
(``--io``'s choices and help come from it), and :func:`make_reader` picks one: a name forces that
reader; ``io="auto"`` takes, on a CUDA device, whichever reader that can run here a short probe of
the caller's files (:func:`probe_io`) measured fastest — what is installed does not decide it —
and the file reader otherwise. Adding a reader (SPDK, say) is a class with the
:class:`Reader` interface and one :data:`READERS` entry.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from moment.errors import MomentError
from moment.preads import native_preads
from moment.ssd_reads import pages_read
from moment.uring import Ring, uring_reads

# O_DIRECT needs file offsets, sizes and buffer addresses aligned to the device's logical block.
DIRECT_ALIGN = 512
# Fewer runs than this are not worth a task of their own (a task costs tens of microseconds).
MIN_RUNS_PER_TASK = 8
# Tasks per thread: threads that finish early take the remaining ones, so the last reads of a
# batch do not queue behind one slow thread.
TASKS_PER_THREAD = 4
# Longer runs are split so that one long sequential stretch still spreads over the threads.
MAX_RUN_BYTES = 4 << 20

FileRef = str | Path | int


class ReadError(MomentError, OSError):
    """A bin file could not be opened or read: one line naming the file (a MomentError, so the
    trainer prints it without a traceback, also when it was raised in the prefetch thread) and
    an OSError with its errno, for callers that handle I/O errors (``io=auto``'s probe)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass
class ReadRequest:
    """Rows (sorted, unique row numbers of one bin file) to read into ``out`` back to back."""

    file: FileRef
    rows: np.ndarray
    out: Any  # FileReader: a C-contiguous numpy array; KvikioReader: a contiguous CUDA tensor


class Reader(Protocol):
    """What the feature store asks of an SSD reader."""

    on_device: bool  # reads into GPU memory (``out`` buffers are CUDA tensors), else host memory
    preads: int  # read calls issued so far
    modes: dict[str, str]  # file → how it is read ("direct", "buffered"; kvikio: see kvikio_mode)
    read_bytes: dict[str, int]  # file → bytes of the pages its reads touched so far (moment.ssd_reads.pages_read)
    route: str  # how SSD bytes reach a GPU: "host" (through host memory) or "direct" (GPUDirect Storage)
    probe: dict[str, float]  # seconds per reader of the probe io=auto chose it by (empty otherwise)

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[float]:
        """Serve all requests, reads in flight together; per request the seconds from the start
        of the batch until its last row was in."""
        ...

    def close(self) -> None:
        """Release files and threads."""
        ...


def coalesce(rows: np.ndarray, max_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of consecutive rows as (first row in the file, first position in the buffer, rows),
    runs longer than ``max_rows`` split."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    pos = np.flatnonzero(np.diff(rows) != 1) + 1
    pos = np.concatenate(([0], pos))
    counts = np.diff(np.append(pos, rows.size))
    if max_rows is not None and counts.max() > max_rows:
        pieces = -(-counts // max_rows)
        run = np.repeat(np.arange(pos.size), pieces)
        k = np.arange(run.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        pos = pos[run] + k * max_rows
        counts = np.minimum(counts[run] - k * max_rows, max_rows)
    return rows[pos], pos, counts


def _check_rows(rows: np.ndarray) -> None:
    if rows.size > 1 and not (np.diff(rows) > 0).all():
        raise ValueError("rows must be sorted ascending and unique")
    if rows.size and rows[0] < 0:
        raise ValueError(f"row {int(rows[0])} is negative")


@dataclass
class _File:
    name: str
    fd: int
    direct_fd: int | None  # None: O_DIRECT refused by the file system, or not asked for
    owned: bool
    direct_failed: bool = False  # a direct read was refused (EINVAL): read buffered from then on


@dataclass
class ReadTask:
    """Reads for one request, in bytes: file offsets, offsets in the buffer, sizes (all of the
    request's runs, or a slice of them)."""

    request: int
    file: Any  # FileReader: a _File; KvikioReader: a kvikio CuFile
    name: str
    direct: bool  # FileReader: O_DIRECT; KvikioReader: kvikio prefers cuFile (GDS) for the file
    offsets: np.ndarray  # int64, as are dests and sizes
    dests: np.ndarray
    sizes: np.ndarray
    buffer: Any = field(repr=False)  # (the buffer: a memoryview or a CUDA tensor, its address)


def _runs_in_bytes(rows: np.ndarray, row_bytes: int, max_run_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first, pos, counts = coalesce(rows, max(1, max_run_bytes // max(row_bytes, 1)))
    return first * row_bytes, pos * row_bytes, counts * row_bytes


def _tasks(requests: list[ReadTask], threads: int) -> list[ReadTask]:
    """Split each request's runs (one task holding them all) into about ``TASKS_PER_THREAD ×
    threads`` tasks in all, interleaved across requests so that every file is read from the start."""
    total = sum(len(r.sizes) for r in requests)
    step = max(MIN_RUNS_PER_TASK, -(-total // (threads * TASKS_PER_THREAD)))
    per_request = [
        [
            replace(r, offsets=r.offsets[s : s + step], dests=r.dests[s : s + step], sizes=r.sizes[s : s + step])
            for s in range(0, len(r.offsets), step)
        ]
        for r in requests
    ]
    return _interleave(per_request)


class _Pool:
    """A lazily started thread pool running a reader's tasks (inline for one task or thread)."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {threads}")
        self.threads, self._name = threads, name
        self._pool: ThreadPoolExecutor | None = None

    def run(self, do: Any, tasks: list[ReadTask]) -> list[Any]:
        if len(tasks) <= 1 or self.threads == 1:
            return [do(t) for t in tasks]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
        return list(self._pool.map(do, tasks))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _finish_times(start: float, n: int, results: list[tuple[int, float, int]]) -> tuple[list[float], int]:
    """Per request, seconds from ``start`` until its last task ended; and the reads issued."""
    done = [start] * n
    preads = 0
    for request, finished, count in results:
        done[request] = max(done[request], finished)
        preads += count
    return [d - start for d in done], preads


def _pread_full(fd: int, view: memoryview, offset: int, name: str) -> None:
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise ReadError(errno.EIO, f"{name}: unexpected end of file at byte {offset}")
        view, offset = view[got:], offset + got


class _Reader:
    """What both readers share: planning a batch's reads (and counting the pages they touch, in
    ``read_bytes``: what the SSD moves, whole pages, however few bytes of them a row needs),
    closing, also as a context manager."""

    threads: int
    read_bytes: dict[str, int]

    def plan_task(self, i: int, req: ReadRequest) -> ReadTask:
        raise NotImplementedError

    def _plan(self, requests: Sequence[ReadRequest]) -> list[ReadTask]:
        planned = [self.plan_task(i, req) for i, req in enumerate(requests)]
        for task in planned:  # one task per request yet: its runs sorted, each page counted once
            self.read_bytes[task.name] = self.read_bytes.get(task.name, 0) + pages_read(task.offsets, task.sizes)
        return _tasks(planned, self.threads)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    on_device = False
    route = "host"  # how SSD bytes reach a GPU: through host memory (the plan's ssd_reads: host)

    def __init__(
        self, threads: int = 16, direct: bool = True, max_run_bytes: int = MAX_RUN_BYTES, engine: str = "auto"
    ) -> None:
        self._pool = _Pool(threads, "moment-read")
        self.engine = pick_engine(engine)
        self._pread = native_preads() if self.engine == "pread" else None
        self._uring = uring_reads()[0] if self.engine == "io_uring" else None
        self._rings: list[Ring] = []
        self._local = threading.local()
        self.threads = threads
        self.direct = direct
        self.max_run_bytes = max_run_bytes
        self.preads = 0
        self.probe: dict[str, float] = {}  # seconds per reader, when io=auto chose by a probe
        self.modes: dict[str, str] = {}
        self.read_bytes: dict[str, int] = {}
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
        """Close the files this reader opened and stop its threads."""
        for f in self._files.values():
            if f.owned:
                os.close(f.fd)
            if f.direct_fd is not None and f.direct_fd != f.fd:
                os.close(f.direct_fd)
        self._files.clear()
        self._pool.shutdown()
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

    def _open_direct(self, path: FileRef) -> int | None:
        if not self.direct or not hasattr(os, "O_DIRECT"):
            return None
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return None  # e.g. tmpfs: EINVAL; read buffered

    def plan_task(self, i: int, req: ReadRequest) -> ReadTask:
        """One request's reads, and whether they can go O_DIRECT."""
        rows = np.asarray(req.rows, dtype=np.int64)
        _check_rows(rows)
        out = req.out
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise TypeError("out must be a writeable C-contiguous numpy array")
        row_bytes = _row_bytes(out.nbytes, rows.size)
        f = self._open(req.file)
        direct = (
            f.direct_fd is not None
            and not f.direct_failed
            and row_bytes % DIRECT_ALIGN == 0
            and out.ctypes.data % DIRECT_ALIGN == 0
        )
        offsets, dests, sizes = _runs_in_bytes(rows, row_bytes, self.max_run_bytes)
        buffer = (memoryview(out.reshape(-1).view(np.uint8)), out.ctypes.data)
        return ReadTask(i, f, f.name, direct, offsets, dests, sizes, buffer)

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


def _row_bytes(nbytes: int, rows: int) -> int:
    if rows and (nbytes == 0 or nbytes % rows):
        raise ValueError(f"out holds {nbytes} bytes: not a whole number of {rows} rows")
    return nbytes // max(rows, 1)


def _interleave(groups: list[list[ReadTask]]) -> list[ReadTask]:
    """Round-robin over the groups: a0 b0 a1 b1 a2."""
    longest = max((len(g) for g in groups), default=0)
    return [g[k] for k in range(longest) for g in groups if k < len(g)]


# kvikio's GDS threshold since 25.04 (it was 1 MiB before): reads of this many bytes or more go
# through cuFile (GPUDirect Storage) and kvikio's pool; smaller ones through its POSIX path.
GDS_THRESHOLD = 16 << 10
# ``routes`` key of reads at or above the threshold of files kvikio opened under its AUTO compat
# mode with cuFile available: cuFile, unless registering that file failed and kvikio fell back
# to POSIX. kvikio decides that per file at open, and its Python API (26.x) does not say which:
# ``CuFile`` binds no ``get_compat_mode_manager``.
UNREPORTED = "gds_or_posix"


class DeviceSpan:
    """``size`` bytes at device address ``ptr``, as kvikio's ``pread`` takes a buffer (anything
    with a ``__cuda_array_interface__``): built from an integer, so a run costs no tensor slice
    and no call of torch's interface property, which rebuilds its dict every time."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (size,), "typestr": "|u1", "version": 3}


def configure_kvikio(kvikio: Any, threads: int) -> dict[str, Any]:
    """Set kvikio's pool to ``threads`` threads, its GDS threshold to :data:`GDS_THRESHOLD` and
    direct (O_DIRECT) compat-mode reads on, where the installed version has the setting; return
    what kvikio reports afterwards (``auto_direct_io_read`` False where it has no such setting:
    compat-mode reads then go through the page cache)."""
    defaults = kvikio.defaults
    wanted = {"num_threads": threads, "gds_threshold": GDS_THRESHOLD, "auto_direct_io_read": True}
    if hasattr(defaults, "set"):  # kvikio ≥ 25.04: set(key, value) / get(key)
        for key, value in wanted.items():
            with contextlib.suppress(KeyError):  # a setting this version does not have
                defaults.set(key, value)
        got = {key: _kvikio_get(defaults, key) for key in wanted}
    else:  # older: <name>_reset(value) and a getter per setting
        defaults.num_threads_reset(threads)
        defaults.gds_threshold_reset(GDS_THRESHOLD)
        getter = getattr(defaults, "get_num_threads", None) or defaults.num_threads
        got = {"num_threads": getter(), "gds_threshold": defaults.gds_threshold(), "auto_direct_io_read": None}
    got["auto_direct_io_read"] = bool(got["auto_direct_io_read"])
    return got


def _kvikio_get(defaults: Any, key: str) -> Any:
    try:
        return defaults.get(key)
    except KeyError:
        return None


class KvikioReader(_Reader):
    """Reads rows straight into GPU memory with kvikio (GPUDirect Storage, or its compat mode).

    ``out`` buffers are contiguous CUDA tensors. Runs of rows are planned as in
    :class:`FileReader` and each thread of a pool issues its runs' ``CuFile.pread`` and waits for
    them (see the module's docstring for why not kvikio's own pool alone). ``module`` replaces
    the kvikio module (tests); ``device_type`` is the kind of tensor ``out`` must be. ``config``
    is kvikio's configuration as set (:func:`configure_kvikio`). ``modes`` maps each file to
    what kvikio's compat setting at its open says of it (:func:`kvikio_mode`); ``routes`` counts
    the reads by path, only as far as kvikio lets it be known: ``posix`` (below the GDS threshold,
    or of a file in compat mode), ``gds`` (at or above it, of a file kvikio must read through
    cuFile: compat mode OFF), and :data:`UNREPORTED` (at or above it, of a file opened under AUTO
    with cuFile available; the key appears once there is such a read)."""

    on_device = True
    device_type = "cuda"

    def __init__(self, threads: int = 16, max_run_bytes: int = MAX_RUN_BYTES, module: Any = None) -> None:
        if module is None:
            if not torch.cuda.is_available():
                raise RuntimeError("KvikioReader needs CUDA")
            module = import_kvikio()
        self._kvikio = module
        self.config = configure_kvikio(module, threads)
        self.mode = kvikio_mode(module)
        self._pool = _Pool(threads, "moment-kvikio")
        self.threads = threads
        self.max_run_bytes = max_run_bytes
        self.preads = 0
        self.probe: dict[str, float] = {}  # seconds per reader, when io=auto chose by a probe
        self.modes: dict[str, str] = {}
        self.read_bytes: dict[str, int] = {}
        self.routes = {"posix": 0, "gds": 0}
        self._files: dict[str, Any] = {}

    @property
    def route(self) -> str:
        """How SSD bytes reach the GPU: ``host`` (compat mode: a bounce buffer in host memory) or
        ``direct`` (kvikio prefers cuFile, i.e. GPUDirect Storage: only reads of ``gds_threshold``
        bytes or more take it, and under AUTO not those of a file cuFile could not register)."""
        return "host" if self.mode == "kvikio-compat" else "direct"

    def read(self, file: FileRef, rows: np.ndarray, out: torch.Tensor) -> float:
        """Read ``rows`` (sorted, unique) of ``file`` into the CUDA tensor ``out``."""
        return self.read_batch([ReadRequest(file, rows, out)])[0]

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[float]:
        """Serve all requests with their reads in flight together; seconds per request as FileReader."""
        start = time.perf_counter()
        tasks = self._plan(requests)
        results = self._pool.run(self.issue, tasks)
        seconds, preads = _finish_times(start, len(requests), results)
        self.preads += preads
        threshold = self.config["gds_threshold"]
        for task in tasks:
            large = int((task.sizes >= threshold).sum())
            self.routes["posix"] += len(task.sizes) - large  # below the threshold: POSIX in every mode
            route = {"kvikio-gds": "gds", "kvikio-compat": "posix"}.get(self.modes.get(task.name, ""), UNREPORTED)
            if large or route in self.routes:
                self.routes[route] = self.routes.get(route, 0) + large
        return seconds

    def close(self) -> None:
        """Stop the threads; deregister and close every file, once (a second call does nothing).

        The trainer calls this when training ends (``trainer.loop.train``'s ``finally``), not at
        interpreter exit, so cuFile handles are deregistered while CUDA is up. It is hygiene, not
        a fix for the segfault at exit with GDS active (rapidsai/kvikio#497, cuFile's, on CUDA
        12): what that thread reports avoids it is ``"profile": {"cufile_stats": 0}`` in
        cufile.json, compat mode (``KVIKIO_COMPAT_MODE=ON``), or CUDA 13.0 ("fixed in CUDA-13.0",
        NVIDIA); README says the same under ``--io``."""
        self._pool.shutdown()
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def plan_task(self, i: int, req: ReadRequest) -> ReadTask:
        rows = np.asarray(req.rows, dtype=np.int64)
        _check_rows(rows)
        if isinstance(req.file, int):
            raise TypeError("KvikioReader reads files by path, not by descriptor")
        out = req.out
        if not (isinstance(out, torch.Tensor) and out.device.type == self.device_type and out.is_contiguous()):
            raise TypeError(f"out must be a contiguous {self.device_type.upper()} tensor")
        name = str(req.file)
        nbytes = out.numel() * out.element_size()
        offsets, dests, sizes = _runs_in_bytes(rows, _row_bytes(nbytes, rows.size), self.max_run_bytes)
        handle = self._handle(name) if rows.size else None
        gds = self.modes.get(name) == "kvikio-gds"  # known to be read through cuFile
        # The buffer travels as the tensor (kept alive until the reads are done) and its address.
        return ReadTask(i, handle, name, gds, offsets, dests, sizes, (out, out.data_ptr()))

    def issue(self, task: ReadTask) -> tuple[int, float, int]:
        """Issue a task's reads, then wait for each (a small read is done in this thread, in
        ``get``). kvikio never reads short: at the end of the file it raises; that becomes an
        OSError naming the file, after every read issued has ended (none writes into the buffer
        after this returns)."""
        handle, base, span = task.file, task.buffer[1], DeviceSpan
        offsets, sizes = task.offsets.tolist(), task.sizes.tolist()
        futures: list[Any] = []
        failed: tuple[int, int, Exception] | None = None
        try:
            for offset, dest, size in zip(offsets, task.dests.tolist(), sizes):
                futures.append(handle.pread(span(base + dest, size), size, offset))
        except RuntimeError as exc:  # e.g. a cuFile error at submission: wait for those issued first
            failed = (sizes[len(futures)], offsets[len(futures)], exc)
        for future, size, offset in zip(futures, sizes, offsets):
            try:
                future.get()
            except RuntimeError as exc:
                failed = failed or (size, offset, exc)
        if failed is not None:
            size, offset, exc = failed
            raise ReadError(errno.EIO, f"{task.name}: reading {size} bytes at byte {offset}: {exc}")
        return task.request, time.perf_counter(), len(futures)

    def _handle(self, name: str) -> Any:
        if name not in self._files:
            try:
                self._files[name] = self._kvikio.CuFile(name, "r")
            except (RuntimeError, OSError) as exc:  # e.g. cuFile cannot register it (compat mode OFF, kvikio ≤ 24.12)
                raise ReadError(errno.EIO, f"{name}: kvikio cannot open it: {exc}") from None
            self.modes[name] = kvikio_mode(self._kvikio)  # read at open, as kvikio does for the file
        return self._files[name]


def import_kvikio() -> Any:
    """The kvikio module (the optional GPU extra; imported only here). Any failure of the import
    is an ImportError: an incomplete wheel set fails inside libkvikio's loader with a RuntimeError
    (cuda.pathfinder's DynamicLibNotFoundError for a missing libcufile) or an OSError (ctypes)."""
    try:
        import kvikio
        import kvikio.defaults  # a submodule kvikio's __init__ does not import (26.10): the reader configures it
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 (whatever the loader raises means "not usable here")
        raise ImportError(f"kvikio cannot be loaded: {type(exc).__name__}: {exc}") from exc
    return kvikio


def kvikio_mode(kvikio: Any) -> str:
    """What kvikio's compat setting says of a file it opens now: "kvikio-compat" (every read
    POSIX), "kvikio-gds" (reads of ``gds_threshold`` or more through cuFile: compat mode OFF,
    where a file cuFile cannot register fails to open) or "kvikio-auto" (AUTO with cuFile
    available: cuFile unless registering the file fails, and then POSIX; kvikio decides that per
    file at open — compat_mode_manager.cpp — and does not say which: its Python ``CuFile`` has
    no such query in 26.x). Reads below the threshold are POSIX in every mode (``routes``)."""
    defaults = kvikio.defaults
    get = getattr(defaults, "get", None)  # kvikio ≥ 25.04; before, a compat_mode() getter
    mode = get("compat_mode") if get is not None else defaults.compat_mode()
    name = getattr(mode, "name", None)  # a CompatMode enum (ON, OFF, AUTO) or, before 24.10, a bool
    if name is None:
        return "kvikio-compat" if mode else "kvikio-gds"
    if name == "AUTO":
        preferred = getattr(defaults, "is_compat_mode_preferred", None)  # AUTO without cuFile: compat
        return "kvikio-compat" if preferred is not None and preferred() else "kvikio-auto"
    return {"ON": "kvikio-compat", "OFF": "kvikio-gds"}[name]


def kvikio_refusal(cuda: bool) -> str | None:
    """Why ``io="kvikio"`` cannot work here, as a phrase starting with "kvikio"; None when it
    can. ``cuda``: the device is a GPU and CUDA is available. kvikio is looked up, not imported."""
    if not cuda:
        return "kvikio reads into GPU memory: it needs CUDA"
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed (pip install 'moment[gpu]')"
    return None


@dataclass(frozen=True)
class ReaderKind:
    """One ``--io`` choice: how to make the reader, what it does, why it cannot run here."""

    make: Callable[[int, bool], Reader]  # (threads, direct) → a reader; ImportError when a module is missing
    on_device: bool
    about: str  # for the help text
    refusal: Callable[[bool], str | None] = lambda cuda: None  # (device is CUDA) → why not, or None


READERS: dict[str, ReaderKind] = {
    "posix": ReaderKind(
        lambda threads, direct: FileReader(threads=threads, direct=direct), False, "preads into pinned host memory"
    ),
    "kvikio": ReaderKind(
        lambda threads, direct: KvikioReader(threads=threads),
        True,
        "into GPU memory (GPUDirect Storage or its compat mode)",
        kvikio_refusal,
    ),
}
IO_CHOICES = ("auto", *READERS)


def io_help() -> str:
    """``--io``'s help text, from :data:`READERS`."""
    kinds = ", ".join(f"{name} {kind.about}" for name, kind in READERS.items())
    return f"how SSD bins are read: {kinds}, or auto: on CUDA, whichever of them a short read probe of the SSD bins measures fastest (default)"


def io_refusal(io: str, cuda: bool) -> str | None:
    """Why reader ``io`` cannot work here (a phrase starting with its name), or None; ``cuda``:
    the device is a GPU and CUDA is available. "auto" always works."""
    return None if io == "auto" else READERS[io].refusal(cuda)


# A probe reads about this many bytes per candidate reader (a few milliseconds on NVMe).
PROBE_BYTES = 4 << 20


def probe_io(readers: dict[str, Reader], files: Sequence[tuple[FileRef, int]], seed: int = 0) -> dict[str, float]:
    """Seconds each reader took to read the same amount of random rows (different rows per reader,
    so none reads from the page cache another one filled) spread over ``files`` — (path, row
    bytes) pairs — best of two rounds. What :func:`make_reader` chooses ``io="auto"`` by."""
    rng = np.random.default_rng(seed)
    sizes = [(f, rb, os.stat(f).st_size // rb) for f, rb in files if rb > 0 and os.stat(f).st_size >= rb]
    if not sizes:
        return {}
    per_file = max(1, PROBE_BYTES // sum(rb for _, rb, _ in sizes))  # rows per file: PROBE_BYTES in all
    seconds: dict[str, float] = {}
    for name, reader in readers.items():
        best = float("inf")
        for _ in range(2):
            requests = []
            for f, rb, n in sizes:
                rows = np.unique(rng.integers(0, n, min(per_file, n)))
                if reader.on_device:
                    out: Any = torch.empty(
                        (rows.size, rb), dtype=torch.uint8, device=getattr(reader, "device_type", "cuda")
                    )
                else:
                    out = _aligned_rows(rows.size, rb)
                requests.append(ReadRequest(f, rows, out))
            start = time.perf_counter()
            reader.read_batch(requests)
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
    return seconds


def _aligned_rows(rows: int, row_bytes: int) -> np.ndarray:
    """A (rows, row_bytes) uint8 array at a DIRECT_ALIGN boundary, so O_DIRECT can read into it."""
    raw = np.empty(rows * row_bytes + DIRECT_ALIGN, dtype=np.uint8)
    skew = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skew : skew + rows * row_bytes].reshape(rows, row_bytes)


def make_reader(
    device: str | torch.device,
    threads: int = 16,
    direct: bool = True,
    io: str = "auto",
    probe: Sequence[tuple[FileRef, int]] | None = None,
) -> Reader:
    """The reader for ``device``: a name of :data:`READERS`: that reader, or an error saying why
    not; ``io="auto"``: on a CUDA device with ``probe`` files — (path, row bytes) pairs, the SSD
    bins — whichever reader that can be made here :func:`probe_io` measured fastest (its figures
    in the reader's ``probe``), plain file reads otherwise."""
    if io not in IO_CHOICES:
        raise ValueError(f"io must be one of {', '.join(IO_CHOICES)}, not {io!r}")
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if (why := io_refusal(io, cuda)) is not None:
        raise ValueError(f"{why} (device {device})")
    if io != "auto":
        try:
            reader = READERS[io].make(threads, direct)
        except ImportError as exc:
            raise ValueError(f"{io} cannot be imported: {exc}") from None
        if reader.on_device and getattr(reader, "route", "direct") == "host":
            # The first GPU run measured 0.05 of raw random reads for kvikio in compat mode on
            # 128-byte rows (a bounce and a copy per run of rows), 0.57 for posix.
            print(
                f"warning: --io {io}: no GPUDirect Storage here (kvikio's compat mode): every run of rows "
                "bounces through host memory on its own, much slower than --io posix for small rows; "
                "--io auto measures both and takes the faster",
                file=sys.stderr,
            )
        return reader
    posix = READERS["posix"].make(threads, direct)
    if not cuda or not probe:
        return posix
    candidates: dict[str, Reader] = {"posix": posix}
    for name, kind in READERS.items():
        if name in candidates or kind.refusal(cuda) is not None:
            continue
        try:
            candidates[name] = kind.make(threads, direct)
        except (ImportError, OSError, RuntimeError) as exc:  # e.g. libkvikio's ctypes load: OSError
            print(f"warning: io=auto: the {name} reader cannot be made ({exc}): not used", file=sys.stderr)
    return choose_reader(candidates, probe) if len(candidates) > 1 else posix


def choose_reader(readers: dict[str, Reader], probe: Sequence[tuple[FileRef, int]]) -> Reader:
    """The reader that read ``probe``'s files fastest (the first one when nothing could be
    measured), the others closed; its ``probe`` attribute holds every reader's seconds."""
    seconds: dict[str, float] = {}
    for k, (name, reader) in enumerate(readers.items()):
        try:
            seconds.update(probe_io({name: reader}, probe, seed=k))  # rows of its own: no page-cache hits
        except (OSError, RuntimeError) as exc:  # e.g. cuFile cannot register the files: not a candidate
            print(f"warning: io=auto: {name} reader failed its probe ({exc}): not used", file=sys.stderr)
            seconds[name] = float("inf")
    best = min(seconds, key=seconds.__getitem__) if seconds else next(iter(readers))
    for name, reader in readers.items():
        if name != best:
            reader.close()
    chosen = readers[best]
    chosen.probe = seconds  # type: ignore[attr-defined]
    return chosen
