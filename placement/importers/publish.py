"""What every format importer shares: from the arrays it found to a published dataset directory.

An importer (igb, ogb) only finds the arrays and says how to read them (:class:`Found`);
:func:`write_dataset` prints the schema and the RAM and disk the import needs (all a ``--dry-run``
does), checks free space, then writes into a staging directory renamed into place once complete
(like ``moment dataset synth``): the CSR out of core (placement.importers.csr), the features
block by block once the edges are read, beside the CSR's fill (converted on request, NaN/inf and
float16 overflow refused naming the row), the labels in the narrowest integer type holding the
classes (-1: unlabelled; int8 for IGB's 19), the splits, and the manifest last.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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
    staging,
    write_import_manifest,
)
from placement.estimate import COPY_RATIO, read_rate
from placement.importers import csr, kernels
from placement.importers.readers import Array, ArrayFile, EdgeArray, rows

Log = Callable[[str], None]
BLOCK = 64 << 20  # bytes of features or labels handled at once


@dataclass
class Found:
    """An importer's finding: which arrays to read and how (nothing is read yet)."""

    fmt: str
    features: Array  # N × d
    labels: Array  # N or N × 1, integer or float (NaN: unlabelled)
    edges: EdgeArray
    splits: Callable[[], dict[str, np.ndarray]]  # drawn or read once the labels are written
    split: str | None  # the convention or shipped split, for the manifest
    given_splits: list[str]
    files: dict[str, str]
    seed: int
    labelled: int | None = None  # only rows 0..labelled-1 are labelled; the rest is padding (-1)
    classes: int | None = None  # the declared number of classes; None: the largest label + 1
    prepare: Callable[[], None] | None = None  # slow set-up of ``splits`` (an import), run in a thread meanwhile
    notes: list[str] = field(default_factory=list)  # schema lines for the dry run
    warnings: list[str] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return self.features.shape[0]


