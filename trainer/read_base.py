"""What every SSD reader shares: the requests (these rows of this file into this buffer), the
:class:`Reader` protocol the feature store reads through, runs of consecutive rows coalesced
into reads, the reads cut into tasks for a thread pool, and the pool. :mod:`trainer.readers`
names the readers (``--io``)."""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from moment.errors import MomentError
from moment.gated_pool import GatedPool
from moment.ssd_reads import PAGE_BYTES, pages_read

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
    base: int = 0  # the file's byte where row 0 starts (a packed chunk's page: trainer.packs)


class Reader(Protocol):
    """What the feature store, the run's metrics and ``io=auto``'s probe ask of an SSD reader:
    every member they use (a reader in :data:`trainer.readers.READERS` is checked against it by
    the type checker). The read-only ones may be plain attributes."""

    preads: int  # read calls issued so far
    modes: dict[str, str]  # file → how it is read ("direct", "buffered"; kvikio: see kvikio_mode)
    read_bytes: dict[str, int]  # file → bytes of the pages its reads touched so far (moment.ssd_reads.pages_read)
    routes: dict[str, int]  # reads so far per path they took, where they take several (kvikio); else empty
    probe: dict[str, float]  # seconds per reader of the probe io=auto chose it by (empty otherwise)

    @property
    def on_device(self) -> bool:
        """Reads go into GPU memory (``out`` buffers are tensors of ``device_type``), else host memory."""
        ...

    @property
    def device_type(self) -> str:
        """The torch device type of ``out`` buffers when ``on_device`` ("cuda"); "cpu" otherwise."""
        ...

    @property
    def route(self) -> str:
        """How SSD bytes reach a GPU: "host" (through host memory) or "direct" (GPUDirect Storage)."""
        ...

    @property
    def engine(self) -> str | None:
        """How reads are issued (the file reader's io_uring, pread, python); None: one way only."""
        ...

    @property
    def mode(self) -> str | None:
        """A mode that holds for every file (kvikio's compat setting), named in the run's notes."""
        ...

    @property
    def config(self) -> dict[str, Any] | None:
        """The I/O library's settings as it reports them (kvikio); None: none."""
        ...

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
    pages: int = 0  # bytes of the pages the request's runs touch (plan_runs; a slice keeps its request's)


def plan_runs(
    rows: np.ndarray, row_bytes: int, max_run_bytes: int, base: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A request's reads: its ``rows`` (sorted, unique; a ValueError otherwise) as runs of
    consecutive rows at most ``max_run_bytes`` long, in bytes (file offsets from ``base``,
    offsets in the buffer, sizes), and the bytes of the pages they touch
    (:func:`moment.ssd_reads.pages_read`). Compiled (:mod:`trainer.runs_kernel`) where numba
    builds it, else with numpy; both give the same."""
    rows = np.asarray(rows, dtype=np.int64)
    max_rows = max(1, max_run_bytes // max(row_bytes, 1))
    plan = _planner()
    if plan is None:
        return _plan_runs_numpy(rows, row_bytes, max_rows, base)
    offsets, dests, sizes, pages, status = plan(rows, row_bytes, max_rows, base, PAGE_BYTES)
    if status:
        _check_rows(rows)  # raises the error that status stands for
        raise AssertionError(f"runs_kernel status {status} for rows that pass the check")
    return offsets, dests, sizes, pages


def _plan_runs_numpy(
    rows: np.ndarray, row_bytes: int, max_rows: int, base: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`plan_runs` without numba."""
    _check_rows(rows)
    first, pos, counts = coalesce(rows, max_rows)
    offsets, sizes = base + first * row_bytes, counts * row_bytes
    return offsets, pos * row_bytes, sizes, pages_read(offsets, sizes)


@functools.cache
def _planner() -> Any:
    """The compiled planning (:mod:`trainer.runs_kernel`), built at first use; None without numba."""
    try:
        from trainer import runs_kernel
    except ImportError:
        return None
    return runs_kernel.planner()


def _tasks(requests: list[ReadTask], threads: int) -> list[ReadTask]:
    """Split each request's runs (one task holding them all) into about ``TASKS_PER_THREAD ×
    threads`` tasks in all, interleaved across requests so that every file is read from the start."""
    total = sum(len(r.sizes) for r in requests)
    step = max(MIN_RUNS_PER_TASK, -(-total // (threads * TASKS_PER_THREAD)))
    if all(len(r.sizes) <= step for r in requests):  # one task each, as planned (none: no runs)
        return [r for r in requests if len(r.sizes)]
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
        self._pool: GatedPool | None = None

    def run(self, do: Any, tasks: list[ReadTask]) -> list[Any]:
        if len(tasks) <= 1 or self.threads == 1:
            return [do(t) for t in tasks]
        if self._pool is None:
            self._pool = GatedPool(self.threads, self._name)
        return self._pool.map(do, tasks)

    def shutdown(self) -> None:
        """Cancel the tasks not started and wait for the running ones, a signal meanwhile
        included: only then may the reader close the files and rings they read with."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()


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


_R = TypeVar("_R", bound="_Reader")


class _Reader:
    """What both readers share: their counters, planning a batch's reads (and counting the pages
    they touch, in ``read_bytes``: what the SSD moves, whole pages, however few bytes of them a
    row needs) on a pool of ``threads``, closing, also as a context manager."""

    on_device = False
    device_type = "cpu"
    engine: str | None = None
    mode: str | None = None
    config: dict[str, Any] | None = None

    def __init__(self, threads: int, max_run_bytes: int, pool_name: str) -> None:
        self._pool = _Pool(threads, pool_name)
        self.threads = threads
        self.max_run_bytes = max_run_bytes
        self.preads = 0
        self.probe: dict[str, float] = {}  # seconds per reader, when io=auto chose by a probe
        self.modes: dict[str, str] = {}
        self.read_bytes: dict[str, int] = {}
        self.routes: dict[str, int] = {}

    def plan_task(self, i: int, req: ReadRequest) -> ReadTask:
        raise NotImplementedError

    def _plan(self, requests: Sequence[ReadRequest]) -> list[ReadTask]:
        planned = [self.plan_task(i, req) for i, req in enumerate(requests)]
        for task in planned:  # one task per request yet: its runs sorted, each page counted once
            self.read_bytes[task.name] = self.read_bytes.get(task.name, 0) + task.pages
        return _tasks(planned, self.threads)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row_bytes(nbytes: int, rows: int) -> int:
    if rows and (nbytes == 0 or nbytes % rows):
        raise ValueError(f"out holds {nbytes} bytes: not a whole number of {rows} rows")
    return nbytes // max(rows, 1)


def _interleave(groups: list[list[ReadTask]]) -> list[ReadTask]:
    """Round-robin over the groups: a0 b0 a1 b1 a2."""
    longest = max((len(g) for g in groups), default=0)
    return [g[k] for k in range(longest) for g in groups if k < len(g)]
