"""metrics.json (``moment.metrics/2``): what ``moment train --metrics-json`` writes.

Rank 0 rewrites it atomically after every epoch (``complete`` false until the run ends); the
demo's summary, ``scripts/bench_train.py`` and anyone comparing runs read it. The keys are the
ones users already read (``trainer.metrics`` says what each measures); this model is the one
place that says which there are and of what type, on writing and on reading.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

from pydantic import ConfigDict, Field, model_validator

from moment.contracts import Contract, Strict
from moment.contracts.placed import PredictedWorkload
from moment.contracts.plan import Share, TierShares
from moment.errors import MomentError

FORMAT: Final = (
    "moment.metrics/2"  # Final: typed as this literal (the format field above FORMAT in the class defaults to it)
)


class MetricsError(MomentError):
    """A metrics file that is missing or does not validate (names the file and the field)."""


class _Part(Strict):
    # An accuracy of an empty split, or a diverged loss, is NaN: written as JSON's NaN, read back.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class NodeEpoch(_Part):
    """One node's part of an epoch (several nodes, trainer/nodes.py): its ranks' seeds, their mean
    wait for data, and the read shares of its own placement's tiers and bins."""

    node: int = Field(ge=0)
    host: str
    ranks: int = Field(ge=1)
    seeds: int = Field(ge=0)
    seeds_per_s: float = Field(ge=0)
    data_wait_s: float = Field(ge=0)
    read_share_per_tier: dict[str, float]
    read_share_per_bin: dict[str, float]


class NodePrediction(_Part):
    """What a node's own placement predicts (its placed.json ``prediction``)."""

    node: int = Field(ge=0)
    host: str
    data: str
    iteration_s: float = Field(ge=0)
    tier_shares: TierShares
    bin_shares: dict[str, Share]


class ChunkReads(_Part):
    """How a budget-packed placement's chunks (``moment place --pack-budget``, trainer/packs.py)
    served the epoch's training batches, summed over ranks. ``replayed``: the epoch's batches are
    the ones the placement replayed, so each should read only its chunks (the prediction:
    ``batches_from_chunks == batches``); otherwise every read goes to the bins."""

    replayed: bool
    batches: int = Field(ge=0)  # batches that read SSD bins with chunks
    batches_from_chunks: int = Field(ge=0)  # ... none of whose reads went to a bin
    chunk_reads: int = Field(ge=0)  # (batch, SSD bin) reads served by the bin's chunk and shared cache
    bin_reads: int = Field(ge=0)  # ... read from the bin instead
    missed: int = Field(ge=0)  # of those, a replayed batch's whose rows were not its chunk's


class EpochRecord(_Part):
    """One epoch's training part (validation is outside the timings)."""

    epoch: int = Field(ge=1)
    epoch_s: float = Field(ge=0)
    iterations: int = Field(ge=0)
    iteration_s: float = Field(ge=0)
    seeds: int = Field(ge=0)
    seeds_per_s: float = Field(ge=0)
    loss: float
    val_acc: float | None
    data_wait_s: float = Field(ge=0)
    feature_read_s: float = Field(ge=0)
    feature_read_s_per_iteration: float = Field(ge=0)
    # CPU time of the feature store's calls on their thread, per iteration (absent in older files).
    feature_cpu_s_per_iteration: float | None = Field(default=None, ge=0)
    rows_per_tier: dict[str, int]
    bytes_per_tier: dict[str, int]
    bytes_per_ssd: dict[str, int]  # feature bytes read from each SSD bin (distinct rows)
    # Bytes of the pages those reads touched (what the SSD moved), and Σ of them / Σ bytes_per_ssd;
    # absent from the records of runs before they were counted.
    read_bytes_per_ssd: dict[str, int] = {}
    ssd_read_amplification: float | None = Field(default=None, ge=0)
    # Pages the batches read of the placed directory's files besides the SSD bins (a packed
    # placement's stored samples, a budget-packed bin's chunk row map), per key of placed.json
    # ``files``; and every byte read from disk per feature byte: (Σ read_bytes_per_ssd + Σ these)
    # / Σ bytes_per_ssd. Absent from older files.
    placed_read_bytes: dict[str, int] = {}
    disk_read_amplification: float | None = Field(default=None, ge=0)
    chunks: ChunkReads | None = None  # a placement packed within a budget (absent otherwise, and in older files)
    gbps_per_tier: dict[str, float]
    gbps_per_ssd: dict[str, float]
    hit_rate: dict[str, float]
    read_share_per_tier: dict[str, float]
    read_share_per_bin: dict[str, float]
    # Several nodes: each node's part, and the node the others waited for (None: none stood out).
    nodes: list[NodeEpoch] | None = None
    straggler: str | None = None


