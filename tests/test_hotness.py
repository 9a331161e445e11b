"""placement.hotness: pre-sampled counts, the access curve, hottest-first order, the files on disk."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moment.errors import MomentError
from placement.count_sampler import CountSampler
from placement.dataset import Dataset, open_dataset, write_manifest
from placement.hotness import (
    Hotness,
    access_curve,
    hottest_first,
    presample,
    seed_batches,
    sidecar,
    split_half_gap,
)
from placement.sampler import NeighborSampler

FANOUTS = (5, 4)
BATCH = 64


def power_law_dataset(root: Path, n: int = 3000, degree: int = 8, seed: int = 0) -> Path:
    """Every vertex's neighbours drawn with Zipf weights over a shuffled vertex order, so a few
    (not simply the low-numbered) vertices are everybody's neighbours."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n + 1) ** 1.2
    popular = rng.permutation(n)
    indices = popular[rng.choice(n, n * degree, p=weights / weights.sum())].astype(np.int32)
    indptr = (np.arange(n + 1) * degree).astype(np.int64)
    ids = rng.permutation(n)
    root.mkdir()
    arrays = {
        "indptr": indptr,
        "indices": indices,
        "features": np.zeros((n, 4), dtype=np.float32),
        "labels": rng.integers(0, 3, n).astype(np.int64),
        "train_idx": np.sort(ids[:900]).astype(np.int64),
        "val_idx": np.sort(ids[900:1000]).astype(np.int64),
        "test_idx": np.sort(ids[1000:1100]).astype(np.int64),
    }
    for name, array in arrays.items():
        np.save(root / f"{name}.npy", array)
    meta = {"num_nodes": n, "num_edges": n * degree, "feature_dim": 4, "feature_dtype": "float32", "num_classes": 3}
    write_manifest(root, meta)
    return root


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return power_law_dataset(tmp_path_factory.mktemp("hot") / "ds")


@pytest.fixture(scope="module")
def hot(dataset_dir: Path) -> Hotness:
    return presample(open_dataset(dataset_dir), FANOUTS, BATCH, epochs=2, seed=9)


def _recount(sets: Iterable[np.ndarray], n: int) -> tuple[np.ndarray, list[int]]:
    counts, sizes = np.zeros(n, dtype=np.int64), []
    for nodes in sets:
        assert np.unique(nodes).size == len(nodes), "a batch's vertex set has each vertex once"
        sizes.append(len(nodes))
        for v in nodes.tolist():
            counts[v] += 1
    return counts, sizes


def _count_sets(ds: Dataset, fanouts: tuple[int, ...], batch: int, seed: int, epochs: int, threads: int = 1):
    sampler = CountSampler(ds.indptr(), ds.indices(), fanouts, batch, seed=seed, threads=threads)
    return sampler.sets(seed_batches(np.array(ds.split("train")), batch, seed, epochs))


def test_counts_equal_a_brute_force_recount(dataset_dir: Path, hot: Hotness) -> None:
    ds = open_dataset(dataset_dir)
    counts, sizes = _recount(_count_sets(ds, FANOUTS, BATCH, seed=9, epochs=2), ds.num_nodes)
    assert np.array_equal(hot.counts, counts)
    assert hot.counts.dtype == np.int32  # in memory; int64 on disk (test_save_load_round_trip)
    assert hot.batches == len(sizes) == 2 * 15  # ceil(900 / 64) per epoch
    assert hot.mean_unique_per_batch == pytest.approx(np.mean(sizes))
    assert (hot.epochs, hot.fanouts, hot.batch_size) == (2, FANOUTS, BATCH)
    train = np.array(ds.split("train"))
    assert (hot.counts[train] >= 2).all(), "every seed is read at least once per epoch"


def test_same_seed_same_counts_whatever_the_threads(dataset_dir: Path, hot: Hotness) -> None:
    ds = open_dataset(dataset_dir)
    for threads in (1, 2, 3):
        again = presample(ds, FANOUTS, BATCH, epochs=2, seed=9, threads=threads)
        assert np.array_equal(again.counts, hot.counts)
    assert not np.array_equal(presample(ds, FANOUTS, BATCH, epochs=2, seed=10).counts, hot.counts)


