"""Write every bin's feature rows in one sequential pass over the source, resumably.

The source features are read front to back in chunks; each chunk's rows are grouped by bin
(the dataset order kept inside a bin: the order of the rows old_to_new gives) and appended to that bin's
file, around the page cache where the file system allows (:mod:`placement.direct_io`: the
trainer reads SSD bins with ``O_DIRECT`` anyway). Every few hundred MB the bin files are flushed
and fsync'ed and the progress recorded, so a killed
run resumes from the last checkpoint instead of starting over. Checksums (:mod:`placement.digests`:
xxh3-128, ~15 GB/s a core) are computed on the way; on resume the already-written part is re-read
to rebuild them. Reading the next chunk, hashing and the checkpoint's fsync run in threads beside
the writes (numpy, the hashers and fsync release the GIL), and rows are grouped by
bin with one compiled pass (a counting sort of whole rows, no argsort or gather), which is what
brings the pass to the speed of a plain copy of the same bytes (scripts/bench_pipeline.py). The
read, the grouping and the copy into the bins' write buffers run on up to 4 cores
(:func:`group_threads`; one thread did about 2 GB/s, four 3.7 GB/s, more were slower): each
thread reads and groups the next piece of the chunk (the output the same bytes as one thread's),
then appends the next bin, so every bin file has one writer (scripts/bench_bin_pass.py).
The seconds spent hashing and in fsync are measured in their threads and returned
(:class:`WriteTimes`), so ``moment place`` can say where its time went.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
from numpy.typing import DTypeLike

from moment.cores import usable_cores
from moment.fileio import atomic_write_text
from moment.gated_pool import GatedPool, close_all
from moment.progress import Update
from placement.digests import PLACED_DIGEST, Hasher, new_hasher
from placement.direct_io import ALIGN, BUFFER_BYTES, AppendFile

numba: ModuleType | None  # None: not installed (the same functions then run as Python)
try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; numpy's stable sort is the fallback
    numba = None

_T = TypeVar("_T")
_R = TypeVar("_R")

STATE = "write-state.json"
CHECKPOINT_BYTES = 512 << 20
CHUNK_BYTES = 16 << 20  # source rows read per step (four buffers of this size: two read, two grouped)
HASH_AHEAD_BYTES = 32 << 20  # how far an NpyWriter's hashing may lag behind its writes (memory held)
SYNC_BYTES = 256 << 20  # an NpyWriter fsyncs, beside its writes, every this many bytes (buffered writes only)
BIN_BUFFERS_BYTES = 64 << 20  # the bins' O_DIRECT buffers together, at most (placement.direct_io)
PIECES = 4  # a chunk's read and grouping are cut into this many pieces a thread, taken as threads free up


@dataclass
class BinFile:
    name: str
    path: Path  # the file being written (a .partial name until the placement is committed)
    rows: int  # rows it must end up with


@dataclass
class Written:
    name: str
    path: Path
    bytes: int
    digest: str
    algorithm: str  # the digest's (a key of placement.digests.DIGESTS)


@dataclass
class WriteTimes:
    """Seconds of the pass: ``hash`` and ``fsync`` are busy time in their threads (they overlap
    the writes, and hashing runs one thread per bin: summed over threads; the part the writer
    waited for is in ``wait``)."""

    hash: float = 0.0
    fsync: float = 0.0
    wait: float = 0.0
    group: float = 0.0  # wall seconds the caller spent grouping chunks (all grouping threads at once)
    append: float = 0.0  # ... appending them to the bins' buffers (with any wait for a bin's disk write)
    files: list[Written] = field(default_factory=list)


class NpyWriter:
    """An .npy file written front to back (the header, then blocks as they come), checksummed on
    the way (:data:`~placement.digests.PLACED_DIGEST`): the manifest's digest without reading the
    file back, and resident memory of a few blocks however large the file.

    The bytes go around the page cache (``O_DIRECT``, :class:`placement.direct_io.AppendFile`),
    written by the file's own thread while the caller computes. Neither the checksum nor the
    fsync holds up the caller (the hasher and fsync release the GIL): blocks are hashed in a
    thread of the writer's own, in order, at most ``HASH_AHEAD_BYTES`` behind; :meth:`finish`
    hands another thread the last writes and the fsync, and :meth:`close` waits for both. (Where
    the file system refuses ``O_DIRECT`` that thread also fsyncs every ``SYNC_BYTES``, so the
    disk writes while the caller computes instead of all at the end.) A block must not change
    after :meth:`write` (it is hashed later): callers write fresh arrays. Busy seconds in the
    threads (``hash_s``, ``fsync_s``) and the seconds the caller waited for them (``wait_s``)
    are kept."""

    def __init__(self, path: Path, dtype: DTypeLike, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), shape
        self.algorithm = PLACED_DIGEST
        self.hasher = new_hasher(self.algorithm)
        self.hash_s = self.fsync_s = self.wait_s = 0.0
        self.bytes = 0
        self.digest = ""
        self.out = AppendFile(path)  # O_DIRECT where the file system takes it (placement.direct_io)
        self._hashing = GatedPool(1, "moment-npy-hash")
        self._syncing = GatedPool(1, "moment-npy-fsync")
        self._hashed: deque[tuple[int, Future[float]]] = deque()  # (bytes, job), oldest first
        self._behind = 0  # bytes queued for hashing
        self._synced: Future[float] | None = None
        self._unsynced = 0
        self._finished = self._closed = False
        header = io.BytesIO()
        descr = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(header, descr)
        self._put(memoryview(header.getvalue()))
        self.expected = self.bytes + int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize

    def write(self, block: np.ndarray) -> None:
        self._put(memoryview(np.ascontiguousarray(block, dtype=self.dtype)).cast("B"))

    def _put(self, data: memoryview) -> None:
        self._hashed.append((len(data), self._hashing.submit(_timed, self.hasher.update, data)))
        self._behind += len(data)
        while self._behind > HASH_AHEAD_BYTES:
            self._hash_oldest()
        self.out.write(data)
        self.bytes += len(data)
        self._unsynced += len(data)
        if self.out.direct is None and self._unsynced >= SYNC_BYTES and (self._synced is None or self._synced.done()):
            self._sync(os.fsync, self.out.fd)  # direct writes are on the device already

    def _wait(self, job: Future[float]) -> float:
        """A thread's busy seconds; the time spent waiting for it counted in ``wait_s``."""
        t0 = time.perf_counter()
        busy = job.result()
        self.wait_s += time.perf_counter() - t0
        return busy

    def _hash_oldest(self) -> None:
        size, job = self._hashed.popleft()
        self._behind -= size
        self.hash_s += self._wait(job)

    def _sync(self, fn: Callable[[Any], object], arg: Any) -> None:
        """``fn(arg)`` (an fsync of what was written so far) in the syncing thread, one in flight."""
        if self._synced is not None:
            self.fsync_s += self._wait(self._synced)
        self._synced = self._syncing.submit(_timed, fn, arg)
        self._unsynced = 0

    def finish(self) -> None:
        """The last block is written: start the final fsync (:meth:`close` waits for it). A file
        shorter or longer than its header says is a bug."""
        if self._finished:
            return
        if self.bytes != self.expected:
            raise RuntimeError(f"{self.path}: wrote {self.bytes} bytes, its header promises {self.expected}")
        self._finished = True
        self._sync(_final, self.out)

    def close(self) -> str:
        """Finish, wait until the file is hashed and on disk, close; the digest (also kept as
        ``digest``)."""
        if self._closed:
            return self.digest
        try:
            self.finish()
            while self._hashed:
                self._hash_oldest()
            if self._synced is not None:
                self.fsync_s += self._wait(self._synced)
                self._synced = None
        finally:
            close_all(self._hashing, self._syncing)  # nothing may touch the file once it is closed
            self.out.close(flush=False)  # flushed by finish()'s last writes, unless failing
            self._closed = True
        self.digest = self.hasher.hexdigest()
        return self.digest


