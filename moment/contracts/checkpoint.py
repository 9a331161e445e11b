"""A checkpoint's metadata (``moment.checkpoint/3``): what ``moment train`` checks before it
resumes, and what every rank checks again when it loads the checkpoint.

The checkpoint itself is one ``torch.save`` file (tensors: model, optimizer, RNG states) whose
``meta`` entry is this document as plain data, so ``torch.load(weights_only=True)`` reads it and
a damaged or foreign file is one line naming the field. ``data`` is the identity of the placed
dataset the run trained on: a model resumed on other data would silently learn from other
vertices (or fail deep in ``load_state_dict`` when the feature width differs).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

from pydantic import Field, ValidationError, field_validator

from moment.contracts import Contract, Strict
from moment.contracts.metrics import EpochRecord
from moment.contracts.placed import MANIFEST, PlacedManifest
from moment.errors import MomentError

FORMAT: Final = (
    "moment.checkpoint/3"  # Final: typed as this literal (the format field above FORMAT in the class defaults to it)
)
# Config fields that shape the parameters: a checkpoint made with other values cannot be loaded.
SHAPING = ("model", "hidden", "heads", "fanouts")


class CheckpointError(MomentError):
    """A checkpoint that cannot be read or does not fit this run."""


class DataIdentity(Strict):
    """Which placed dataset a run trained on: the manifest's digest and the shape of the data."""

    placed_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    num_nodes: int = Field(ge=1)
    num_edges: int = Field(ge=0)
    feature_dim: int = Field(ge=1)
    feature_dtype: str
    num_classes: int = Field(ge=1)

    @classmethod
    def of(cls, placed_dir: str | Path, manifest: PlacedManifest) -> DataIdentity:
        """The identity of the placed dataset in ``placed_dir`` (``manifest``: its placed.json)."""
        digest = hashlib.sha256((Path(placed_dir) / MANIFEST).read_bytes()).hexdigest()
        return cls(
            placed_sha256=digest,
            num_nodes=manifest.num_nodes,
            num_edges=manifest.num_edges,
            feature_dim=manifest.feature_dim,
            feature_dtype=manifest.feature_dtype,
            num_classes=manifest.num_classes,
        )

    def difference(self, other: DataIdentity, placement: bool = True) -> str | None:
        """What differs, checkpoint (self) first; None when it is the same placed dataset (with
        ``placement`` False: the same data, placed perhaps otherwise — another node's placement
        of it, whose sameness node 0 checks when training starts, ``trainer.nodes``)."""
        for key in ("num_nodes", "num_edges", "feature_dim", "feature_dtype", "num_classes"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                return f"{key} {mine} (checkpoint) vs {theirs} (--data)"
        if placement and self.placed_sha256 != other.placed_sha256:
            return (
                f"placed.json sha256 {self.placed_sha256[:12]}… (checkpoint) vs {other.placed_sha256[:12]}… "
                "(--data): another placement"
            )
        return None


class CheckpointMeta(Contract):
    format: Literal["moment.checkpoint/3"] = FORMAT
    FORMAT: ClassVar[str] = FORMAT
    WHAT: ClassVar[str] = "a training checkpoint"
    ERROR: ClassVar[type[MomentError]] = CheckpointError

    epoch: int = Field(ge=0)  # epochs done
    config: dict[str, Any]  # the TrainConfig, as primitives
    data: DataIdentity
    history: list[dict[str, Any]]  # the metrics records of the epochs done (EpochRecord each)
    # sha256 over the tensors (model, optimizer, RNG states) as saved: torch.load checks no CRC,
    # so a damaged weight would load silently (trainer.checkpoint.tensors_digest). None: saved
    # by a moment before the digest (its zip CRCs are still checked).
    tensors_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("history")
    @classmethod
    def _records(cls, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each record checked at load, against the one record model metrics.json uses: a damaged
        one is refused before the run, not at its first metrics write. Kept as plain data."""
        for i, record in enumerate(history):
            try:
                EpochRecord.model_validate(record)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"record {i}: {where}: {err['msg']}") from None
        return history

    def refusal(self, config: dict[str, Any], data: DataIdentity, placement: bool = True) -> str | None:
        """Why this checkpoint cannot be resumed by a run of ``config`` on ``data`` (None: it can);
        ``placement`` False: ``data`` may be another placement of the same data (a node past 0)."""
        for key in SHAPING:
            if self.config.get(key) != config.get(key):
                return f"made with {key}={self.config.get(key)!r}, this run has {config.get(key)!r}"
        why = self.data.difference(data, placement)
        return None if why is None else f"trained on other data: {why}"