class SsdRoute(_Part):
    """How the plan assumed SSD bytes reach a GPU, and how this run's reader takes them."""

    planned: Literal["host", "direct"] | None
    run: Literal["host", "direct"]
    reader: str
    engine: str | None = None  # the file reader's engine (io_uring, pread, python); None for others


class RunPrediction(_Part):
    """The placement's prediction (placed.json ``prediction``) as this run compares with it."""

    source: Literal["dataset", "plan"]
    iteration_s: float = Field(ge=0)
    profile: str
    layout: str
    tier_shares: TierShares
    bin_shares: dict[str, Share]
    ssd_amplification: float | None = Field(default=None, ge=1)  # pages moved per feature byte read from SSDs
    disk_amplification: float | None = Field(default=None, ge=1)  # ... with the placed directory's pages too
    workload: PredictedWorkload
    comparable: bool  # re-solved for this dataset (else the plan's, for other data)
    note: str
    ssd_route: SsdRoute | None = None


class Sampling(_Part):
    """Where neighbour sampling ran (rank 0's; ``--sampling``, trainer/sampling.py): gpu (the CSR
    in GPU memory), uva (on the GPU, the CSR in registered host memory), cpu (with its torch
    threads); ``note``: why it is not what was asked (absent when it is)."""

    where: Literal["gpu", "uva", "cpu"]
    threads: int | None
    note: str | None = None
    # training batches rank 0 loaded from a packed placement's stored samples instead of sampling
    # them (placement/samples.py; None: no stored samples used, --live-sampling, or older metrics)
    stored_batches: int | None = None


class MeasuredMemory(_Part):
    """Rank 0's peaks so far, to hold against ``moment train --dry-run --json``'s budget: GPU
    bytes torch allocated and reserved (``torch.cuda.max_memory_allocated`` / ``_reserved``;
    None on a CPU rank), the process's peak resident set (``getrusage`` ``ru_maxrss``) and its
    resident set before it opened the data, with torch and the device up (what the budget leaves
    out: peak minus base is what the budget's host figure predicts)."""

    gpu_peak_allocated_bytes: int | None = Field(default=None, ge=0)
    gpu_peak_reserved_bytes: int | None = Field(default=None, ge=0)
    host_peak_rss_bytes: int = Field(ge=0)
    host_base_rss_bytes: int | None = Field(default=None, ge=0)


class MetricsDoc(Contract):
    format: Literal["moment.metrics/2"] = FORMAT
    FORMAT: ClassVar[str] = FORMAT
    WHAT: ClassVar[str] = "a training metrics file"
    ERROR: ClassVar[type[MomentError]] = MetricsError
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    complete: bool  # the run ended: test_acc and the digests are in
    config: dict[str, Any]  # the run's TrainConfig, as its to_dict()
    world_size: int = Field(ge=1)
    ranks: list[str]  # each rank's device line
    sampling: Sampling | None
    epochs: list[EpochRecord]
    measured_iteration_s: float | None
    predicted_iteration_s: float = Field(ge=0)
    measured_feature_read_s: float | None
    on_plan_gpus: bool
    prediction: RunPrediction
    test_acc: float | None
    rank_param_digests: list[str] | None
    memory: MeasuredMemory | None = None  # rank 0's measured peaks (absent in files from before)
    nodes: list[NodePrediction] | None = None  # several nodes: each node's own prediction

    def compute_s_per_iteration(self) -> float | None:
        """Training time per iteration not spent waiting for data: Σ (epoch_s - data_wait_s) over
        Σ iterations (forward, backward, the optimizer step and the ranks' gradient all-reduce;
        the slowest rank's time less the ranks' mean wait). None without an iteration: what
        ``moment plan --nodes --compute-from`` takes as the compute of an iteration."""
        iterations = sum(e.iterations for e in self.epochs)
        if not iterations:
            return None
        return sum(max(e.epoch_s - e.data_wait_s, 0.0) for e in self.epochs) / iterations

    @model_validator(mode="after")
    def _complete(self) -> MetricsDoc:
        if self.complete and (self.test_acc is None or self.rank_param_digests is None):
            raise ValueError("complete is true but test_acc or rank_param_digests is missing")
        if not self.complete and self.test_acc is not None:
            raise ValueError("complete is false but test_acc is set")
        return self
