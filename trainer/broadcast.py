"""The broadcast engine of ``moment infer``: each layer's input streamed once, in placed order,
its messages scattered into the destinations (the ATLAS scheme; :mod:`trainer.infer` is the
driver, its gather engine the reference).

For a layer with a scatter form (:class:`trainer.models.Scatter`: SAGE mean), destinations
``[a, b)`` (a *partition*) are computed in one pass over the sources:

* the in-edges of the partition (a contiguous slice of the CSR, read once, slab by slab) are
  grouped by **source block** — ``block`` consecutive vertex ids, fixed from id 0 whatever the ranks
  or partitions — stable, so within a block each destination keeps its CSR edge order;
* the source blocks are streamed in new-id order (layer 1: from the tiers — cache bins from
  memory, SSD bins as coalesced large reads; later layers: the previous layer's file, sliced
  sequentially); a block with no edge into the partition and no row of it is not read at all;
* each block's messages (the layer's weight applied per source: transform, then aggregate) are
  added into the partition's sums in edge order, and the rows of the partition in the block add
  their own (root) term; when the last block is in, every destination of the partition is complete:
  the layer's finish and activation are applied and its rows written to the layer's file in one
  sequential write, which the next layer streams.

Memory: the sums (one row of the layer's output width per destination), two blocks' buffers
(one read ahead) and the bucketed edges (8 bytes each) as far as they fit beside the sums; the
rest are written to a scratch file as they are bucketed and read back block by block in the
read-ahead thread (:class:`Buckets`), so the input is still streamed once: edges cost 8 bytes
written and read back, not another pass. Only when a rank's *sums* do not fit its share of
``--memory`` are its destinations cut into several partitions (:func:`partitions`), each
streaming the sources once: the count is recorded in inference.json. The first streams the input
and relays the messages (:class:`Relay`) which the later ones stream instead, where narrower. Every rank streams every
source block its destinations need: with ``N`` ranks the input is read about ``N`` times. The
bytes do not depend on the partitions, the ranks, the budget or where the edges were held: every
destination's sum is added in the same order (source blocks ascending, then CSR order), messages
come from the same fixed blocks. On a CUDA device ``index_add_`` adds in no fixed order (as the
gather engine's scatter); on the CPU a compiled loop adds in edge order.

A killed run resumes at its last finished partition (a partition is the engine's chunk).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment.contracts.inference import InferenceError
from moment.host_memory import available_memory
from trainer.models import Scatter

SLAB_EDGES = 1 << 22  # in-edges bucketed at a time (bounds the sort's scratch memory)
MIN_SLAB_EDGES = 1 << 14  # the fewest (a smaller budget is refused)
READ_BUFFER = 1 << 23  # bytes of buffers reading spilled edges back (shared by their arrays)
READ_CHUNK_MIN = 1 << 12  # elements: the smallest read of a spilled array
EDGE_BYTES = 8  # a bucketed edge: its source's row in its block and its destination's row, int32 each
SCRATCH_PER_SLAB_EDGE = 30  # bytes per edge while a slab is bucketed (ids, keys, the sort order)

Rows = Callable[[int, int], torch.Tensor]  # [s0, s1) -> the layer's input rows (float32, on the device)
Write = Callable[[int, torch.Tensor], None]  # (first destination, its rows of the layer's output)
WRITE_ROWS = 1 << 16  # output rows activated and written at a time (bounds the copies)


def default_memory(held: int = 0) -> int:
    """``--memory``'s default: three quarters of what this process may still use once it holds
    ``held`` more bytes (the tiers' caches it loads); the rest stays for the page cache."""
    return max(available_memory() - held, 0) * 3 // 4


def row_bytes(width: int) -> int:
    """Partial state of one destination: its sum (float32, the layer's output width) and its degree."""
    return 4 * width + 4


def fixed_bytes(block: int, in_width: int, width: int) -> int:
    """Memory a pass needs beside its partition's sums whatever the partition's size: two source
    blocks' input and messages (one computed, one read ahead), the output slices written, the
    buffers reading spilled edges back."""
    return 2 * block * 4 * (in_width + 2 * width) + 2 * WRITE_ROWS * 4 * width + READ_BUFFER


def slab_edges(memory: int) -> int:
    """In-edges bucketed at a time under ``memory``: the bucketing's scratch (freed before the sums
    are made) takes at most a quarter of it. The slab size changes no byte of the output."""
    return int(min(SLAB_EDGES, max(MIN_SLAB_EDGES, memory // (4 * SCRATCH_PER_SLAB_EDGE))))


def edge_room(rows: int, edges: int, width: int, in_width: int, block: int, memory: int) -> int:
    """Bytes of bucketed edges a partition of ``rows`` destinations (``edges`` in-edges) holds in
    memory beside its sums and buffers (and, while they are made, the bucketing's scratch)."""
    scratch = SCRATCH_PER_SLAB_EDGE * min(edges, slab_edges(memory))
    return max(memory - max(rows * row_bytes(width) + fixed_bytes(block, in_width, width), scratch), 0)


def edges_in_memory(rows: int, edges: int, width: int, in_width: int, block: int, memory: int) -> bool:
    """Whether a partition keeps all its bucketed in-edges in memory; where not, those beyond
    :func:`edge_room` go to a scratch file on disk (written once, read back block by block)."""
    return EDGE_BYTES * edges <= edge_room(rows, edges, width, in_width, block, memory)


def partitions(
    indptr: np.ndarray, lo: int, hi: int, width: int, in_width: int, block: int, memory: int
) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into the fewest consecutive destination ranges whose partial state fits
    ``memory`` with one pass's fixed buffers (their bucketed in-edges go to disk where they do not
    fit too: every further partition streams the input once more, a spilled edge costs 8 bytes
    written and read back); refuses a budget too small for even 64 destinations."""
    room = memory - fixed_bytes(block, in_width, width)
    if room < row_bytes(width) * 64 or memory < SCRATCH_PER_SLAB_EDGE * MIN_SLAB_EDGES:
        need = max(fixed_bytes(block, in_width, width) + row_bytes(width) * 64, SCRATCH_PER_SLAB_EDGE * MIN_SLAB_EDGES)
        raise InferenceError(
            f"--memory: {memory / 1e9:.3g} GB a rank is too small for the broadcast engine: a pass needs "
            f"{need / 1e9:.3g} GB (source blocks of {block} rows, {in_width} → {width} wide); "
            f"give more, a smaller --batch-size, or --engine gather"
        )
    size = room // row_bytes(width)
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


class Buckets:
    """The in-edges of destinations ``[a, b)`` grouped by source block: per slab of destinations,
    the slab's edges stably sorted by block, with each block's offsets. Block ``k``'s edges are
    the concatenation of its run in every slab (slabs ascend in destination order, so this is the
    CSR's order restricted to the block, whatever the slab size).

    With ``spill`` (a file path) the slabs' sorted edges beyond the first ``hold`` bytes are
    written there as they are made and block ``k``'s runs read back when it streams (``pread``,
    one per slab and array): memory then holds ``hold`` bytes of edges and the slabs' block
    offsets. The file is removed by :meth:`close`."""

    def __init__(
        self,
        indptr: np.ndarray,
        indices: np.ndarray,
        a: int,
        b: int,
        block: int,
        num_nodes: int,
        slab: int = 0,
        spill: Path | None = None,
        hold: int = 0,
    ) -> None:
        slab = slab or SLAB_EDGES
        self.block, self.blocks = block, -(-num_nodes // block)
        self.pieces: list[tuple[np.ndarray | _Region, np.ndarray | _Region, np.ndarray]] = []
        self.spill, self._fd = spill, None
        if spill is not None:
            self._fd = os.open(spill, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            # read back in large sequential chunks of our own: no readahead the cgroup evicts unread
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        spilled: list[tuple[int, int, int]] = []  # (piece, offset, edges) of the spilled slabs
        ptr = np.asarray(indptr[a : b + 1], dtype=np.int64)
        at, held = 0, 0
        for s, t in slabs(ptr, slab):
            src = np.asarray(indices[ptr[s] : ptr[t]])
            if src.size:
                local, dst, starts = _bucket(ptr[s : t + 1] - ptr[s], src, block, self.blocks, s)
                size = local.nbytes + dst.nbytes
                if self._fd is not None and held + size > hold:  # local then dst, int32 each, appended
                    _write_all(self._fd, local, at)
                    _write_all(self._fd, dst, at + local.nbytes)
                    spilled.append((len(self.pieces), at, local.size))
                    self.pieces.append((local[:0], dst[:0], starts))  # a place holder, in slab order
                    at += local.nbytes + dst.nbytes
                else:
                    self.pieces.append((local, dst, starts))
                    held += size
        if spilled:  # the read buffers share READ_BUFFER
            chunk = max(READ_CHUNK_MIN, READ_BUFFER // (2 * len(spilled)) // 4)
            fd = self._fd
            assert fd is not None
            for i, off, size in spilled:
                starts = self.pieces[i][2]
                self.pieces[i] = (_Region(fd, off, size, chunk), _Region(fd, off + 4 * size, size, chunk), starts)
        counts = sum((p[2][1:] - p[2][:-1] for p in self.pieces), np.zeros(self.blocks, dtype=np.int64))
        self.counts = counts
        self.spilled = at  # bytes written to ``spill``

    def of(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``k``'s edges: each source's row in the block and its destination's row in the partition."""
        parts = [(self._run(p[0], p[2], k), self._run(p[1], p[2], k)) for p in self.pieces]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _run(self, where: np.ndarray | _Region, starts: np.ndarray, k: int) -> np.ndarray:
        if isinstance(where, np.ndarray):
            return where[starts[k] : starts[k + 1]]
        return where.take(int(starts[k]), int(starts[k + 1]))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            assert self.spill is not None
            self.spill.unlink(missing_ok=True)


def slabs(ptr: np.ndarray, slab: int) -> Iterator[tuple[int, int]]:
    """Consecutive destination ranges ``[s, t)`` (offsets into ``ptr``, a CSR slice) of at most
    ``slab`` in-edges each (a destination with more is a slab of its own)."""
    s, n = 0, ptr.size - 1
    while s < n:
        t = int(np.searchsorted(ptr, ptr[s] + slab, side="right")) - 1
        t = min(max(t, s + 1), n)
        yield s, t
        s = t


def spilled_bytes(indptr: np.ndarray, a: int, b: int, slab: int, hold: int) -> int:
    """Bytes of bucketed edges :class:`Buckets` writes to its scratch file for destinations
    ``[a, b)`` when it holds ``hold`` bytes in memory (its rule: whole slabs, in order, while they fit)."""
    ptr = np.asarray(indptr[a : b + 1], dtype=np.int64)
    held = spilled = 0
    for s, t in slabs(ptr, slab):
        size = EDGE_BYTES * int(ptr[t] - ptr[s])
        if size and held + size > hold:
            spilled += size
        else:
            held += size
    return spilled


class _Region:
    """One spilled int32 array in the scratch file, read back front to back (blocks ascend) in
    chunks of at least ``chunk`` elements: each byte read from the disk once."""

    def __init__(self, fd: int, offset: int, size: int, chunk: int) -> None:
        self.fd, self.offset, self.size, self.chunk = fd, offset, size, chunk
        self.buf, self.first = np.empty(0, dtype=np.int32), 0  # elements [first, first + buf.size)

    def take(self, i: int, j: int) -> np.ndarray:
        """Elements ``[i, j)`` (``i`` never below an earlier call's)."""
        if j > self.first + self.buf.size:
            end = min(max(j, i + self.chunk), self.size)
            keep = self.buf[i - self.first :] if i < self.first + self.buf.size else self.buf[:0]
            fresh = np.empty(end - i, dtype=np.int32)
            fresh[: keep.size] = keep
            _read_all(self.fd, fresh[keep.size :], self.offset + 4 * (i + keep.size))
            self.buf, self.first = fresh, i
        return self.buf[i - self.first : j - self.first]


def _write_all(fd: int, a: np.ndarray, offset: int) -> None:
    view, done = memoryview(a).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _read_all(fd: int, a: np.ndarray, offset: int) -> None:
    view, done = memoryview(a).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise InferenceError(f"edge scratch file: ended at byte {offset + done} (removed while the pass ran?)")
        done += got


def _bucket(
    ptr: np.ndarray, src: np.ndarray, block: int, blocks: int, first: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One slab's edges grouped by source block (stable): (row in block, destination, block starts)."""
    local, dst = np.empty(src.size, dtype=np.int32), np.empty(src.size, dtype=np.int32)
    starts = np.empty(blocks + 1, dtype=np.int64)
    kernel = _kernels()[1]
    if kernel is not None:
        kernel(ptr, src, block, blocks, first, local, dst, starts)
        return local, dst, starts
    key = src // block
    order = np.argsort(key, kind="stable")
    starts[:] = np.searchsorted(key[order], np.arange(blocks + 1), side="left")
    local[:] = src[order] - key[order] * block
    dst[:] = np.repeat(np.arange(first, first + ptr.size - 1, dtype=np.int32), np.diff(ptr))[order]
    return local, dst, starts


def relays(parts: int, width: int, in_row_bytes: int) -> bool:
    """Whether a rank whose destinations take ``parts`` partitions relays its layer's messages
    (:class:`Relay`): where its later passes would otherwise re-read an input wider than the
    messages they need."""
    return parts > 1 and 4 * width < in_row_bytes


@dataclass
class Relay:
    """A layer's messages of every source and root terms of rows ``[r0, r1)`` (a rank's rows
    after its first partition), written by the rank's first pass as it streams the input and
    streamed by its later passes in their place: the input is read once whatever the partitions,
    the later passes read ``width`` floats a source instead of the input's row. The values are
    the ones those passes would compute from the input (the same blocks through the same
    weights), so the bytes of the output do not change."""

    messages: np.memmap  # num_nodes × width float32
    roots: np.memmap  # (r1 - r0) × width float32
    r0: int
    writing: bool  # the first pass (writes), else a later one (reads)


@dataclass
class Pass:
    """What one partition's pass did (the bytes of input it asked for, its blocks read)."""

    blocks_read: int = 0
    input_bytes: int = 0  # as the engine holds them (float32)
    input_rows: int = 0
    message_rows: int = 0  # relayed messages read in place of input rows
    root_rows: int = 0  # relayed root terms read
    spilled_bytes: int = 0  # bucketed edges written to the scratch file (and read back once)
    edges_on_disk: bool = False  # its bucketed in-edges went through a scratch file


def run_partition(
    form: Scatter,
    after: Callable[[torch.Tensor], torch.Tensor],
    indptr: np.ndarray,
    indices: np.ndarray,
    a: int,
    b: int,
    rows: Rows,
    block: int,
    num_nodes: int,
    width: int,
    device: torch.device,
    write: Write,
    update: Callable[[int], None] | None = None,
    memory: int = 0,
    in_width: int = 0,
    scratch: Path | None = None,
    relay: Relay | None = None,
) -> Pass:
    """The layer's output rows of destinations ``[a, b)``, from one stream of its input's source
    blocks, handed to ``write`` in ascending slices after ``after`` (the activation). ``update``:
    told the partition's vertices in steps as the stream advances (``b - a`` in all). ``memory``:
    the pass's budget (0: none; ``in_width``: the input's width, for its buffers); where the
    bucketed edges do not fit it beside the sums they go to the file ``scratch`` (removed after).
    ``relay``: the messages this pass writes (the rank's first) or streams instead of the input."""
    edges = int(indptr[b]) - int(indptr[a])
    in_memory = not memory or edges_in_memory(b - a, edges, width, in_width, block, memory)
    spill = None if in_memory or scratch is None else scratch
    hold = edge_room(b - a, edges, width, in_width, block, memory) if memory else 0
    buckets = Buckets(indptr, indices, a, b, block, num_nodes, slab_edges(memory) if memory else 0, spill, hold)
    with contextlib.closing(buckets):
        h, done = _stream(form, buckets, indptr, (a, b), rows, num_nodes, width, device, update, relay)
    done.edges_on_disk = spill is not None
    done.spilled_bytes = buckets.spilled
    for i in range(0, b - a, WRITE_ROWS):
        write(a + i, after(h[i : i + WRITE_ROWS]))
    return done


def _stream(
    form: Scatter,
    buckets: Buckets,
    indptr: np.ndarray,
    dests: tuple[int, int],
    rows: Rows,
    num_nodes: int,
    width: int,
    device: torch.device,
    update: Callable[[int], None] | None,
    relay: Relay | None = None,
) -> tuple[torch.Tensor, Pass]:
    """The finished rows of destinations ``dests`` from one stream of the source blocks, and what
    the stream read."""
    a, b = dests
    block = buckets.block
    deg = np.diff(np.asarray(indptr[a : b + 1], dtype=np.int64))
    c = torch.from_numpy(np.maximum(deg, 1).astype(np.float32)).to(device).unsqueeze(1)
    acc = torch.zeros((b - a, width), dtype=torch.float32, device=device)
    add = _scatter_add(device)
    done = Pass()
    spans = [(k * block, min((k + 1) * block, num_nodes)) for k in range(buckets.blocks)]
    writing = relay is not None and relay.writing
    # a block with nothing reaching the partition (no edge, no row of it) is not read (unless relayed)
    todo = [k for k, (s0, s1) in enumerate(spans) if writing or buckets.counts[k] or max(s0, a) < min(s1, b)]

    def fetch(k: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, Any]:
        """Block ``k``'s input rows — or, from a relay, its messages and the partition's root
        terms in it — and its edges into the partition (read back where spilled)."""
        s0, s1 = spans[k]
        edges = buckets.of(k) if buckets.counts[k] else None
        if relay is None or writing:
            return rows(s0, s1), None, None, edges
        lo, hi = max(s0, a), min(s1, b)
        msg = torch.from_numpy(np.array(relay.messages[s0:s1])).to(device) if edges is not None else None
        root = torch.from_numpy(np.array(relay.roots[lo - relay.r0 : hi - relay.r0])).to(device) if lo < hi else None
        return None, msg, root, edges

    with ThreadPoolExecutor(1, thread_name_prefix="broadcast-read") as pool:
        ahead = [pool.submit(fetch, todo[0])] if todo else []
        for i, k in enumerate(todo):
            x, msg, root, edges = ahead.pop().result()
            if i + 1 < len(todo):  # the next block is read while this one is computed
                ahead.append(pool.submit(fetch, todo[i + 1]))
            s0, s1 = spans[k]
            lo, hi = max(s0, a), min(s1, b)
            done.blocks_read += 1
            if x is not None:
                done.input_bytes += x.numel() * x.element_size()
                done.input_rows += s1 - s0
                if relay is not None and relay.writing:  # every block's messages and root terms, relayed
                    msg, terms = form.message(x).contiguous(), form.root(x)
                    _relay_block(relay, s0, s1, msg, terms)
                    full: torch.Tensor | None = terms
                else:
                    msg = form.message(x).contiguous() if edges is not None else None
                    full = form.root(x) if lo < hi else None
                root = full[lo - s0 : hi - s0] if full is not None and lo < hi else None
            else:
                done.message_rows += s1 - s0 if msg is not None else 0
                done.root_rows += hi - lo if root is not None else 0
            if edges is not None:
                assert msg is not None  # computed or relayed for every block with edges into the partition
                src, dst = edges
                add(acc, dst, src, msg)
            if lo < hi:  # the partition's own rows in this block: their root term, weighted by c
                assert root is not None  # computed or relayed for every block holding partition rows
                acc[lo - a : hi - a] += c[lo - a : hi - a] * root
            if update is not None:  # the stream's share of the partition's vertices
                step = (b - a) * (i + 1) // len(todo) - (b - a) * i // len(todo)
                if step:
                    update(step)
    return form.finish(acc, c), done


def _relay_block(relay: Relay, s0: int, s1: int, msg: torch.Tensor, root: torch.Tensor) -> None:
    """Block ``[s0, s1)``'s messages and its root terms of the relayed rows, into the relay."""
    relay.messages[s0:s1] = msg.cpu().numpy()
    w0, w1 = max(s0, relay.r0), min(s1, relay.r0 + relay.roots.shape[0])
    if w0 < w1:
        relay.roots[w0 - relay.r0 : w1 - relay.r0] = root[w0 - s0 : w1 - s0].cpu().numpy()


def _scatter_add(device: torch.device) -> Callable[[torch.Tensor, np.ndarray, np.ndarray, torch.Tensor], None]:
    """``acc[dst] += msg[src]`` over the edges: the compiled loop on the CPU (edge order, no
    gathered copy), ``index_add_`` on another device (or where numba cannot compile)."""
    kernel = _kernels()[0] if device.type == "cpu" else None
    if kernel is not None:

        def add(acc: torch.Tensor, dst: np.ndarray, src: np.ndarray, msg: torch.Tensor) -> None:
            kernel(acc.numpy(), np.ascontiguousarray(dst), np.ascontiguousarray(src), msg.numpy())

        return add

    def index_add(acc: torch.Tensor, dst: np.ndarray, src: np.ndarray, msg: torch.Tensor) -> None:
        d = torch.from_numpy(dst.astype(np.int64)).to(acc.device)
        s = torch.from_numpy(src.astype(np.int64)).to(acc.device)
        acc.index_add_(0, d, msg.index_select(0, s))

    return index_add


_KERNELS: list[Any] = []


def _kernels() -> tuple[Any, Any]:
    """The compiled scatter-add and bucketing (None each where numba is missing or cannot build it)."""
    if not _KERNELS:
        try:
            from trainer import scatter_kernel

            _KERNELS.extend([scatter_kernel.compiled(), scatter_kernel.bucket_compiled()])
        except ImportError:  # no numba: index_add_ and numpy's sort
            _KERNELS.extend([None, None])
    return _KERNELS[0], _KERNELS[1]
