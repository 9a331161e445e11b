"""The training workload the planner predicts for: how many feature bytes each GPU needs per
iteration, and which share of them each tier (GPU cache, CPU cache, SSD) serves.

Tier shares come from a hotness curve — the share of accesses caught by the hottest x of the
vertices. A measured curve (pre-sampling, ``moment place``) is best; without one a Zipf-like
default is used and said so in every report.

The caches are modelled the way the trainer runs them (one source of truth for both):
* GPU cache, *replicated*: every GPU holds the same hottest ``gpu_cache_rows`` in its own
  memory, so its hits never cross a link. (Partitioning the hottest rows over the GPUs pays only
  where GPUs read each other's memory directly — NVLink/P2P; the trainer does not, and over plain
  PCIe a replicated cache moves fewer bytes, as Quiver found.) Default none: the paper's runs cache
  no features in GPU memory and its authors' planner puts no GPU cache in the flow.
* CPU cache, *replicated per socket*: the next-hottest ``cpu_cache_rows`` (default the paper's
  1 % of the vertices), one copy in each socket's memory, read by the GPUs of that socket.
* SSD reads, ``ssd_reads``: ``direct`` (GPUDirect Storage: an SSD and a GPU under one switch
  talk peer to peer without touching the root complex) or ``host`` (every byte goes up to the
  SSD's socket and down to the GPU). GeForce GPUs cannot do peer-to-peer DMA at all, so their
  reads always take the host route.

Each cache has one size, in one unit: rows (``gpu_cache_rows``, ``cpu_cache_rows``) where the
dataset is known, as ``moment place`` records them in ``workload.yaml``; or, in a workload
written before the dataset exists, what its user types: ``gpu_cache_gb`` per GPU and
``cpu_cache_fraction`` of the vertices, which become rows of the dataset placed
(:meth:`Workload.asked_cache_rows`). A workload giving both units of one cache is refused.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moment.contracts import first_error
from moment.errors import MomentError
from moment.ssd_reads import PAGE_BYTES, amplification, pack_amplification
from moment.yamlio import load_yaml, yaml_problem

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CPU_CACHE_FRACTION = 0.01  # of the vertices, per socket: the paper's
# One cache, two units: its rows (the dataset known) -> what a user types before it exists.
CACHE_UNITS = {"gpu_cache_rows": "gpu_cache_gb", "cpu_cache_rows": "cpu_cache_fraction"}


def cap_cache_rows(gpu: int, cpu: int, nodes: int) -> tuple[int, int]:
    """The caches' rows within the ``nodes`` there are: the GPU cache first, the CPU cache the next."""
    gpu = min(gpu, nodes)
    return gpu, min(cpu, nodes - gpu)


