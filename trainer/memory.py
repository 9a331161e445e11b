"""How much GPU memory a rank and host memory a node will need, computed before the run starts.

A run that does not fit fails late and far from its cause: an out-of-memory error in the
prefetch thread after the caches were loaded. So the launcher adds up, from the placed dataset
(or a planner workload) and the trainer's config, what each part of a rank holds at its peak,
and refuses a run that does not fit with one line naming what to shrink.

GPU, per rank (``device`` cuda):

* ``gpu_cache``: the GPU cache bin (replicated: every rank holds all of it).
* ``batches``: feature rows of ``prefetch + 2`` batches at once — the queue, the one the prefetch
  thread is preparing, the one training — each ``unique rows × row bytes``.
* ``staging``: the device-side copy of one batch's host and SSD rows before they are gathered.
* ``model``: parameters, gradients and Adam's two moments (4 × parameters × 4 bytes).
* ``activations``: an estimate for the model, fan-outs and batch: every layer's saved outputs
  plus its largest per-edge tensor, as the registered model says (``Layer.activations``: SAGE's
  gathered ``x_j`` is [edges, input width]; GAT's projected messages and attention coefficients).
* ``cuda_context``: CUDA context and allocator slack (a fixed allowance).
* ``csr``: the graph, when sampling runs on the GPU with the CSR there (``sampling`` gpu).

Host, per node: ``runtime``, what each rank's process holds whatever the data (Python, torch,
CUDA's host side, the libraries: :data:`RANK_RUNTIME`, measured); the GPU and CPU cache bins once per socket (the shared copy each socket maps,
see :mod:`trainer.featurestore`), and every rank's pinned staging buffer: one batch of rows
(:func:`stage_reserve`, what the store allocates once before training), rounded up to a power of
two by torch's pinned-memory allocator; under ``sampling`` uva the graph pinned in host memory
(``pinned_csr``: once per socket when the ranks share it in ``--shm-dir``, else once per rank);
a packed placement's slot maps once per rank (``slot_maps``: 4 B per SSD row); the row map
(``row_map``: ``old_to_new``, 4 B per vertex, 8 past 2^31 - 1 vertices), which every rank's
feature store reads through one read-only mapping: page cache, once per node.
Which of gpu, uva or cpu ``--sampling auto`` takes is predicted (:func:`predict_sampling`) as
the rank will decide it (:mod:`trainer.sampling`). A CPU-sampled graph stays a memory map of
its file: page cache, not counted.

The figures are estimates of the peak, not measurements: the activations term in particular is
an upper-side guess from tensor shapes. Batch rows come from the placement's pre-sampling (its
mean unique rows per batch, scaled when the trainer's fan-outs or batch size differ).
"""

from __future__ import annotations

import os
import resource
import subprocess
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from moment.contracts.plan import Workload  # the planner's workload, as plans carry it
from placement.relabel import id_type
from placement.sampler import csr_bytes, fits_on_gpu, num_batches
from trainer.models import LAYERS, LayerSize, activations_of
from trainer.packs import index_bytes
from trainer.staging import pinned_bytes, stage_bytes

CUDA_CONTEXT = 1 << 30
# Host memory a rank holds whatever the data: Python, torch, CUDA's host side, PyG, numba's
# compiler and the kernels loaded on first use. The first GPU run's peak RSS on the demo (whose
# data is a few MiB): 2,214 MiB on a CUDA rank (1,034 MiB of it before the data opened), 944 MiB
# on a CPU rank (H200, Python 3.12, torch 2.11+cu130; scripts/gpu_check.sh, 2026-11-27; the
# second run's peak again 2,214 MiB, 0.4 % over a budget that had rounded it down: rounded up now).
RANK_RUNTIME = {"cuda": 2304 << 20, "cpu": 950 << 20}
GB = 1e9


