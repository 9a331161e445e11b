"""The on-disk graph dataset ``moment`` reads: CSR topology, one feature matrix, labels, splits.

A dataset directory holds ``dataset.json`` (the manifest) and .npy arrays, all memory-mapped on
open so that a graph far larger than RAM can be opened instantly:

* ``indptr.npy``  int64, N+1 — CSR row pointers: the neighbours of v are indices[indptr[v]:indptr[v+1]]
  (the vertices v's features are aggregated from, i.e. its in-neighbours for message passing);
* ``indices.npy`` int32 (N < 2^31) or int64, E — neighbour ids;
* ``features.npy`` float32 or float16, N × d, row-major — or, for an import that did not copy them,
  the rows of the source file itself (``features_at`` in the manifest: path, offset, size, mtime and
  a sampled digest, checked on every open, so a moved or changed source is refused by name);
* ``labels.npy`` N — class of each vertex (-1: unlabelled), in the narrowest signed integer type
  holding the classes (:func:`label_type`: int8 up to 127 classes); datasets written before
  that hold int64, which readers take as well (they widen per batch, never the whole array);
* ``train_idx.npy``, ``val_idx.npy``, ``test_idx.npy`` int64 — vertex ids of each split.

``open_dataset`` runs the cheap checks on every open (the manifest through its contract, each
array's dtype, shape and size, indptr's ends, a non-empty train split); ``check_dataset`` is the
full scan (ids, indptr order, labels), chunk by chunk, which can hash each file as it reads it. Every error is one line naming the file.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moment import faults, outputs
from moment.contracts.dataset import FEATURE_DTYPES, FILES, FORMAT, DatasetError, DatasetManifest, FeatureSource
from placement.digests import Hasher, new_hasher

__all__ = [
    "DATASET",
    "FEATURE_DTYPES",
    "FILES",
    "FORMAT",
    "LABEL_DTYPES",
    "Dataset",
    "DatasetError",
    "DatasetManifest",
    "FeatureShape",
    "NpyHeader",
    "SPLITS",
    "ScannedFile",
    "check_dataset",
    "check_free_space",
    "feature_source",
    "file_identity",
    "label_type",
    "open_dataset",
    "read_npy_header",
    "staging",
    "write_manifest",
]

SPLITS = ("train", "val", "test")
LABEL_DTYPES = ("int8", "int16", "int32", "int64")  # what labels.npy may hold, narrowest first
CHUNK = 1 << 22  # entries per step of a full scan: tens of MB whatever the dataset's size


def label_type(num_classes: int) -> np.dtype:
    """The narrowest of ``LABEL_DTYPES`` holding -1 (unlabelled) and every class
    0..num_classes-1: what importers, synth and ``moment place`` write labels in (int8 for
    IGB's 19 classes: an eighth of int64's bytes to write, hash and read)."""
    for name in LABEL_DTYPES[:-1]:
        if num_classes - 1 <= np.iinfo(name).max:
            return np.dtype(name)
    return np.dtype(LABEL_DTYPES[-1])


class FeatureShape:
    """Sizes read from a manifest's ``meta``: shared by datasets and placed datasets."""

    if TYPE_CHECKING:  # a Dataset's is computed once, a Placed's is a field: read-only here

        @property
        def meta(self) -> dict[str, Any]: ...

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
    """An opened dataset directory: its validated manifest, and memory maps of its arrays on demand."""

    root: Path
    manifest: DatasetManifest

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The manifest as plain JSON data (what ``moment place`` records and hashes); unset fields left out."""
        return self.manifest.model_dump(mode="json", exclude_none=True)

    def path(self, key: str) -> Path:
        """Where an array is: in the directory, or (features imported without a copy) the source file."""
        if key == "features" and self.manifest.features_at is not None:
            return Path(self.manifest.features_at.path)
        return self.root / getattr(self.manifest.files, key)

    def array(self, key: str) -> np.ndarray:
        """A read-only memory map of one array (no data is read until used)."""
        at = self.manifest.features_at
        if key == "features" and at is not None:  # a source's rows (an .npy past its header, or IGB's raw file)
            shape = (self.num_nodes, self.feature_dim)
            return np.memmap(at.path, dtype=self.feature_dtype, mode="r", offset=at.offset, shape=shape)
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


@dataclass(frozen=True)
class NpyHeader:
    """What an .npy file's header promises: shape, dtype, order, and where the data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    offset: int

    @property
    def nbytes(self) -> int:
        """The file size the header implies."""
        return self.offset + math.prod(self.shape) * self.dtype.itemsize


