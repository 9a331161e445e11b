"""placed.json (``moment.placed/4``): what ``moment place`` writes and the trainer, ``moment
verify`` and the next ``moment place`` read.

The placed dataset numbers vertices as its dataset does: ``indptr``, ``indices``, ``labels`` and
the splits are the dataset's own files (hard links where the file system allows, else copies:
:mod:`placement.place_write`), and ``old_to_new`` maps a dataset id to its row in the bins' order
(bin ``b`` holds rows ``[start, start + count)``), which the feature store goes through. Placed
datasets of ``moment.placed/3`` (graph and labels rewritten in those row ids) are parsed only so
that a new ``moment place`` may replace them and remove their files; everything that reads their
data refuses them (:func:`placement.placed.open_placed`).

Written last into the staging directory (its presence with ``complete: true`` is what makes a
directory a placed dataset). Every file has its size and digest, and the digest's algorithm
(``digest_algorithm``: a key of ``placement.digests.DIGESTS``; entries written before it was
recorded are SHA-256, the registry's ``UNRECORDED_DIGEST``); ``files`` are relative to the
placed directory (never ``..``), SSD bins outside it are absolute paths whose name carries the
run id, so a later run can prove which files it may remove.

``prediction`` is the planner's proportional model re-solved for the dataset placed (its size,
the measured hotness and unique rows per batch, the cache sizes used) on the plan's layout: the
shares DDAK balanced to (every bin's ``target`` is its ``bin_shares`` entry) and the tier shares
to compare the achieved ones with. Where the plan's profile could not be found it is the plan's
own prediction (``source: plan``). Each fact once: a cache's size (rows, per GPU or per socket)
is its bin's ``capacity``, which the prediction's workload does not repeat.

``pack`` (``moment place --pack``, :mod:`placement.pack`): SSD rows lie in the order the replayed
training batches read them; each SSD bin's slot map (a ``files`` entry: the file row of each of
its rows) is what the readers go through, and ``prediction.ssd_amplification`` is the replay's
page count of those batches. With ``--pack-budget`` (:mod:`placement.chunks`) ``pack.chunks``
lists instead, per SSD bin, its per-batch chunk file and shared cache (beside the bin, sizes and
checksums like a bin's) and their row maps (``files`` entries). ``pack.samples``: the replayed
batches' samples (:mod:`placement.samples`: ``files`` entries), which the trainer loads instead of
sampling those batches.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import Field, field_validator, model_validator

from moment.contracts import Contract, Registered, Strict, registry_default
from moment.contracts.dataset import FeatureDtype
from moment.contracts.plan import Share, TierShares
from moment.contracts.tiers import Tier
from moment.errors import MomentError

FORMAT: Final = (
    "moment.placed/4"  # Final: typed as this literal (the format field above FORMAT in the class defaults to it)
)
OLDER: Final = "moment.placed/3"  # graph and labels in row ids: replaced and removed, never read as data
MANIFEST = "placed.json"
RUN_ID = re.compile(r"^[0-9a-f]{8,32}$")
BIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:_-]*$")
# Seconds per phase of `moment place` (``timings_s`` keys, in order; "total" is the whole run).
# checksums and fsync run in threads beside the writing of the bins and arrays, so the phases may add up to more.
PHASES = {
    "check": "checking the dataset (a full scan)",
    "presample": "pre-sampling hotness",
    "predict": "re-solving the plan's model",
    "ddak": "placement (the --policy: DDAK or another)",
    "write_bins": "writing the bins",
    "arrays": "the dataset's topology, labels and splits linked (or copied), the row map (old_to_new)",
    "pack": "packing the SSD bins (replaying the trainer's batches, then writing each bin in their order)",
    "checksums": "checksums",
    "fsync": "fsync",
    "total": "total",
}
# A file's digest (hex; its length is its algorithm's, which placement.digests checks) and, for
# entries written before the algorithm was recorded, the algorithm they were taken with.
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{32,128}$")]
UNRECORDED_DIGEST = registry_default("placement.digests", "UNRECORDED_DIGEST")
# Every file `moment place` writes into a placed directory (the bins aside): what it may remove.
REQUIRED_FILES = ("indptr", "indices", "labels", "train", "val", "test", "old_to_new")


class PlacedError(MomentError):
    """A placed dataset that is missing, incomplete or damaged (names the file)."""


def bin_file_name(bin_name: str, run_id: str) -> str:
    """A bin's file name: the bin and the run that wrote it (``nvme0-1a2b3c4d.bin``)."""
    return f"{bin_name.replace(':', '-')}-{run_id}.bin"


