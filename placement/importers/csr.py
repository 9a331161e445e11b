"""CSR by destination from a stream of edge chunks, out of core, in a stated memory budget.

The neighbours of v are the sources of the edges into v (what v aggregates from). Two passes over
the edges, whatever their number:

1. **count**: in-degrees per destination, chunk by chunk (``np.bincount``, or a sort of the chunk
   when N is much larger than a chunk): an N-sized int64 array, the only thing that grows with N;
   its running sum becomes ``indptr`` (int64: more than 2^31 edges is fine).
2. **fill**: the destinations are cut into windows whose neighbour lists fit the budget. With one
   window, the edges are read again and placed in RAM; with several, one more read spreads them into
   one scratch file per window (in input order), then each window is read back, placed, and
   appended to ``indices.npy``. Every file is written with plain sequential writes (no memory map,
   so resident memory is the budget, not the file sizes), and the scratch files are deleted.

Order within a row, the same for any chunk size and any budget: the added self-loop (``self_loops``),
then the given edges in input order, then (``undirected``) the reverses in input order. A reverse is
not added for a self-loop, and no duplicate is removed: an edge given both ways appears twice, as in
``moment dataset import`` before. ``self_loops`` drops the input's self-loops and gives every vertex
exactly one (the IGB/DGL ``remove_self_loop`` + ``add_self_loop`` convention).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from moment.contracts.dataset import FILES, DatasetError
from moment.progress import Progress

Edges = Iterator[tuple[np.ndarray, np.ndarray]]  # chunks of (sources, destinations), int64, ids checked

ENTRY_BYTES = 40  # RAM per neighbour while a window is placed: read-back record, sort key, order, output
CHUNK_BYTES = 96  # RAM per input edge while a chunk is counted or spread (int64 pairs, reverses, keys)
MAX_CHUNK = 1 << 23  # edges per chunk: beyond this, larger chunks are not faster
LOOP, FORWARD, REVERSE = 0, 1, 2  # the order of a row's parts


class EdgeSource(Protocol):
    """Edges read in chunks: ``size`` edges in all, each chunk a pair of int64 arrays, ids checked."""

    size: int

    def chunks(self, chunk: int) -> Edges: ...


@dataclass(frozen=True)
class Layout:
    """How the builder spends the budget: edges per chunk and neighbours per window."""

    chunk: int
    window: int

    @staticmethod
    def plan(num_nodes: int, memory: int) -> Layout:
        """Split ``memory`` bytes: the N-sized counters first, then a quarter of the rest for the
        chunk being read, the remainder for the window being placed. Refused if the counters alone
        do not fit (one line saying how much is needed)."""
        fixed = 8 * (num_nodes + 1)
        need = fixed + 64 * (CHUNK_BYTES + ENTRY_BYTES) * 1024
        if memory < need:
            raise DatasetError(
                f"--memory {memory / 1e9:.3g} GB is too small for {num_nodes:,} vertices: the "
                f"CSR build needs at least {need / 1e9:.3g} GB (8 bytes per vertex for the "
                "degree counters, plus room for a chunk of edges)"
            )
        rest = memory - fixed
        chunk = int(min(MAX_CHUNK, rest // 4 // CHUNK_BYTES))
        return Layout(chunk=chunk, window=max(1, (rest - chunk * CHUNK_BYTES) // ENTRY_BYTES))


def index_dtype(num_nodes: int) -> np.dtype:
    """Neighbour ids: int32 while every id fits (IGB-full and papers100M do), else int64."""
    return np.dtype(np.int32 if num_nodes < 2**31 else np.int64)


def _parts(src: np.ndarray, dst: np.ndarray, undirected: bool, self_loops: bool) -> list[tuple[np.ndarray, ...]]:
    """A chunk's entries as (sources, destinations, part): the given edges, then their reverses."""
    if self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    parts = [(src, dst, FORWARD)]
    if undirected:
        keep = src != dst
        parts.append((dst[keep], src[keep], REVERSE))
    return parts