def read_npy_header(path: str | Path, what: str) -> NpyHeader:
    """An .npy file's header, read without its data, and checked against the file's size.

    Refused with one line naming the file: missing, not an .npy file (text, .npz, pickle), an array
    of Python objects (pickled: never loaded), or shorter than its header says (truncated).
    """
    path = Path(path)
    fmt = np.lib.format
    try:
        with open(path, "rb") as fh:
            if fh.read(len(fmt.MAGIC_PREFIX)) != fmt.MAGIC_PREFIX:
                raise DatasetError(f"{path}: not a .npy file ({what})")
            fh.seek(0)
            version = fmt.read_magic(fh)
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read(fh)
            header = NpyHeader(tuple(shape), dtype, fortran, fh.tell())
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing ({what})") from None
    except OSError as exc:
        raise DatasetError(f"{path}: unreadable ({what}: {exc.strerror})") from None
    except ValueError as exc:
        raise DatasetError(f"{path}: not a readable .npy file ({what}: {str(exc).splitlines()[0]})") from None
    if dtype.hasobject:
        raise DatasetError(f"{path}: {what} holds Python objects (pickled data), not numbers")
    if size < header.nbytes:
        raise DatasetError(f"{path}: truncated: {size} bytes, expected {header.nbytes}")
    return header


def _read_manifest(root: Path) -> DatasetManifest:
    if not root.is_dir():
        raise DatasetError(f"{root}: not a dataset directory")
    return DatasetManifest.read(root / "dataset.json")


def _expected(ds: Dataset) -> dict[str, tuple[tuple[int, ...] | None, tuple[str, ...]]]:
    """Shape (None: any 1-D) and allowed dtypes of each array, from the manifest."""
    n, e, d = ds.num_nodes, ds.num_edges, ds.feature_dim
    ids = ("int64", "int32")
    return {
        "indptr": ((n + 1,), ("int64",)),
        "indices": ((e,), ("int32", "int64")),
        "features": ((n, d), (ds.manifest.feature_dtype,)),
        "labels": ((n,), LABEL_DTYPES),
        **{key: (None, ids) for key in SPLITS},
    }


def _check_array(file: Path, key: str, shape: tuple[int, ...] | None, dtypes: tuple[str, ...]) -> NpyHeader:
    header = read_npy_header(file, key)
    if header.fortran and len(header.shape) > 1:
        raise DatasetError(f"{file}: {key} must be row-major (C order), not Fortran order")
    if header.dtype.name not in dtypes:
        raise DatasetError(f"{file}: {key} has dtype {header.dtype.name}, expected {' or '.join(dtypes)}")
    if shape is not None and header.shape != shape:
        raise DatasetError(f"{file}: {key} has shape {header.shape}, expected {shape}")
    if shape is None and len(header.shape) != 1:
        raise DatasetError(f"{file}: {key} must be a 1-D array of vertex ids, got shape {header.shape}")
    return header


DIGEST_BLOCKS, DIGEST_BLOCK = 16, 1 << 16  # a source's sampled digest: 16 blocks of 64 KiB at fixed offsets


def sampled_digest(path: str | Path, size: int) -> str:
    """blake2b of ``DIGEST_BLOCKS`` blocks spread evenly over a file (first and last included) and its
    size: 1 MiB read whatever the file's size, enough to see a file rewritten in place."""
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    starts = np.unique(np.linspace(0, max(0, size - DIGEST_BLOCK), DIGEST_BLOCKS).astype(np.int64))
    with open(path, "rb") as fh:
        for start in starts:
            h.update(os.pread(fh.fileno(), DIGEST_BLOCK, int(start)))
    return "blake2b-" + h.hexdigest()