def _relative(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"{path!r}: must be a path inside the placed directory (relative, no '..')")
    return path


class FileEntry(Strict):
    path: str
    bytes: int = Field(ge=0)
    digest: Digest
    digest_algorithm: Registered = Field(default_factory=UNRECORDED_DIGEST)

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        return _relative(v)


class BinEntry(Strict):
    name: str = Field(pattern=BIN_NAME.pattern)
    tier: Tier
    start: int = Field(ge=0)
    count: int = Field(ge=0)
    path: str  # relative to the placed directory, or absolute (an SSD directory outside it)
    bytes: int = Field(ge=0)
    digest: Digest
    digest_algorithm: Registered = Field(default_factory=UNRECORDED_DIGEST)
    target: float = Field(ge=0, le=1)
    achieved: float = Field(ge=0, le=1)
    capacity: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        p = PurePosixPath(v)
        if ".." in p.parts or not p.parts:
            raise ValueError(f"{v!r}: a bin path may not contain '..'")
        return v


class Source(Strict):
    path: str
    name: str | None = None


class PlanRef(Strict):
    path: str
    profile: dict[str, Any]
    layout: str


class HotnessSummary(Strict):
    batches: int = Field(ge=0)
    epochs: int = Field(ge=0)
    fanouts: list[int]
    batch_size: int = Field(ge=1)
    mean_unique_per_batch: float = Field(ge=0)
    curve: list[tuple[float, float]]
    # How far the caches' predicted read share may be off from sampling noise (the split-half gap
    # of placement.hotness); the gap pre-sampling ran until (None: a fixed number of epochs).
    bound: float | None = Field(default=None, ge=0, le=1)
    tolerance: float | None = Field(default=None, gt=0, le=1)


class PredictedWorkload(Strict):
    """The workload a prediction is for, in brief (``workload.yaml`` holds all of it).

    Its caches (rows per GPU, replicated; per socket, one copy each) are here only where they are
    not the placement's: a plan's own prediction (``source: plan``) is for the plan's workload's.
    A prediction re-solved for the dataset is for the caches placed, whose size the cache bins'
    ``capacity`` records: None here (placed.json files of earlier versions hold a copy, which
    must agree with the bins)."""

    fanouts: list[int]
    batch_size: int = Field(ge=1)
    unique_per_batch: float = Field(ge=0)
    gpu_cache_rows: int | None = Field(default=None, ge=0)
    cpu_cache_rows: int | None = Field(default=None, ge=0)
    hotness: str  # where the hotness curve came from


class Prediction(Strict):
    """What the planner predicts for this placement, and where DDAK's targets came from."""

    source: Literal["dataset", "plan"]  # re-solved for the dataset placed, or the plan's (profile not found)
    profile: str
    layout: str
    iteration_s: float = Field(ge=0)
    tier_shares: TierShares
    bin_shares: dict[str, Share]
    # Bytes the SSDs move per feature byte read from them (whole pages: moment/ssd_reads.py);
    # None in placements made before it was predicted.
    ssd_amplification: float | None = Field(default=None, ge=1)
    # A packed placement: every byte its replayed batches read from disk per feature byte, the SSD
    # pages and those of the placed directory's files (stored samples, chunk row maps:
    # PackSummary.placed_bytes); None: not packed, or placed before these were counted.
    disk_amplification: float | None = Field(default=None, ge=1)
    workload: PredictedWorkload


class PackFile(Strict):
    """A file of packed rows on an SSD, beside its bin (named, like it, with the run id)."""

    path: str  # as a bin's: relative to the placed directory, or absolute
    bytes: int = Field(ge=0)
    digest: Digest
    digest_algorithm: Registered = Field(default_factory=UNRECORDED_DIGEST)


