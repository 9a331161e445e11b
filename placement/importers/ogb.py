"""OGB node-property datasets in OGB's binary raw layout (ogbn-papers100M's ``papers100M-bin``).

``ROOT/raw/data.npz`` holds ``edge_index`` (2 × E int64, citing → cited), ``node_feat`` (N × d
float32), ``num_nodes_list`` and ``num_edges_list`` (and ``node_year``, not imported). Its members
are DEFLATE-compressed: they cannot be memory-mapped, and ``np.load`` of ``edge_index`` alone takes
25.9 GB of RAM for papers100M, so each member is inflated as a stream, chunk by chunk, straight into
the CSR passes and the feature file. ``ROOT/raw/node-label.npz`` holds ``node_label`` (N × 1
float, NaN where unlabelled → -1). The split is shipped: ``ROOT/split/<name>/{train,valid,test}.csv.gz``
(one vertex id per line; ``time`` for papers100M). ``processed/`` (pickled torch files) is never read.

The CSV raw layout of the smaller ogbn datasets (ogbn-arxiv, ogbn-products) is read too:
``raw/edge.csv.gz`` (E lines ``src,dst``), ``raw/node-feat.csv.gz``, ``raw/node-label.csv.gz``, with
N and E from ``raw/num-node-list.csv.gz`` and ``raw/num-edge-list.csv.gz``, parsed a batch of lines
at a time. Single-graph, single-label datasets only (not ogbn-proteins' 112 tasks, not ogbn-mag).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moment.errors import UsageError
from placement.dataset import Dataset, DatasetError
from placement.importers.publish import Found, write_dataset
from placement.importers.readers import Array, CsvArray, EdgeArray, csv_count, csv_width, gzip_ints, npz_member

SPLIT_FILES = {"train": "train.csv.gz", "val": "valid.csv.gz", "test": "test.csv.gz"}


def find(root: str | Path, split: str | None = None) -> Found:
    """Locate and check OGB's files (headers and sizes; compressed members read as streams)."""
    check_split_name(split)
    root = Path(root)
    raw = root / "raw"
    if (raw / "data.npz").exists():
        feats, labs, edges, files, notes = _binary(raw)
    elif (raw / "edge.csv.gz").exists():
        feats, labs, edges, files, notes = _csv(raw)
    else:
        raise DatasetError(
            f"{raw / 'data.npz'}: missing, and no {raw / 'edge.csv.gz'} either (--root is the "
            "directory holding raw/ and split/)"
        )
    n = feats.shape[0]
    name = split or _only_split(root)
    folder = root / "split" / name
    notes.append(f"split: {folder} (shipped)")
    return Found(
        fmt="ogb",
        features=feats,
        labels=labs,
        edges=edges,
        splits=lambda: {key: read_ids(folder / file, n) for key, file in SPLIT_FILES.items()},
        split=name,
        given_splits=["train", "val", "test"],
        files={**files, **{key: str((folder / file).absolute()) for key, file in SPLIT_FILES.items()}},
        seed=0,
        notes=notes,
    )


def _binary(raw: Path) -> tuple[Array, Array, EdgeArray, dict[str, str], list[str]]:
    """papers100M-bin: raw/data.npz and raw/node-label.npz, members streamed."""
    data = raw / "data.npz"
    feats = npz_member(data, "node_feat", "features")
    n = feats.shape[0] if feats.shape else 0
    edges = EdgeArray(npz_member(data, "edge_index", "edges"), n, "edges", pairs=False)
    labs = npz_member(raw / "node-label.npz", "node_label", "labels")
    listed = npz_member(data, "num_nodes_list", "node count", required=False)
    if listed is not None:
        with listed.stream() as fh:
            total = int(listed.read(fh, listed.size).sum())
        if total != n:
            raise DatasetError(f"{listed.label}: says {total:,} vertices, but node_feat has {n:,} rows")
    files = {
        "features": f"{data.absolute()}:node_feat",
        "edges": f"{data.absolute()}:edge_index",
        "labels": f"{(raw / 'node-label.npz').absolute()}:node_label",
    }
    return feats, labs, edges, files, [a.describe() for a in (feats, edges.arr, labs)]


def _csv(raw: Path) -> tuple[Array, Array, EdgeArray, dict[str, str], list[str]]:
    """The CSV raw layout (ogbn-arxiv, ogbn-products): counts from num-*-list.csv.gz, rows parsed in batches."""
    nodes, edge_count = raw / "num-node-list.csv.gz", raw / "num-edge-list.csv.gz"
    n, e = csv_count(nodes), csv_count(edge_count)
    feats = CsvArray(raw / "node-feat.csv.gz", (n, csv_width(raw / "node-feat.csv.gz")), np.dtype(np.float32), nodes)
    width = csv_width(raw / "node-label.csv.gz")
    if width != 1:
        raise DatasetError(
            f"{raw / 'node-label.csv.gz'}: {width} labels per vertex (a multi-task dataset): "
            "moment imports one class per vertex"
        )
    labs = CsvArray(raw / "node-label.csv.gz", (n, 1), np.dtype(np.float64), nodes)
    edges = EdgeArray(CsvArray(raw / "edge.csv.gz", (e, 2), np.dtype(np.int64), edge_count), n, "edges", pairs=True)
    files = {
        "features": str(feats.path.absolute()),
        "labels": str(labs.path.absolute()),
        "edges": str(edges.arr.path.absolute()),
    }
    notes = [a.describe() for a in (feats, edges.arr, labs)]
    notes.append(
        "OGB adds the reverse edges when it loads some datasets (master.csv add_inverse_edge: "
        "ogbn-products): pass --undirected for the same graph"
    )
    return feats, labs, edges, files, notes


def run(out: Path, *, root: str, split: str | None = None, **common: Any) -> Dataset | None:
    """The registry's entry point (placement.importers)."""
    return write_dataset(out, find(root, split), **common)


def _only_split(root: Path) -> str:
    """The split directory when there is exactly one (papers100M: time); else --split must name it."""
    here = root / "split"
    names = sorted(p.name for p in here.iterdir() if p.is_dir()) if here.is_dir() else []
    if len(names) != 1:
        have = ", ".join(names) or "none"
        raise UsageError(f"{here}: give --split NAME among its split directories ({have})")
    return names[0]


def read_ids(path: Path, n: int) -> np.ndarray:
    """One vertex id per line of a .csv.gz, checked in range (one line naming the file and line)."""
    ids = gzip_ints(path, " (split file)", "list of vertex ids")
    if ids.ndim != 1:
        raise DatasetError(f"{path}: expected one vertex id per line, got {ids.shape[1]} columns")
    bad = (ids < 0) | (ids >= n)
    if bad.any():
        i = int(np.argmax(bad))
        raise DatasetError(f"{path}: line {i + 1} holds {int(ids[i])}, not a vertex id (N = {n:,})")
    return np.sort(ids)


def check_split_name(name: str | None) -> None:
    if name is not None and ("/" in name or name in ("", ".", "..")):
        raise UsageError(f"--split {name}: the name of a directory under split/")
