"""The broadcast engine of ``moment infer``: each layer's input streamed once, in placed order,
its messages scattered into the destinations (the ATLAS scheme; :mod:`trainer.infer` is the
driver, its gather engine the reference).

For a layer with a scatter form (:class:`trainer.models.Scatter`: SAGE mean), destinations
``[a, b)`` (a *partition*) are computed in one pass over the sources:

* the in-edges of the partition (a contiguous slice of the CSR, read once, slab by slab) are
  grouped by **source block** — ``block`` consecutive new ids, fixed from id 0 whatever the ranks
  or partitions — stable, so within a block each destination keeps its CSR edge order;
* the source blocks are streamed in new-id order (layer 1: from the tiers — cache bins from
  memory, SSD bins as coalesced large reads; later layers: the previous layer's file, sliced
  sequentially); a block with no edge into the partition and no row of it is not read at all;
* each block's messages (the layer's weight applied per source: transform, then aggregate) are
  added into the partition's sums in edge order, and the rows of the partition in the block add
  their own (root) term; when the last block is in, every destination of the partition is complete:
  the layer's finish and activation are applied and its rows written to the layer's file in one
  sequential write, which the next layer streams.

Memory: the sums (one row of the layer's output width per destination), the bucketed edges
(8 bytes each) and two blocks' buffers (one read ahead). When a rank's destinations do not fit
its share of ``--memory``, they are cut into several partitions (:func:`partitions`), each
streaming the sources once: the count is recorded in inference.json. Every rank streams every
source block its destinations need: with ``N`` ranks the input is read about ``N`` times. The bytes do not depend on the partitions, the ranks or the
budget: every destination's sum is added in the same order (source blocks ascending, then CSR
order), messages come from the same fixed blocks. On a CUDA device ``index_add_`` adds in no
fixed order (as the gather engine's scatter); on the CPU a compiled loop adds in edge order.

A killed run resumes at its last finished partition (a partition is the engine's chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment.contracts.inference import InferenceError
from trainer.models import Scatter

SLAB_EDGES = 1 << 22  # in-edges bucketed at a time (bounds the sort's scratch memory)
EDGE_BYTES = 8  # a bucketed edge: its source's row in its block and its destination's row, int32 each
SCRATCH_PER_SLAB_EDGE = 30  # bytes per edge while a slab is bucketed (ids, keys, the sort order)

Rows = Callable[[int, int], torch.Tensor]  # [s0, s1) -> the layer's input rows (float32, on the device)
Write = Callable[[int, torch.Tensor], None]  # (first destination, its rows of the layer's output)
WRITE_ROWS = 1 << 16  # output rows activated and written at a time (bounds the copies)


def default_memory(held: int = 0) -> int:
    """``--memory``'s default: three quarters of what this process may still use once it holds
    ``held`` more bytes (the tiers' caches it loads); the rest stays for the page cache."""
    return max(available_memory() - held, 0) * 3 // 4


def available_memory() -> int:
    """MemAvailable, bounded by this process's memory cgroup (v1 or v2): its limit less what it
    uses, page cache excepted (the kernel reclaims that); 2 GB where /proc cannot be read."""
    from placement.importers.csr import free_memory

    free = free_memory()
    group = cgroup_memory()
    return min(free, group) if group is not None else free


def cgroup_memory(proc: Path = Path("/proc/self/cgroup"), sys_fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup (v1 or v2) still allows: its limit less its usage, page
    cache excepted; None where there is no limit (or nothing can be read)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v1 = "memory" in controllers.split(",")
        if not v1 and controllers:
            continue
        root = (sys_fs / "memory" if v1 else sys_fs) / path.lstrip("/")
        limit_file, usage_file, cache = (
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
            if v1
            else ("memory.max", "memory.current", "file")
        )
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                continue  # no limit at this level
            stat = dict(ln.split()[:2] for ln in (root / "memory.stat").read_text().splitlines() if " " in ln)
            used = int((root / usage_file).read_text()) - int(stat.get(cache, 0))
            return max(int(limit) - used, 0)
        except (OSError, ValueError):
            continue
    return None


def row_bytes(width: int) -> int:
    """Partial state of one destination: its sum (float32, the layer's output width) and its degree."""
    return 4 * width + 4


def fixed_bytes(block: int, in_width: int, width: int) -> int:
    """Memory a pass needs whatever its partition's size: two source blocks' input and messages
    (one computed, one read ahead), the scratch of bucketing one slab, the output slices written."""
    return 2 * block * 4 * (in_width + 2 * width) + SCRATCH_PER_SLAB_EDGE * SLAB_EDGES + 2 * WRITE_ROWS * 4 * width


def partitions(
    indptr: np.ndarray, lo: int, hi: int, width: int, in_width: int, block: int, memory: int
) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into the fewest consecutive destination ranges whose partial state and
    bucketed edges fit ``memory`` with one pass's fixed buffers (a vertex whose edges alone do not
    fit is a partition of its own); refuses a budget too small for even that."""
    room = memory - fixed_bytes(block, in_width, width)
    if room < row_bytes(width) + EDGE_BYTES * 64:
        need = fixed_bytes(block, in_width, width) + row_bytes(width) + EDGE_BYTES * 64
        raise InferenceError(
            f"--memory: {memory / 1e9:.3g} GB a rank is too small for the broadcast engine: a pass needs "
            f"{need / 1e9:.3g} GB (source blocks of {block} rows, {in_width} → {width} wide); "
            f"give more, a smaller --batch-size, or --engine gather"
        )
    if hi <= lo:
        return []
    ptr = np.asarray(indptr[lo : hi + 1], dtype=np.int64)
    cost = row_bytes(width) * np.arange(hi - lo + 1, dtype=np.int64) + EDGE_BYTES * (ptr - ptr[0])
    out, i = [], 0
    while i < hi - lo:
        j = int(np.searchsorted(cost, cost[i] + room, side="right")) - 1
        j = min(max(j, i + 1), hi - lo)
        out.append((lo + i, lo + j))
        i = j
    return out


class Buckets:
    """The in-edges of destinations ``[a, b)`` grouped by source block: per slab of destinations,
    the slab's edges stably sorted by block, with each block's offsets. Block ``k``'s edges are
    the concatenation of its run in every slab (slabs ascend in destination order, so this is the
    CSR's order restricted to the block, whatever the slab size)."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, a: int, b: int, block: int, num_nodes: int) -> None:
        self.blocks = -(-num_nodes // block)
        self.pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        ptr = np.asarray(indptr[a : b + 1], dtype=np.int64)
        s = 0
        while s < b - a:
            t = int(np.searchsorted(ptr, ptr[s] + SLAB_EDGES, side="right")) - 1
            t = min(max(t, s + 1), b - a)
            src = np.asarray(indices[ptr[s] : ptr[t]])
            if src.size:
                self.pieces.append(_bucket(ptr[s : t + 1] - ptr[s], src, block, self.blocks, s))
            s = t
        counts = sum((p[2][1:] - p[2][:-1] for p in self.pieces), np.zeros(self.blocks, dtype=np.int64))
        self.counts = counts

    def of(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``k``'s edges: each source's row in the block and its destination's row in the partition."""
        parts = [(p[0][p[2][k] : p[2][k + 1]], p[1][p[2][k] : p[2][k + 1]]) for p in self.pieces]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


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


@dataclass
class Pass:
    """What one partition's pass did (the bytes of input it asked for, its blocks read)."""

    blocks_read: int = 0
    input_bytes: int = 0


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
) -> Pass:
    """The layer's output rows of destinations ``[a, b)``, from one stream of its input's source
    blocks, handed to ``write`` in ascending slices after ``after`` (the activation). ``update``:
    told the partition's vertices in steps as the stream advances (``b - a`` in all)."""
    buckets = Buckets(indptr, indices, a, b, block, num_nodes)
    deg = np.diff(np.asarray(indptr[a : b + 1], dtype=np.int64))
    c = torch.from_numpy(np.maximum(deg, 1).astype(np.float32)).to(device).unsqueeze(1)
    acc = torch.zeros((b - a, width), dtype=torch.float32, device=device)
    add = _scatter_add(device)
    done = Pass()
    spans = [(k * block, min((k + 1) * block, num_nodes)) for k in range(buckets.blocks)]
    # a block with nothing reaching the partition (no edge, no row of it) is not read
    todo = [k for k, (s0, s1) in enumerate(spans) if buckets.counts[k] or max(s0, a) < min(s1, b)]
    with ThreadPoolExecutor(1, thread_name_prefix="broadcast-read") as pool:
        ahead = pool.submit(rows, *spans[todo[0]]) if todo else None
        for i, k in enumerate(todo):
            x = ahead.result()  # type: ignore[union-attr]
            if i + 1 < len(todo):  # the next block is read while this one is computed
                ahead = pool.submit(rows, *spans[todo[i + 1]])
            s0, s1 = spans[k]
            lo, hi = max(s0, a), min(s1, b)
            done.blocks_read += 1
            done.input_bytes += x.numel() * x.element_size()
            if buckets.counts[k]:
                src, dst = buckets.of(k)
                add(acc, dst, src, form.message(x).contiguous())
            if lo < hi:  # the partition's own rows in this block: their root term, weighted by c
                acc[lo - a : hi - a] += c[lo - a : hi - a] * form.root(x)[lo - s0 : hi - s0]
            if update is not None:  # the stream's share of the partition's vertices
                step = (b - a) * (i + 1) // len(todo) - (b - a) * i // len(todo)
                if step:
                    update(step)
    h = form.finish(acc, c)
    for i in range(0, b - a, WRITE_ROWS):
        write(a + i, after(h[i : i + WRITE_ROWS]))
    return done


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