def write_dataset(
    out: str | Path,
    found: Found,
    *,
    feature_dtype: str | None = None,
    undirected: bool = False,
    self_loops: bool = False,
    memory: int | None = None,
    dry_run: bool = False,
    copy_features: bool = False,
    progress: Progress | None = None,
    log: Log = print,
) -> Dataset | None:
    """Import what ``found`` describes into ``out`` (None with ``dry_run``: only the schema and needs).

    Features that already are rows moment reads are not copied (``in_place``): the manifest names
    the source file; ``copy_features`` (or a conversion) copies them."""
    out = Path(out)
    n, dim, dtype = _check_features(found, feature_dtype)
    refer = in_place(found.features, dtype, copy_features)
    _check_labels_shape(found.labels, n, found.features)
    memory = memory or csr.default_memory()
    layout = csr.Layout.plan(n, memory)
    most = found.edges.size * (2 if undirected else 1) + (n if self_loops else 0)
    scratch = not csr.keeps(most, layout)
    label = None if found.classes is None else label_type(found.classes)  # None: known once they are read
    disk = {
        "csr": csr.disk_need(n, most, scratch),
        "features": 0 if refer else n * dim * dtype.itemsize,
        "labels and splits": ((8 if label is None else label.itemsize) + 8) * n,
    }
    for line in found.notes:
        log(line)
    log(
        f"will write: {n:,} vertices × {dim} {dtype.name} features, up to {most:,} edges "
        f"({'undirected: reverses added' if undirected else 'directed'}"
        f"{', a self-loop per vertex' if self_loops else ''}), labels "
        f"{'in the narrowest type holding the classes (read twice)' if label is None else label.name} (-1: unlabelled)"
    )
    log(
        f"RAM: budget {memory / 1e9:.2f} GB (--memory): chunks of {layout.chunk:,} edges, spread into buckets "
        f"of destinations {'(scratch files)' if scratch else '(kept in RAM)'} of about "
        f"{csr.target(most, layout):,} neighbours, each filled at once if it holds ≤ {layout.window:,}, else in windows"
    )
    log(
        "disk: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in disk.items())
        + f"; {sum(disk.values()) / 1e9:.2f} GB in all (scratch included, freed at the end)"
    )
    log_costs(
        log,
        found.edges.arr.path,
        found.edges.arr.nbytes,
        found.labels.nbytes * (2 if label is None else 1),
        found.features.nbytes,
        refer,
        2 * most * csr.index_dtype(n).itemsize if scratch else 0,
        sum(disk.values()),
    )
    log(
        f"features: read in place from {found.features.path} (not copied; --copy-features copies them)"
        if refer
        else f"features: copied into {out / FILES['features']}"
    )
    for warning in found.warnings:
        log(f"warning: {warning}")
    check_free_space(out, sum(disk.values()))  # the dry run too: it says whether the import can run
    if dry_run:
        log("dry run: nothing written")
        return None
    clock = _Phases()
    if found.prepare is not None:  # e.g. torch's import (seconds), while the CSR build waits on the disk
        threading.Thread(target=found.prepare, name="import-prepare", daemon=True).start()
    with staging(out) as tmp, ThreadPoolExecutor(1, thread_name_prefix="import-features") as pool:
        checked: list[Future[None]] = []  # the features read (checked or copied) once the edges are read,
        # beside the CSR fill, which works from its scratch files: the disk is free then
        target = None if refer else tmp / FILES["features"]
        num_edges = csr.build(
            tmp,
            found.edges,
            n,
            undirected=undirected,
            self_loops=self_loops,
            memory=memory,
            progress=progress,
            layout=layout,
            after_read=lambda: checked.append(pool.submit(_write_features, target, found.features, dtype, progress)),
        )
        clock("csr")
        f = found.features
        source = feature_source(f.path, f.offset) if refer and isinstance(f, ArrayFile) else None
        checked[0].result()  # its error, if any, raised here
        clock("features")
        classes, labelled = _write_labels(tmp, found, progress)
        clock("labels")
        splits = found.splits()
        _check_splits(tmp, splits, n, found)
        for name in SPLITS:
            np.save(tmp / FILES[name], splits[name].astype(np.int64))
        clock("splits")
        write_import_manifest(
            tmp,
            out,
            nodes=n,
            edges=num_edges,
            dim=dim,
            dtype=dtype,
            classes=classes,
            undirected=undirected,
            source={
                "kind": "import",
                "format": found.fmt,
                "files": found.files,
                "given_splits": found.given_splits,
                "undirected": undirected,
                "self_loops": self_loops,
                "seed": found.seed,
                "split": found.split,
                "labelled": labelled,
            },
            features_at=source,
        )
    clock("publish")
    log(clock.line())
    return open_dataset(out)


class _Phases:
    """Seconds per import step and the CPU seconds of all threads in it, for the last line
    (``import phases: csr 1.20 s (CPU 1.90 s), ...``: CPU above wall time is the threads at work,
    far below it is waiting on the disk or on a busy machine). The features are read during the
    CSR's fill: their step is what remains of it after the CSR."""

    def __init__(self) -> None:
        self.last, self.cpu = time.perf_counter(), time.process_time()
        self.took: dict[str, tuple[float, float]] = {}

    def __call__(self, name: str) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        self.took[name] = (now - self.last, cpu - self.cpu)
        self.last, self.cpu = now, cpu

    def line(self) -> str:
        return "import phases: " + ", ".join(f"{k} {w:.2f} s (CPU {c:.2f} s)" for k, (w, c) in self.took.items())


def check_feature_layout(f: Array) -> None:
    """A row-major N×d float array, or one line naming the file (before anything reads rows of it)."""
    if len(f.shape) != 2 or f.dtype.kind != "f" or f.fortran:
        raise DatasetError(
            f"{f.label}: features must be a row-major N×d float array, got {f.dtype.name} of shape "
            f"{f.shape}{' in Fortran order' if f.fortran else ''}"
        )


