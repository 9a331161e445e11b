"""What ``moment infer`` will cost, before it runs (``--dry-run``) and beside what it measured
(``inference.json``): per layer its engine, the passes over its input, the bytes it reads, the
memory of its largest pass and its time on the plan's machine.

The model follows the engines' own arithmetic, so the bytes are exact where the engine's work
is fixed by the inputs (the broadcast engine: every pass streams every source block — the
input, or the messages a rank's first pass relayed —, reads its partition's CSR slice and reads
back its spilled edges) and an upper bound where it is not (the
gather engine: every in-edge's source row once per chunk, as if no two edges of a chunk shared
a source). Time: the broadcast engine reads one block ahead while it computes one, so a layer
takes the longer of its reads — at the plan's sequential rates: cache bins from memory, each
SSD bin at its SSD's ``read_gbps``, the previous layer's file and the scratch at the plan's
median SSD rate (the output directory's disk is not in the plan) — and its compute, measured
here on the run's device on one source block and one slab of edges, the best of five (a
profile has no compute rate). The gather engine's time is not modelled (random reads; its bytes are).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moment.contracts.inference import LayerPrediction
from trainer import broadcast
from trainer.models import Scatter

CALIBRATION_EDGES = 1 << 18  # edges bucketed and scattered to time the per-edge work
CALIBRATION_SUMS = 1 << 26  # bytes of partial sums they are added into, at most: beyond the CPU's caches
CALIBRATION_RUNS = 16  # source blocks the edges come in


@dataclass(frozen=True)
class Rates:
    """The plan's machine as inference reads it: sequential GB/s of its SSDs (device id → rate,
    those ``moment bench`` or the profile gives) and of its memory."""

    machine: str
    ssd_gbps: dict[str, float]
    dram_gbps: float | None

    def ssd(self, name: str | None = None) -> float | None:
        """The rate of SSD ``name``; the median of the plan's SSDs for one not in it (or None)."""
        if name in self.ssd_gbps:
            return self.ssd_gbps[name]
        return statistics.median(self.ssd_gbps.values()) if self.ssd_gbps else None


@dataclass(frozen=True)
class Shape:
    """What the model reads of one layer: widths, bytes per input row, the engine's form."""

    layer: int  # 1-based
    in_width: int
    width: int
    row_bytes: int  # of the input as stored (layer 1: the placed features; else the work file)
    out_row_bytes: int  # of the output as stored (the work file)
    form: Scatter | None


@dataclass(frozen=True)
class Compute:
    """Seconds per source row (the layer's transform) and per in-edge (bucketing and the scatter)."""

    per_row: float
    per_edge: float


