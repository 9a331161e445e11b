"""IGB homogeneous (IGB-HOM, "IGB260M": papers and their citations), as downloaded.

``ROOT/<size>/processed/`` with ``size`` in tiny, small, medium, large, full (``experimental`` is
the old name of tiny):

* ``paper/node_feat.npy``: N × 1024 float32 — a real .npy for tiny–medium, a *headerless* raw
  float32 file for large and full despite its name (N then comes from the file size / 4096);
* ``paper/node_label_19.npy`` or ``paper/node_label_2K.npy`` (``--classes 19|2983``): N float32
  class numbers (raw as well for large/full). In full only a prefix is labelled — 227,130,858
  vertices for 19 classes, 153,383,374 for 2983 (the count the IGB maintainers confirmed in
  IGB-Datasets #57; their code says 157,675,969) — and the rest is zero padding, imported as
  unlabelled (-1), not as class 0;
* ``paper__cites__paper/edge_index.npy``: E × 2 integer (citing, cited), a real .npy.

Counts are taken from the files, not from published tables. IGB ships no split: ``--split``
draws one of the conventions of placement.importers.splits. Downloads made before 2023-11-07 lack
the embeddings of the last 4,957,567 papers (all-zero rows): sampled and warned about.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moment.errors import UsageError
from placement.dataset import Dataset, DatasetError
from placement.importers import splits as conventions
from placement.importers.publish import Found, check_feature_layout, write_dataset
from placement.importers.readers import ArrayFile, EdgeArray, npy, npy_or_raw

SIZES = ("tiny", "small", "medium", "large", "full")
NODES = {"tiny": 100_000, "small": 1_000_000, "medium": 10_000_000, "large": 100_000_000, "full": 269_346_174}
LABEL_FILES = {19: "node_label_19.npy", 2983: "node_label_2K.npy"}
FULL_LABELLED = {19: 227_130_858, 2983: 153_383_374}
DIM = 1024
MISSING_TAIL = 4_957_567  # papers without embeddings in downloads before 2023-11-07
TAIL_SAMPLES = 64


def processed_dir(root: Path, size: str) -> Path:
    """``ROOT/<size>/processed`` (or ROOT itself if it is that directory); tiny may be 'experimental'."""
    for name in (size, "experimental") if size == "tiny" else (size,):
        if (root / name / "processed").is_dir():
            return root / name / "processed"
    if root.name == "processed" and (root / "paper").is_dir():
        return root
    raise DatasetError(f"{root / size / 'processed'}: missing (--root is the directory holding IGB's <size>/processed)")


def find(
    root: str | Path,
    size: str,
    classes: int = 19,
    split: str = "igb",
    seed: int | None = None,
    labelled: int | None = None,
) -> Found:
    """Locate and check IGB's files (headers, sizes, shapes) without reading their data."""
    if size not in SIZES:
        raise UsageError(f"--size {size}: expected one of {', '.join(SIZES)}")
    if classes not in LABEL_FILES:
        raise UsageError(f"--classes {classes}: IGB has 19 or 2983 classes")
    conventions.parse(split)
    base = processed_dir(Path(root), size)
    notes: list[str] = []
    feats = npy_or_raw(base / "paper" / "node_feat.npy", "features", "float32", DIM)
    check_feature_layout(feats)  # before zero_tail reads rows of it
    n = feats.shape[0]
    if feats.raw:
        notes.append(
            f"{feats.path}: no .npy header (IGB's raw layout): float32 × {DIM} per row, "
            f"N = {feats.path.stat().st_size:,} bytes / {4 * DIM} = {n:,} vertices"
        )
    labels_path = base / "paper" / LABEL_FILES[classes]
    labs = npy_or_raw(labels_path, "labels", "float32")
    edges = EdgeArray(npy(base / "paper__cites__paper" / "edge_index.npy", "edges"), n, "edges", pairs=True)
    if labelled is None and size == "full":
        labelled = min(n, FULL_LABELLED[classes])
    if labelled is not None and not 0 < labelled <= n:
        raise UsageError(f"--labelled {labelled}: expected 1..{n:,} (the vertices of {feats.path})")
    count = n if labelled is None else labelled
    warnings = []
    if n != NODES[size]:
        warnings.append(
            f"{feats.path}: {n:,} vertices, where IGB publishes {NODES[size]:,} for {size} (imported as the files say)"
        )
    zero = zero_tail(feats)
    if zero:
        warnings.append(zero)
    notes += [f"{a.describe()}" for a in (feats, labs, edges.arr)]
    t, v, s = conventions.sizes(split, count)
    notes.append(
        f"labels: {classes} classes, {count:,} labelled vertices"
        + (f" (a prefix: rows {count:,}.. are padding → -1)" if count < n else "")
    )
    notes.append(
        f"split {split}: {t:,} train, {v:,} val, {s:,} test (seeded; see `moment dataset import --help`); "
        f"drawing it takes {16 * count / 1e9:.2f} GB of RAM after the CSR build (a permutation of the "
        "labelled vertices), outside --memory"
    )
    return Found(
        fmt="igb",
        features=feats,
        labels=labs,
        edges=edges,
        splits=lambda: conventions.draw(split, count, seed),
        prepare=conventions.prepare,
        split=split,
        given_splits=[],
        files={
            "features": str(feats.path.absolute()),
            "labels": str(labs.path.absolute()),
            "edges": str(edges.arr.path.absolute()),
        },
        seed=conventions.DEFAULT_SEED[conventions.parse(split)[0]] if seed is None else seed,
        labelled=labelled,
        classes=classes,
        notes=notes,
        warnings=warnings,
    )


def run(
    out: Path,
    *,
    root: str,
    size: str,
    classes: int | None = None,
    split: str | None = None,
    seed: int | None = None,
    labelled: int | None = None,
    **common: Any,
) -> Dataset | None:
    """The registry's entry point (placement.importers)."""
    found = find(root, size, classes=classes or 19, split=split or "igb", seed=seed, labelled=labelled)
    return write_dataset(out, found, **common)


def zero_tail(feats: ArrayFile) -> str | None:
    """A warning if rows sampled from the end of the features are all zero (an old IGB download)."""
    n = feats.shape[0]
    tail = min(MISSING_TAIL, max(1, n // 20))
    picks = np.unique(np.linspace(n - tail, n - 1, min(TAIL_SAMPLES, tail)).astype(np.int64))
    width = feats.shape[1]
    if any(feats.read_at(int(r) * width, width).any() for r in picks):
        return None
    return (
        f"{feats.path}: the {len(picks)} rows sampled among the last {tail:,} are all zero: downloads made "
        f"before 2023-11-07 lack the embeddings of the last {MISSING_TAIL:,} papers; patch node_feat.npy with "
        "node_feat_5M_tail.npy as the IGB README says, then import again"
    )