def test_sets_are_the_trainers_where_rows_fit_the_fanouts(dataset_dir: Path) -> None:
    """Rows of 8 neighbours and fan-outs of 8: nothing random is drawn, so each batch's set is
    exactly the trainer's sampler's (same seeds, same hops, every target's whole row)."""
    ds = open_dataset(dataset_dir)
    trainer = NeighborSampler(np.array(ds.indptr()), np.array(ds.indices()), (8, 8), seed=4)
    batches = list(seed_batches(np.array(ds.split("train")), BATCH, seed=4, epochs=1))
    sets = CountSampler(ds.indptr(), ds.indices(), (8, 8), BATCH, seed=4, threads=2).sets(iter(batches))
    for seeds, nodes in zip(batches, sets, strict=True):
        want = trainer.sample(torch.from_numpy(seeds)).nodes.numpy()
        assert np.array_equal(np.sort(nodes), np.sort(want))
        assert np.array_equal(nodes[: seeds.size], seeds)  # seeds first, as the trainer's


def test_sets_follow_the_trainers_distribution(dataset_dir: Path) -> None:
    """Rows of 8, fan-outs (5, 4): draws differ, the distribution must not. Over 20 epochs each,
    the per-vertex counts of the two samplers agree within their noise, and so do set sizes."""
    ds = open_dataset(dataset_dir)
    epochs, n = 20, ds.num_nodes
    ours, our_sizes = _recount(_count_sets(ds, FANOUTS, BATCH, seed=1, epochs=epochs, threads=2), n)
    trainer = NeighborSampler(np.array(ds.indptr()), np.array(ds.indices()), FANOUTS, seed=1)
    train = np.array(ds.split("train"))
    theirs, their_sizes = _recount(
        (trainer.sample(s).nodes.numpy() for e in range(epochs) for s in trainer.batches(train, BATCH, epoch=e)), n
    )
    assert len(our_sizes) == len(their_sizes)
    assert np.mean(our_sizes) == pytest.approx(np.mean(their_sizes), rel=0.01)
    # Poisson-like noise: the difference of two counts c1, c2 has variance about c1 + c2.
    z = (ours - theirs) / np.sqrt(np.maximum(ours + theirs, 1))
    assert np.abs(z).max() < 5.5 and abs(z.mean()) < 0.05 and z.std() < 1.15
    assert np.corrcoef(ours, theirs)[0, 1] > 0.99


def test_floyd_draws_uniform_subsets(tmp_path: Path) -> None:
    """A star: vertex 0 with 10 neighbours, fan-out 3, seed 0 every batch. Each neighbour is
    drawn with probability 3/10 and each pair with 3·2/(10·9), as a uniform 3-subset."""
    n, deg, trials = 11, 10, 20_000
    indptr = np.array([0, deg] + [deg] * (n - 1), dtype=np.int64)
    indices = np.arange(1, n, dtype=np.int64)
    sampler = CountSampler(indptr, indices, (3,), 1, seed=5, threads=2)
    hits, pairs = np.zeros(n), np.zeros((n, n))
    for nodes in sampler.sets(iter([np.zeros(1, dtype=np.int64)] * trials)):
        assert nodes[0] == 0 and nodes.size == 4
        hits[nodes[1:]] += 1
        pairs[np.ix_(nodes[1:], nodes[1:])] += 1
    assert np.allclose(hits[1:] / trials, 0.3, atol=0.015)
    off = pairs[1:, 1:][~np.eye(deg, dtype=bool)] / trials
    assert np.allclose(off, 6 / 90, atol=0.012)