class HotnessCurve(BaseModel):
    """Share of feature reads caught by the hottest ``x`` of the vertices.

    Either a measured ``curve`` of ``[x, share]`` points (increasing), or the Zipf-like default
    ``share(x) = x ** (1 - zipf_s)``.
    """

    model_config = ConfigDict(extra="forbid")
    zipf_s: float = Field(default=0.8, ge=0.0, lt=1.0)
    curve: list[tuple[float, float]] | None = None
    source: str = "Zipf-like default share(x) = x^(1-s), s = 0.8 (not measured)"

    @model_validator(mode="after")
    def _monotone(self) -> HotnessCurve:
        if self.curve:
            pts = [(0.0, 0.0), *self.curve, (1.0, 1.0)]
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                if x1 < x0 or y1 < y0 or not (0 <= x1 <= 1 and 0 <= y1 <= 1):
                    raise ValueError("curve points must rise from (0,0) to (1,1) with x and share in [0, 1]")
        return self

    def share(self, x: float) -> float:
        """Share of accesses caught by the hottest fraction ``x`` of vertices."""
        x = min(max(x, 0.0), 1.0)
        if not self.curve:
            return x ** (1.0 - self.zipf_s) if x > 0 else 0.0
        pts = [(0.0, 0.0), *self.curve, (1.0, 1.0)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return 1.0

    def points(self) -> list[tuple[float, float]]:
        """The curve as (x, share) points from (0, 0) to (1, 1); the Zipf-like default sampled
        on a log grid fine enough for :meth:`expected_unique`."""
        if self.curve:
            return [(0.0, 0.0), *self.curve, (1.0, 1.0)]
        xs = [0.0] + [10 ** (-12 + 12 * i / 480) for i in range(481)]
        return [(x, self.share(x)) for x in xs]

    def expected_unique(self, draws: int, nodes: int) -> float:
        """Expected distinct vertices among ``draws`` independent draws, a vertex in the curve
        segment [x0, x1] being drawn with probability (y1 - y0) / ((x1 - x0)·nodes): the sum
        over vertices of 1 - (1 - p)^draws, segment by segment. Hot vertices come up in most
        batches and count once, which is why fewer rows are read than sampled."""
        total = 0.0
        pts = self.points()
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            n = (x1 - x0) * nodes
            if n <= 0 or y1 <= y0:
                continue
            p = min((y1 - y0) / n, 1.0)
            total += n * -math.expm1(draws * math.log1p(-p)) if p < 1 else n
        return min(total, float(draws), float(nodes))


class Workload(BaseModel):
    """What one training iteration asks of the storage tiers."""

    model_config = ConfigDict(extra="forbid")  # a typo (`batchsize:`) must not fall back to a default
    dataset: str = "synthetic"
    nodes: int = Field(default=100_000_000, gt=0)
    edges: int | None = None
    feature_dim: int = Field(default=1024, gt=0)
    feature_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    fanouts: list[int] = Field(default_factory=lambda: [25, 10])
    batch_size: int = Field(default=8000, gt=0)
    unique_per_batch: float | None = Field(default=None, gt=0, description="measured unique sampled vertices per batch")
    train_fraction: float = Field(default=0.01, gt=0, le=1)
    # Each cache in one unit: rows where the dataset is known (what `moment place` records), else
    # what a user types before it exists (GB per GPU, a share of the vertices per socket).
    cpu_cache_rows: int | None = Field(
        default=None, ge=0, description="rows each socket's memory caches, one copy per socket (the dataset known)"
    )
    cpu_cache_fraction: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description=f"share of the vertices each socket's memory caches (default {CPU_CACHE_FRACTION:.0%}), "
        "before the dataset is known",
    )
    gpu_cache_rows: int | None = Field(
        default=None, ge=0, description="rows each GPU caches, the same on every GPU (the dataset known)"
    )
    gpu_cache_gb: float | None = Field(
        default=None,
        ge=0,
        description="feature cache in each GPU's memory, GB (default 0), before the dataset is known",
    )
    gpu_cache_policy: Literal["replicated"] = "replicated"
    ssd_reads: Literal["direct", "host"] = Field(
        default="direct",
        description="direct: SSD → GPU DMA (GPUDirect Storage, kvikio; the paper's runtime), peer to peer under a "
        "shared switch, for GPUs that can; host: through a buffer in host memory (posix reads, kvikio's "
        "compat mode)",
    )
    ssd_pack_bytes: int | None = Field(
        default=None,
        gt=0,
        description="bytes of one packed SSD read (a packed placement: the rows a batch needs back to back); "
        "None: each row is read where it lies, at random, whole pages at least (moment/planner/ssd_reads.py)",
    )
    ssd_pack_amplification: float | None = Field(
        default=None,
        ge=1,
        description="bytes a packed placement's batches read from disk per feature byte, counted page by page on "
        "the training batches `moment place --pack` replayed (placement/pack.py): the SSD pages, and the pages of "
        "their stored samples and chunk row maps, charged to the SSDs; None: the pack's page rounding",
    )
    hotness: HotnessCurve = Field(default_factory=HotnessCurve)
    model: str = "graphsage"
    hidden: int = 256

    @model_validator(mode="after")
    def _one_unit(self) -> Workload:
        for rows, other in CACHE_UNITS.items():
            if getattr(self, rows) is not None and getattr(self, other) is not None:
                raise ValueError(f"{rows} and {other} give one cache twice: keep one ({rows} where the rows are known)")
        return self

    @property
    def row_bytes(self) -> int:
        return self.feature_dim * DTYPE_BYTES[self.feature_dtype]

    def sampled_per_batch(self) -> int:
        """Vertices one batch samples, repeats included: seeds plus every hop's draws."""
        total, layer = self.batch_size, self.batch_size
        for f in self.fanouts:
            layer *= f
            total += layer
        return total

    def vertices_per_batch(self) -> float:
        """Feature rows one GPU reads per iteration: the measured unique count, else the expected
        number of distinct vertices among the batch's draws when a vertex is drawn as often as
        the hotness curve says (:meth:`HotnessCurve.expected_unique`)."""
        if self.unique_per_batch:
            return self.unique_per_batch
        return _expected_unique(self.hotness.model_dump_json(), self.sampled_per_batch(), self.nodes)

    def demand_gb(self) -> float:
        """Feature GB one GPU needs per iteration."""
        return self.vertices_per_batch() * self.row_bytes / 1e9

    def asked_cache_rows(self, nodes: int | None = None, row_bytes: int | None = None) -> tuple[int, int]:
        """Rows the GPU cache (each GPU) and the CPU cache (each socket) ask for, of a dataset of
        ``nodes`` rows of ``row_bytes`` (default: this workload's): the rows recorded, else the GB
        and share typed before the dataset was known, in its rows; not capped."""
        n = self.nodes if nodes is None else nodes
        rb = self.row_bytes if row_bytes is None else row_bytes
        gpu = self.gpu_cache_rows if self.gpu_cache_rows is not None else int((self.gpu_cache_gb or 0.0) * 1e9 // rb)
        share = CPU_CACHE_FRACTION if self.cpu_cache_fraction is None else self.cpu_cache_fraction
        cpu = self.cpu_cache_rows if self.cpu_cache_rows is not None else int(n * share)
        return gpu, cpu

    def cache_rows(self) -> tuple[int, int]:
        """Rows each GPU caches (the hottest; the same rows on every GPU) and each socket's CPU
        cache holds (the next hottest), capped by the vertices there are."""
        return cap_cache_rows(*self.asked_cache_rows(), self.nodes)

    def tier_shares(self) -> dict[str, float]:
        """Share of row reads served by the GPU cache, the CPU cache and the SSDs."""
        gpu, cpu = self.cache_rows()
        f_gpu, f_cpu = gpu / self.nodes, cpu / self.nodes
        h_gpu = self.hotness.share(f_gpu)
        h_cpu = self.hotness.share(f_gpu + f_cpu) - h_gpu
        return {"gpu": h_gpu, "cpu": h_cpu, "ssd": max(0.0, 1.0 - h_gpu - h_cpu)}

    def ssd_density(self) -> float:
        """Share of the SSD-resident rows one GPU's batch reads: its SSD rows over the rows the
        SSDs hold (what makes a small graph's batch read neighbouring rows of one page)."""
        stored = self.nodes - sum(self.cache_rows())
        return min(self.vertices_per_batch() * self.tier_shares()["ssd"] / stored, 1.0) if stored > 0 else 0.0

    def ssd_amplification(self) -> float:
        """SSD bytes moved per feature byte read from the SSDs: whole pages for rows read at
        random, the page-rounded pack for packed reads (:mod:`moment.ssd_reads`)."""
        if self.ssd_pack_bytes is not None:
            return self.ssd_pack_amplification or pack_amplification(self.ssd_pack_bytes)
        return amplification(self.row_bytes, self.ssd_density())

    def describe(self) -> str:
        rows = (
            "measured unique rows"
            if self.unique_per_batch
            else f"unique rows estimated from the hotness curve, of {self.sampled_per_batch():,} sampled"
        )
        return (
            f"{self.dataset}: {self.nodes:,} vertices × {self.feature_dim} {self.feature_dtype}, batch {self.batch_size}, "
            f"fan-outs {','.join(map(str, self.fanouts))}; {self.demand_gb():.2f} GB per GPU per iteration ({rows}); "
            f"caches: {self._caches()}; "
            f"SSD reads {'direct to the GPU where it can' if self.ssd_reads == 'direct' else 'through host memory'}, "
            f"{self._ssd_moves()}; "
            f"hotness: {self.hotness.source}"
        )

    def _caches(self) -> str:
        """The caches as the workload gives them (rows, or GB and a share before the dataset is known)."""
        gpu = f"{self.gpu_cache_rows:,} rows" if self.gpu_cache_rows is not None else f"{self.gpu_cache_gb or 0.0:g} GB"
        share = CPU_CACHE_FRACTION if self.cpu_cache_fraction is None else self.cpu_cache_fraction
        cpu = f"{self.cpu_cache_rows:,} rows" if self.cpu_cache_rows is not None else f"{share:.2%} of vertices"
        return f"{gpu} per GPU (replicated), {cpu} per socket"

    def _ssd_moves(self) -> str:
        amp = self.ssd_amplification()
        if self.ssd_pack_bytes is not None:
            return f"packed, {self.ssd_pack_bytes:,} B per read ({amp:.2f}× the feature bytes moved)"
        return f"{self.row_bytes:,} B rows at random in {PAGE_BYTES} B pages ({amp:.2f}× the feature bytes moved)"


def load_workload(base: dict | None, path: str | None = None, **overrides: object) -> Workload:
    """The profile's default workload, updated by a YAML/JSON file, then by CLI overrides."""
    data = dict(base or {})
    if path:
        p = Path(path)
        try:
            text = p.read_text()
            extra = json.loads(text) if p.suffix == ".json" else load_yaml(text)
        except FileNotFoundError:
            raise MomentError(f"{p}: no such workload file") from None
        except IsADirectoryError:
            raise MomentError(f"{p}: a directory, not a workload file") from None
        except yaml.YAMLError as exc:
            raise MomentError(f"{p}: cannot read workload: {yaml_problem(exc)}") from None
        except (OSError, ValueError) as exc:
            raise MomentError(f"{p}: cannot read workload: {str(exc).splitlines()[0]}") from None
        if not isinstance(extra, dict):
            raise MomentError(f"{p}: a workload file is a mapping of fields")
        if "format" in extra:  # plan.json, placed.json ...: a document that carries a workload, not one
            raise MomentError(
                f"{p}: a {extra['format']} document, not a workload file (give a YAML/JSON "
                f"mapping of workload fields, e.g. the workload.yaml `moment place` writes)"
            )
        _layer(data, extra)
    _layer(data, {k: v for k, v in overrides.items() if v is not None})
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        raise MomentError(f"{path or 'workload'}: {first_error(exc)}") from None


def _layer(data: dict, layer: dict) -> None:
    """``layer`` over ``data``; a cache it gives in either unit replaces that cache in both (a
    measured workload's rows over a profile's share of the vertices)."""
    for pair in CACHE_UNITS.items():
        if any(k in layer for k in pair):
            for k in pair:
                data.pop(k, None)
    data.update(layer)


@functools.lru_cache(maxsize=64)
def _expected_unique(curve: str, draws: int, nodes: int) -> float:
    """:meth:`HotnessCurve.expected_unique` remembered by value: every layout a search predicts
    asks it again for the same workload (a sweep thousands of times)."""
    return HotnessCurve.model_validate_json(curve).expected_unique(draws, nodes)