def count(
    source: EdgeSource, num_nodes: int, undirected: bool, self_loops: bool, chunk: int, progress: Progress | None = None
) -> np.ndarray:
    """In-degrees per destination (pass 1), int64, loops and reverses included."""
    counts = np.zeros(num_nodes, dtype=np.int64) if not self_loops else np.ones(num_nodes, dtype=np.int64)
    done = 0
    for src, dst in source.chunks(chunk):
        for _, d, _ in _parts(src, dst, undirected, self_loops):
            if not d.size:
                continue
            lo, hi = int(d.min()), int(d.max()) + 1
            if hi - lo <= 4 * d.size:  # a counter per vertex of the chunk's range: no N-sized temporary
                counts[lo:hi] += np.bincount(d - lo, minlength=hi - lo)
            else:
                ids, k = np.unique(d, return_counts=True)
                counts[ids] += k
        done += src.size
        _report(progress, "count", done, source.size)
    return counts


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
    ends = count(source, num_nodes, undirected, self_loops, layout.chunk, progress)
    np.cumsum(ends, out=ends)  # ends[v] = indptr[v + 1]: the counters become the row pointers in place
    total = int(ends[-1]) if num_nodes else 0
    with open(tmp / FILES["indptr"], "wb") as fh:
        _header(fh, np.dtype(np.int64), (num_nodes + 1,))
        fh.write(np.zeros(1, np.int64).data)
        fh.write(ends.data)
    cuts = windows(ends, layout.window)
    dtype = index_dtype(num_nodes)
    key_dtype = np.dtype(np.int32 if 3 * num_nodes < 2**31 else np.int64)
    with open(tmp / FILES["indices"], "wb") as out:
        _header(out, dtype, (total,))
        if len(cuts) == 1:
            _place_all(out, source, cuts[0], ends, dtype, key_dtype, undirected, self_loops, layout.chunk, progress)
        else:
            _place_spread(
                tmp, out, source, cuts, ends, dtype, key_dtype, undirected, self_loops, layout.chunk, progress
            )
    return total


def _place_all(
    out,
    source: EdgeSource,
    cut: tuple[int, int],
    ends: np.ndarray,
    dtype: np.dtype,
    key_dtype: np.dtype,
    undirected: bool,
    self_loops: bool,
    chunk: int,
    progress: Progress | None,
) -> None:
    """One window: read the edges again, place them all in RAM, write them out."""
    srcs, keys, done = [], [], 0
    for src, dst in source.chunks(chunk):
        for s, d, part in _parts(src, dst, undirected, self_loops):
            srcs.append(s.astype(dtype))
            keys.append((d * 3 + part).astype(key_dtype))
        done += src.size
        _report(progress, "fill", done, source.size)
    srcs.append(np.empty(0, dtype))
    keys.append(np.empty(0, key_dtype))
    _write_window(out, cut, ends, np.concatenate(srcs), np.concatenate(keys), dtype, self_loops)