def test_adaptive_sampling_stops_once_the_gap_is_within_tolerance(dataset_dir: Path, hot: Hotness) -> None:
    """By default pre-sampling checks the split-half gap at 10, 20, ... batches and stops at the
    first check within the tolerance; the counts are those of the batches it ran (the first ten
    of the same draws), and what it stopped at is recorded."""
    ds = open_dataset(dataset_dir)
    loose = presample(ds, FANOUTS, BATCH, seed=9, boundaries=(30,), tolerance=0.5)
    assert loose.batches == 10 and loose.tolerance == 0.5 and loose.bound is not None and loose.bound <= 0.5
    counts, _ = _recount(itertools.islice(_count_sets(ds, FANOUTS, BATCH, seed=9, epochs=1), 10), ds.num_nodes)
    assert np.array_equal(loose.counts, counts)
    # A tolerance never met: the whole budget (one epoch, 15 batches), and the gap it got to.
    strict = presample(ds, FANOUTS, BATCH, seed=9, boundaries=(30,), tolerance=1e-9)
    assert strict.batches == 15 and strict.epochs == 1 and strict.bound is not None and strict.bound > 1e-9
    # --epochs: exactly those, no tolerance; the gap between its halves still measured.
    assert (hot.batches, hot.tolerance) == (30, None) and hot.bound is not None


def test_split_half_gap_is_the_top_k_optimism_of_each_half() -> None:
    """Against a brute force: rank by one half (ties by id), share of that half minus share of
    the other, averaged over both directions, the largest over the boundaries (never below 0)."""
    rng = np.random.default_rng(1)
    for _ in range(5):
        p = rng.pareto(1.5, 1000)
        first = rng.poisson(p / p.sum() * 500).astype(np.int32)
        total = first + rng.poisson(p / p.sum() * 500).astype(np.int32)
        second = total - first
        for k in (1, 10, 100, 500):
            brute = 0.0
            for a, b in ((first, second), (second, first)):
                top = np.argsort(-a, kind="stable")[:k]
                brute += a[top].sum() / a.sum() - b[top].sum() / b.sum()
            assert split_half_gap(first, total, [k]) == pytest.approx(max(0.0, brute / 2), abs=1e-12)
    assert split_half_gap(np.zeros(5, np.int32), np.ones(5, np.int32), [2]) == 1.0  # a half with no reads


def test_progress_reports_every_batch(dataset_dir: Path) -> None:
    calls: list[tuple[int, int]] = []
    hot = presample(open_dataset(dataset_dir), FANOUTS, 300, epochs=2, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(i, 6) for i in range(1, 7)] and hot.batches == 6


def test_curve_monotone_ends_at_one_and_shows_skew(hot: Hotness) -> None:
    curve = hot.curve()
    xs, shares = zip(*curve)
    assert list(xs) == sorted(xs)
    assert all(a <= b for a, b in zip(shares, shares[1:]))
    assert curve[-1] == (1.0, 1.0)
    top1 = dict(curve)[0.01]
    assert top1 > 0.05, f"top 1% of a power-law graph catch only {top1:.1%} of reads"


def test_curve_matches_sorting(hot: Hotness) -> None:
    ordered = np.sort(hot.counts)[::-1]
    reads = np.cumsum(ordered)
    n = ordered.size
    points = (0.0, 0.0003, 0.001, 0.0101, 0.37, 0.999, 1.0)
    expected = [0.0] + [reads[int(np.ceil(x * n)) - 1] / reads[-1] for x in points[1:]]
    assert [s for _, s in access_curve(hot.counts, points)] == pytest.approx(expected)
    assert access_curve(np.zeros(5, dtype=np.int64), (0.5, 1.0)) == [(0.5, 0.0), (1.0, 0.0)]


@pytest.mark.parametrize("top", [0, 7, 60_000, 70_000, 3_000_000_000, 2**40])
def test_hottest_first_matches_stable_argsort(top: int) -> None:
    rng = np.random.default_rng(top % 1000)
    counts = rng.integers(0, top + 1, 5000, dtype=np.int64)
    counts[rng.choice(5000, 50)] = top  # many ties at the top and elsewhere
    counts[:100] = counts[100:200]
    assert np.array_equal(hottest_first(counts), np.argsort(-counts, kind="stable"))


