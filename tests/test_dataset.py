"""The dataset format: validation names the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from placement.dataset import DatasetError, check_ids, open_dataset
from placement.synth import synthesize


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
    check_ids(ds)
    assert ds.features().shape == (2_000, 8)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda d: (d / "features.npy").unlink(), "features.npy: missing"),
        (lambda d: np.save(d / "features.npy", np.zeros((2_000, 8), dtype=np.float64)), "dtype float64"),
        (lambda d: np.save(d / "labels.npy", np.zeros(1_999, dtype=np.int64)), "shape (1999,)"),
        (lambda d: (d / "indices.npy").write_bytes(b"not numpy"), "not a readable .npy"),
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


def test_ids_out_of_range(good: Path, tmp_path: Path) -> None:
    d = copy(good, tmp_path)
    idx = np.load(d / "indices.npy")
    idx[7] = 2_000
    np.save(d / "indices.npy", idx)
    with pytest.raises(DatasetError, match=r"indices\[7\] = 2000 is not a vertex id"):
        check_ids(open_dataset(d))
    train = np.load(d / "train_idx.npy")
    train[0] = -1
    np.save(d / "train_idx.npy", train)
    idx[7] = 0
    np.save(d / "indices.npy", idx)
    with pytest.raises(DatasetError, match="train"):
        check_ids(open_dataset(d))