class BinChunks(Strict):
    """One SSD bin's per-batch chunks and shared cache; the row maps are keys in ``files``."""

    chunks: PackFile  # every replayed batch's chunk, back to back, in replay order
    shared: PackFile  # the rows many batches read, once, page-reordered
    chunk_rows: str  # the bin row at each row of ``chunks`` (each chunk in id order)
    chunk_offsets: str  # each batch's first row in ``chunks`` (batches + 1 entries)
    shared_rows: str  # the bin row at each row of ``shared``


class PackChunks(Strict):
    """``--pack-budget`` (:mod:`placement.chunks`): a chunk per replayed batch and SSD bin holding
    the rows it reads, rows read by more than ``threshold`` batches in a shared cache instead."""

    budget: int = Field(ge=0)  # bytes the chunks and shared caches may take
    bytes: int = Field(ge=0)  # bytes they take (padding included)
    threshold: int = Field(ge=0)
    bins: dict[str, BinChunks]
    # Each chunk starts on a multiple of this many bytes (zeros pad the chunk before): a page,
    # so a chunk read moves its own pages only; 1 in placements made before (chunks back to back).
    align: int = Field(default=1, ge=1)
    # How the shared caches order their rows (a key of placement.chunks.SHARED_ORDERS: the one the
    # replayed batches read the fewest pages of); placements made before: first then second reader.
    order: str = "first-reader"


class SampleFiles(Strict):
    """The replayed batches' samples (:mod:`placement.samples`), kept so the trainer loads them
    instead of sampling: keys in ``files`` of the three files holding them."""

    nodes: str  # every batch's vertices (seeds first, then each hop's new ones), as node_dtype
    edges: str  # int32: per batch and hop, each target's sampled count, then the sources' positions
    index: str  # .npy int64, a row per batch: vertices after 0..hops hops, then each hop's edges
    node_dtype: Literal["int32", "int64"]
    hops: int = Field(ge=1)
    batches: int = Field(ge=0)
    bytes: int = Field(ge=0)  # the three files' bytes

    @property
    def keys(self) -> list[str]:
        return [self.nodes, self.edges, self.index]


class PackSummary(Strict):
    """A packed placement (``moment place --pack``, :mod:`placement.pack`): SSD rows laid out in
    the order the replayed training batches first read them (``slots``), or, within a
    ``--pack-budget``, copied into per-batch chunks and shared caches (``chunks``; bins in id
    order, ``slots`` empty), and what those batches move."""

    epochs: int = Field(ge=1)  # training epochs replayed (the trainer's first ones)
    ranks: int = Field(ge=1)  # training ranks replayed (the trainer's world size)
    seed: int  # the trainer's --seed the batches are replayed with
    batch_size: int = Field(ge=1)
    fanouts: list[int]
    batches: int = Field(ge=0)
    # SSD bin name → key in ``files`` of its slot map (the file row of each of its rows, in id order)
    slots: dict[str, str]
    useful_bytes: int = Field(ge=0)  # feature bytes of the SSD rows the replayed batches read
    unpacked_bytes: int = Field(ge=0)  # pages those reads would move with rows in id order
    packed_bytes: int = Field(ge=0)  # ... and move in the packed layout
    reads: int = Field(ge=0)  # runs of consecutive file rows those reads form, packed
    # Bytes of the pages those batches read of the placed directory's files: their stored samples
    # (each batch's vertices and edges) and the chunk row maps (each chunk's slice); None: placed
    # before they were counted.
    placed_bytes: int | None = Field(default=None, ge=0)
    chunks: PackChunks | None = None  # None: the ordering (slots)
    samples: SampleFiles | None = None  # None: not stored (placements made before they were)

    @property
    def map_keys(self) -> list[str]:
        """Keys in ``files`` of the row maps: the slot maps, or the chunk and shared row maps."""
        chunks = self.chunks.bins.values() if self.chunks else ()
        return [*self.slots.values(), *(k for c in chunks for k in (c.chunk_rows, c.chunk_offsets, c.shared_rows))]

    @property
    def amplification(self) -> float | None:
        """Bytes moved per feature byte read, packed (None: the batches read no SSD row)."""
        return self.packed_bytes / self.useful_bytes if self.useful_bytes else None

    @property
    def disk_amplification(self) -> float | None:
        """Every byte read per feature byte: the packed pages and the placed directory's
        (None: no SSD row read, or ``placed_bytes`` not counted)."""
        if not self.useful_bytes or self.placed_bytes is None:
            return None
        return (self.packed_bytes + self.placed_bytes) / self.useful_bytes