def test_hottest_first_on_presampled_counts(hot: Hotness) -> None:
    order = hottest_first(hot.counts)
    assert np.array_equal(order, np.argsort(-hot.counts, kind="stable"))
    assert hot.counts[order[0]] == hot.counts.max()


def test_save_load_round_trip(hot: Hotness, tmp_path: Path) -> None:
    path = tmp_path / "hotness.npy"
    hot.save(path)
    assert sidecar(path) == tmp_path / "hotness.json"
    back = Hotness.load(path, num_nodes=hot.counts.size)
    assert np.array_equal(back.counts, hot.counts) and np.load(path).dtype == np.int32 == hot.counts.dtype
    assert (back.batches, back.mean_unique_per_batch, back.epochs, back.fanouts, back.batch_size, back.bound) == (
        hot.batches,
        hot.mean_unique_per_batch,
        hot.epochs,
        hot.fanouts,
        hot.batch_size,
        hot.bound,
    )
    assert not list(tmp_path.glob(".*.tmp")), "temporary files are cleaned up"


def test_counts_files_written_as_int64_before_still_load(hot: Hotness, tmp_path: Path) -> None:
    """Counts saved before they were narrowed (int64) load as the same int32 counts; past int32
    they are saved and loaded as int64."""
    path = tmp_path / "hotness.npy"
    hot.save(path)
    np.save(path, np.load(path).astype(np.int64))
    back = Hotness.load(path, num_nodes=hot.counts.size)
    assert back.counts.dtype == np.int32 and np.array_equal(back.counts, hot.counts)
    wide = replace(hot, counts=hot.counts.astype(np.int64))
    wide.counts[0] = 2**31
    wide.save(path)
    assert np.load(path).dtype == np.int64 and np.array_equal(Hotness.load(path).counts, wide.counts)


def _break(path: Path, how: str) -> None:
    meta_path = sidecar(path)
    meta = json.loads(meta_path.read_text())
    counts = np.load(path)
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "shape":
        np.save(path, counts[:-1])
    elif how == "sum":
        counts[3] += 1
        np.save(path, counts)
    elif how == "dtype":
        np.save(path, counts.astype(np.float64))
    elif how == "pickle":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif how == "format":
        meta_path.write_text(json.dumps({**meta, "format": "moment.dataset/1"}))
    elif how == "json":
        meta_path.write_text("{not json")
    elif how == "no-sidecar":
        meta_path.unlink()
    elif how == "fanouts":
        meta_path.write_text(json.dumps({**meta, "fanouts": "25,10"}))


@pytest.mark.parametrize(
    "how", ["truncated", "shape", "sum", "dtype", "pickle", "format", "json", "no-sidecar", "fanouts"]
)
def test_load_rejects_corrupt_or_mismatched_files(hot: Hotness, tmp_path: Path, how: str) -> None:
    path = tmp_path / "hotness.npy"
    hot.save(path)
    _break(path, how)
    with pytest.raises(MomentError, match="hotness"):
        Hotness.load(path)


def test_load_rejects_counts_for_another_dataset(hot: Hotness, tmp_path: Path) -> None:
    path = tmp_path / "hotness.npy"
    hot.save(path)
    with pytest.raises(MomentError, match="dataset has 10"):
        Hotness.load(path, num_nodes=10)


def test_access_curve_over_many_slices_is_the_sorted_prefix_sum() -> None:
    """Counted by slices of 2^20 vertices (no N-entry int64 temporary): the same shares as sorting
    the counts hottest first, a count value seen in some slices only included."""
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 40, 2_600_000).astype(np.int32)
    counts[-7:] = 97  # the hottest value: in the last slice only
    points = (0.000001, 0.01, 0.3, 0.999, 1.0)
    ordered = np.cumsum(np.sort(counts)[::-1].astype(np.int64))
    expected = [ordered[int(np.ceil(x * counts.size * (1 - 1e-12))) - 1] / ordered[-1] for x in points]
    assert [s for _, s in access_curve(counts, points)] == pytest.approx(expected)
