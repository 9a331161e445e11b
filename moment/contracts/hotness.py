"""The hotness sidecar (``moment.hotness/1``): the JSON beside a counts ``.npy``.

``moment place`` keeps ``hotness.npy`` + ``hotness.json`` (the dataset's vertex ids) in every placed
dataset, so a later ``moment place --hotness`` can reuse them instead of pre-sampling again. The
sidecar records N and the total so that a truncated, swapped or foreign counts file is caught.
"""

from __future__ import annotations

from typing import ClassVar, Final, Literal

from pydantic import Field, StrictFloat, StrictInt

from moment.contracts import Contract
from moment.errors import MomentError

FORMAT: Final = (
    "moment.hotness/1"  # Final: typed as this literal (the format field above FORMAT in the class defaults to it)
)


class HotnessError(MomentError):
    """A hotness file pair that does not load; the message names the file and what is wrong."""


class HotnessMeta(Contract):
    format: Literal["moment.hotness/1"] = FORMAT
    FORMAT: ClassVar[str] = FORMAT
    WHAT: ClassVar[str] = "the counts file's JSON sidecar"
    ERROR: ClassVar[type[MomentError]] = HotnessError

    num_nodes: StrictInt = Field(ge=0)
    total: StrictInt = Field(ge=0)  # sum of the counts
    batches: StrictInt = Field(ge=0)
    mean_unique_per_batch: StrictFloat | StrictInt = Field(ge=0)
    epochs: StrictInt = Field(ge=0)
    fanouts: list[StrictInt] = Field(min_length=1)
    batch_size: StrictInt = Field(ge=1)
    # Split-half gap at the cache boundaries: how far the caches' predicted read share may be off
    # (placement.hotness.split_half_gap); None when the sample was too small to split.
    bound: StrictFloat | None = Field(default=None, ge=0, le=1)
    # The gap pre-sampling stopped at (it ran until converged); None: a fixed number of epochs.
    tolerance: StrictFloat | None = Field(default=None, gt=0, le=1)