class PlacedManifest(Contract):
    format: Literal["moment.placed/4", "moment.placed/3"] = FORMAT
    FORMAT: ClassVar[str] = FORMAT
    ALSO_READS: ClassVar[tuple[str, ...]] = (OLDER,)
    WHAT: ClassVar[str] = "a placed dataset's manifest"
    ERROR: ClassVar[type[MomentError]] = PlacedError

    complete: Literal[True] = True
    run_id: str = Field(pattern=RUN_ID.pattern)  # in every bin's file name: what proves a bin is this run's
    key: str = Field(pattern=r"^[0-9a-f]{16}$")  # digest of the inputs: an identical re-run has nothing to do
    source: Source
    plan: PlanRef
    # The placement policy's registered name (placement.policies) and DDAK's priority, where the
    # policy reads one: names, checked against the registries when a run is asked for, not here,
    # so a registered policy needs no change to this contract.
    policy: Registered
    pool: int = Field(ge=1)
    priority: Registered | None
    num_nodes: int = Field(ge=1)
    num_edges: int = Field(ge=0)
    feature_dim: int = Field(ge=1)
    feature_dtype: FeatureDtype
    num_classes: int = Field(ge=1)
    hotness: HotnessSummary
    prediction: Prediction
    bins: list[BinEntry]
    files: dict[str, FileEntry]
    timings_s: dict[str, float] = {}
    pack: PackSummary | None = None  # None: SSD rows lie in id order

    @field_validator("files")
    @classmethod
    def _required(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        missing = [k for k in REQUIRED_FILES if k not in files]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (every file the trainer reads must be listed)")
        return files

    @model_validator(mode="after")
    def _ranges(self) -> PlacedManifest:
        """Bins hold consecutive row ranges covering every vertex, one file each."""
        expect, names = 0, set()
        row = self.feature_dim * (4 if self.feature_dtype == "float32" else 2)
        for b in self.bins:
            if b.name in names:
                raise ValueError(f"bins: duplicate bin {b.name}")
            names.add(b.name)
            if b.start != expect or b.bytes != b.count * row:
                raise ValueError(f"bins: bin {b.name} does not continue the id ranges")
            expect += b.count
        if expect != self.num_nodes:
            raise ValueError(f"bins: bins hold {expect} rows, expected {self.num_nodes}")
        if self.prediction.bin_shares != {b.name: b.target for b in self.bins}:
            raise ValueError("prediction.bin_shares: must name every bin once, with the bin's target share")
        w = self.prediction.workload
        for tier, rows in (("gpu", w.gpu_cache_rows), ("cpu", w.cpu_cache_rows)):
            held = sum(b.capacity for b in self.bins if b.tier == tier)
            # re-solved for these very caches: an earlier version's copy of their size must agree
            if self.prediction.source == "dataset" and rows is not None and held != rows:
                raise ValueError(
                    f"prediction.workload.{tier}_cache_rows: {rows}, but the {tier} bins' capacity is {held} rows "
                    "(a copy of the cache's size: the two must agree)"
                )
        if self.pack is not None:
            ssd = {b.name for b in self.bins if b.tier == "ssd"}
            chunks = self.pack.chunks
            if set(self.pack.slots if chunks is None else chunks.bins) != ssd or (chunks and self.pack.slots):
                raise ValueError("pack: slots (or chunks.bins, with no slots) must name every SSD bin once")
            keys = self.pack.map_keys + (self.pack.samples.keys if self.pack.samples else [])
            missing = [k for k in keys if k not in self.files]
            if missing:
                raise ValueError(f"pack: {', '.join(missing)} not in files")
        return self