def _place_spread(
    tmp: Path,
    out,
    source: EdgeSource,
    cuts: list[tuple[int, int]],
    ends: np.ndarray,
    dtype: np.dtype,
    key_dtype: np.dtype,
    undirected: bool,
    self_loops: bool,
    chunk: int,
    progress: Progress | None,
) -> None:
    """Several windows: spread the edges into one scratch file per window, then place each."""
    scratch = tmp / ".csr-windows"
    scratch.mkdir()
    try:
        starts = np.array([a for a, _ in cuts], dtype=np.int64)
        record = np.dtype(np.int64) if max(dtype.itemsize, key_dtype.itemsize) == 8 else np.dtype(np.int32)
        files = [open(scratch / f"{w}.bin", "wb") for w in range(len(cuts))]  # noqa: SIM115 - closed below
        try:
            done = 0
            for src, dst in source.chunks(chunk):
                for s, d, part in _parts(src, dst, undirected, self_loops):
                    _spread(files, starts, s, d, part, record)
                done += src.size
                _report(progress, "spread", done, source.size)
        finally:
            for fh in files:
                fh.close()
        done = 0
        for w, cut in enumerate(cuts):
            path = scratch / f"{w}.bin"
            pairs = np.fromfile(path, dtype=record).reshape(-1, 2)
            path.unlink()
            src, keys = pairs[:, 0].astype(dtype), pairs[:, 1].astype(key_dtype)
            del pairs
            _write_window(out, cut, ends, src, keys, dtype, self_loops)
            del src, keys
            done += cut[1] - cut[0]
            _report(progress, "fill", done, ends.size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # our own scratch directory inside the staging one


def _spread(files: list, starts: np.ndarray, src: np.ndarray, dst: np.ndarray, part: int, record: np.dtype) -> None:
    """Append a chunk's (source, key) records to the file of each destination's window, in input order."""
    if not src.size:
        return
    which = np.searchsorted(starts, dst, side="right") - 1
    rec = np.empty((src.size, 2), dtype=record)
    rec[:, 0] = src
    rec[:, 1] = dst * 3 + part
    if len(files) < 2**15:
        which = which.astype(np.int16)  # a stable sort of 16-bit keys is a radix sort
    order = np.argsort(which, kind="stable")
    sizes = np.bincount(which, minlength=len(files))
    rec = rec[order]
    at = 0
    for w in np.flatnonzero(sizes):
        files[w].write(rec[at : at + sizes[w]].data)
        at += int(sizes[w])


def _write_window(
    out, cut: tuple[int, int], ends: np.ndarray, src: np.ndarray, keys: np.ndarray, dtype: np.dtype, self_loops: bool
) -> None:
    """Order a window's entries by (destination, part, input order) and append them to indices."""
    a, b = cut
    if self_loops:
        loops = np.arange(a, b, dtype=np.int64)
        src = np.concatenate([src, loops.astype(dtype)])
        keys = np.concatenate([keys, (loops * 3 + LOOP).astype(keys.dtype)])
    n = keys.size
    if not n:
        return
    base = int(ends[a - 1]) if a else 0
    if n != int(ends[b - 1]) - base:
        raise DatasetError(
            f"the edges changed between two reads ({n} neighbours for vertices {a}..{b - 1}, "
            f"{int(ends[b - 1]) - base} counted): is the input being written to?"
        )
    # (key - 3a)·n + position is unique, so a plain in-place sort of it is a stable sort by key
    order = keys.astype(np.int64)
    del keys
    order -= 3 * a
    order *= n
    order += np.arange(n, dtype=np.int64)
    order.sort()
    order %= n
    out.write(np.ascontiguousarray(src[order], dtype=dtype).data)


def _header(fh, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """An .npy header; the data follows with plain writes."""
    np.lib.format.write_array_header_2_0(
        fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )


def _report(progress: Progress | None, stage: str, done: int, total: int) -> None:
    if progress:
        progress(stage, done, total)


def free_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); a conservative 2 GB where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 30


def default_memory() -> int:
    """The default budget: half of the memory available now."""
    return free_memory() // 2


UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_memory(text: str) -> int:
    """``4GB``, ``512MB``, ``1.5GiB``, ``2e9`` → bytes (a ValueError naming the text otherwise)."""
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        value = float(num) * UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size (e.g. 4GB, 512MB, 1GiB)") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a memory budget must be positive")
    return int(value)


def disk_need(num_nodes: int, num_edges: int, windows_needed: bool) -> int:
    """Bytes the CSR files take (and the scratch files, if the edges do not fit one window)."""
    ids = index_dtype(num_nodes).itemsize
    record = 4 if ids == 4 and 3 * num_nodes < 2**31 else 8
    scratch = num_edges * 2 * record if windows_needed else 0
    return 8 * (num_nodes + 1) + num_edges * ids + scratch + 2 * 128
