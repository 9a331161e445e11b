"""``dataset.json`` (``moment.dataset/1``): the manifest of a dataset directory.

What ``moment dataset synth`` and ``moment dataset import`` write and every reader of a dataset
(``moment place``, the benchmarks) reads. Sizes are strict integers (``"5"``, ``5.0`` and ``true``
are wrong types, not a 5), unknown keys are errors, and ``files`` holds plain file names only.
The one reference outside the directory is ``features_at``: an import that did not copy the
features (they were already rows moment reads) names the source file with what it was at import
(size, mtime, a sampled digest), and every open checks that it still is.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from moment.contracts import Contract, Registered, Strict, registry_default
from moment.errors import MomentError

FORMAT = "moment.dataset/1"
FeatureDtype = Literal["float32", "float16"]
FEATURE_DTYPES: tuple[str, ...] = get_args(FeatureDtype)
FILES = {
    "indptr": "indptr.npy",
    "indices": "indices.npy",
    "features": "features.npy",
    "labels": "labels.npy",
    "train": "train_idx.npy",
    "val": "val_idx.npy",
    "test": "test_idx.npy",
}


class DatasetError(MomentError):
    """A dataset that does not validate; the message names the file and the field."""


def _plain_name(name: str) -> str:
    """A file name inside the manifest's directory: no separator, no ``..``, nothing hidden in it."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name (a manifest names files in its own directory)")
    return name


FileName = Annotated[str, AfterValidator(_plain_name)]


class _Typed(Strict):
    """Strict types: JSON ``"5"`` or ``5.0`` where an integer belongs is a mistake, not a 5."""

    model_config = ConfigDict(strict=True)


class DatasetFiles(_Typed):
    """The array files, by role; a role left out has its usual name."""

    indptr: FileName = FILES["indptr"]
    indices: FileName = FILES["indices"]
    features: FileName | None = FILES["features"]  # None: read in place from the manifest's features_at
    labels: FileName = FILES["labels"]
    train: FileName = FILES["train"]
    val: FileName = FILES["val"]
    test: FileName = FILES["test"]

    @model_validator(mode="after")
    def _distinct(self) -> DatasetFiles:
        seen: dict[str, str] = {}
        for role, name in self.model_dump().items():
            if name is None:
                continue
            if name in seen:
                raise ValueError(f"{seen[name]} and {role} both name {name!r}")
            seen[name] = role
        return self


class SynthProvenance(_Typed):
    """How ``moment dataset synth`` generated the graph (enough to generate it again)."""

    kind: Literal["chung-lu"]
    seed: int = Field(ge=0)
    avg_degree: float
    alpha: float
    weight_cap: float
    p_in: float
    signal: float
    fractions: list[float] = Field(min_length=3, max_length=3)
    rng_block: int = Field(ge=1)


class ImportProvenance(_Typed):
    """Which files ``moment dataset import`` read, and how."""

    kind: Literal["import"]
    files: dict[Registered, str]  # the importer's file options (its own names) -> the files read
    given_splits: list[Literal["train", "val", "test"]]
    undirected: bool
    seed: int
    # which importer read them (its name in placement.importers.IMPORTERS; files written before they
    # named it: the registry's UNRECORDED_FORMAT)
    format: Registered = Field(default_factory=registry_default("placement.importers", "UNRECORDED_FORMAT"))
    self_loops: bool = False  # every vertex given exactly one self-loop
    split: str | None = None  # the split convention (igb, mlperf, fraction:F) or the shipped split read
    labelled: int | None = None  # vertices labelled (IGB-full: a prefix; the rest is padding, imported as -1)


class FeatureSource(_Typed):
    """Features read in place from the file an import read (not copied), and what that file was then:
    checked on every open, so a moved, replaced or rewritten source is refused by name."""

    path: str = Field(min_length=2, pattern=r"^/")  # absolute
    offset: int = Field(ge=0)  # bytes before row 0: the .npy header (0 for IGB's raw files)
    size: int = Field(ge=1)  # the file's size in bytes
    mtime_ns: int = Field(ge=0)
    digest: str = Field(pattern=r"^blake2b-[0-9a-f]{32}$")  # of DIGEST_BLOCKS fixed-offset blocks (placement.dataset)


class DatasetManifest(Contract):
    """dataset.json: the sizes every array is checked against, the file names, the provenance."""

    FORMAT: ClassVar[str] = FORMAT
    WHAT: ClassVar[str] = "dataset manifest"
    ERROR: ClassVar[type[MomentError]] = DatasetError
    model_config = ConfigDict(strict=True)

    name: str | None = None
    num_nodes: int = Field(ge=1)
    num_edges: int = Field(ge=0)
    feature_dim: int = Field(ge=1)
    feature_dtype: FeatureDtype
    num_classes: int = Field(ge=1)
    directed: bool | None = None  # None: not recorded (a hand-written manifest)
    files: DatasetFiles = Field(default_factory=DatasetFiles)
    generator: SynthProvenance | None = None  # written by synth
    source: ImportProvenance | None = None  # written by import
    features_at: FeatureSource | None = None  # the features are this file's rows, not files.features

    @model_validator(mode="after")
    def _one_feature_file(self) -> DatasetManifest:
        if (self.files.features is None) == (self.features_at is None):
            raise ValueError(
                "features_at: give either files.features (a copy in the directory) or features_at (the source read "
                "in place) and set the other to null"
            )
        return self
