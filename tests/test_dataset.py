"""The dataset format: validation names the file and the problem, in one line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from moment.contracts.dataset import DatasetManifest
from placement.dataset import DatasetError, check_dataset, open_dataset, write_manifest
from placement.synth import synthesize

N = 2_000


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "good"
    synthesize(out, nodes=2_000, avg_degree=4, dim=8, dtype="float32", seed=0)
    return out


def copy(good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ds"
    shutil.copytree(good, dst)
    return dst


def test_good_dataset_opens(good: Path) -> None:
    ds = open_dataset(good)
    check_dataset(ds)
    assert ds.features().shape == (2_000, 8)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda d: (d / "features.npy").unlink(), "features.npy: missing"),
        (lambda d: np.save(d / "features.npy", np.zeros((2_000, 8), dtype=np.float64)), "dtype float64"),
        (lambda d: np.save(d / "labels.npy", np.zeros(1_999, dtype=np.int64)), "shape (1999,)"),
        (lambda d: (d / "indices.npy").write_bytes(b"not numpy"), "indices.npy: not a .npy file"),
        (lambda d: (d / "dataset.json").write_text("{"), "not valid JSON"),
        (lambda d: (d / "dataset.json").unlink(), "dataset.json: missing"),
        (lambda d: _edit(d, feature_dtype="int8"), "feature_dtype"),
        (lambda d: _edit(d, num_nodes=-5), "num_nodes"),
    ],
)
def test_bad_dataset_is_named(good: Path, tmp_path: Path, damage, needle: str) -> None:
    d = copy(good, tmp_path)
    damage(d)
    with pytest.raises(DatasetError) as info:
        open_dataset(d)
    assert needle in str(info.value)


def _edit(d: Path, **fields) -> None:
    meta = json.loads((d / "dataset.json").read_text())
    meta.update(fields)
    (d / "dataset.json").write_text(json.dumps(meta))


def _set(name: str, index: int, value) -> Callable[[Path], None]:
    """A damage: entry ``index`` of ``name``.npy becomes ``value`` (a callable gets the array)."""

    def damage(d: Path) -> None:
        a = np.load(d / f"{name}.npy")
        a[index] = value(a) if callable(value) else value
        np.save(d / f"{name}.npy", a)

    return damage


def _truncate(d: Path) -> None:  # truncate -s -64 features.npy
    p = d / "features.npy"
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size - 64)


def _unlabel_a_val_vertex(d: Path) -> None:
    labels = np.load(d / "labels.npy")
    labels[np.load(d / "val_idx.npy")[3]] = -1
    np.save(d / "labels.npy", labels)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, rf"features\.npy: truncated: {128 + N * 8 * 4 - 64} bytes, expected {128 + N * 8 * 4}$"),
        (lambda d: np.save(d / "train_idx.npy", np.zeros(0, np.int64)), r"train_idx\.npy: train split is empty"),
        (_set("indptr", -1, lambda a: a[-1] + 1), r"indptr\.npy: indptr must start at 0 and end at num_edges"),
    ],
)
def test_cheap_checks_on_open(good: Path, tmp_path: Path, damage, message: str) -> None:
    """Refused by open_dataset itself (every open), before anything maps the arrays."""
    d = copy(good, tmp_path)
    damage(d)
    with pytest.raises(DatasetError, match=message) as info:
        open_dataset(d)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("chunk", [7, 1 << 22])  # chunk boundaries must not hide (or shift) a bad entry
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            _set("indices", 1234, 10**6),
            r"indices\.npy: indices\[1234\] = 1000000 is not a vertex id \(N = 2000\) "
            r"\(a neighbour of vertex \d+\)",
        ),
        (_set("indices", 1234, -7), r"indices\.npy: indices\[1234\] = -7 is not a vertex id"),
        (
            _set("indptr", 5, lambda a: a[6] + 100),
            r"indptr\.npy: indptr\[6\] = \d+ is below indptr\[5\] = \d+: "
            r"indptr must not decrease \(vertex 5\)",
        ),
        (_set("train_idx", 0, N + 3_000), r"train_idx\.npy: train\[0\] = 5000 is not a vertex id \(N = 2000\)"),
        (_set("test_idx", 4, -1), r"test_idx\.npy: test\[4\] = -1 is not a vertex id"),
        (_set("labels", 1500, 77), r"labels\.npy: labels\[1500\] = 77 is not a class \(num_classes = 16; "),
        (_set("labels", 1500, 16), r"labels\.npy: labels\[1500\] = 16 is not a class"),
        (_set("labels", 1500, -2), r"labels\.npy: labels\[1500\] = -2 is not a class"),
        (_unlabel_a_val_vertex, r"val_idx\.npy: val\[3\] = vertex \d+ is unlabelled \(-1 in labels\.npy\)"),
    ],
)
def test_full_scan_names_file_and_index(good: Path, tmp_path: Path, damage, message: str, chunk: int) -> None:
    """What only a full read can see (today's reproductions: an IndexError traceback deep in place or
    train, or a negative id silently wrapping around to vertex N-7)."""
    d = copy(good, tmp_path)
    damage(d)
    ds = open_dataset(d)  # cheap checks pass: sizes and ends are right
    with pytest.raises(DatasetError, match=message) as info:
        check_dataset(ds, chunk=chunk)
    assert "\n" not in str(info.value)


def test_full_scan_accepts_unlabelled_vertices_outside_the_splits(good: Path, tmp_path: Path) -> None:
    d = copy(good, tmp_path)
    labels = np.load(d / "labels.npy")
    in_split = np.concatenate([np.load(d / f"{k}_idx.npy") for k in ("train", "val", "test")])
    labels[np.setdiff1d(np.arange(N), in_split)[:100]] = -1
    np.save(d / "labels.npy", labels)
    check_dataset(open_dataset(d), chunk=7)


def _edit_json(d: Path, change) -> None:
    meta = json.loads((d / "dataset.json").read_text())
    change(meta)
    (d / "dataset.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.pop("num_edges"), r"dataset\.json: num_edges: Field required$"),
        (lambda m: m.update(num_nodes="2000"), r"dataset\.json: num_nodes: Input should be a valid integer$"),
        (lambda m: m.update(num_nodes=2000.0), r"dataset\.json: num_nodes: Input should be a valid integer$"),
        (lambda m: m.update(directed="yes"), r"dataset\.json: directed: Input should be a valid boolean$"),
        (lambda m: m.update(nodes=2000), r"dataset\.json: nodes: Extra inputs are not permitted$"),
        (lambda m: m["generator"].update(seed="0"), r"dataset\.json: generator\.seed: Input should be a valid integer"),
        (
            lambda m: m["files"].update(train="../train_idx.npy"),
            r"dataset\.json: files\.train: '\.\./train_idx\.npy' is not a plain file name",
        ),
        (
            lambda m: m["files"].update(features="/etc/passwd"),
            r"dataset\.json: files\.features: '/etc/passwd' is not a ",
        ),
        (lambda m: m["files"].update(labels=".."), r"dataset\.json: files\.labels: '\.\.' is not a plain file name"),
        (
            lambda m: m["files"].update(weights="w.npy"),
            r"dataset\.json: files\.weights: Extra inputs are not permitted",
        ),
        (lambda m: m["files"].update(val="train_idx.npy"), r"dataset\.json: files: train and val both name"),
        (lambda m: m.update(format="moment.dataset/2"), r"dataset\.json: format: expected 'moment\.dataset/1'"),
    ],
)
def test_manifest_is_schema_checked(good: Path, tmp_path: Path, change, message: str) -> None:
    d = copy(good, tmp_path)
    _edit_json(d, change)
    with pytest.raises(DatasetError, match=message):
        open_dataset(d)


def test_manifest_files_are_read_from_the_dataset_directory(good: Path, tmp_path: Path) -> None:
    """A renamed array is found through ``files``; a role left out keeps its usual name."""
    d = copy(good, tmp_path)
    (d / "features.npy").rename(d / "x.npy")
    _edit_json(d, lambda m: m.update(files={"features": "x.npy"}))
    ds = open_dataset(d)
    assert ds.path("features") == d / "x.npy" and ds.path("train") == d / "train_idx.npy"
    assert ds.meta["files"]["indptr"] == "indptr.npy" and ds.features().shape == (N, 8)


def test_write_manifest_refuses_what_a_reader_would_refuse(tmp_path: Path) -> None:
    meta = {"num_nodes": 3, "num_edges": 0, "feature_dim": 1, "feature_dtype": "float32", "num_classes": 2}
    with pytest.raises(DatasetError, match=r"files\.train: '\.\./t\.npy' is not a plain file name"):
        write_manifest(tmp_path, {**meta, "files": {"train": "../t.npy"}})
    assert not (tmp_path / "dataset.json").exists()
    written = write_manifest(tmp_path, meta)
    assert DatasetManifest.read(tmp_path / "dataset.json") == written
    assert written.directed is None and written.files.train == "train_idx.npy"