def calibrate(
    form: Scatter, in_width: int, width: int, block: int, device: torch.device, rows: int, num_nodes: int
) -> Compute:
    """Time one source block through the layer's transform, and a slab of random in-edges of up
    to ``rows`` destinations (a partition's; sums of at most :data:`CALIBRATION_SUMS` bytes, so
    that they miss the caches as a partition's do) from ``num_nodes`` sources through the
    bucketing and the scatter-add, on ``device`` (the best of five each)."""
    x = torch.randn(block, in_width, device=device)
    rng = np.random.default_rng(0)
    dests = max(1, min(rows, CALIBRATION_SUMS // (4 * width)))
    deg = rng.poisson(CALIBRATION_EDGES / dests, dests)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    edges = max(int(indptr[-1]), 1)
    indices = rng.integers(0, num_nodes, int(indptr[-1])).astype(np.int32)
    # as a stream adds them: block by block, each block's edges few, spread over all the sums, ascending
    runs = np.array_split(rng.integers(0, dests, edges).astype(np.int32), CALIBRATION_RUNS)
    local, dst = indices % block, np.concatenate([np.sort(r) for r in runs])[: indices.size]
    acc = torch.zeros(dests, width, device=device)
    msg = form.message(x).contiguous()
    add = broadcast._scatter_add(device)

    def transform() -> None:
        form.message(x)
        form.root(x)

    with torch.inference_mode():
        t_rows = _best(transform, device)
        t_bucket = _best(lambda: broadcast.Buckets(indptr, indices, 0, dests, block, num_nodes), device)
        t_add = _best(lambda: add(acc, dst, local, msg), device)
    return Compute(t_rows / block, (t_bucket + t_add) / edges)


def _best(fn: Callable[[], object], device: torch.device, tries: int = 5) -> float:
    """The shortest of ``tries`` timed calls after one untimed (compiles, allocator, thread pool)."""
    fn()
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def predict_broadcast(
    shape: Shape,
    indptr: np.ndarray,
    index_bytes: int,
    ranges: list[tuple[int, int]],
    block: int,
    budget: int,
    bins: list[tuple[str, str, int]] | None,
    rates: Rates | None,
    compute: Compute | None,
) -> LayerPrediction:
    """A broadcast layer: ``ranges`` the ranks' destinations, ``budget`` a rank's ``--memory``;
    ``bins`` (layer 1): (name, tier, bytes) of the placed bins in new-id order."""
    n, e = len(indptr) - 1, int(indptr[-1])
    ranks = [broadcast.partitions(indptr, lo, hi, shape.width, shape.in_width, block, budget) for lo, hi in ranges]
    parts = [p for rank in ranks for p in rank]
    streams, relayed, written = 0, 0, 0  # input passes; relayed bytes read back; and written
    for rank in ranks:
        if broadcast.relays(len(rank), shape.width, shape.row_bytes):  # one input pass, then the messages
            roots = (rank[-1][1] - rank[0][1]) * 4 * shape.width
            streams += 1
            relayed += (len(rank) - 1) * n * 4 * shape.width + roots
            written += n * 4 * shape.width + roots
        else:
            streams += len(rank)
    spilled, memory = 0, 0
    for a, b in parts:
        edges = int(indptr[b] - indptr[a])
        out = 0
        if not broadcast.edges_in_memory(b - a, edges, shape.width, shape.in_width, block, budget):
            hold = broadcast.edge_room(b - a, edges, shape.width, shape.in_width, block, budget)
            out = broadcast.spilled_bytes(indptr, a, b, broadcast.slab_edges(budget), hold)
        kept = broadcast.EDGE_BYTES * edges - out
        spilled += out
        sums = (b - a) * broadcast.row_bytes(shape.width) + broadcast.fixed_bytes(block, shape.in_width, shape.width)
        memory = max(memory, sums + kept)
    passes = len(parts)
    input_bytes = n * shape.row_bytes
    csr = (n + passes) * indptr.dtype.itemsize + e * index_bytes
    read_bytes = streams * input_bytes + relayed + csr + spilled
    read_s = write_s = None
    if rates is not None and rates.ssd() is not None:
        disk = rates.ssd()
        assert disk is not None
        if shape.layer == 1 and bins:
            stream = sum(size / _bin_rate(name, tier, rates) for name, tier, size in bins)
        else:
            stream = input_bytes / (disk * 1e9)
        # spilled edges and relayed messages: written, then read back
        read_s = streams * stream + (csr + 2 * spilled + relayed + written) / (disk * 1e9)
        write_s = n * shape.out_row_bytes / (disk * 1e9)  # the layer's rows, after the stream
    compute_s = streams * n * compute.per_row + e * compute.per_edge if compute is not None else None
    seconds = None
    if read_s is not None or compute_s is not None:  # the reads overlap the compute; the writes follow
        seconds = max(read_s or 0.0, compute_s or 0.0) + (write_s or 0.0)
    return LayerPrediction(
        engine="broadcast",
        passes=passes,
        input_streams=streams,
        input_bytes=input_bytes,
        read_bytes=read_bytes,
        spilled_edge_bytes=spilled,
        memory_bytes=memory,
        read_s=read_s,
        compute_s=compute_s,
        write_s=write_s,
        seconds=seconds,
        machine=rates.machine if rates is not None else None,
    )


def predict_gather(shape: Shape, indptr: np.ndarray, index_bytes: int, batch: int) -> LayerPrediction:
    """A gathered layer: its bytes as an upper bound (every in-edge's source row and every
    destination's own row once); its time is not modelled."""
    n, e = len(indptr) - 1, int(indptr[-1])
    csr = (n + 1) * indptr.dtype.itemsize + e * index_bytes
    rows = min(batch * (1 + 16), n)  # a chunk's sources at most (trainer.infer.EDGES_PER_VERTEX)
    return LayerPrediction(
        engine="gather",
        passes=None,
        input_bytes=n * shape.row_bytes,
        read_bytes=(n + e) * shape.row_bytes + csr,
        spilled_edge_bytes=0,
        memory_bytes=rows * 4 * (shape.in_width + shape.width),
        read_s=None,
        compute_s=None,
        seconds=None,
        machine=None,
        note="gather: bytes are an upper bound, time not modelled (random reads)",
    )


def _bin_rate(name: str, tier: str, rates: Rates) -> float:
    """Bytes per second a bin streams at: SSD bins at their SSD's rate, cache bins from memory."""
    gbps = rates.ssd(name) if tier == "ssd" else rates.dram_gbps or rates.ssd()
    assert gbps is not None  # the caller checked the plan has an SSD rate
    return gbps * 1e9
