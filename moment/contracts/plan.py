"""plan.json (``moment.plan/2``): what ``moment plan`` hands to ``moment place`` and the trainer.

Users exchange plans, so a plan is untrusted input: every part is typed, unknown keys are
refused, and the parts other stages act on are checked for what would hurt them there:

* ``bin_targets``: bin names become file and directory names in ``moment place``, so a name is
  ``[A-Za-z0-9][A-Za-z0-9:_-]*`` of at most 100 characters (no ``/``, no ``..``), and names are
  unique, also as file names (where ``:`` becomes ``-``); shares are numbers in [0, 1]; tiers
  are gpu, cpu or ssd;
* ``workload``: the planner's :class:`Workload` (``place`` pre-samples with its batch size and
  fan-outs, so fan-outs are positive too);
* ``ranks``: numbered 0..n-1 in order, one GPU each (the trainer maps local rank r to ``ranks[r]``);
* ``profile``, ``layout``, ``tier_shares``: what ``place`` and the trainer compare and report.

The report-only parts (``predicted``, ``ranking``, ``classic``, ``links``, ``search``, ``nodes``) are typed
records too (what ``Scored.to_dict``, ``links_table`` and ``plan()`` write), so a plan written
by ``moment plan`` reads back equal, field for field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from moment.contracts import Contract, Strict, first_error
from moment.contracts.tiers import Tier
from moment.planner.workload import Workload
from moment.topology.model import DeviceKind

FORMAT: Final = (
    "moment.plan/2"  # Final: typed as this literal (the format field above FORMAT in the class defaults to it)
)
BIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:_-]{0,99}$")


def _bin_name(name: str) -> str:
    """A bin's name is part of file names: no path separators, no dots, not too long."""
    if not BIN_NAME.match(name):
        raise ValueError(f"{name!r} is not a bin name (up to 100 letters, digits, ':', '_', '-'; it names files)")
    return name


BinName = Annotated[str, AfterValidator(_bin_name)]
Share = Annotated[float, Field(ge=0.0, le=1.0)]


class _Part(Strict):
    """A nested part of a plan: unknown keys refused, no coercion ("0.5" is not a number)."""

    model_config = ConfigDict(strict=True)


class PlanProfile(_Part):
    """The profile the plan was made for; ``place --profile`` refuses another one's hash."""

    name: str
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Slot(_Part):
    """One device of a layout and the slot (port) it goes in."""

    port: str
    slot: str | None
    device: str
    kind: DeviceKind
    bdf: str | None
    socket: str


class PlanLayout(_Part):
    """The chosen layout."""

    name: str
    slots: list[Slot]


class TierShares(_Part):
    """Share of all feature reads the GPU caches, the CPU cache and the SSDs serve."""

    gpu: Share
    cpu: Share
    ssd: Share


class BinTarget(_Part):
    """One storage bin and the share of feature reads it should serve (``place``'s target).

    ``bin`` names files and directories of the placed dataset, hence the strict pattern."""

    bin: BinName
    tier: Tier
    share: Share
    port: str | None
    socket: str | None
    capacity_gb: Annotated[float, Field(ge=0.0)] | None

    @property
    def file_stem(self) -> str:
        """How the bin's name appears in its file's name (``dram:cpu0`` → ``dram-cpu0``)."""
        return self.bin.replace(":", "-")


class Rank(_Part):
    """Training rank → GPU → PCI address → socket (the trainer pins rank r to ``ranks[r]``).

    The GPU's cache bin is named after it, hence the bin-name pattern."""

    rank: Annotated[int, Field(ge=0)]
    gpu: BinName
    bdf: str | None
    socket: str | None
    port: str | None


# A flow model beyond these two (moment.planner.flow.FLOW_MODELS) writes its figures as
# <model>_iteration_s, <model>_gbps_per_gpu and <model>_bottleneck: typed here, by suffix.
MODEL_FIGURES: dict[str, TypeAdapter[Any]] = {
    "_iteration_s": TypeAdapter(float),
    "_gbps_per_gpu": TypeAdapter(list[float]),
    "_bottleneck": TypeAdapter(list[str]),
}
MODEL_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class LayoutRecord(_Part):
    """Every flow model's prediction for one layout (``Scored.to_dict``): report-only, except
    that the trainer sets its measured time beside ``predicted_iteration_s``. The primary
    (proportional) model's figures are unprefixed, the paper model's ``paper_``; another model's
    are extra keys named for it (:data:`MODEL_FIGURES`), and any other key is refused."""

    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    layout: dict[str, str]  # port id -> device id
    slots: list[Slot]
    predicted_iteration_s: float
    gbps_per_gpu: list[float]
    bottleneck: list[str]
    bottleneck_edges: list[str]
    imbalance: float
    paper_iteration_s: float
    paper_gbps_per_gpu: list[float]
    paper_bottleneck: list[str]
    models_differ: str | None

    @model_validator(mode="after")
    def _other_models(self) -> LayoutRecord:
        for key, value in (self.model_extra or {}).items():
            suffix = next((s for s in MODEL_FIGURES if key.endswith(s)), None)
            if suffix is None or not MODEL_NAME.match(key[: -len(suffix)]):
                raise ValueError(
                    f"unknown field {key!r} (another flow model's figures are named "
                    f"<model>{', <model>'.join(MODEL_FIGURES)})"
                )
            try:
                MODEL_FIGURES[suffix].validate_python(value, strict=True)
            except ValidationError as exc:
                raise ValueError(f"{key}: {first_error(exc)}") from None
        return self