def feature_source(path: str | Path, offset: int) -> FeatureSource:
    """What a source file is now (recorded at import, compared on every open)."""
    path = Path(path).absolute()
    st = path.stat()
    return FeatureSource(
        path=str(path), offset=offset, size=st.st_size, mtime_ns=st.st_mtime_ns, digest=sampled_digest(path, st.st_size)
    )


def _check_source(ds: Dataset) -> None:
    """The features' source file is still the one imported: same path, size, mtime and sampled digest."""
    at = ds.manifest.features_at
    assert at is not None
    fix = (
        f"put the file back as it was, or import the dataset again (`moment dataset import ... --out {ds.root}`; "
        "--copy-features keeps a copy that does not depend on the source)"
    )
    try:
        st = os.stat(at.path)
    except FileNotFoundError:
        raise DatasetError(
            f"{at.path}: missing: {ds.root / 'dataset.json'} reads its features from this file (moved or deleted?): "
            + fix
        ) from None
    except OSError as exc:
        raise DatasetError(f"{at.path}: unreadable ({exc.strerror}): the features of {ds.root}") from None
    changed = []
    if st.st_size != at.size:
        changed.append(f"{st.st_size:,} bytes, was {at.size:,}")
    elif st.st_mtime_ns != at.mtime_ns:
        changed.append("modified since the import")
    elif sampled_digest(at.path, st.st_size) != at.digest:
        changed.append("its content differs from the import's")
    if changed:
        raise DatasetError(
            f"{at.path}: changed ({changed[0]}): {ds.root / 'dataset.json'} reads its features from this file: " + fix
        )


def open_dataset(path: str | Path) -> Dataset:
    """Open a dataset directory with the cheap checks, run on every open (no array is scanned).

    The manifest; every array's dtype, shape, and file size against its header (a truncated file is
    named here, not in numpy's mmap error); indptr's ends; a non-empty train split.
    ``check_dataset`` is the full scan.
    """
    root = Path(path)
    ds = Dataset(root, _read_manifest(root))
    expected = _expected(ds)
    if ds.manifest.features_at is not None:
        _check_source(ds)
        del expected["features"]
    headers = {key: _check_array(ds.path(key), key, *spec) for key, spec in expected.items()}
    e = ds.num_edges
    indptr = ds.indptr()
    if indptr[0] != 0 or indptr[-1] != e:
        raise DatasetError(
            f"{ds.path('indptr')}: indptr must start at 0 and end at num_edges={e}, got {indptr[0]}..{indptr[-1]}"
        )
    if headers["train"].shape[0] == 0:
        raise DatasetError(f"{ds.path('train')}: train split is empty (no vertex to train on)")
    return ds


def check_dataset(ds: Dataset, chunk: int = CHUNK, digest: str | None = None) -> dict[str, ScannedFile]:
    """The full scan, ``chunk`` entries at a time (bounded memory): what a cheap open cannot see.

    indptr non-decreasing; every neighbour and split id in [0, N) (a negative id would silently wrap
    around to another vertex); every label in [-1, num_classes) (-1: unlabelled); every split vertex
    labelled. Otherwise these surface as an IndexError deep in sampling or training, or never.

    With ``digest`` (an algorithm of :mod:`placement.digests`), each scanned file (topology, labels,
    splits) is hashed whole from the chunks the scan reads anyway, so that ``moment place`` need
    not read them a second time for placed.json; a file that changed while it was read (another
    inode, size or mtime after than before) is left out of what is returned.
    """
    taps = {key: _Tap(ds.path(key), key, digest) for key in SCANNED} if digest else {}
    _check_indptr(ds, chunk, taps.get("indptr"))
    n = ds.num_nodes
    for key in ("indices", *SPLITS):
        arr = ds.array(key)
        at = _first_outside(arr, 0, n, chunk, taps.get(key))
        if at is not None:
            where = f" (a neighbour of vertex {_row_of(ds, at)})" if key == "indices" else ""
            raise DatasetError(f"{ds.path(key)}: {key}[{at}] = {int(arr[at])} is not a vertex id (N = {n}){where}")
    labels, k = ds.labels(), ds.num_classes
    at = _first_outside(labels, -1, k, chunk, taps.get("labels"))
    if at is not None:
        raise DatasetError(
            f"{ds.path('labels')}: labels[{at}] = {int(labels[at])} is not a class (num_classes = {k}; -1 = unlabelled)"
        )
    for key in SPLITS:
        _check_labelled(ds, key, labels, chunk)
    return {key: done for key, tap in taps.items() if (done := tap.finish()) is not None}