@dataclass(frozen=True)
class RunShape:
    """What the memory figures depend on, whichever stage it came from."""

    nodes: int
    feature_dim: int
    row_bytes: int
    fanouts: tuple[int, ...]
    batch_size: int
    unique_per_batch: float  # distinct rows one batch reads
    model: str  # a name in trainer.models.LAYERS
    hidden: int
    heads: int
    classes: int
    gpu_cache_rows: int  # per rank (replicated)
    host_cache_rows: int  # GPU and CPU cache rows, the copy each socket shares
    prefetch: int
    ranks_per_node: int
    sockets: int
    csr_bytes: int = 0  # the graph as sampling holds it (indptr int64 + indices)
    sampling: str = "cpu"  # where sampling runs, as the rank will decide it (predict_sampling): gpu | uva | cpu
    csr_copies: int = 1  # pinned CSR copies per node under uva: one per socket when shared, else one per rank
    slot_map_bytes: int = 0  # a packed placement's slot maps or chunk row maps, which every rank holds (--pack)

    @property
    def row_map_bytes(self) -> int:
        """The placement's row map (``old_to_new``), as the feature store maps it."""
        return self.nodes * np.dtype(id_type(self.nodes)).itemsize

    def with_batch(self, batch_size: int) -> RunShape:
        """The same run with another batch size (unique rows scaled with the draws, capped)."""
        scale = sampled(self.fanouts, batch_size) / sampled(self.fanouts, self.batch_size)
        return replace(self, batch_size=batch_size, unique_per_batch=min(self.unique_per_batch * scale, self.nodes))


def sampled(fanouts: tuple[int, ...] | list[int], batch_size: int) -> int:
    """Vertices one batch draws, repeats included: seeds plus every hop's draws."""
    total = layer = batch_size
    for f in fanouts:
        layer *= f
        total += layer
    return total


