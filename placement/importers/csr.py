"""CSR by destination from a stream of edge chunks, out of core, in a stated memory budget, reading
the edges once.

The neighbours of v are the sources of the edges into v (what v aggregates from). The destinations
are cut into buckets of consecutive vertices once the first chunk is read (:class:`Buckets`: sized
from that chunk so that a bucket's rows fit the budget with room to spare, and stay small enough
for the caches):

1. **spread** (the one read of the input): each chunk's ids are checked against N, and its entries
   (neighbour, destination) — the reverses too with ``undirected`` — are grouped by the bucket of
   their destination and appended to that bucket's scratch file (forward and reverse apart), or
   kept in RAM when all of them fit the budget (``keeps``). Nothing grows with N here.
2. **fill**, bucket by bucket, front to back: the bucket's records (forward, then reverse) are
   counted per destination, which gives its rows' pointers (appended to ``indptr.npy``), then each
   neighbour is placed at its row's cursor (a stable counting sort: no comparison sort), and the
   rows are appended to ``indices.npy``. A bucket holding more entries than the budget allows (a
   range of hubs) is filled in windows of its rows instead, its scratch files read once for the
   counts and once per window.

The loops are compiled (placement.importers.kernels, GIL released) and split between threads
(each takes a slice of a chunk, or of a bucket's records, with its own cursors); the next chunk is
read by a helper thread while this one is spread. Outputs are written with plain sequential writes
(no memory map: resident memory is the budget, not the file sizes); the scratch files are deleted.

Order within a row, the same for any chunk size, budget and thread count: the added self-loop
(``self_loops``), then the given edges in input order, then (``undirected``) the reverses in input order. A reverse is not added for a
self-loop, and no duplicate is removed: an edge given both ways appears twice, as in ``moment
dataset import`` before. ``self_loops`` drops the input's self-loops and gives every vertex exactly
one (the IGB/DGL ``remove_self_loop`` + ``add_self_loop`` convention).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import queue
import shutil
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, TypeVar

import numpy as np

from moment.contracts.dataset import FILES, DatasetError
from moment.host_memory import available_memory
from moment.progress import Progress
from placement.importers import kernels

T = TypeVar("T")
Edges = Iterator[tuple[np.ndarray, np.ndarray]]  # chunks of (sources, destinations), integers, ids checked

CHUNK_BYTES = 64  # RAM per input edge while reading: three chunks in flight (int64 pairs) and their
# records (a pair of ids, twice with the reverses); ``entry_bytes`` per entry of the bucket being filled
MAX_CHUNK = 1 << 23  # edges per chunk: beyond this, larger chunks are not faster
FILL_TARGET = 1 << 22  # entries a bucket is sized for: its rows (16 MB of int32) stay near the caches
MAX_BUCKETS = 256  # buckets at most (each with a scratch file per part, open during the read)
FINE_BITS = 16  # buckets are cut at multiples of N / 2^16 vertices (rounded to a power of two)


def entry_bytes(num_nodes: int) -> int:
    """RAM per entry while a bucket is filled: its id in the output and its record (a pair)."""
    return 3 * index_dtype(num_nodes).itemsize


class EdgeSource(Protocol):
    """Edges read in chunks: ``size`` edges in all, each chunk a pair of integer arrays, ids checked."""

    size: int

    def chunks(self, chunk: int) -> Edges: ...


@dataclass(frozen=True)
class Layout:
    """How the builder spends the budget: edges per chunk and entries per window (the most a bucket
    filled at once may hold)."""

    chunk: int
    window: int

    @staticmethod
    def plan(num_nodes: int, memory: int) -> Layout:
        """Split ``memory`` bytes: a quarter for the chunks being read, the rest for the bucket
        being filled. Refused if not even a small chunk and window fit (one line saying how much is
        needed)."""
        entry = entry_bytes(num_nodes)
        need = 64 * (CHUNK_BYTES + entry) * 1024
        if memory < need:
            raise DatasetError(
                f"--memory {memory / 1e9:.3g} GB is too small: the CSR build needs at least {need / 1e9:.3g} GB "
                "(room for a chunk of edges and a bucket of rows)"
            )
        chunk = int(min(MAX_CHUNK, memory // 4 // CHUNK_BYTES))
        return Layout(chunk=chunk, window=max(1, (memory - chunk * CHUNK_BYTES) // entry))


def index_dtype(num_nodes: int) -> np.dtype:
    """Neighbour ids: int32 while every id fits (IGB-full and papers100M do), else int64."""
    return np.dtype(np.int32 if num_nodes < 2**31 else np.int64)


ENTRY_BYTES = entry_bytes(1)  # int32 ids: every graph with fewer than 2^31 vertices


@dataclass(frozen=True)
class Buckets:
    """The destinations cut into buckets: bucket k is vertices ``starts[k]..starts[k + 1] - 1``, its
    bounds multiples of ``2^fine``; ``table[v >> fine]`` is v's bucket (what the spread looks up)."""

    fine: int
    starts: np.ndarray  # int64, one more than the buckets, the last one N
    table: np.ndarray  # int32, one per range of 2^fine vertices

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @staticmethod
    def plan(
        num_nodes: int,
        most: int,
        layout: Layout,
        threads: int,
        sample: tuple[np.ndarray, np.ndarray] | None = None,
        undirected: bool = False,
        self_loops: bool = False,
    ) -> Buckets:
        """Buckets expected to hold about :func:`target` entries each, at most
        ``MAX_BUCKETS``: the entries per range of ``2^fine`` vertices estimated from the spread of
        the ``sample`` edges (the first chunk: a graph whose hubs share ids is cut finer there), or
        as if spread evenly where that is more (an unrepresentative sample, say of an input sorted
        by destination, then cuts the rest evenly, not into one bucket). A bucket's vertices also keep its per-vertex
        counters (8 bytes a vertex per thread, and the row starts) within a quarter of the budget."""
        fine = max(0, num_nodes.bit_length() - FINE_BITS)
        ranges = max(1, -(-num_nodes >> fine))
        sizes = np.full(ranges, 1 << fine, dtype=np.float64)
        sizes[-1] = num_nodes - ((ranges - 1) << fine)
        given = max(0, most - (num_nodes if self_loops else 0))
        even = given * sizes / max(1, num_nodes)
        est = even
        if sample is not None:
            src, dst = (np.asarray(x, dtype=np.int64) for x in sample)
            ok = (src >= 0) & (src < num_nodes) & (dst >= 0) & (dst < num_nodes)  # the spread names a bad id
            if self_loops:
                ok &= src != dst
            seen = np.bincount(dst[ok] >> fine, minlength=ranges).astype(np.float64)
            if undirected:
                seen += np.bincount(src[ok & (src != dst)] >> fine, minlength=ranges)
            if seen.sum():
                est = np.maximum(even, seen * (given / seen.sum()))
        if self_loops:
            est = est + sizes
        cap = max(1, layout.window * ENTRY_BYTES // (4 * 8 * (threads + 1)) >> fine)  # ranges a bucket may span
        aim = target(most, layout)
        while True:
            cuts = _cut(est, float(aim), cap)
            if len(cuts) - 1 <= MAX_BUCKETS or cap >= ranges and aim >= est.sum():
                break
            aim *= 2
            cap *= 2
        starts = np.minimum(np.asarray(cuts, dtype=np.int64) << fine, num_nodes)
        table = np.repeat(np.arange(len(cuts) - 1, dtype=np.int32), np.diff(cuts))
        return Buckets(fine=fine, starts=starts, table=table)


def target(most: int, layout: Layout) -> int:
    """Entries a bucket is sized for: ``FILL_TARGET``, or half a window if less, or more if
    ``MAX_BUCKETS`` buckets would not hold ``most``."""
    return max(1, min(FILL_TARGET, layout.window // 2), -(-most // MAX_BUCKETS))


def _cut(est: np.ndarray, target: float, cap: int) -> list[int]:
    """Range indices where buckets start (and the end): a bucket closes before the range that
    would take it over ``target`` entries or ``cap`` ranges."""
    cuts, held, start = [0], 0.0, 0
    for r, e in enumerate(est.tolist()):
        if r > start and (held + e > target or r - start >= cap):
            cuts.append(r)
            held, start = 0.0, r
        held += e
    cuts.append(len(est))
    return cuts


def _ints(a: np.ndarray) -> np.ndarray:
    """An id array as the kernels take it: int32 or int64 in native order (others converted)."""
    if a.dtype in (np.dtype(np.int32), np.dtype(np.int64)):
        return a
    return a.astype(np.int64)


def prefetched(chunks: Iterator[T], ahead: bool) -> Generator[T, None, None]:
    """The chunks, the next one read by a helper thread while this one is used (``ahead``)."""
    if not ahead:
        yield from chunks
        return
    q: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    done = object()

    def read() -> None:
        try:
            for item in chunks:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            q.put(exc)
        finally:
            chunks.close() if hasattr(chunks, "close") else None

    worker = threading.Thread(target=read, name="csr-reader", daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while worker.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.1)
        worker.join()


def refuse(source: EdgeSource, src: np.ndarray, dst: np.ndarray, at: int, bad: int, num_nodes: int) -> None:
    """Edge ``at + bad`` names a vertex that is not one: the source's own message, or a generic one."""
    check = getattr(source, "check", None)
    if check is not None:
        check(src, dst, at)  # raises, naming the file
    raise DatasetError(f"edge {at + bad} ({int(src[bad])} → {int(dst[bad])}) names a vertex outside 0..{num_nodes - 1}")


def windows(ends: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Vertex ranges [a, b) holding at most ``cap`` neighbours each (one vertex may hold more)."""
    out, a, n = [], 0, ends.size
    while a < n:
        base = int(ends[a - 1]) if a else 0
        b = max(a + 1, int(np.searchsorted(ends, base + cap, side="right")))
        out.append((a, min(b, n)))
        a = b
    return out or [(0, 0)]


def keeps(most: int, layout: Layout) -> bool:
    """Whether the spread keeps every record in RAM instead of scratch files: all of them (a pair of
    ids each) within two thirds of the budget, leaving room to fill a bucket."""
    return 2 * most <= layout.window


def build(
    tmp: Path,
    source: EdgeSource,
    num_nodes: int,
    *,
    undirected: bool = False,
    self_loops: bool = False,
    memory: int,
    progress: Progress | None = None,
    layout: Layout | None = None,
    after_read: Callable[[], object] | None = None,
) -> int:
    """Write ``indptr.npy`` and ``indices.npy`` into ``tmp``; returns the number of edges.

    ``layout`` overrides the split of the budget (tests use it to force many chunks and buckets).
    ``after_read`` is called once the input is read, before the fill (which reads only the scratch
    files): what else needs the disk can start then.
    """
    layout = layout or Layout.plan(num_nodes, memory)
    threads = kernels.threads()
    dtype = index_dtype(num_nodes)
    most = source.size * (2 if undirected else 1) + (num_nodes if self_loops else 0)
    with contextlib.closing(prefetched(source.chunks(layout.chunk), threads > 1)) as chunks:
        first = next(chunks, None)
        buckets = Buckets.plan(num_nodes, most, layout, threads, first, undirected, self_loops)
        scratch = _Scratch(tmp / ".csr-buckets", buckets.count, 2 if undirected else 1, dtype, keeps(most, layout))
        try:
            _spread(source, num_nodes, buckets, scratch, undirected, self_loops, (first, chunks), threads, progress)
            if after_read is not None:
                after_read()
            total = scratch.total + (num_nodes if self_loops else 0)
            with open(tmp / FILES["indptr"], "wb") as ip, open(tmp / FILES["indices"], "wb") as ix:
                _header(ip, np.dtype(np.int64), (num_nodes + 1,))
                _header(ix, dtype, (total,))
                _Fill(scratch, ip, ix, self_loops, layout, threads, progress).run(buckets.starts)
        finally:
            scratch.remove()
    return total


def _spread(
    source: EdgeSource,
    num_nodes: int,
    buckets: Buckets,
    scratch: _Scratch,
    undirected: bool,
    self_loops: bool,
    chunks: tuple[tuple[np.ndarray, np.ndarray] | None, Edges],
    threads: int,
    progress: Progress | None,
) -> None:
    """Pass 1, the one read of the input (its first chunk, then the rest): every chunk checked and
    spread into the buckets."""
    records = np.empty((0, 2), dtype=scratch.dtype)
    sizes = np.zeros(scratch.parts * scratch.buckets, dtype=np.int64)
    done = 0
    first, rest = chunks
    for src, dst in itertools.chain([first] if first is not None else [], rest):
        s, d = _ints(src), _ints(dst)
        if records.shape[0] < scratch.parts * len(s):
            records = np.empty((scratch.parts * len(s), 2), dtype=scratch.dtype)
        bad = kernels.spread(
            s, d, num_nodes, buckets.fine, buckets.table, self_loops, undirected, records, sizes, threads
        )
        if bad >= 0:
            refuse(source, s, d, done, bad, num_nodes)
        scratch.add(records, sizes)
        done += len(s)
        _report(progress, "spread", done, source.size)
    scratch.close()


class _Scratch:
    """Each bucket's records (neighbour, destination), per part (forward, reverse) in input order:
    appended while the edges are read, read back bucket by bucket. In RAM when ``keep``, else one
    file per bucket and part under ``root`` (our own directory inside the staging one)."""

    def __init__(self, root: Path, buckets: int, parts: int, dtype: np.dtype, keep: bool) -> None:
        self.root, self.buckets, self.parts, self.dtype, self.keep = root, buckets, parts, dtype, keep
        self.sizes = np.zeros(parts * buckets, dtype=np.int64)
        self.kept: dict[int, list[np.ndarray]] = {}
        self.files: dict[int, IO[bytes]] = {}
        if not keep:
            root.mkdir()

    @property
    def total(self) -> int:
        return int(self.sizes.sum())

    def entries(self, k: int) -> int:
        """Records of bucket k, all parts."""
        return int(self.sizes[k :: self.buckets].sum())

    def path(self, seg: int) -> Path:
        return self.root / f"{seg % self.buckets}-{seg // self.buckets}.bin"

    def add(self, records: np.ndarray, sizes: np.ndarray) -> None:
        """A chunk's records, grouped by segment (``part * buckets + bucket``) with ``sizes`` each."""
        at = 0
        for seg in np.flatnonzero(sizes).tolist():
            part = records[at : at + sizes[seg]]
            at += int(sizes[seg])
            if self.keep:
                self.kept.setdefault(seg, []).append(part.copy())
            else:
                if seg not in self.files:
                    self.files[seg] = open(self.path(seg), "wb")  # noqa: SIM115 - closed by close()
                self.files[seg].write(part.data)
        self.sizes += sizes

    def close(self) -> None:
        """The read is over: every file complete."""
        for f in self.files.values():
            f.close()
        self.files.clear()

    def segments(self, k: int) -> list[int]:
        return [p * self.buckets + k for p in range(self.parts) if self.sizes[p * self.buckets + k]]

    @contextlib.contextmanager
    def load(self, k: int) -> Iterator[list[np.ndarray]]:
        """Bucket k's records per part (forward, then reverse), whole: kept arrays joined, or the
        scratch files mapped read-only (their pages are the page cache's, not copied); the
        bucket's scratch freed after."""
        maps: list[mmap.mmap] = []
        parts: list[np.ndarray] = []
        try:
            for seg in self.segments(k):
                size = int(self.sizes[seg])
                if self.keep:
                    parts.append(np.concatenate(self.kept[seg]))
                    continue
                with open(self.path(seg), "rb") as fh:
                    if os.fstat(fh.fileno()).st_size < size * 2 * self.dtype.itemsize:
                        self._short(seg)
                    maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
                    maps[-1].madvise(mmap.MADV_WILLNEED)  # read ahead if the pages were evicted
                parts.append(np.frombuffer(maps[-1], dtype=self.dtype, count=2 * size).reshape(-1, 2))
            yield parts
        finally:
            parts.clear()
            for m in maps:
                with contextlib.suppress(
                    BufferError
                ):  # an array of it still held (an error's traceback): closed when freed
                    m.close()
            self.drop(k)

    def pieces(self, k: int, size: int) -> Iterator[np.ndarray]:
        """Bucket k's records, forward then reverse, ``size`` at a time (read again on every call)."""
        for seg in self.segments(k):
            yield from self._read(seg, size)

    def _read(self, seg: int, size: int) -> Iterator[np.ndarray]:
        if self.keep:
            yield from self.kept.get(seg, [])
            return
        left = int(self.sizes[seg])
        with open(self.path(seg), "rb") as fh:
            while left:
                piece = np.fromfile(fh, dtype=self.dtype, count=2 * min(size, left))
                if piece.size != 2 * min(size, left) or not piece.size:
                    self._short(seg)
                left -= piece.size // 2
                yield piece.reshape(-1, 2)

    def _short(self, seg: int) -> None:
        raise DatasetError(
            f"{self.path(seg)}: a scratch file of the import ended early: was it changed while the import ran?"
        )

    def drop(self, k: int) -> None:
        for p in range(self.parts):
            seg = p * self.buckets + k
            self.kept.pop(seg, None)
            if not self.keep:
                self.path(seg).unlink(missing_ok=True)

    def remove(self) -> None:
        self.close()
        self.kept.clear()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


class _Fill:
    """Pass 2: bucket by bucket, the rows' pointers and neighbours appended to the two files."""

    def __init__(
        self,
        scratch: _Scratch,
        indptr: IO[bytes],
        indices: IO[bytes],
        self_loops: bool,
        layout: Layout,
        threads: int,
        progress: Progress | None,
    ) -> None:
        self.scratch, self.indptr, self.indices, self.self_loops = scratch, indptr, indices, self_loops
        self.layout, self.threads, self.progress = layout, threads, progress
        self.base = 0  # entries written so far: the next row's first slot

    def run(self, starts: np.ndarray) -> None:
        """Every bucket (``starts``: their first vertices, then N), front to back."""
        whole = {k for k in range(self.scratch.buckets) if self.scratch.entries(k) <= self.layout.window}
        most = max((self.scratch.entries(k) for k in whole), default=0)
        span = int(np.diff(starts).max(initial=0))
        out = np.empty(most + (span if self.self_loops else 0), dtype=self.scratch.dtype)
        first = np.empty(span + 1, dtype=np.int64)
        for k in range(self.scratch.buckets):
            lo, hi = int(starts[k]), int(starts[k + 1])
            if k in whole:
                self._whole(k, lo, hi, out, first)
            else:
                self._windowed(k, lo, hi)
            _report(self.progress, "fill", hi, int(starts[-1]))
        self.indptr.write(np.array([self.base], dtype=np.int64).data)

    def _whole(self, k: int, lo: int, hi: int, out: np.ndarray, starts: np.ndarray) -> None:
        """A bucket that fits: all its records at once, a parallel counting sort."""
        none = np.empty((0, 2), dtype=self.scratch.dtype)
        with self.scratch.load(k) as parts:
            forward, reverse = (*parts, none, none)[:2]  # either part may be absent: the order is the same
            rows = out[: len(forward) + len(reverse) + (hi - lo if self.self_loops else 0)]
            first = starts[: hi - lo + 1]
            wrong = kernels.fill(forward, reverse, lo, hi - lo, self.self_loops, rows, first, self.threads)
            del forward, reverse  # before the maps close
        if wrong:
            self._damaged(lo, hi)
        first += self.base
        self.indptr.write(first[:-1].data)
        self.indices.write(rows.data)
        self.base += len(rows)

    def _windowed(self, k: int, lo: int, hi: int) -> None:
        """A bucket over the budget: its degrees from one read of its records, then its rows in
        windows that fit, its records read again for each."""
        deg = np.full(hi - lo, 1 if self.self_loops else 0, dtype=np.int64)
        for piece in self.scratch.pieces(k, self.layout.chunk):
            if kernels.degrees(piece, lo, deg):
                self._damaged(lo, hi)
        ends = np.cumsum(deg)
        self.indptr.write((self.base + ends - deg).data)
        for a, b in windows(ends, self.layout.window):
            first = int(ends[a - 1]) if a else 0
            out = np.empty(int(ends[b - 1]) - first, dtype=self.scratch.dtype)
            cursor = ends[a:b] - deg[a:b] - first
            if self.self_loops:
                out[cursor] = np.arange(lo + a, lo + b, dtype=out.dtype)
                cursor += 1
            for piece in self.scratch.pieces(k, self.layout.chunk):
                if kernels.place(piece, lo, a, b, cursor, out):
                    self._damaged(lo, hi)
            if not np.array_equal(cursor, ends[a:b] - first):
                self._damaged(lo, hi)
            self.indices.write(out.data)
            del out
        self.scratch.drop(k)
        self.base += int(ends[-1]) if len(ends) else 0

    def _damaged(self, lo: int, hi: int) -> None:
        raise DatasetError(
            f"{self.scratch.root}: the scratch records of vertices {lo}..{hi - 1} do not match their count: "
            "was the import's staging directory changed while it ran?"
        )


def _header(fh, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """An .npy header; the data follows with plain writes."""
    np.lib.format.write_array_header_2_0(
        fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )


def _report(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress:
        progress(stage, done, total)


def default_memory() -> int:
    """The default budget: half of the memory available now (within this process's cgroup)."""
    return available_memory() // 2


def disk_need(num_nodes: int, num_edges: int, scratch: bool) -> int:
    """Bytes the CSR files take (and the scratch files, unless the records are kept in RAM)."""
    ids = index_dtype(num_nodes).itemsize
    return 8 * (num_nodes + 1) + num_edges * ids + (num_edges * 2 * ids if scratch else 0) + 2 * 128