# The files the full scan reads whole, in order (and so can hash): all but the features.
SCANNED = ("indptr", "indices", "labels", *SPLITS)


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """What says a file is the same one: device, inode, size, mtime (ns). moment never writes into
    a dataset's file (a new dataset is a new inode), so an equal identity means the same bytes."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class ScannedFile:
    """A file's digest taken by the full scan, and the file's identity while it was read: the
    digest stands for any name of that identity (a hard link), never for a copy or a replacement."""

    path: Path
    identity: tuple[int, int, int, int]
    digest: str
    algorithm: str


class _Tap:
    """A whole-file digest fed by a scan: the .npy header read here (a few hundred bytes), the data
    in the scan's chunks, in order, and any bytes past the data read here."""

    def __init__(self, path: Path, key: str, algorithm: str) -> None:
        self.path, self.algorithm = path, algorithm
        self.before = file_identity(path)
        self.header = read_npy_header(path, key)
        self.hasher: Hasher = new_hasher(algorithm)
        with open(path, "rb") as fh:
            self.hasher.update(fh.read(self.header.offset))
        self.fed = 0

    def __call__(self, part: np.ndarray) -> None:
        view = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        self.hasher.update(memoryview(view))
        self.fed += view.size

    def finish(self) -> ScannedFile | None:
        """The digest, or None where the scan did not feed every byte or the file changed."""
        end = self.header.nbytes
        if self.fed != end - self.header.offset:
            return None
        with open(self.path, "rb") as fh:
            fh.seek(end)
            while chunk := fh.read(8 << 20):  # bytes past the array's (numpy writes none)
                self.hasher.update(chunk)
        if file_identity(self.path) != self.before:
            return None
        return ScannedFile(self.path, self.before, self.hasher.hexdigest(), self.algorithm)


def _check_indptr(ds: Dataset, chunk: int, tap: _Tap | None = None) -> None:
    indptr = ds.indptr()
    last = None  # the previous chunk's last entry: each entry is read once
    for start in range(0, indptr.shape[0], chunk):
        part = np.asarray(indptr[start : start + chunk])
        if tap is not None:
            tap(part)
        steps = np.diff(part) if last is None else np.diff(part, prepend=last)
        if (steps < 0).any():
            v = start - (last is not None) + int(np.argmax(steps < 0))
            raise DatasetError(
                f"{ds.path('indptr')}: indptr[{v + 1}] = {int(indptr[v + 1])} is below "
                f"indptr[{v}] = {int(indptr[v])}: indptr must not decrease (vertex {v})"
            )
        last = part[-1]


def _first_outside(arr: np.ndarray, lo: int, hi: int, chunk: int, tap: _Tap | None = None) -> int | None:
    """Index of the first entry outside [lo, hi), or None (each chunk fed to ``tap`` as read)."""
    for start in range(0, arr.shape[0], chunk):
        part = np.asarray(arr[start : start + chunk])
        if tap is not None:
            tap(part)
        if part.min() < lo or part.max() >= hi:
            return start + int(np.argmax((part < lo) | (part >= hi)))
    return None