@dataclass
class MemoryBudget:
    """Peak bytes per part; ``gpu_bytes_per_rank`` and ``host_bytes_per_node`` are their sums."""

    gpu: dict[str, int]
    host: dict[str, int]
    shape: RunShape
    gpu_capacity: int | None = None  # bytes of one GPU, when known
    gpu_capacity_source: str = ""
    host_capacity: int | None = None
    host_capacity_source: str = ""

    @property
    def gpu_bytes_per_rank(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_bytes_per_node(self) -> int:
        return sum(self.host.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_bytes_per_rank": self.gpu_bytes_per_rank,
            "host_bytes_per_node": self.host_bytes_per_node,
            "gpu": dict(self.gpu),
            "host": dict(self.host),
            "gpu_capacity_bytes": self.gpu_capacity,
            "gpu_capacity_source": self.gpu_capacity_source,
            "host_capacity_bytes": self.host_capacity,
            "host_capacity_source": self.host_capacity_source,
            "sampling": self.shape.sampling if self.gpu else "cpu",
            "estimate": "peak, from tensor shapes (activations are an upper-side guess)",
        }


def model_parameters(shape: RunShape) -> int:
    """Parameters of the configured model: by its layers' formulas where the model registers
    them (no PyG import), else built on the meta device (no memory)."""
    from trainer.config import TrainConfig
    from trainer.models import build_model, count_parameters

    cfg = TrainConfig(data="-", model=shape.model, hidden=shape.hidden, heads=shape.heads, fanouts=shape.fanouts)
    if (counted := count_parameters(cfg, shape.feature_dim, shape.classes)) is not None:
        return counted
    with torch.device("meta"):
        model = build_model(cfg, shape.feature_dim, shape.classes)
    return sum(p.numel() for p in model.parameters())


def _hops(shape: RunShape) -> list[float]:
    """Distinct vertices after each hop, seeds first (the last is the batch's rows)."""
    out, total = [float(shape.batch_size)], float(shape.batch_size)
    for f in shape.fanouts:
        total *= 1 + f
        out.append(min(total, shape.unique_per_batch))
    out[-1] = shape.unique_per_batch
    return out


def layer_sizes(shape: RunShape) -> list[tuple[LayerSize, tuple[float, float, int]]]:
    """Every layer's expected size over one batch, the outermost first (layer i consumes hop
    ``layers - i``), with the registered model's activation estimate of it, whose output width is
    the next layer's input. The memory budget's activations and trainer.flops' step both read them."""
    estimate = activations_of(shape.model)  # the registered model's own (trainer.models.LAYERS)
    hops = _hops(shape)
    layers = len(shape.fanouts)
    sizes, width = [], shape.feature_dim
    for i in range(layers):
        n_dst = hops[layers - 1 - i]
        last = i == layers - 1
        size = LayerSize(
            n_src=hops[layers - i],
            n_dst=n_dst,
            edges=n_dst * shape.fanouts[layers - 1 - i],
            width=width,
            out=shape.classes if last else shape.hidden,
            heads=shape.heads,
            last=last,
        )
        activations = estimate(size)
        sizes.append((size, activations))
        width = activations[2]
    return sizes


def activation_bytes(shape: RunShape) -> int:
    """Saved outputs of every layer plus the largest per-edge tensor of one layer (float32)."""
    sizes = layer_sizes(shape)
    saved = sum(a[0] for _, a in sizes)
    edge_peak = max((a[1] for _, a in sizes), default=0.0)
    return int(4 * (saved + edge_peak))


def stage_reserve(shape: RunShape) -> int:
    """Bytes of a rank's host staging buffer: one batch's rows; the store allocates exactly this
    before training (``TieredFeatureStore(stage_reserve=...)``) and the budget counts it."""
    return stage_bytes(shape.unique_per_batch, shape.row_bytes)


def budget(shape: RunShape, cuda: bool = True) -> MemoryBudget:
    """Peak GPU bytes of one rank (zero on a CPU run, whose rank holds them in host memory) and
    host bytes of one node."""
    batch = shape.unique_per_batch * shape.row_bytes
    params = model_parameters(shape)
    per_rank = {
        "gpu_cache": shape.gpu_cache_rows * shape.row_bytes,
        "batches": int((shape.prefetch + 2) * batch),
        "staging": int(batch),
        "model": 4 * 4 * params,
        "activations": activation_bytes(shape),
    }
    host = {
        "host_caches": shape.sockets * shape.host_cache_rows * shape.row_bytes,
        "runtime": shape.ranks_per_node * RANK_RUNTIME["cuda" if cuda else "cpu"],
        "row_map": shape.row_map_bytes,
    }
    if shape.slot_map_bytes:
        host["slot_maps"] = shape.ranks_per_node * shape.slot_map_bytes
    if cuda:
        gpu = {**per_rank, "cuda_context": CUDA_CONTEXT}
        host["pinned_staging"] = shape.ranks_per_node * pinned_bytes(stage_reserve(shape))
        if shape.sampling == "gpu":
            gpu["csr"] = shape.csr_bytes
        elif shape.sampling == "uva":
            host["pinned_csr"] = shape.csr_copies * shape.csr_bytes
        return MemoryBudget(gpu, host, shape)
    per_rank.pop("gpu_cache")  # a CPU rank's GPU tier is a view of the shared host copy
    host["ranks"] = shape.ranks_per_node * sum(per_rank.values())
    return MemoryBudget({}, host, shape)


def predict_sampling(shape: RunShape, mode: str, cuda: bool, gpu_free: int | None) -> str:
    """Where a rank will sample (:func:`trainer.sampling.choose`) for ``--sampling mode``: auto
    puts the CSR on the GPU when it takes at most ``CSR_GPU_SHARE`` of what ``gpu_free`` leaves
    once the GPU cache, the model and the CUDA context are in (unknown ``gpu_free``: as if it
    fits), else in pinned host memory (uva; whether the host has room is the budget's to say)."""
    if not cuda or mode == "cpu":
        return "cpu"
    if mode != "auto":
        return mode
    if gpu_free is None:
        return "gpu"
    left = gpu_free - shape.gpu_cache_rows * shape.row_bytes - 16 * model_parameters(shape) - CUDA_CONTEXT
    return "gpu" if fits_on_gpu(shape.csr_bytes, left) else "uva"


def shape_of_placed(placed: Any, cfg: Any, ranks_per_node: int, sockets: int, gpu_free: int | None = None) -> RunShape:
    """The run ``cfg`` would make on the placed dataset ``placed`` (a :class:`Placed`), with the
    sampling placement predicted from ``gpu_free`` (bytes of one GPU, when known)."""
    m = placed.manifest
    hot = m.hotness
    fanouts = tuple(cfg.fanouts or hot.fanouts)
    # A train split smaller than the batch size makes smaller batches, in pre-sampling (whose mean
    # unique rows are for its mean batch, not the nominal one) and in training alike.
    train = max(1, int(placed.array("train").size))
    presampled = max(1, round(train / num_batches(train, hot.batch_size)))
    batch = min(int(cfg.batch_size or hot.batch_size), train)
    rows = {t: sum(b.count for b in m.bins if b.tier == t) for t in ("gpu", "cpu")}
    base = RunShape(
        nodes=m.num_nodes,
        feature_dim=m.feature_dim,
        row_bytes=placed.row_bytes,
        fanouts=tuple(hot.fanouts),
        batch_size=presampled,
        unique_per_batch=float(hot.mean_unique_per_batch or sampled(hot.fanouts, presampled)),
        model=cfg.model,
        hidden=int(cfg.hidden),
        heads=int(cfg.heads),
        classes=m.num_classes,
        gpu_cache_rows=rows["gpu"],
        host_cache_rows=rows["gpu"] + rows["cpu"],
        prefetch=int(cfg.prefetch),
        ranks_per_node=ranks_per_node,
        sockets=max(1, sockets),
    )
    if fanouts != base.fanouts:
        scale = sampled(fanouts, base.batch_size) / sampled(base.fanouts, base.batch_size)
        base = replace(base, fanouts=fanouts, unique_per_batch=min(base.unique_per_batch * scale, base.nodes))
    shared = ranks_per_node > 1 and bool(getattr(cfg, "shm_dir", ""))
    base = replace(
        base,
        csr_bytes=csr_bytes(placed.array("indptr"), placed.array("indices")),
        csr_copies=base.sockets if shared else ranks_per_node,
        slot_map_bytes=sum(b.slots.stat().st_size for b in placed.bins if getattr(b, "slots", None) is not None)
        + index_bytes(placed),
    )
    cuda = cfg.resolved_device().startswith("cuda")
    base = replace(base, sampling=predict_sampling(base, getattr(cfg, "sampling", "auto"), cuda, gpu_free))
    return base.with_batch(batch) if batch != base.batch_size else base


def shape_of_workload(
    w: Workload, ranks_per_node: int, sockets: int, classes: int = 19, prefetch: int = 2, heads: int = 8
) -> RunShape:
    """The run a planner workload describes (the profiles' paper workloads: IGB has 19 classes)."""
    from trainer.config import TrainConfig

    # the registered model the workload names (GraphSAGE: sage), else the trainer's default
    model = next((name for name in LAYERS if name in w.model.lower()), TrainConfig(data="").model)
    return RunShape(
        nodes=w.nodes,
        feature_dim=w.feature_dim,
        row_bytes=w.row_bytes,
        fanouts=tuple(w.fanouts),
        batch_size=w.batch_size,
        unique_per_batch=float(w.vertices_per_batch()),
        model=model,
        hidden=w.hidden,
        heads=heads,
        classes=classes,
        gpu_cache_rows=w.cache_rows()[0],
        host_cache_rows=sum(w.cache_rows()),
        prefetch=prefetch,
        ranks_per_node=ranks_per_node,
        sockets=max(1, sockets),
    )


def gpu_capacity(machine: Any = None, gpu_ids: list[str] | None = None) -> tuple[int | None, str]:
    """Bytes of one GPU: the least free memory among this machine's GPUs when CUDA is here
    (nvidia-smi, so the launcher makes no CUDA context of its own that would hold GPU memory
    through the run; torch's total memory without it), else the smallest ``memory_gb`` of the
    profile's GPUs (those of ``gpu_ids`` when given); (None, "") if unknown."""
    if torch.cuda.is_available():
        free = _nvidia_smi_free()
        if free:
            return min(free), "free memory reported by nvidia-smi"
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"{props.name} (torch)"
    if machine is not None:
        gpus = [d for d in machine.devices() if d.kind == "gpu" and d.memory_gb and (not gpu_ids or d.id in gpu_ids)]
        if gpus:
            small = min(gpus, key=lambda d: d.memory_gb)
            return int(small.memory_gb * GB), f"{small.model or small.id}, profile {machine.name}"
    return None, ""


def _nvidia_smi_free() -> list[int]:
    """Free bytes per GPU from nvidia-smi ([] when it is missing or says nothing usable)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    try:
        return [int(float(line)) << 20 for line in out.split() if line.strip()]  # MiB
    except ValueError:
        return []


def host_capacity(machine: Any = None) -> tuple[int | None, str]:
    """Bytes of host memory: the profile's sockets' DRAM, else this machine's MemTotal."""
    if machine is not None and all(s.dram_gb for s in machine.sockets):
        return int(sum(s.dram_gb for s in machine.sockets) * GB), f"DRAM of profile {machine.name}"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    except (ValueError, OSError):
        return None, ""


def refusal(b: MemoryBudget) -> str | None:
    """One line saying the run does not fit and what to shrink, or None when it fits (or the
    capacity is unknown)."""
    shape = b.shape
    if b.gpu and b.gpu_capacity is not None and b.gpu_bytes_per_rank > b.gpu_capacity:
        over = b.gpu_bytes_per_rank - b.gpu_capacity
        hints = []
        if shape.prefetch > 1:
            saved = (shape.prefetch - 1) * b.gpu["batches"] / (shape.prefetch + 2)
            hints.append(f"--prefetch 1 (saves {saved / GB:.1f} GB)")
        fit = largest_batch(shape, b.gpu_capacity)
        if fit is not None and fit < shape.batch_size:
            hints.append(f"--batch-size {fit} or less")
        if b.gpu.get("gpu_cache", 0) > 0:
            hints.append(f"a smaller GPU cache (moment place --gpu-cache; it takes {b.gpu['gpu_cache'] / GB:.1f} GB)")
        if b.gpu.get("csr", 0) > 0:
            hints.append(f"--sampling uva (the graph, {b.gpu['csr'] / GB:.1f} GB, in pinned host memory)")
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in sorted(b.gpu.items(), key=lambda kv: -kv[1]) if v)
        return (
            f"memory: a rank needs about {b.gpu_bytes_per_rank / GB:.1f} GB of GPU memory ({parts} GB), "
            f"{over / GB:.1f} GB more than the {b.gpu_capacity / GB:.1f} GB of the GPU ({b.gpu_capacity_source}): "
            f"shrink with {' or '.join(hints) or 'a smaller model'}"
        )
    if b.host_capacity is not None and b.host_bytes_per_node > b.host_capacity:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in b.host.items())
        return (
            f"memory: a node needs about {b.host_bytes_per_node / GB:.1f} GB of host memory ({parts} GB), more "
            f"than the {b.host_capacity / GB:.1f} GB it has ({b.host_capacity_source}): shrink the CPU cache "
            f"(moment place --cpu-cache), --batch-size or --nproc"
            + (
                ", or sample on the CPU (--sampling cpu) instead of pinning the graph"
                if b.host.get("pinned_csr")
                else ""
            )
        )
    return None