class LinkLoad(_Part):
    """One link at the prediction (report-only)."""

    edge: str
    label: str
    capacity_gbps: float
    load_gb: float
    utilisation: float


class SearchStats(_Part):
    """How the layout was found (report-only)."""

    gpus: int
    ssds: int
    method: str
    raw_layouts: int
    distinct_layouts: int
    evaluated: int
    seconds: float


class NodesPrediction(_Part):
    """``moment plan --nodes N`` (report-only): the iteration with N such servers, the longer of
    the one-node data time and the compute (``bound`` says which) plus a ring all-reduce of the
    model's gradients over each node's NIC (``moment.planner.nodes``). Plans written before the
    compute term have none of its fields (None): their ``iteration_s`` is the data time plus the
    all-reduce."""

    nodes: Annotated[int, Field(ge=1)]
    parameters: Annotated[int, Field(ge=0)]
    classes: Annotated[int, Field(ge=1)]
    nic_gbps: Annotated[float, Field(gt=0.0)]
    nic_source: str
    data_iteration_s: float
    compute_s: Annotated[float, Field(ge=0.0)] | None = None  # one iteration's compute on one GPU
    compute_source: str | None = None  # "measured: FILE ..." or "estimated: FLOPs at a GPU rate ..."
    step_flops: Annotated[float, Field(ge=0.0)] | None = None  # the estimate's (None: measured)
    gpu_tflops: Annotated[float, Field(gt=0.0)] | None = None  # the estimate's GPU rate
    bound: Literal["data", "compute"] | None = None  # the longer of the two
    allreduce_s: Annotated[float, Field(ge=0.0)]
    iteration_s: float


def _invalid(loc: tuple[str | int, ...], message: str) -> ValidationError:
    """A validation error at ``loc`` (a cross-field check names the field it is about)."""
    error = PydanticCustomError("plan_value", "{why}", {"why": message})
    return ValidationError.from_exception_data("PlanDoc", [InitErrorDetails(type=error, loc=loc, input=None)])


class PlanDoc(Contract):
    """plan.json, read with :meth:`read` (one line naming the file and field on any problem)."""

    format: Literal["moment.plan/2"] = FORMAT
    FORMAT = FORMAT
    WHAT = "plan file"
    model_config = ConfigDict(strict=True)

    created: str  # ISO 8601, UTC
    moment_version: str
    profile: PlanProfile
    workload: Workload
    demand_gb_per_gpu: Annotated[float, Field(ge=0.0)]
    tier_shares: TierShares
    notes: list[str]  # the planner's assumptions (unknown bandwidths ...)
    layout: PlanLayout
    predicted: LayoutRecord
    links: list[LinkLoad]
    bin_targets: Annotated[list[BinTarget], Field(min_length=1)]
    ranks: list[Rank]
    search: SearchStats
    ranking: list[LayoutRecord]
    classic: dict[str, LayoutRecord]  # the profile's named layouts, scored
    nodes: NodesPrediction | None = None  # --nodes N; absent from plans without it

    @model_validator(mode="after")
    def _consistent(self) -> PlanDoc:
        _check_fanouts(self.workload.fanouts)
        _check_bins(self.bin_targets)
        _check_ranks(self.ranks)
        return self

    def rank(self, local_rank: int) -> Rank | None:
        """The GPU the plan gives ``local_rank`` (None past the plan's GPUs)."""
        return self.ranks[local_rank] if 0 <= local_rank < len(self.ranks) else None


def _check_fanouts(fanouts: list[int]) -> None:
    """``place`` pre-samples with them: at least one hop, each a positive count."""
    if not fanouts:
        raise _invalid(("workload", "fanouts"), "expected at least one positive fan-out")
    for i, f in enumerate(fanouts):
        if f < 1:
            raise _invalid(("workload", "fanouts", i), f"a fan-out must be positive, got {f}")


def _check_bins(targets: list[BinTarget]) -> None:
    """Bin names are unique, also as file names (two bins in one file would clobber each other)."""
    seen: dict[str, str] = {}  # file stem, case-folded -> the first bin with it
    for i, t in enumerate(targets):
        key = t.file_stem.lower()
        if key in seen:
            other = seen[key]
            why = f"duplicate bin {t.bin}" if other == t.bin else f"bin {t.bin} has the same file name as bin {other}"
            raise _invalid(("bin_targets", i, "bin"), why)
        seen[key] = t.bin


def _check_ranks(ranks: list[Rank]) -> None:
    """Numbered 0..n-1 in order (local rank r takes ``ranks[r]``), one GPU per rank."""
    first: dict[str, int] = {}
    for i, r in enumerate(ranks):
        if r.rank != i:
            raise _invalid(("ranks", i, "rank"), f"expected {i} (ranks are numbered 0..n-1 in order), got {r.rank}")
        if r.gpu in first:
            raise _invalid(("ranks", i, "gpu"), f"{r.gpu} already has rank {first[r.gpu]}")
        first[r.gpu] = i


def read_plan(path: str | Path) -> PlanDoc:
    """Load a plan.json; one line naming the file and field for a missing, broken or foreign file.

    Here, beside the contract, so the stages that only read a plan (the trainer) load neither
    the planner's search nor its presentation."""
    return PlanDoc.read(path)