def _row_of(ds: Dataset, edge: int) -> int:
    """The vertex whose neighbour list holds entry ``edge`` of indices (indptr already checked)."""
    return int(np.searchsorted(ds.indptr(), edge, side="right")) - 1


def _check_labelled(ds: Dataset, key: str, labels: np.ndarray, chunk: int) -> None:
    """Every vertex of a split has a label (a target of -1 fails the loss or the accuracy)."""
    ids = ds.array(key)
    for start in range(0, ids.shape[0], chunk):
        part = np.asarray(ids[start : start + chunk])
        bad = np.asarray(labels[part]) < 0
        if bad.any():
            at = int(np.argmax(bad))
            raise DatasetError(
                f"{ds.path(key)}: {key}[{start + at}] = vertex {int(part[at])} is unlabelled "
                f"(-1 in {ds.path('labels').name})"
            )


def write_manifest(root: Path, meta: dict[str, Any]) -> DatasetManifest:
    """Write dataset.json through its contract (last, atomically: its presence means the arrays are
    complete); a writer cannot produce a manifest that readers refuse."""
    path = Path(root) / "dataset.json"
    manifest = DatasetManifest.parse({"format": FORMAT, **meta}, path)
    manifest.write(path)
    return manifest


def write_import_manifest(
    root: Path,
    out: Path,
    *,
    nodes: int,
    edges: int,
    dim: int,
    dtype: np.dtype,
    classes: int,
    undirected: bool,
    source: dict[str, Any],
    features_at: FeatureSource | None = None,
) -> DatasetManifest:
    """dataset.json of an imported dataset (every importer: the same fields, its own provenance);
    ``features_at``: the features are read in place from that source file, not copied."""
    refer = {} if features_at is None else {"files": {"features": None}, "features_at": features_at.model_dump()}
    return write_manifest(
        root,
        {
            **refer,
            "name": out.absolute().name,
            "num_nodes": nodes,
            "num_edges": edges,
            "feature_dim": dim,
            "feature_dtype": dtype.name,
            "num_classes": classes,
            "directed": not undirected,
            "source": source,
        },
    )


# Writing a dataset directory (synth and import): moment.outputs' protocol for this kind ########


def check_free_space(out: str | Path, needed_bytes: int) -> None:
    """Refuse to start a write that cannot fit, rather than fail hours in with a full disk."""
    outputs.check_free_space({Path(out): needed_bytes}, DatasetError)


def _dataset_files(root: Path) -> list[Path]:
    """A dataset's files that moment wrote: the arrays its validated manifest names, and the manifest."""
    ds = open_dataset(root)
    return [*(ds.path(key) for key in ds.meta["files"]), root / "dataset.json"]


DATASET = outputs.Kind("dataset", "dataset.json", "moment dataset", open_dataset, _dataset_files, DatasetError)


@contextmanager
def staging(out: Path, replace: bool = False) -> Iterator[Path]:
    """A locked staging directory (``OUT.partial/data``) that becomes ``out`` only once complete
    and synced (moment.outputs). ``out`` must be absent or empty — or, with ``replace``, a
    dataset, replaced whole. A killed run's staging is taken over: a half-written dataset is
    thrown away (generation is not resumable), a half-published one finished first.
    """
    out = Path(out)
    stage = outputs.Staging(out, DATASET)
    if stage.resume():
        if stage.old.exists():
            stage.publish("dataset")
            stage = outputs.Staging(out, DATASET)
        elif stage.data.exists():
            shutil.rmtree(stage.data)  # inside our own locked staging directory
    outputs.check_out(out, DATASET, replace=replace)
    stage.create()
    stage.data.mkdir()
    try:
        yield stage.data
        faults.point("dataset:written")
    except BaseException as exc:
        shutil.rmtree(stage.data, ignore_errors=True)
        stage.release()
        if isinstance(exc, OSError) and exc.filename is None and exc.strerror:  # a write's ENOSPC names no file
            raise DatasetError(f"{out}: {exc.strerror} while writing the dataset (nothing kept)") from None
        raise
    stage.publish("dataset")
