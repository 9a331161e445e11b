"""Readers of feature rows from SSD bin files, for the tiered feature store.

A read is a batch of requests, each "these rows of this file into this buffer": ``rows`` are row
numbers within the bin file, sorted ascending and unique, and the buffer holds ``len(rows)``
rows back to back. Runs of consecutive rows become one read, and the requests of all bins are in
flight together, so every SSD has work queued at once (the plan counts on the SSDs reading in
parallel).

* :class:`FileReader` reads into host memory with ``os.preadv`` from a thread pool (preadv
  releases the GIL). With ``direct=True`` it uses ``O_DIRECT`` — bypassing the page cache, whose
  memory the plan gave to the CPU tier — when the file system accepts it and the rows are
  512-byte aligned in size and buffer address; otherwise, or if the kernel then refuses a read,
  it reads buffered. ``modes`` records what each file got.
* :class:`KvikioReader` reads straight into GPU memory with kvikio (GPUDirect Storage when the
  system has it, kvikio's POSIX compat mode otherwise). kvikio is imported only when one is made.
  Its reads are planned as the file reader's and issued from a thread pool too: kvikio sends a
  read below its GDS threshold (1 MiB by default), which is what a run of feature rows usually
  is, through a synchronous POSIX path in the calling thread (``CuFile.pread`` releases the GIL),
  and its own pool has one thread unless ``KVIKIO_NTHREADS`` says otherwise.

:class:`Reader` is what the feature store needs of a reader; :data:`READERS` names each reader
(``--io``'s choices and help come from it), and :func:`make_reader` picks one: ``io="auto"``
takes a reader into GPU memory for a CUDA device when it can be made (kvikio installed), the file
reader otherwise; a name forces that reader. Adding a reader (io_uring, say) is a class with the
:class:`Reader` interface and one :data:`READERS` entry.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

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
    modes: dict[str, str]  # file → how its latest read went (e.g. "direct", "buffered", "kvikio-gds")

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
class _Task:
    """Reads for one request, in bytes: file offsets, offsets in the buffer, sizes (all of the
    request's runs, or a slice of them)."""

    request: int
    file: Any  # FileReader: a _File; KvikioReader: a kvikio CuFile
    name: str
    direct: bool
    offsets: list[int]
    dests: list[int]
    sizes: list[int]
    buffer: Any = field(repr=False)  # FileReader: a memoryview; KvikioReader: a flat uint8 CUDA tensor


def _runs_in_bytes(rows: np.ndarray, row_bytes: int, max_run_bytes: int) -> tuple[list[int], list[int], list[int]]:
    first, pos, counts = coalesce(rows, max(1, max_run_bytes // max(row_bytes, 1)))
    return (first * row_bytes).tolist(), (pos * row_bytes).tolist(), (counts * row_bytes).tolist()


def _tasks(requests: list[_Task], threads: int) -> list[_Task]:
    """Split each request's runs (one task holding them all) into about ``TASKS_PER_THREAD ×
    threads`` tasks in all, interleaved across requests so that every file is read from the start."""
    total = sum(len(r.sizes) for r in requests)
    step = max(MIN_RUNS_PER_TASK, -(-total // (threads * TASKS_PER_THREAD)))
    per_request = [
        [replace(r, offsets=r.offsets[s : s + step], dests=r.dests[s : s + step], sizes=r.sizes[s : s + step])
         for s in range(0, len(r.offsets), step)]
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

    def run(self, do: Any, tasks: list[_Task]) -> list[Any]:
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
            raise OSError(errno.EIO, f"{name}: unexpected end of file at byte {offset}")
        view, offset = view[got:], offset + got


class _Reader:
    """What both readers share: closing, also as a context manager."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileReader(_Reader):
    """Reads rows of plain files into host memory: coalesced preads from a thread pool.

    ``preads`` counts the read calls issued (a run of consecutive rows is one); ``modes`` maps
    each file to ``"direct"`` or ``"buffered"``, the mode its latest read used. Files are opened
    once and kept open until :meth:`close`."""

    on_device = False

    def __init__(self, threads: int = 16, direct: bool = True, max_run_bytes: int = MAX_RUN_BYTES) -> None:
        self._pool = _Pool(threads, "moment-read")
        self.threads = threads
        self.direct = direct
        self.max_run_bytes = max_run_bytes
        self.preads = 0
        self.modes: dict[str, str] = {}
        self._files: dict[FileRef, _File] = {}

    def read(self, file: FileRef, rows: np.ndarray, out: np.ndarray) -> float:
        """Read ``rows`` (sorted, unique) of ``file`` into ``out``; returns the seconds taken."""
        return self.read_batch([ReadRequest(file, rows, out)])[0]

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[float]:
        """Serve all requests with their reads in flight together; returns, per request, the
        seconds from the start of the batch until its last row was in."""
        start = time.perf_counter()
        tasks = _tasks([self._runs(i, req) for i, req in enumerate(requests)], self.threads)
        results = self._pool.run(self._do, tasks)
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
            f = _File(str(file), os.open(file, os.O_RDONLY), self._open_direct(file), owned=True)
        self._files[key] = f
        return f

    def _open_direct(self, path: FileRef) -> int | None:
        if not self.direct or not hasattr(os, "O_DIRECT"):
            return None
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return None  # e.g. tmpfs: EINVAL; read buffered

    def _runs(self, i: int, req: ReadRequest) -> _Task:
        """One request's reads, and whether they can go O_DIRECT."""
        rows = np.asarray(req.rows, dtype=np.int64)
        _check_rows(rows)
        out = req.out
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise TypeError("out must be a writeable C-contiguous numpy array")
        row_bytes = _row_bytes(out.nbytes, rows.size)
        f = self._open(req.file)
        direct = (f.direct_fd is not None and not f.direct_failed and row_bytes % DIRECT_ALIGN == 0
                  and out.ctypes.data % DIRECT_ALIGN == 0)
        offsets, dests, sizes = _runs_in_bytes(rows, row_bytes, self.max_run_bytes)
        return _Task(i, f, f.name, direct, offsets, dests, sizes, memoryview(out.reshape(-1).view(np.uint8)))

    def _do(self, task: _Task) -> tuple[int, float, int, str]:
        """One task's preads (the hot loop: one preadv per run, checks only on the rare paths)."""
        f, buffer, preadv = task.file, task.buffer, os.preadv
        direct = task.direct and not f.direct_failed
        fd = f.direct_fd if direct else f.fd
        for offset, dest, size in zip(task.offsets, task.dests, task.sizes):
            view = buffer[dest : dest + size]
            try:
                got = preadv(fd, [view], offset)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise OSError(exc.errno, f"{f.name}: {exc.strerror}") from None
                f.direct_failed, direct, fd = True, False, f.fd  # the device wants a larger alignment
                got = preadv(fd, [view], offset)
            if got != size:
                _pread_full(fd, view[got:], offset + got, f.name)
        return task.request, time.perf_counter(), len(task.offsets), "direct" if direct else "buffered"


def _row_bytes(nbytes: int, rows: int) -> int:
    if rows and (nbytes == 0 or nbytes % rows):
        raise ValueError(f"out holds {nbytes} bytes: not a whole number of {rows} rows")
    return nbytes // max(rows, 1)


def _interleave(groups: list[list[_Task]]) -> list[_Task]:
    """Round-robin over the groups: a0 b0 a1 b1 a2."""
    longest = max((len(g) for g in groups), default=0)
    return [g[k] for k in range(longest) for g in groups if k < len(g)]


class KvikioReader(_Reader):
    """Reads rows straight into GPU memory with kvikio (GPUDirect Storage, or its compat mode).

    ``out`` buffers are contiguous CUDA tensors. Runs of rows are planned as in
    :class:`FileReader` and each thread of a pool issues its runs' ``CuFile.pread`` and waits for
    them (see the module's docstring for why not kvikio's own pool alone). ``module`` replaces
    the kvikio module (tests); ``device_type`` is the kind of tensor ``out`` must be."""

    on_device = True
    device_type = "cuda"

    def __init__(self, threads: int = 16, max_run_bytes: int = MAX_RUN_BYTES, module: Any = None) -> None:
        if module is None:
            if not torch.cuda.is_available():
                raise RuntimeError("KvikioReader needs CUDA")
            import kvikio as module  # the optional GPU extra; imported only here
        self._kvikio = module
        self._pool = _Pool(threads, "moment-kvikio")
        self.threads = threads
        self.max_run_bytes = max_run_bytes
        self.preads = 0
        self.modes: dict[str, str] = {}
        self._files: dict[str, Any] = {}

    def read(self, file: FileRef, rows: np.ndarray, out: torch.Tensor) -> float:
        """Read ``rows`` (sorted, unique) of ``file`` into the CUDA tensor ``out``."""
        return self.read_batch([ReadRequest(file, rows, out)])[0]

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[float]:
        """Serve all requests with their reads in flight together; seconds per request as FileReader."""
        start = time.perf_counter()
        tasks = _tasks([self._runs(i, req) for i, req in enumerate(requests)], self.threads)
        seconds, preads = _finish_times(start, len(requests), self._pool.run(self._do, tasks))
        self.preads += preads
        return seconds

    def close(self) -> None:
        """Stop the threads; deregister and close the files."""
        self._pool.shutdown()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _runs(self, i: int, req: ReadRequest) -> _Task:
        rows = np.asarray(req.rows, dtype=np.int64)
        _check_rows(rows)
        if isinstance(req.file, int):
            raise TypeError("KvikioReader reads files by path, not by descriptor")
        out = req.out
        if not (isinstance(out, torch.Tensor) and out.device.type == self.device_type and out.is_contiguous()):
            raise TypeError(f"out must be a contiguous {self.device_type.upper()} tensor")
        flat = out.view(torch.uint8).reshape(-1)
        name = str(req.file)
        offsets, dests, sizes = _runs_in_bytes(rows, _row_bytes(flat.numel(), rows.size), self.max_run_bytes)
        return _Task(i, self._handle(name) if rows.size else None, name, False, offsets, dests, sizes, flat)

    def _do(self, task: _Task) -> tuple[int, float, int]:
        """Issue a task's reads, then wait for each (a small read is done in this thread)."""
        flat, handle = task.buffer, task.file
        futures = [handle.pread(flat[dest : dest + size], size, offset)
                   for offset, dest, size in zip(task.offsets, task.dests, task.sizes)]
        for future, size, offset in zip(futures, task.sizes, task.offsets):
            got = future.get()
            if got != size:
                raise OSError(errno.EIO, f"{task.name}: read {got} of {size} bytes at byte {offset}")
        return task.request, time.perf_counter(), len(futures)

    def _handle(self, name: str) -> Any:
        if name not in self._files:
            self._files[name] = self._kvikio.CuFile(name, "r")
            self.modes[name] = kvikio_mode(self._kvikio)
        return self._files[name]


def kvikio_mode(kvikio: Any) -> str:
    """How kvikio will read: "kvikio-compat" (POSIX), "kvikio-gds" or, where kvikio decides per
    file (its AUTO setting, older versions), "kvikio-auto"."""
    defaults = kvikio.defaults
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return "kvikio-compat" if preferred() else "kvikio-gds"
    mode = defaults.compat_mode()
    name = getattr(mode, "name", None)  # a CompatMode enum (ON, OFF, AUTO) or, before, a bool
    if name is None:
        return "kvikio-compat" if mode else "kvikio-gds"
    return {"ON": "kvikio-compat", "OFF": "kvikio-gds"}.get(name, "kvikio-auto")


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
    "posix": ReaderKind(lambda threads, direct: FileReader(threads=threads, direct=direct), False,
                        "preads into pinned host memory"),
    "kvikio": ReaderKind(lambda threads, direct: KvikioReader(threads=threads), True,
                         "into GPU memory (GPUDirect Storage or its compat mode)", kvikio_refusal),
}
IO_CHOICES = ("auto", *READERS)


def io_help() -> str:
    """``--io``'s help text, from :data:`READERS`."""
    kinds = ", ".join(f"{name} {kind.about}" for name, kind in READERS.items())
    return f"how SSD bins are read: {kinds}, or auto: into GPU memory on CUDA when the reader is installed (default)"


def io_refusal(io: str, cuda: bool) -> str | None:
    """Why reader ``io`` cannot work here (a phrase starting with its name), or None; ``cuda``:
    the device is a GPU and CUDA is available. "auto" always works."""
    return None if io == "auto" else READERS[io].refusal(cuda)


def make_reader(device: str | torch.device, threads: int = 16, direct: bool = True, io: str = "auto") -> Reader:
    """The reader for ``device``: ``io="auto"``: a reader into GPU memory (kvikio) for a CUDA
    device when CUDA is there and the reader can be made, plain file reads otherwise; a name of
    :data:`READERS`: that reader, or an error saying why not."""
    if io not in IO_CHOICES:
        raise ValueError(f"io must be one of {', '.join(IO_CHOICES)}, not {io!r}")
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if (why := io_refusal(io, cuda)) is not None:
        raise ValueError(f"{why} (device {device})")
    if io != "auto":
        try:
            return READERS[io].make(threads, direct)
        except ImportError as exc:
            raise ValueError(f"{io} cannot be imported: {exc}") from None
    for kind in sorted(READERS.values(), key=lambda k: not k.on_device):  # GPU readers first
        if kind.on_device and not cuda:
            continue
        try:
            return kind.make(threads, direct)
        except ImportError:
            continue
    raise ValueError(f"no reader can run on device {device}")
