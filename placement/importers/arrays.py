"""Bring real data in (``moment dataset import``): plain .npy arrays → a dataset directory.

Edges come as an E×2 list (src, dst) or as CSR (indptr, indices, already in moment's orientation:
the neighbours of v are indices[indptr[v]:indptr[v+1]]). Either is turned into CSR by destination
(the neighbours of v are the sources of the edges into v, what v aggregates from) by
placement.importers.csr: one read of the edges into buckets of destinations, then each bucket's
rows filled and appended to the on-disk arrays, within the memory budget. Every input is checked first (its .npy header and size, ids, labels, splits, and that every
feature is finite) and an error names the file and what is wrong with it, in one line. The result
is written beside ``out`` and renamed into place once complete, like ``synthesize``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moment.errors import UsageError
from moment.progress import Progress
from placement.dataset import (
    FEATURE_DTYPES,
    FILES,
    SPLITS,
    Dataset,
    DatasetError,
    check_free_space,
    feature_source,
    label_type,
    open_dataset,
    read_npy_header,
    staging,
    write_import_manifest,
)
from placement.importers import csr, publish, readers

EDGE_FORMS = "give either --edges (an edge list), or --indptr with --indices"


def import_arrays(
    out: str | Path,
    features: str | Path,
    labels: str | Path,
    edges: str | Path | None = None,
    indptr: str | Path | None = None,
    indices: str | Path | None = None,
    train: str | Path | None = None,
    val: str | Path | None = None,
    test: str | Path | None = None,
    undirected: bool = False,
    self_loops: bool = False,
    seed: int = 0,
    feature_dtype: str | None = None,
    memory: int | None = None,
    fractions: tuple[float, float, float] = (0.01, 0.005, 0.005),
    chunk: int = 1 << 21,
    progress: Progress | None = None,
    dry_run: bool = False,
    copy_features: bool = False,
    log: Callable[[str], None] = print,
) -> Dataset | None:
    """Validate the arrays, then write them as a dataset directory at ``out`` and open it.

    ``undirected`` adds the reverse of every edge (self-loops once); ``self_loops`` gives every
    vertex exactly one self-loop; ``memory`` is the CSR build's budget in bytes
    (placement.importers.csr). ``dry_run`` checks the inputs and logs the schema and the disk
    needed, writing nothing (returns None). Splits not given are drawn at
    random (``fractions`` of the labelled vertices, ``seed``) from labelled vertices in no given split.
    ``feature_dtype`` converts the features (e.g. float64 → float32); by default they keep theirs.
    ``chunk`` is the number of edges (or feature values) handled at once. Features kept as they are
    (their dtype, native byte order) are read in place from ``features``, not copied, unless
    ``copy_features``: the manifest records the file's identity (placement.dataset.feature_source).
    """
    if (edges is None) == (indptr is None and indices is None) or (indptr is None) != (indices is None):
        raise UsageError(EDGE_FORMS)
    out = Path(out)
    if feature_dtype is not None and feature_dtype not in FEATURE_DTYPES:
        raise UsageError(f"feature_dtype: expected one of {', '.join(FEATURE_DTYPES)}, got {feature_dtype!r}")
    feats = _npy(features, "features")
    n, dim = _check_features(feats, features)
    _check_finite(feats, features, chunk)
    dtype = np.dtype(feature_dtype or feats.dtype.name)
    if dtype.name not in FEATURE_DTYPES:
        raise DatasetError(
            f"{features}: features have dtype {dtype.name}, expected {' or '.join(FEATURE_DTYPES)} "
            "(or ask for a conversion with feature_dtype)"
        )
    labs = _npy(labels, "labels")
    classes = _check_labels(labs, labels, n, features, chunk)
    if edges is not None:
        source: _EdgeList | _Csr = _EdgeList(edges, n)
    elif indptr is not None and indices is not None:
        source = _Csr(indptr, indices, n, chunk)
    else:
        raise UsageError(EDGE_FORMS)
    splits = {name: _read_split(path, name, n) for name, path in zip(SPLITS, (train, val, test)) if path is not None}
    _check_splits(splits, labs, labels)
    memory = memory or csr.default_memory()
    planned = csr.Layout.plan(n, memory)
    layout = csr.Layout(chunk=min(chunk, planned.chunk), window=planned.window)
    most = source.size * (2 if undirected else 1) + (n if self_loops else 0)  # an upper bound on the edges
    refer = not copy_features and feats.dtype == dtype and feats.dtype.isnative
    label = label_type(classes)
    need = (
        csr.disk_need(n, most, not csr.keeps(most, layout))
        + label.itemsize * n
        + (0 if refer else n * dim * dtype.itemsize)
    )
    if dry_run:
        log(
            f"{features}: {n:,} × {dim} {feats.dtype.name} features → {dtype.name}"
            f"{' (read in place, not copied)' if refer else ''}; {labels}: {classes} classes; "
            f"{source.size:,} edges in, up to {most:,} out"
        )
        log(f"RAM: budget {memory / 1e9:.2f} GB (--memory); disk: {need / 1e9:.2f} GB")
        edge_files = [Path(p) for p in (edges, indptr, indices) if p is not None]
        publish.log_costs(
            log,
            edge_files[-1],
            sum(p.stat().st_size for p in edge_files),
            Path(labels).stat().st_size,
            feats.nbytes,
            refer,
            0 if csr.keeps(most, layout) else 2 * most * csr.index_dtype(n).itemsize,
            need,
        )
    check_free_space(out, need)  # the dry run too: it says whether the import can run
    if dry_run:
        log("dry run: nothing written")
        return None
    with staging(out) as tmp:
        num_edges = csr.build(
            tmp,
            source,
            n,
            undirected=undirected,
            self_loops=self_loops,
            memory=memory,
            progress=progress,
            layout=layout,
        )
        at = feature_source(features, read_npy_header(features, "features").offset) if refer else None
        if not refer:
            _write_features(tmp, feats, features, dtype, chunk, progress)
        _write_labels(tmp, labels, labs, label, chunk)
        _write_splits(tmp, splits, labs, labels, fractions, seed, chunk)
        source_files = {"features": features, "labels": labels, "edges": edges, "indptr": indptr, "indices": indices}
        write_import_manifest(
            tmp,
            out,
            nodes=n,
            edges=num_edges,
            dim=dim,
            dtype=dtype,
            classes=classes,
            undirected=undirected,
            source=_provenance(source_files, splits, undirected, seed),
            features_at=at,
        )
    return open_dataset(out)


def _npy(path: str | Path, what: str) -> np.ndarray:
    """A read-only memory map of an .npy input, or an error naming it (the header is checked first:
    numpy's own errors for a text file or a truncated one are advice a user cannot act on)."""
    read_npy_header(path, what)
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: not a readable .npy array ({what}: {str(exc).splitlines()[0]})") from None


def _check_features(feats: np.ndarray, path: str | Path) -> tuple[int, int]:
    if feats.ndim != 2:
        raise DatasetError(f"{path}: features must be a 2-D N×d array, got shape {feats.shape}")
    if feats.dtype.kind != "f":
        raise DatasetError(f"{path}: features have dtype {feats.dtype.name}, expected float32 or float16")
    if not feats.flags.c_contiguous:
        raise DatasetError(f"{path}: features must be row-major (C order)")
    if feats.shape[0] < 1 or feats.shape[1] < 1:
        raise DatasetError(f"{path}: features have shape {feats.shape}: need at least one vertex and one column")
    return feats.shape


def _check_finite(feats: np.ndarray, path: str | Path, chunk: int) -> None:
    """Refuse NaN and inf before anything is written: no model learns from them, and NaN != NaN
    makes a byte-exact copy look corrupt to any comparison of values."""
    rows = max(1, chunk // feats.shape[1])
    for a, part in readers.rows(readers.npy(path, "features"), rows):  # plain reads: no resident map
        if not np.isfinite(part).all():
            row, col = (int(i) for i in np.argwhere(~np.isfinite(part))[0])
            raise DatasetError(
                f"{path}: features row {a + row} holds {part[row, col]} (column {col}): "
                "NaN and inf features are refused"
            )


def _check_labels(labs: np.ndarray, path: str | Path, n: int, features: str | Path, chunk: int) -> int:
    """Shape and range of the labels (-1: unlabelled); returns the number of classes."""
    if labs.ndim != 1 or labs.dtype.kind not in "iu":
        raise DatasetError(f"{path}: labels must be a 1-D integer array, got {labs.dtype.name} of shape {labs.shape}")
    if labs.shape[0] != n:
        raise DatasetError(f"{path}: labels have {labs.shape[0]} entries but {features} has {n} rows")
    top = -1
    for a, part in readers.rows(readers.npy(path, "labels"), chunk):
        if (part < -1).any():
            at = int(np.argmax(part < -1))
            raise DatasetError(f"{path}: labels[{a + at}] = {int(part[at])}: a class id is >= 0 (-1 for unlabelled)")
        top = max(top, int(part.max()))
    if top < 0:
        raise DatasetError(f"{path}: no vertex is labelled (all -1)")
    return top + 1


class _EdgeList:
    """An E×2 .npy edge list (src, dst), read in chunks."""

    def __init__(self, path: str | Path, n: int) -> None:
        self.path, self.n = path, n
        self.array = _npy(path, "edges")
        if self.array.ndim != 2 or self.array.shape[1] != 2 or self.array.dtype.kind not in "iu":
            raise DatasetError(
                f"{path}: edges must be an E×2 integer array (src, dst), "
                f"got {self.array.dtype.name} of shape {self.array.shape}"
            )
        self.size = self.array.shape[0]

    def chunks(self, chunk: int) -> csr.Edges:
        if self.array.flags.c_contiguous:  # plain reads: no resident memory map of the whole list
            blocks = readers.rows(readers.npy(self.path, "edges"), chunk)
        else:
            blocks = ((a, self.array[a : a + chunk]) for a in range(0, self.size, chunk))
        for a, block in blocks:
            part = np.asarray(block, dtype=np.int64)
            _check_range(part, self.n, self.path, "edges", a)
            yield part[:, 0], part[:, 1]


class _Csr:
    """CSR arrays (neighbours of v = indices[indptr[v]:indptr[v+1]]), read as edges row range by row range."""

    def __init__(self, indptr: str | Path, indices: str | Path, n: int, chunk: int) -> None:
        self.indptr_path, self.indices_path, self.n = indptr, indices, n
        self.indptr, self.indices = _npy(indptr, "indptr"), _npy(indices, "indices")
        for arr, path, what in ((self.indptr, indptr, "indptr"), (self.indices, indices, "indices")):
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise DatasetError(
                    f"{path}: {what} must be a 1-D integer array, got {arr.dtype.name} of shape {arr.shape}"
                )
        if self.indptr.shape[0] != n + 1:
            raise DatasetError(
                f"{indptr}: indptr has {self.indptr.shape[0]} entries, expected N+1 = {n + 1} (N from the features)"
            )
        e = self.size = self.indices.shape[0]
        if self.indptr[0] != 0 or self.indptr[-1] != e:
            raise DatasetError(
                f"{indptr}: indptr must run from 0 to len(indices) = {e}, "
                f"got {int(self.indptr[0])}..{int(self.indptr[-1])}"
            )
        for a in range(0, n, chunk):
            steps = np.diff(np.asarray(self.indptr[a : a + chunk + 1]))
            if (steps < 0).any():
                raise DatasetError(f"{indptr}: indptr decreases at vertex {a + int(np.argmax(steps < 0))}")

    def chunks(self, chunk: int) -> csr.Edges:
        """Whole rows, about ``chunk`` edges at a time (one row may be longer)."""
        v = 0
        while v < self.n:
            start = int(self.indptr[v])
            end = max(v + 1, int(np.searchsorted(self.indptr, start + chunk, side="right")) - 1)
            end = min(end, self.n)
            stop = int(self.indptr[end])
            src = np.asarray(self.indices[start:stop], dtype=np.int64)
            _check_range(src, self.n, self.indices_path, "indices", start)
            yield src, np.repeat(np.arange(v, end, dtype=np.int64), np.diff(np.asarray(self.indptr[v : end + 1])))
            v = end


def _check_range(ids: np.ndarray, n: int, path: str | Path, what: str, offset: int) -> None:
    bad = (ids < 0) | (ids >= n)
    if bad.any():
        at = int(np.argmax(bad.ravel()))
        row = offset + (at // ids.shape[1] if ids.ndim == 2 else at)
        value = int(ids.ravel()[at])
        raise DatasetError(f"{path}: {what}[{row}] holds {value}, not a vertex id (N = {n} from the features)")


def _write_features(
    tmp: Path, feats: np.ndarray, path: str | Path, dtype: np.dtype, chunk: int, progress: Progress | None
) -> None:
    """A byte copy when nothing changes, else a chunked conversion that refuses overflow."""
    target = tmp / FILES["features"]
    if feats.dtype == dtype and feats.dtype.isnative:
        shutil.copyfile(path, target)  # --copy-features
        return
    rows = max(1, chunk // feats.shape[1])
    with open(target, "wb") as out:
        np.lib.format.write_array_header_2_0(
            out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": feats.shape}
        )
        for a, block in readers.rows(readers.npy(path, "features"), rows):
            with np.errstate(over="ignore"):  # overflow is checked just below, naming the rows
                part = block.astype(dtype)
            if not np.isfinite(part).all():  # the source is finite (_check_finite): the conversion overflowed
                raise DatasetError(f"{path}: features in rows {a}..{a + len(part) - 1} do not fit in {dtype.name}")
            out.write(part.data)
            _report(progress, "features", a + len(part), feats.shape[0])


def _write_labels(tmp: Path, path: str | Path, labs: np.ndarray, dtype: np.dtype, chunk: int) -> None:
    """The labels in ``dtype`` (``dataset.label_type`` of the classes ``_check_labels`` found)."""
    with open(tmp / FILES["labels"], "wb") as out:
        descr = np.lib.format.dtype_to_descr(dtype)
        np.lib.format.write_array_header_2_0(out, {"descr": descr, "fortran_order": False, "shape": labs.shape})
        for _, part in readers.rows(readers.npy(path, "labels"), chunk):
            out.write(part.astype(dtype).data)


def _read_split(path: str | Path, name: str, n: int) -> np.ndarray:
    """A split's ids, checked (1-D integers in range, no repeats) and sorted."""
    arr = _npy(path, name)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DatasetError(
            f"{path}: {name} must be a 1-D integer array of vertex ids, got {arr.dtype.name} of shape {arr.shape}"
        )
    if name == "train" and not arr.size:
        raise DatasetError(f"{path}: train split is empty (no vertex to train on)")
    ids = np.asarray(arr, dtype=np.int64)
    _check_range(ids, n, path, name, 0)  # before sorting, so the index named is the file's
    ids = np.sort(ids)
    if ids.size and (np.diff(ids) == 0).any():
        raise DatasetError(f"{path}: {name} lists vertex {int(ids[np.argmax(np.diff(ids) == 0)])} twice")
    return ids


def _check_splits(given: dict[str, np.ndarray], labs: np.ndarray, labels_path: str | Path) -> None:
    """Given splits are disjoint and hold only labelled vertices (a training label of -1 is a bug)."""
    names = list(given)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = np.intersect1d(given[a], given[b])
            if both.size:
                raise DatasetError(f"{a} and {b} share {both.size} vertices (e.g. {int(both[0])}): splits are disjoint")
        unlabelled = given[a][np.asarray(labs[given[a]]) < 0]
        if unlabelled.size:
            raise DatasetError(f"{labels_path}: vertex {int(unlabelled[0])} of the {a} split is unlabelled (-1)")


def _write_splits(
    tmp: Path,
    given: dict[str, np.ndarray],
    labs: np.ndarray,
    labels_path: str | Path,
    fractions: tuple[float, float, float],
    seed: int,
    chunk: int,
) -> None:
    """Given splits as they are, the others random among labelled vertices not yet in a split."""
    splits = dict(given)
    missing = [(name, f) for name, f in zip(SPLITS, fractions) if name not in given]
    if missing:
        pool = _labelled(labs, chunk)
        sizes = [max(1, round(f * pool.size)) for _, f in missing]
        pool = np.setdiff1d(pool, np.concatenate([np.empty(0, np.int64), *given.values()]), assume_unique=True)
        if sum(sizes) > pool.size:
            raise DatasetError(
                f"{labels_path}: only {pool.size} labelled vertices are free for the "
                f"{', '.join(name for name, _ in missing)} split(s), {sum(sizes)} needed"
            )
        picked = np.random.default_rng(seed).choice(pool, size=sum(sizes), replace=False)
        for (name, _), part in zip(missing, np.split(picked, np.cumsum(sizes)[:-1])):
            splits[name] = np.sort(part)
    for name in SPLITS:
        np.save(tmp / FILES[name], splits[name])


def _labelled(labs: np.ndarray, chunk: int) -> np.ndarray:
    parts = [a + np.flatnonzero(np.asarray(labs[a : a + chunk]) >= 0) for a in range(0, labs.shape[0], chunk)]
    return np.concatenate(parts).astype(np.int64)


def _provenance(
    files: dict[str, str | Path | None], splits: dict[str, np.ndarray], undirected: bool, seed: int
) -> dict[str, Any]:
    """Where the dataset came from, for the manifest."""
    return {
        "kind": "import",
        "files": {k: str(Path(v).absolute()) for k, v in files.items() if v is not None},
        "given_splits": sorted(splits),
        "undirected": undirected,
        "seed": seed,
    }


def _report(progress: Progress | None, stage: str, done: int, total: int) -> int:
    """Tell the progress callback; returns ``done`` so a loop can carry it."""
    if progress:
        progress(stage, done, total)
    return done


def run(out: Path, **options: Any) -> Dataset | None:
    """The registry's entry point (placement.importers)."""
    return import_arrays(out, **options)
