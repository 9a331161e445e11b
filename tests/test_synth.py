"""Synthetic graphs: valid datasets with the promised structure, reproducible, out of core, crash-safe."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from moment.errors import MomentError, UsageError
from placement.dataset import FILES, Dataset, DatasetError, check_dataset, check_free_space, open_dataset
from placement.synth import estimate, synthesize

N, DEGREE, DIM, CLASSES = 20_000, 10, 32, 16


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return synthesize(tmp_path_factory.mktemp("synth") / "g", N, DEGREE, DIM, seed=1, classes=CLASSES)


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_writes_a_valid_dataset_of_the_asked_size(graph: Dataset) -> None:
    check_dataset(graph)
    assert (graph.num_nodes, graph.feature_dim, graph.num_classes) == (N, DIM, CLASSES)
    assert abs(graph.num_edges / (N * DEGREE) - 1) < 0.05  # E = N + Poisson((d-1)·N) by construction
    assert np.diff(graph.indptr()).min() >= 1
    assert graph.indices().dtype == np.int32 and graph.features().dtype == np.float16
    assert graph.meta["generator"]["kind"] == "chung-lu" and graph.meta["directed"] is True
    assert graph.meta["name"] == "g"


def test_in_degrees_are_skewed(graph: Dataset) -> None:
    indeg = np.bincount(graph.indices(), minlength=N)
    top = np.sort(indeg)[::-1][: N // 100].sum() / graph.num_edges
    assert top > 0.12  # ~0.19 here; an Erdős–Rényi graph of this degree gives ~0.02
    assert indeg.max() > 20 * DEGREE


def test_edges_are_homophilous_and_classes_are_interleaved(graph: Dataset) -> None:
    labels = np.asarray(graph.labels())
    source = np.repeat(np.arange(N), np.diff(graph.indptr()))
    same = (labels[source] == labels[graph.indices()]).mean()
    assert 0.6 < same < 0.85  # P_IN = 0.7 plus chance agreement; 1/16 without communities
    assert np.bincount(labels, minlength=CLASSES).min() == N // CLASSES
    assert all(len(set(labels[a : a + CLASSES])) == CLASSES for a in range(0, 2000, CLASSES))


def _nearest_centroid(x: np.ndarray, labels: np.ndarray, train: np.ndarray, test: np.ndarray) -> float:
    centroids = np.stack([x[train][labels[train] == c].mean(0) for c in range(CLASSES)])
    dist = ((x[test][:, None, :] - centroids[None]) ** 2).sum(-1)
    return float((dist.argmin(1) == labels[test]).mean())


def test_features_carry_the_label_and_neighbours_carry_more(graph: Dataset) -> None:
    x = np.asarray(graph.features(), dtype=np.float32)
    labels = np.asarray(graph.labels())
    train, test = np.asarray(graph.split("train")), np.asarray(graph.split("test"))
    alone = _nearest_centroid(x, labels, train, test)
    assert 0.3 < alone < 0.8  # chance is 1/16
    indptr = np.asarray(graph.indptr())
    mean_of_neighbours = np.add.reduceat(x[graph.indices()], indptr[:-1]) / np.diff(indptr)[:, None]
    everyone = np.arange(N)
    assert _nearest_centroid(mean_of_neighbours, labels, train, everyone) > alone + 0.1


def test_splits_are_disjoint_sorted_and_exactly_sized(graph: Dataset) -> None:
    splits = [np.asarray(graph.split(s)) for s in ("train", "val", "test")]
    assert [s.size for s in splits] == [200, 100, 100]
    assert all(s.dtype == np.int64 and (np.diff(s) > 0).all() for s in splits)
    assert np.unique(np.concatenate(splits)).size == 400


def test_same_seed_same_bytes_whatever_the_chunk_and_another_seed_differs(tmp_path: Path) -> None:
    make = lambda where, seed, chunk: _digests(  # noqa: E731
        synthesize(tmp_path / where / "g", 9000, 6, 8, "float32", seed=seed, chunk_nodes=chunk).root
    )
    first = make("a", 7, 4096)
    assert make("b", 7, 1 << 20) == first
    other = make("c", 8, 4096)
    assert all(other[FILES[k]] != first[FILES[k]] for k in ("indices", "features", "train"))


def test_memory_stays_at_a_block_not_the_graph(tmp_path: Path) -> None:
    synthesize(tmp_path / "warm", 500, 4, 4)  # first-use imports stay out of the measurement
    tracemalloc.start()
    try:
        ds = synthesize(tmp_path / "big", 100_000, 10, 64, "float32", chunk_nodes=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    on_disk = sum(p.stat().st_size for p in ds.root.iterdir())
    assert on_disk > 30e6
    assert peak < 0.2 * on_disk  # ~5 MB: an edge slice, a feature block, 8 B/vertex of weights


def test_refuses_to_overwrite_but_fills_an_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "g"
    out.mkdir()
    synthesize(out, 500, 4, 4)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    synthesize(out, 500, 4, 4)  # the identical command again: nothing to do, nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(MomentError, match=f"{out}: already a dataset"):
        synthesize(out, 500, 4, 4, seed=1)  # another dataset into it: refused
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    replaced = synthesize(out, 600, 4, 4, replace=True)
    assert replaced.num_nodes == 600 and sorted(p.name for p in tmp_path.iterdir()) == ["g"]


def test_an_interrupted_run_leaves_nothing_a_reader_could_open(tmp_path: Path) -> None:
    out = tmp_path / "g"

    def stop(stage: str, done: int, total: int) -> None:
        if stage == "edges" and done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synthesize(out, 30_000, 4, 4, chunk_nodes=4096, progress=stop)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(DatasetError):
        open_dataset(out)
    synthesize(out, 500, 4, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]


def test_reports_each_stage_to_completion(tmp_path: Path) -> None:
    seen: dict[str, list[int]] = {}
    synthesize(
        tmp_path / "g",
        10_000,
        4,
        4,
        chunk_nodes=4096,
        progress=lambda stage, done, total: seen.setdefault(stage, []).append(done),
    )
    assert list(seen) == ["weights", "degrees", "edges", "features", "splits"]
    assert all(dones == [0, 4096, 8192, 10_000] for dones in seen.values())


def test_estimate_matches_the_files(graph: Dataset) -> None:
    guess = estimate(N, DEGREE, DIM, "float16")
    assert set(guess) == set(FILES)
    for key, size in guess.items():
        assert abs(graph.path(key).stat().st_size - size) <= max(64, 0.05 * size), key


def test_free_space_check_names_the_path_and_the_shortfall(tmp_path: Path) -> None:
    check_free_space(tmp_path / "new" / "g", 1)
    with pytest.raises(DatasetError, match=r"g: needs .* GB short"):
        check_free_space(tmp_path / "new" / "g", 1 << 62)


@pytest.mark.parametrize(
    "bad",
    [
        {"avg_degree": 0.5},
        {"dtype": "float64"},
        {"classes": 1},
        {"nodes": 2},
        {"train_fraction": 0.0},
        {"train_fraction": 0.9, "val_fraction": 0.2},
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, bad: dict) -> None:
    args = {"nodes": 100, "avg_degree": 4, "dim": 4, **bad}
    with pytest.raises(UsageError, match=next(iter(bad)).split("_")[0]):
        synthesize(tmp_path / "g", **args)
    assert not (tmp_path / "g").exists()