def _check_features(found: Found, feature_dtype: str | None) -> tuple[int, int, np.dtype]:
    f = found.features
    check_feature_layout(f)
    if feature_dtype is not None and feature_dtype not in FEATURE_DTYPES:
        raise UsageError(f"--feature-dtype: expected one of {', '.join(FEATURE_DTYPES)}, got {feature_dtype!r}")
    dtype = np.dtype(feature_dtype or f.dtype.name)
    if dtype.name not in FEATURE_DTYPES:
        raise DatasetError(
            f"{f.label}: features have dtype {dtype.name}, expected {' or '.join(FEATURE_DTYPES)} "
            "(ask for a conversion with --feature-dtype)"
        )
    return f.shape[0], f.shape[1], dtype


def _check_labels_shape(labels: Array, n: int, features: Array) -> None:
    if labels.shape not in ((n,), (n, 1)) or labels.dtype.kind not in "iuf":
        raise DatasetError(
            f"{labels.label}: labels must be N or N×1 numbers with N = {n:,} (the rows of "
            f"{features.label}), got {labels.dtype.name} of shape {labels.shape}"
        )


def log_costs(
    log: Log, edges: Path, edge_bytes: int, other_bytes: int, feature_bytes: int, refer: bool, scratch: int, writes: int
) -> None:
    """What an import reads and writes, and about how long that takes: the edges and labels at
    ``COPY_RATIO`` of a copy's speed, the features at read (``refer``) or copy speed, the copy's speed
    taken as half a cold read of ``edges`` measured now (a copy reads and writes each byte).
    ``scratch``: bytes of scratch files written and read back (0: the records are kept in RAM)."""
    log(
        f"reads: edges once ({edge_bytes / 1e9:.2f} GB{f', then {scratch / 1e9:.2f} GB of scratch files' if scratch else ''}), "
        f"labels and splits ({other_bytes / 1e9:.2f} GB), features once ({feature_bytes / 1e9:.2f} GB: "
        f"{'checked' if refer else 'copied'}); writes {writes / 1e9:.2f} GB"
    )
    rate = read_rate(edges)
    if rate:
        seconds = (edge_bytes + other_bytes) / (COPY_RATIO * rate / 2) + feature_bytes / (rate if refer else rate / 2)
        log(
            f"time: about {seconds:,.0f} s ({seconds / 3600:.1f} h): the edges and labels at {COPY_RATIO}× the "
            f"speed of a copy of them (measured: scripts/bench_import.py), the features at "
            f"{'read' if refer else 'copy'} speed; {edges} reads at {rate / 1e6:,.0f} MB/s now"
        )


def in_place(f: Array, dtype: np.dtype, copy_features: bool) -> bool:
    """Whether the features can be read where they are: a file of their own (not an archive member or
    a CSV), C order, already the dataset's dtype in this machine's byte order."""
    return (
        not copy_features
        and isinstance(f, ArrayFile)
        and f.member is None
        and not f.fortran
        and f.dtype == dtype
        and f.dtype.isnative
    )


def _write_features(target: Path | None, f: Array, dtype: np.dtype, progress: Progress | None) -> None:
    """Block by block into ``target`` (None: read in place, only checked); a non-finite value, or one
    that overflows float16, is refused naming its row."""
    n, dim = f.shape
    count = max(1, BLOCK // (dim * max(4, f.dtype.itemsize)))
    with open(target, "wb") if target is not None else contextlib.nullcontext() as fh:
        if fh is not None:
            np.lib.format.write_array_header_2_0(
                fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n, dim)}
            )
        for a, block in csr.prefetched(rows(f, count), kernels.threads() > 1):  # the next block read meanwhile
            with np.errstate(over="ignore"):
                part = block.astype(dtype, copy=False)
            bad = kernels.first_nonfinite_row(part)
            if bad >= 0:
                row, col = bad, int(np.flatnonzero(~np.isfinite(part[bad]))[0])
                if np.isfinite(block[row, col]):
                    raise DatasetError(
                        f"{f.label}: features row {a + row} holds {block[row, col]} (column {col}), "
                        f"which does not fit in {dtype.name}"
                    )
                raise DatasetError(
                    f"{f.label}: features row {a + row} holds {block[row, col]} (column {col}): "
                    "NaN and inf features are refused"
                )
            if fh is not None:
                fh.write(np.ascontiguousarray(part).data)
            if progress:
                progress("features", a + len(part), n)