def _final(out: AppendFile) -> None:
    """The last buffered bytes written, the file made durable, its buffers released."""
    out.sync()
    out.close()


def _timed(fn: Callable[[Any], object], arg: Any) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def save_npy(
    path: Path, array: np.ndarray, dtype: DTypeLike | None = None, chunk: int = 1 << 20, wait: bool = True
) -> NpyWriter:
    """``array`` as an .npy file of ``dtype`` (default its own) through :class:`NpyWriter`,
    converted ``chunk`` entries at a time (no full-size copy), closed: digest and timings kept
    (``wait=False``: only finished; the caller closes it, which waits for its hash and fsync)."""
    out = NpyWriter(path, dtype or array.dtype, array.shape)
    for lo in range(0, array.shape[0], chunk):
        out.write(array[lo : lo + chunk])
    if wait:
        out.close()
    else:
        out.finish()
    return out


def _load_state(work: Path, key: str) -> dict | None:
    try:
        state = json.loads((work / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if state.get("key") == key else None


def _save_state(work: Path, key: str, next_row: int, sizes: dict[str, int]) -> None:
    atomic_write_text(work / STATE, json.dumps({"key": key, "next_row": next_row, "bytes": sizes}))


def _hash_part(hasher: Hasher, part: memoryview) -> float:
    t0 = time.perf_counter()
    hasher.update(part)
    return time.perf_counter() - t0


def hash_threads(nbins: int) -> int:
    """Threads hashing a chunk's parts: one per bin up to the cores (xxh3-128 runs at about 15 GB/s
    a core, so one thread would still bound a server's array of SSDs; bins hash independently)."""
    return usable_cores(nbins)


# The most threads the bin pass groups and copies with. The first GPU server (16 cores, H200
# host, scripts/gpu_check.sh's bin-pass-cores step, a page-cached 1.28 GB source into tmpfs,
# 2026-11-27 22:49 UTC) did 2.06, 3.36, 3.67, 2.73 and 2.05 GB/s with 1, 2, 4, 8 and 16 threads:
# each feature byte crosses memory several times (read copy, grouping, buffer copy, hash), and
# past 4 threads they contend for it rather than share the work.
GROUP_THREADS = 4


def group_threads() -> int:
    """Threads grouping each chunk and copying it into the bins' buffers: the usable cores
    (:func:`moment.cores.usable_cores`: the process's affinity), at most :data:`GROUP_THREADS`."""
    return usable_cores(GROUP_THREADS)


def _append(handles: list[AppendFile], parts: list[tuple[Any, memoryview]], pool: GatedPool | None, n: int) -> None:
    """Each bin's part appended to its file; with a ``pool``, ``n`` threads take the bins one at a
    time, largest first, so that a file has one writer (an :class:`AppendFile` is not
    thread-safe) and the copies run at once (they release the GIL)."""
    if pool is None or len(parts) < 2:
        for b, part in parts:
            handles[b].write(part)
        return
    _share(pool, n, lambda p: handles[p[0]].write(p[1]), sorted(parts, key=lambda p: -len(p[1])))


def _checkpoint(handles: list[AppendFile], work: Path, key: str, row: int, sizes: dict[str, int]) -> float:
    """Make the bytes written so far durable, then record how far the run got. Runs beside the
    writes (the caller flushed ``sizes`` bytes of each file first): fsync makes at least those
    durable, which is all the state claims."""
    t0 = time.perf_counter()
    for fh in handles:
        os.fsync(fh.fd)
    _save_state(work, key, row, sizes)
    return time.perf_counter() - t0


def group_rows_py(rows: np.ndarray, bins: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
    """Copy ``rows[i]`` to ``out`` so that bin b's rows fill ``out[starts[b]:...]`` in their
    original order: a counting sort of whole rows, one pass, no index array. (Element by element:
    numba turns the inner loop into a vectorised copy; a slice assignment is slower.)"""
    pos = starts.copy()
    width = rows.shape[1]
    for i in range(rows.shape[0]):
        b = bins[i]
        p = pos[b]
        for j in range(width):
            out[p, j] = rows[i, j]
        pos[b] = p + 1


group_rows_fast = numba.njit(cache=True, nogil=True)(group_rows_py) if numba is not None else None


def count_bins_py(bins: np.ndarray, out: np.ndarray) -> None:
    """``out[b]`` += the entries of ``bins`` equal to b (a tenth of ``np.bincount``'s time on
    small bin numbers, compiled, and without the GIL)."""
    for i in range(bins.size):
        out[bins[i]] += 1


count_bins_fast = numba.njit(cache=True, nogil=True)(count_bins_py) if numba is not None else count_bins_py


def count_bins(bins: np.ndarray, nbins: int) -> np.ndarray:
    """How many entries of ``bins`` fall in each of ``nbins`` bins (int64)."""
    out = np.zeros(nbins, dtype=np.int64)
    count_bins_fast(bins, out)
    return out


def group_rows(
    rows: np.ndarray,
    bins: np.ndarray,
    counts: np.ndarray,
    out: np.ndarray | None = None,
    pool: GatedPool | None = None,
    threads: int = 1,
) -> np.ndarray:
    """``rows`` (n x row_bytes uint8) grouped by ``bins``, original order kept inside a bin (into
    ``out``, of the same shape, where given). With a ``pool``, the rows are cut into
    ``PIECES * threads`` consecutive ranges grouped by ``threads`` threads, the caller and the
    pool's, at once (the kernel releases the GIL): range k's rows of bin b go right after those
    of ranges 0..k-1 (:func:`range_starts`), so the result is the same bytes and every output row
    is written by one thread."""
    if group_rows_fast is None:
        grouped = np.take(rows, np.argsort(bins, kind="stable"), axis=0)
        if out is None:
            return grouped
        np.copyto(out, grouped)
        return out
    unit = next(u for u in (np.uint64, np.uint32, np.uint16, np.uint8) if rows.shape[1] % np.dtype(u).itemsize == 0)
    words = rows.view(unit)  # copy whole words: 8 bytes at a time where the row size allows
    dest = np.empty_like(words) if out is None else out.view(unit)
    pieces = max(1, min(PIECES * threads, bins.size))
    edges = np.linspace(0, bins.size, pieces + 1).astype(np.int64) if pool and threads > 1 else None
    if edges is None or edges.size <= 2:
        starts = np.zeros(counts.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        group_rows_fast(words, bins, starts, dest)
        return dest.view(np.uint8)
    cuts = [slice(lo, hi) for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist())]
    assert pool is not None
    starts = range_starts(_share(pool, threads, lambda cut: count_bins(bins[cut], counts.size), cuts))
    _share(
        pool, threads, lambda k: group_rows_fast(words[cuts[k]], bins[cuts[k]], starts[k], dest), list(range(len(cuts)))
    )
    return dest.view(np.uint8)


def _share(pool: GatedPool, threads: int, do: Callable[[_T], _R], items: list[_T]) -> list[_R]:
    """``do`` of every item (results in their order), by the calling thread and ``threads - 1``
    of the pool's, each taking the next item as it frees up: a thread that another process
    preempts holds up one item, not a fixed share (there are more items than threads). If the
    caller raises, the pool's threads still finish: its ``close`` waits for them."""
    results: list[_R | None] = [None] * len(items)
    taken = itertools.count()  # next() on it is atomic (the GIL)

    def work() -> None:
        while (k := next(taken)) < len(items):
            results[k] = do(items[k])

    jobs = [pool.submit(work) for _ in range(min(threads, len(items)) - 1)]
    work()
    for job in jobs:
        job.result()
    return results  # type: ignore[return-value] # every slot filled


def range_starts(counts: list[np.ndarray]) -> np.ndarray:
    """Where each range's rows of each bin start in the grouped output (``counts[k][b]``: range
    k's rows in bin b): bin b's block (after the rows of bins < b) holds range 0's rows, then
    range 1's, ...: the order of a stable sort of the whole."""
    per = np.stack(counts).astype(np.int64)  # ranges x bins
    before = np.zeros_like(per)
    np.cumsum(per[:-1], axis=0, out=before[1:])  # rows of the bin in earlier ranges
    block = np.zeros(per.shape[1], dtype=np.int64)
    np.cumsum(per.sum(axis=0)[:-1], out=block[1:])  # where each bin's block starts
    return before + block


class _Source:
    """The source rows, chunk by chunk, into two reused buffers (one being read ahead while the
    other is grouped). A memory-mapped .npy is read with ``preadv`` from its file: one system
    call per chunk instead of a page fault per page, which matters most on a busy machine. With a
    ``pool``, a chunk's read is cut into ``PIECES * threads`` byte ranges read by ``threads``
    threads at once (the calling thread one of them): one thread copied about 5 GB/s out of the
    page cache on the development VM, a bound once the grouping runs on every core."""

    def __init__(self, features: np.ndarray, chunk_rows: int, pool: GatedPool | None = None, threads: int = 1) -> None:
        self.features = features
        self.pool, self.threads = pool, threads
        self.row_bytes = features.shape[1] * features.dtype.itemsize if features.ndim == 2 else features.itemsize
        self.buffers = [np.empty((chunk_rows, self.row_bytes), dtype=np.uint8) for _ in range(2)]
        self.fd: int | None = None
        self.name = name = getattr(features, "filename", None)
        if isinstance(features, np.memmap) and name and features.flags.c_contiguous and features.shape[0]:
            self.fd, self.offset = os.open(name, os.O_RDONLY), int(features.offset)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if not np.array_equal(self.read(0, 0, 1), self._copy(self.buffers[1][:1], 0, 1)):
                self.close()  # not the layout it claims (a view of a larger map?): copy from the map

    def _copy(self, buf: np.ndarray, row: int, end: int) -> np.ndarray:
        buf[...] = np.ascontiguousarray(self.features[row:end]).reshape(end - row, -1).view(np.uint8)
        return buf

    def read(self, i: int, row: int, end: int) -> np.ndarray:
        """Rows [row, end) as uint8 rows, in buffer ``i % 2``."""
        buf = self.buffers[i % 2][: end - row]
        if self.fd is None:
            return self._copy(buf, row, end)
        view, at = memoryview(buf.reshape(-1)), self.offset + row * self.row_bytes
        cuts = np.linspace(0, len(view), PIECES * self.threads + 1).astype(np.int64) // ALIGN * ALIGN
        cuts[-1] = len(view)
        pieces = [(lo, hi) for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()) if hi > lo]
        if self.pool is None or len(pieces) < 2:
            self._pread(view, at, end)
        else:
            _share(self.pool, self.threads, lambda p: self._pread(view[p[0] : p[1]], at + p[0], end), pieces)
        return buf

    def _pread(self, view: memoryview, offset: int, end: int) -> None:
        assert self.fd is not None
        got = 0
        while got < len(view):
            k = os.preadv(self.fd, [view[got:]], offset + got)
            if k == 0:
                raise OSError(f"{self.name}: ends before row {end} (truncated while placing?)")
            got += k

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_ahead(features: np.ndarray, budget: int) -> threading.Thread | None:
    """Start the kernel reading a memory-mapped source's rows into the page cache, at most
    ``budget`` bytes from the front (the order :func:`write_bins` reads them), in a thread (the
    request may block while it queues the reads). ``moment place`` calls it before pre-sampling,
    which is CPU-bound on a topology already cached by the check: the disk would be idle
    otherwise, and the bin pass then reads from memory. None where there is nothing to read."""
    name = getattr(features, "filename", None)
    if not isinstance(features, np.memmap) or not name or budget <= 0 or not features.flags.c_contiguous:
        return None
    offset, size = int(features.offset), min(int(features.nbytes), budget)

    def advise() -> None:
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            return  # the bin pass reports a missing source
        try:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    thread = threading.Thread(target=advise, name="moment-read-ahead", daemon=True)
    thread.start()
    return thread


def _read_chunk(
    source: _Source, i: int, bin_of: np.ndarray, row: int, end: int, nbins: int
) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``i``: its source rows (as uint8 rows) and their bins. Runs ahead in a thread (the
    read releases the GIL), so reading the next chunk overlaps grouping and writing this one."""
    small = np.uint8 if nbins <= 1 << 8 else np.uint16 if nbins <= 1 << 16 else np.int64
    return source.read(i, row, end), np.asarray(bin_of[row:end]).astype(small)


def write_bins(
    features: np.ndarray,
    bin_of: np.ndarray,
    files: list[BinFile],
    work: Path,
    key: str,
    chunk_rows: int | None = None,
    progress: Update | None = None,
    threads: int | None = None,
) -> WriteTimes:
    """Append each vertex's feature row to its bin's file, in original id order.

    ``files[b]`` receives the rows of vertices with ``bin_of == b``; ``key`` identifies the inputs
    (a resumed run must be writing the same placement, or it starts over). Four things overlap:
    reading the next source chunk, grouping and writing this one, hashing it (each bin's part in
    its own thread), and the last checkpoint's fsync. Returns the files written and where the time
    went.

    ``threads`` (default: the usable cores, :func:`group_threads`) read each chunk, a byte range
    at a time, group it, a range of its rows at a time, then append the bins' parts to their
    files, a bin at a time: every file has one writer at a time, and the bytes are those of one
    thread. The caller is one of them. Memory held: four chunk buffers (``CHUNK_BYTES`` each: two read, two
    grouped) and the bins' write buffers (``BIN_BUFFERS_BYTES`` in all), whatever the threads.
    """
    n, row_bytes = features.shape[0], features.shape[1] * features.dtype.itemsize
    chunk_rows = chunk_rows or max(1, CHUNK_BYTES // row_bytes)
    state = _load_state(work, key)
    if state and any(_size(f.path) < state["bytes"].get(f.name, 0) for f in files):
        state = None  # a bin lost bytes the checkpoint recorded: start over
    start = state["next_row"] if state else 0
    hashers = [new_hasher(PLACED_DIGEST) for _ in files]
    handles: list[AppendFile] = []
    buffer = max(ALIGN, min(BUFFER_BYTES, BIN_BUFFERS_BYTES // (2 * max(len(files), 1))))
    try:
        for f, h in zip(files, hashers):
            done = state["bytes"].get(f.name, 0) if state else 0
            f.path.parent.mkdir(parents=True, exist_ok=True)
            if done:
                _hash_prefix(f.path, done, h)  # rebuild the checksum of what a killed run already wrote
            handles.append(AppendFile(f.path, done, buffer))
    except BaseException:
        for fh in handles:
            fh.close(flush=False)
        raise
    if progress and start:
        progress(start, n)  # resuming: the bar (and a test) sees where the killed run got to
    sizes = [fh.size for fh in handles]
    threads_n = threads or group_threads()
    reading = GatedPool(threads_n - 1, "moment-read") if threads_n > 1 else None  # the reader is one of them
    source = _Source(features, min(chunk_rows, max(n, 1)), reading, threads_n)
    grouped_bufs = [np.empty_like(b) for b in source.buffers]  # chunk i groups into i % 2
    chunk = 0
    grouping = GatedPool(threads_n - 1, "moment-group") if threads_n > 1 else None  # the caller is one of them
    ahead_pool = GatedPool(2, "moment-write")  # closed below only once no task of it runs (signals too)
    hashing = GatedPool(hash_threads(len(files)), "moment-hash")
    hashed: list = []
    synced = None
    times = WriteTimes()

    def wait(job):  # a thread's seconds, and how long this one waited for it
        t0 = time.perf_counter()
        busy = job.result()
        times.wait += time.perf_counter() - t0
        return busy

    try:
        since = 0
        ahead = (
            ahead_pool.submit(_read_chunk, source, 0, bin_of, start, min(n, start + chunk_rows), len(files))
            if start < n
            else None
        )
        row = start
        while ahead is not None:
            records, bins = ahead.result()
            end = row + records.shape[0]
            ahead = (
                ahead_pool.submit(_read_chunk, source, chunk + 1, bin_of, end, min(n, end + chunk_rows), len(files))
                if end < n
                else None
            )
            t0 = time.perf_counter()
            counts = count_bins(bins, len(files))
            grouped = group_rows(
                records, bins, counts, grouped_bufs[chunk % 2][: records.shape[0]], grouping, threads_n
            )
            t1 = time.perf_counter()
            times.group += t1 - t0
            chunk += 1
            edges = np.concatenate(([0], np.cumsum(counts))) * row_bytes
            raw = memoryview(grouped.reshape(-1))
            parts = [(b, raw[edges[b] : edges[b + 1]]) for b in np.flatnonzero(counts)]
            times.hash += sum(wait(job) for job in hashed)  # a bin's parts are hashed in order: chunk by chunk
            hashed = [hashing.submit(_hash_part, hashers[b], part) for b, part in parts]
            t1 = time.perf_counter()
            _append(handles, parts, grouping, threads_n)
            times.append += time.perf_counter() - t1
            for b, part in parts:
                sizes[b] += len(part)
            since += raw.nbytes
            row = end
            if since >= CHECKPOINT_BYTES or row == n:
                if synced is not None:
                    times.fsync += wait(synced)  # one checkpoint in flight
                for fh in handles:
                    fh.flush()  # every byte the state will claim handed to the file system
                synced = ahead_pool.submit(
                    _checkpoint, handles, work, key, row, {f.name: size for f, size in zip(files, sizes)}
                )
                since = 0
            if progress:
                progress(row, n)
        times.hash += sum(wait(job) for job in hashed)
        if synced is not None:
            times.fsync += wait(synced)
    finally:
        # no read, grouping, hash or fsync may run once the source and the bins are closed
        close_all(ahead_pool, hashing, *[p for p in (reading, grouping) if p])  # the reads first: they use `reading`
        source.close()
        for fh in handles:
            fh.close(flush=False)  # the last checkpoint flushed every byte; a failed run resumes from one
    for f, h in zip(files, hashers):
        size = f.path.stat().st_size
        if size != f.rows * row_bytes:
            raise RuntimeError(f"{f.path}: wrote {size} bytes, expected {f.rows * row_bytes}")
        times.files.append(Written(f.name, f.path, size, h.hexdigest(), PLACED_DIGEST))
    return times


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else -1


def _hash_prefix(path: Path, size: int, hasher: Hasher) -> None:
    """Feed the first ``size`` bytes of ``path`` to ``hasher``."""
    with open(path, "rb") as fh:
        while size:
            block = fh.read(min(size, 8 << 20))
            if not block:
                raise OSError(f"{path}: shorter than the {size} bytes still expected")
            hasher.update(block)
            size -= len(block)