def live_refusal(b: MemoryBudget, free: int, device: str) -> str | None:
    """In the rank, once the GPU cache and the model are loaded: one line when what the batches
    will still take (``batches``, ``staging``, ``activations``) exceeds the ``free`` bytes
    ``torch.cuda.mem_get_info`` reports (other processes on the GPU count too); None when it fits."""
    need = sum(b.gpu.get(k, 0) for k in ("batches", "staging", "activations"))
    if need <= free:
        return None
    shape = b.shape
    fit = largest_batch(shape, b.gpu_bytes_per_rank - need + free)
    hint = f"--batch-size {fit} or less" if fit is not None and fit < shape.batch_size else "a smaller GPU cache"
    return (
        f"memory: {device} has {free / GB:.1f} GB free after loading the GPU cache and the model; the batches need "
        f"about {need / GB:.1f} GB ({shape.prefetch + 2} batches of {shape.unique_per_batch:,.0f} rows, staging, "
        f"activations): shrink with --prefetch 1, {hint}"
    )


def largest_batch(shape: RunShape, capacity: int) -> int | None:
    """The largest batch size whose rank budget fits ``capacity`` (None: not even a batch of 1)."""

    def fits(n: int) -> bool:
        return budget(shape.with_batch(n)).gpu_bytes_per_rank <= capacity

    if not fits(1):
        return None
    lo, hi = 1, shape.batch_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def resident_bytes() -> int | None:
    """This process's resident set now (``/proc/self/statm``; None where there is none): taken
    once the device is up, it is the part of the peak that torch, CUDA and the libraries hold
    themselves, which :func:`budget` does not count."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def measured(device: torch.device, base_rss: int | None = None) -> dict[str, int | None]:
    """This process's peaks so far (:class:`moment.contracts.metrics.MeasuredMemory`): what the
    budget of :func:`budget` predicts, measured — GPU bytes torch allocated and reserved on
    ``device`` (None on a CPU one), the peak resident set (Linux reports ``ru_maxrss`` in KiB)
    and ``base_rss``, the resident set before the run opened its data (:func:`resident_bytes`)."""
    cuda = device.type == "cuda"
    return {
        "gpu_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "gpu_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)) if cuda else None,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "host_base_rss_bytes": base_rss,
    }