def _label_blocks(found: Found) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(first row, the source's block, its classes as int64: -1 where unlabelled, i.e. NaN or
    past the labelled prefix), each block checked: whole numbers, -1 or a class."""
    lab, n = found.labels, found.num_nodes
    prefix = n if found.labelled is None else found.labelled
    for a, block in rows(lab, BLOCK // 8):
        block = block.reshape(-1)
        if block.dtype.kind == "f":
            unlabelled = np.isnan(block)  # NaN → -1 before any cast (NaN cast to int is garbage)
            values = np.where(unlabelled, -1, block)
            if (values != np.round(values)).any():
                i = int(np.argmax(values != np.round(values)))
                raise DatasetError(f"{lab.label}: labels[{a + i}] = {block[i]} is not a whole class number")
            ints = values.astype(np.int64)
        else:
            ints = block.astype(np.int64)
        ints[max(0, prefix - a) :] = -1  # past the labelled prefix: padding, not class 0
        bad = ints < -1
        if found.classes is not None:
            bad |= ints >= found.classes
        if bad.any():
            i = int(np.argmax(bad))
            also = f" (--classes {found.classes})" if found.classes is not None else ""
            raise DatasetError(f"{lab.label}: labels[{a + i}] = {block[i]} is not a class{also}")
        yield a, block, ints


def _write_labels(tmp: Path, found: Found, progress: Progress | None) -> tuple[int, int]:
    """labels.npy in the narrowest type holding the classes (``dataset.label_type``), -1 where
    unlabelled; returns (number of classes, labelled vertices). A format that declares no
    number of classes (OGB) has its labels read twice: the largest first, which sets the type."""
    n, classes = found.num_nodes, found.classes
    if classes is None:
        classes = 1 + max((int(ints.max()) for _, _, ints in _label_blocks(found) if ints.size), default=-1)
        if not classes:
            raise DatasetError(f"{found.labels.label}: no vertex is labelled")
    dtype = label_type(classes)
    labelled = 0
    with open(tmp / FILES["labels"], "wb") as fh:
        descr = np.lib.format.dtype_to_descr(dtype)
        np.lib.format.write_array_header_2_0(fh, {"descr": descr, "fortran_order": False, "shape": (n,)})
        for a, _, ints in _label_blocks(found):
            labelled += int((ints >= 0).sum())
            fh.write(ints.astype(dtype).data)
            if progress:
                progress("labels", a + len(ints), n)
    if not labelled:
        raise DatasetError(f"{found.labels.label}: no vertex is labelled")
    return classes, labelled


def _check_splits(tmp: Path, splits: dict[str, Any], n: int, found: Found) -> None:
    """In range, disjoint, labelled, and a non-empty train split (one line naming the split)."""
    labels = np.load(tmp / FILES["labels"], mmap_mode="r")
    seen = np.zeros(n, dtype=bool)
    for name in SPLITS:
        ids = splits[name]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise DatasetError(
                f"{name} split: vertex {int(ids[(ids < 0) | (ids >= n)][0])} is not a vertex id (N = {n:,})"
            )
        ids = np.sort(ids)
        twice = ids[np.flatnonzero(ids[1:] == ids[:-1])] if ids.size > 1 else ids[:0]
        if twice.size:
            raise DatasetError(f"{name} split: lists vertex {int(twice[0])} twice")
        if seen[ids].any():
            raise DatasetError(
                f"{name} split: vertex {int(ids[seen[ids]][0])} is in an earlier split too (splits are disjoint)"
            )
        seen[ids] = True
        unlabelled = ids[np.asarray(labels[ids]) < 0]
        if unlabelled.size:
            hint = (
                ": IGB's drawn splits take the first --labelled vertices (default all), so a NaN label among "
                "them is a damaged file or a wrong --labelled"
                if found.fmt == "igb"
                else ""
            )
            raise DatasetError(
                f"{name} split: vertex {int(unlabelled[0])} is unlabelled ({found.labels.label} gives it no "
                f"class){hint}"
            )
    if not splits["train"].size:
        raise DatasetError("train split is empty (no vertex to train on)")
