"""The on-disk graph dataset ``moment`` reads: CSR topology, one feature matrix, labels, splits.

A dataset directory holds ``dataset.json`` (the manifest) and .npy arrays, all memory-mapped on
open so that a graph far larger than RAM can be opened instantly:

* ``indptr.npy``  int64, N+1 — CSR row pointers: the neighbours of v are indices[indptr[v]:indptr[v+1]]
  (the vertices v's features are aggregated from, i.e. its in-neighbours for message passing);
* ``indices.npy`` int32 (N < 2^31) or int64, E — neighbour ids;
* ``features.npy`` float32 or float16, N × d, row-major;
* ``labels.npy`` int64, N — class of each vertex (-1: unlabelled);
* ``train_idx.npy``, ``val_idx.npy``, ``test_idx.npy`` int64 — vertex ids of each split.

``open_dataset`` validates the manifest and every array's dtype and shape, and names the file
and field that is wrong; ``check_ids`` scans ids for range errors chunk by chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moment.errors import MomentError
from moment.fileio import read_json

FORMAT = "moment.dataset/1"
FILES = {
    "indptr": "indptr.npy",
    "indices": "indices.npy",
    "features": "features.npy",
    "labels": "labels.npy",
    "train": "train_idx.npy",
    "val": "val_idx.npy",
    "test": "test_idx.npy",
}
FEATURE_DTYPES = ("float32", "float16")


class DatasetError(MomentError):
    """A dataset that does not validate; the message names the file and the field."""


class FeatureShape:
    """Sizes read from a manifest's ``meta``: shared by datasets and placed datasets."""

    meta: dict[str, Any]

    @property
    def num_nodes(self) -> int:
        return int(self.meta["num_nodes"])

    @property
    def num_edges(self) -> int:
        return int(self.meta["num_edges"])

    @property
    def feature_dim(self) -> int:
        return int(self.meta["feature_dim"])

    @property
    def feature_dtype(self) -> np.dtype:
        return np.dtype(self.meta["feature_dtype"])

    @property
    def num_classes(self) -> int:
        return int(self.meta["num_classes"])

    @property
    def row_bytes(self) -> int:
        return self.feature_dim * self.feature_dtype.itemsize


@dataclass
class Dataset(FeatureShape):
    root: Path
    meta: dict[str, Any]

    def path(self, key: str) -> Path:
        return self.root / self.meta["files"][key]

    def array(self, key: str) -> np.ndarray:
        """A read-only memory map of one array (no data is read until used)."""
        return np.load(self.path(key), mmap_mode="r")

    def indptr(self) -> np.ndarray:
        return self.array("indptr")

    def indices(self) -> np.ndarray:
        return self.array("indices")

    def features(self) -> np.ndarray:
        return self.array("features")

    def labels(self) -> np.ndarray:
        return self.array("labels")

    def split(self, name: str) -> np.ndarray:
        return self.array(name)


def _read_meta(root: Path) -> dict[str, Any]:
    path = root / "dataset.json"
    if not root.is_dir():
        raise DatasetError(f"{root}: not a dataset directory")
    meta = read_json(path, FORMAT, "a dataset directory needs its manifest", DatasetError)
    for key in ("num_nodes", "num_edges", "feature_dim", "num_classes"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key != "num_edges" else 0):
            raise DatasetError(f"{path}: {key}: expected a positive integer, got {value!r}")
    if meta.get("feature_dtype") not in FEATURE_DTYPES:
        raise DatasetError(f"{path}: feature_dtype: expected one of {FEATURE_DTYPES}, got {meta.get('feature_dtype')!r}")
    files = {**FILES, **(meta.get("files") or {})}
    meta["files"] = files
    return meta


def _header(path: Path, key: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an .npy file without reading its data."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(fh)
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing ({key})") from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: not a readable .npy file ({str(exc).splitlines()[0]})") from None
    if fortran and len(shape) > 1:
        raise DatasetError(f"{path}: {key} must be row-major (C order), not Fortran order")
    return shape, dtype


def open_dataset(path: str | Path) -> Dataset:
    """Open and validate a dataset directory (manifest, every array's dtype and shape)."""
    root = Path(path)
    meta = _read_meta(root)
    ds = Dataset(root, meta)
    n, e, d = ds.num_nodes, ds.num_edges, ds.feature_dim
    expect: dict[str, tuple[tuple[int, ...] | None, tuple[str, ...]]] = {
        "indptr": ((n + 1,), ("int64",)),
        "indices": ((e,), ("int32", "int64")),
        "features": ((n, d), (meta["feature_dtype"],)),
        "labels": ((n,), ("int64", "int32")),
        "train": (None, ("int64", "int32")),
        "val": (None, ("int64", "int32")),
        "test": (None, ("int64", "int32")),
    }
    for key, (shape, dtypes) in expect.items():
        file = ds.path(key)
        got_shape, got_dtype = _header(file, key)
        if got_dtype.name not in dtypes:
            raise DatasetError(f"{file}: {key} has dtype {got_dtype.name}, expected {' or '.join(dtypes)}")
        if shape is not None and tuple(got_shape) != shape:
            raise DatasetError(f"{file}: {key} has shape {tuple(got_shape)}, expected {shape}")
        if shape is None and len(got_shape) != 1:
            raise DatasetError(f"{file}: {key} must be a 1-D array of vertex ids, got shape {tuple(got_shape)}")
    indptr = ds.indptr()
    if indptr[0] != 0 or indptr[-1] != e:
        raise DatasetError(f"{ds.path('indptr')}: indptr must start at 0 and end at num_edges={e}, got {indptr[0]}..{indptr[-1]}")
    return ds


def check_ids(ds: Dataset, chunk: int = 1 << 24) -> None:
    """Full scan: indptr non-decreasing, every neighbour and split id in [0, N). Chunked."""
    n = ds.num_nodes
    indptr = ds.indptr()
    for start in range(0, n + 1, chunk):
        part = np.asarray(indptr[start : start + chunk + 1])
        if part.size > 1 and (np.diff(part) < 0).any():
            at = start + int(np.argmax(np.diff(part) < 0))
            raise DatasetError(f"{ds.path('indptr')}: indptr decreases at vertex {at}")
    for key in ("indices", "train", "val", "test"):
        arr = ds.array(key)
        for start in range(0, arr.shape[0], chunk):
            part = np.asarray(arr[start : start + chunk])
            bad = (part < 0) | (part >= n)
            if bad.any():
                at = start + int(np.argmax(bad))
                raise DatasetError(f"{ds.path(key)}: {key}[{at}] = {int(arr[at])} is not a vertex id (N = {n})")


def write_manifest(root: Path, meta: dict[str, Any]) -> None:
    """Write dataset.json (last, atomically: its presence means the arrays are complete)."""
    from moment.fileio import atomic_write_text

    body = {"format": FORMAT, **meta}
    body.setdefault("files", dict(FILES))
    atomic_write_text(root / "dataset.json", json.dumps(body, indent=2) + "\n")
