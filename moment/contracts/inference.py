"""inference.json (``moment.inference/1``): what ``moment infer`` writes beside its arrays.

Written last into the staging directory, so its presence makes a directory a complete inference
output. It says which model (the checkpoint's digest and config) ran on which data (the placed
dataset's identity, as checkpoints record it), and lists every array with its shape, dtype, size
and SHA-256. Rows of every array are vertices in the dataset's ids (which the placed dataset keeps).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, ClassVar, Final, Literal

from pydantic import Field, field_validator

from moment.contracts import Contract, Registered, Strict, registry_default
from moment.contracts.checkpoint import DataIdentity
from moment.errors import MomentError

FORMAT: Final = (
    "moment.inference/1"  # Final: typed as this literal (the format field above FORMAT in the class defaults to it)
)
MANIFEST = "inference.json"


class InferenceError(MomentError):
    """An inference output or input that is missing, incomplete or does not fit (names the file)."""


class ArrayEntry(Strict):
    """One .npy array of the output."""

    path: str
    shape: list[int]
    dtype: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or len(p.parts) != 1:
            raise ValueError(f"{v!r}: must be a file name inside the output directory")
        return v


class LayerPrediction(Strict):
    """What ``moment infer`` predicted of one layer before it ran (``trainer/infer_predict.py``;
    ``moment infer --dry-run`` prints the same): passes over the input, bytes read, memory of the
    largest pass (one rank), seconds on the plan's machine (None: no plan, or not modelled)."""

    engine: Registered  # one of trainer.infer_options.INFER_ENGINES
    passes: int | None = Field(default=None, ge=0)  # broadcast: streams over the sources (partitions, all ranks)
    input_streams: int | None = Field(default=None, ge=0)  # of those, over the input (the others: relayed messages)
    input_bytes: int = Field(ge=0)  # the layer's input: every vertex's row as stored
    read_bytes: int = Field(ge=0)  # input rows, CSR, spilled edges read back (gather: an upper bound)
    spilled_edge_bytes: int = Field(default=0, ge=0)  # bucketed edges written to disk (and read back)
    memory_bytes: int = Field(ge=0)
    read_s: float | None = Field(default=None, ge=0)  # at the plan's sequential rates
    compute_s: float | None = Field(default=None, ge=0)  # measured here on one block and one slab
    write_s: float | None = Field(default=None, ge=0)  # the layer's rows, at the plan's SSD rate
    seconds: float | None = Field(default=None, ge=0)  # the longer of reads and compute (they overlap), then writes
    machine: str | None = None  # the plan's profile
    note: str | None = None


class LayerThroughput(Strict):
    """How fast one stage ran in the run that finished the output (vertices it computed / seconds)."""

    stage: str  # "layer 1", ..., "export"
    vertices: int = Field(ge=0)
    seconds: float = Field(ge=0)
    vertices_per_s: float = Field(ge=0)
    engine: Registered | None = None  # of a layer: which engine (trainer.infer_options.INFER_ENGINES) computed it
    partitions: int | None = Field(default=None, ge=0)  # broadcast: destination partitions, all ranks
    edges_on_disk: int | None = Field(default=None, ge=0)  # broadcast: partitions whose bucketed edges were spilled
    note: str | None = None  # gather where broadcast was asked for: why
    read_bytes: int | None = Field(default=None, ge=0)  # of a layer: input rows, CSR and spilled edges it asked for
    disk_read_bytes: int | None = Field(default=None, ge=0)  # of those, from the disk (/proc/self/io; page cache not)
    predicted: LayerPrediction | None = None  # of a layer: what the run predicted before it started


class InferenceManifest(Contract):
    format: Literal["moment.inference/1"] = FORMAT
    FORMAT: ClassVar[str] = FORMAT
    WHAT: ClassVar[str] = "an inference manifest"
    ERROR: ClassVar[type[MomentError]] = InferenceError

    key: str = Field(pattern=r"^[0-9a-f]{64}$")  # digest of the inputs and options: same key, same bytes
    model: dict[str, Any]  # the checkpoint's training config (model, hidden, heads, fanouts, ...)
    checkpoint_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    checkpoint_epoch: int = Field(ge=0)
    data: DataIdentity
    vertex_ids: Literal["original"] = "original"
    dtype: Literal["float16", "float32"]  # of the hidden-layer arrays (logits are float32)
    layers: Literal["all", "last"]
    nproc: int = Field(ge=1)  # ranks per node
    nodes: int = Field(default=1, ge=1)  # --nnodes (files from before several nodes: one); ranks: world_size
    batch_size: int = Field(ge=1)
    # one of trainer.infer_options.INFER_ENGINES, asked for (--engine); each layer's is in throughput;
    # files written before they named it: the registry's UNRECORDED_ENGINE
    engine: Registered = Field(default_factory=registry_default("trainer.infer_options", "UNRECORDED_ENGINE"))
    memory: int | None = Field(default=None, ge=1)  # bytes a broadcast pass may hold (--memory), if one ran
    arrays: dict[str, ArrayEntry]  # "embeddings", "predictions", optional "logits", "layer1", ...
    accuracy: dict[str, float]  # split -> accuracy of the predictions on it ("test", "val")
    # the checkpoint's last sampled evaluation during training (split -> accuracy), to compare with
    training_accuracy: dict[str, float]
    throughput: list[LayerThroughput]

    @property
    def world_size(self) -> int:
        """Ranks of the run that wrote it: every node ran ``nproc``."""
        return self.nodes * self.nproc
