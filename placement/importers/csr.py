"""CSR by destination from a stream of edge chunks, out of core, in a stated memory budget.

The neighbours of v are the sources of the edges into v (what v aggregates from). Two passes over
the edges, whatever their number:

1. **count**: in-degrees per destination, chunk by chunk, into an N+1 int64 array (the only thing
   that grows with N) whose running sum becomes ``indptr`` (int64: more than 2^31 edges is fine).
2. **fill**: the destinations are cut into windows whose neighbour lists fit the budget. With one
   window whose input edges also fit, the count kept them (two ids an edge) and each neighbour is
   written straight into its row at the row's cursor (``indptr`` itself, advanced one slot per
   neighbour: no sort, no extra memory): the input is read once. Otherwise one more read spreads
   the edges into scratch files per window (in input order), then each window is read back and
   scattered the same way. ``indices.npy`` is written window by
   window with plain sequential writes (no memory map, so resident memory is the budget, not the
   file sizes), and the scratch files are deleted.

The loops are compiled (placement.importers.kernels, GIL released); with more than one thread the
next chunk is read while this one is placed, and a window's rows are split between threads.

Order within a row, the same for any chunk size, budget and thread count: the added self-loop
(``self_loops``), then the given edges in input order, then (``undirected``) the reverses in input order. A reverse is not added for a
self-loop, and no duplicate is removed: an edge given both ways appears twice, as in ``moment
dataset import`` before. ``self_loops`` drops the input's self-loops and gives every vertex exactly
one (the IGB/DGL ``remove_self_loop`` + ``add_self_loop`` convention).
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from moment.contracts.dataset import FILES, DatasetError
from moment.host_memory import available_memory
from moment.progress import Progress
from placement.importers import kernels

T = TypeVar("T")
Edges = Iterator[tuple[np.ndarray, np.ndarray]]  # chunks of (sources, destinations), integers, ids checked

CHUNK_BYTES = 64  # RAM per input edge: three chunks in flight (int64 pairs) and a chunk grouped by window
# (``entry_bytes`` per neighbour for the window: its output id and its record; the edges kept by the
# count in one-read mode take two ids each, counted against the same budget: ``keeps``)
MAX_CHUNK = 1 << 23  # edges per chunk: beyond this, larger chunks are not faster
CHECK = 1 << 22  # row pointers compared with indptr.npy at once, after each window


def entry_bytes(num_nodes: int) -> int:
    """RAM per neighbour while a window is placed: its id in the output and its scratch record (a pair)."""
    return 3 * index_dtype(num_nodes).itemsize


class EdgeSource(Protocol):
    """Edges read in chunks: ``size`` edges in all, each chunk a pair of integer arrays, ids checked."""

    size: int

    def chunks(self, chunk: int) -> Edges: ...


@dataclass(frozen=True)
class Layout:
    """How the builder spends the budget: edges per chunk and neighbours per window."""

    chunk: int
    window: int

    @staticmethod
    def plan(num_nodes: int, memory: int) -> Layout:
        """Split ``memory`` bytes: the N+1 row pointers first, then a quarter of the rest for the
        chunks being read, the remainder for the window being placed. Refused if the pointers alone
        do not fit (one line saying how much is needed)."""
        fixed = 8 * (num_nodes + 1)
        entry = entry_bytes(num_nodes)
        need = fixed + 64 * (CHUNK_BYTES + entry) * 1024
        if memory < need:
            raise DatasetError(
                f"--memory {memory / 1e9:.3g} GB is too small for {num_nodes:,} vertices: the "
                f"CSR build needs at least {need / 1e9:.3g} GB (8 bytes per vertex for the "
                "degree counters, plus room for a chunk of edges)"
            )
        rest = memory - fixed
        chunk = int(min(MAX_CHUNK, rest // 4 // CHUNK_BYTES))
        return Layout(chunk=chunk, window=max(1, (rest - chunk * CHUNK_BYTES) // entry))


def index_dtype(num_nodes: int) -> np.dtype:
    """Neighbour ids: int32 while every id fits (IGB-full and papers100M do), else int64."""
    return np.dtype(np.int32 if num_nodes < 2**31 else np.int64)


ENTRY_BYTES = entry_bytes(1)  # int32 ids: every graph with fewer than 2^31 vertices


def _ints(a: np.ndarray) -> np.ndarray:
    """An id array as the kernels take it: int32 or int64 in native order (others converted)."""
    if a.dtype in (np.dtype(np.int32), np.dtype(np.int64)):
        return a
    return a.astype(np.int64)


def prefetched(chunks: Iterator[T], ahead: bool) -> Iterator[T]:
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


def count(
    source: EdgeSource,
    num_nodes: int,
    undirected: bool,
    self_loops: bool,
    chunk: int,
    progress: Progress | None = None,
    ahead: bool = False,
    kept: np.ndarray | None = None,
) -> np.ndarray:
    """Row pointers (pass 1): ``ptr[v + 1]`` = in-degree of v, loops and reverses included, then
    summed in place, so ``ptr`` is indptr (int64, N + 1). Every id is checked against N; ``kept``
    (E × 2), if given, receives the edges, so that the fill needs no second read."""
    ptr = np.zeros(num_nodes + 1, dtype=np.int64)
    if self_loops:
        ptr[1:] = 1
    keep = kept if kept is not None else np.empty((0, 2), dtype=index_dtype(num_nodes))
    done = 0
    for src, dst in prefetched(source.chunks(chunk), ahead):
        s, d = _ints(src), _ints(dst)
        bad = kernels.count_degrees(s, d, ptr, self_loops, undirected, keep, done)
        if bad >= 0:
            refuse(source, s, d, done, bad, num_nodes)
        done += len(src)
        _report(progress, "count", done, source.size)
    np.cumsum(ptr, out=ptr)
    return ptr


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
) -> int:
    """Write ``indptr.npy`` and ``indices.npy`` into ``tmp``; returns the number of edges.

    ``layout`` overrides the split of the budget (tests use it to force many chunks and windows).
    """
    layout = layout or Layout.plan(num_nodes, memory)
    ahead = kernels.threads() > 1
    dtype = index_dtype(num_nodes)
    most = source.size * (2 if undirected else 1) + (num_nodes if self_loops else 0)
    kept = np.empty((source.size, 2), dtype=dtype) if keeps(source.size, most, layout) else None
    ptr = count(source, num_nodes, undirected, self_loops, layout.chunk, progress, ahead, kept)
    total = int(ptr[-1])
    with open(tmp / FILES["indptr"], "wb") as fh:
        _header(fh, np.dtype(np.int64), (num_nodes + 1,))
        fh.write(ptr.data)
    fill = _Fill(tmp / FILES["indptr"], ptr, dtype, self_loops, progress)
    with open(tmp / FILES["indices"], "wb") as out:
        _header(out, dtype, (total,))
        if kept is not None:
            fill.kept(out, kept, (0, num_nodes), undirected)
        else:
            fill.spread(tmp, out, source, windows(ptr[1:], layout.window), undirected, layout.chunk, ahead)
    return total


def keeps(num_edges: int, most: int, layout: Layout) -> bool:
    """Whether the edges (a pair of ids each) and the whole output fit the window budget: then the
    count keeps the edges it reads and the fill reads nothing again (one read of the input)."""
    return 2 * num_edges + most <= 3 * layout.window


class _Fill:
    """Pass 2: neighbours scattered into their rows, window by window, at the cursors ``ptr``."""

    def __init__(self, indptr: Path, ptr: np.ndarray, dtype: np.dtype, self_loops: bool, progress) -> None:
        self.indptr, self.ptr, self.dtype, self.self_loops, self.progress = indptr, ptr, dtype, self_loops, progress
        self.threads = kernels.threads()

    def _window(self, cut: tuple[int, int]) -> tuple[np.ndarray, int]:
        a, b = cut
        base = int(self.ptr[a])
        out = np.empty(int(self.ptr[b]) - base, dtype=self.dtype)
        if self.self_loops:
            kernels.place_loops(a, b, self.ptr, out, base)
        return out, base

    def _place(self, src, dst, cut, out, base, part: int, drop_loops: bool) -> None:
        outside = kernels.scatter(
            _ints(src), _ints(dst), cut[0], cut[1], self.ptr, out, base, drop_loops, part, self.threads
        )
        if outside:
            self._changed(cut)

    def _finish(self, fh, cut: tuple[int, int], out: np.ndarray) -> None:
        """Every row of the window exactly full (its cursor at the next row's start), then written."""
        a, b = cut
        with open(self.indptr, "rb") as ip:
            for v in range(a, b, CHECK):
                m = min(CHECK, b - v)
                ip.seek(self.header + 8 * (v + 1))
                if not np.array_equal(np.fromfile(ip, dtype=np.int64, count=m), self.ptr[v : v + m]):
                    self._changed(cut)
        fh.write(out.data)

    @property
    def header(self) -> int:
        return int(self.indptr.stat().st_size) - 8 * self.ptr.size

    def _changed(self, cut: tuple[int, int]) -> None:
        raise DatasetError(
            f"the edges changed between two reads (the neighbours of vertices {cut[0]}..{cut[1] - 1} differ from "
            "their count): is the input being written to?"
        )

    def kept(self, fh, edges: np.ndarray, cut: tuple[int, int], undirected: bool) -> None:
        """Everything in one window, the edges kept in RAM by the count: scatter them, then the
        reverses, then write."""
        out, base = self._window(cut)
        self._place(edges[:, 0], edges[:, 1], cut, out, base, kernels.FORWARD, self.self_loops)
        _report(self.progress, "fill", edges.shape[0], edges.shape[0])
        if undirected:
            self._place(edges[:, 0], edges[:, 1], cut, out, base, kernels.REVERSE, self.self_loops)
        self._finish(fh, cut, out)

    def spread(self, tmp: Path, fh, source: EdgeSource, cuts, undirected: bool, chunk: int, ahead: bool) -> None:
        """Several windows: spread the edges into scratch files per window (and part), then place each."""
        scratch = tmp / ".csr-windows"
        scratch.mkdir()
        parts = (kernels.FORWARD, kernels.REVERSE) if undirected else (kernels.FORWARD,)
        try:
            starts = np.array([a for a, _ in cuts], dtype=np.int64)
            files = {
                (w, p): open(scratch / f"{w}-{p}.bin", "wb")  # noqa: SIM115 - closed below
                for w in range(len(cuts))
                for p in parts
            }
            try:
                done = 0
                for src, dst in prefetched(source.chunks(chunk), ahead):
                    s, d = _ints(src), _ints(dst)
                    for p in parts:
                        sizes = np.zeros(len(cuts), dtype=np.int64)
                        records = np.empty((len(s), 2), dtype=self.dtype)
                        if kernels.group(s, d, self.ptr.size - 1, starts, self.self_loops, p, records, sizes) < 0:
                            self._changed((0, self.ptr.size - 1))
                        at = 0
                        for w in np.flatnonzero(sizes).tolist():
                            files[(w, p)].write(records[at : at + sizes[w]].data)
                            at += int(sizes[w])
                    done += len(src)
                    _report(self.progress, "spread", done, source.size)
            finally:
                for f in files.values():
                    f.close()
            done = 0
            for w, cut in enumerate(cuts):
                out, base = self._window(cut)
                for p in parts:
                    path = scratch / f"{w}-{p}.bin"
                    records = np.fromfile(path, dtype=self.dtype).reshape(-1, 2)
                    path.unlink()
                    self._place(records[:, 0], records[:, 1], cut, out, base, kernels.FORWARD, False)
                    del records
                self._finish(fh, cut, out)
                del out
                done += cut[1] - cut[0]
                _report(self.progress, "fill", done, self.ptr.size - 1)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # our own scratch directory inside the staging one


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


def disk_need(num_nodes: int, num_edges: int, windows_needed: bool) -> int:
    """Bytes the CSR files take (and the scratch files, if the edges do not fit one window)."""
    ids = index_dtype(num_nodes).itemsize
    scratch = num_edges * 2 * ids if windows_needed else 0
    return 8 * (num_nodes + 1) + num_edges * ids + scratch + 2 * 128
