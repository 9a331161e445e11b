"""Stored samples of a packed placement (issue #25, placement/samples.py): ``moment place --pack``
keeps the replayed batches' samples and the trainer loads them instead of sampling. Checked by
reading every batch back against the sampler's, by training with stored and live samples to the
same parameters, by a batch that is not the replayed one being sampled, and by damaging the
files and killing the placement while it stores them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moment.contracts.metrics import MetricsDoc
from moment.contracts.placed import PlacedError, PlacedManifest
from placement.pack import replay_samples
from placement.place import PlaceOptions, place
from placement.placed import open_placed, verify
from placement.sampler import NeighborSampler, SampledBatch
from placement.samples import FILES, StoredSamples, check, record
from tests import test_pack
from trainer.epoch import make_prepare
from trainer.featurestore import TieredFeatureStore
from trainer.loop import main as train_main

OPTS = test_pack.OPTS
plan_file, dataset = test_pack.plan_file, test_pack.dataset  # its plan and 128 B-row dataset (fixtures)


def _same(a: SampledBatch, b: SampledBatch) -> bool:
    return (
        torch.equal(a.seeds, b.seeds)
        and torch.equal(a.nodes, b.nodes)
        and len(a.blocks) == len(b.blocks)
        and all(
            (x.num_dst, x.num_src) == (y.num_dst, y.num_src)
            and x.edge_index.dtype == y.edge_index.dtype
            and torch.equal(x.edge_index, y.edge_index)
            for x, y in zip(a.blocks, b.blocks)
        )
    )


def test_every_batch_reads_back_as_sampled(tmp_path: Path) -> None:
    """Three hops over a random graph with isolated vertices (targets without neighbours) and
    one batch of a single seed: each stored batch is the sampler's, tensor for tensor; a batch
    asked for with other seeds, or past the last, is not served."""
    rng = np.random.default_rng(0)
    n = 2_000
    deg = rng.integers(0, 12, size=n)
    deg[::7] = 0
    indptr = np.concatenate(([0], np.cumsum(deg)))
    indices = rng.integers(0, n, size=int(indptr[-1])).astype(np.int32)
    sampler = NeighborSampler(indptr, indices, [4, 3, 2], seed=5)
    seeds = [torch.arange(0, 40), torch.tensor([7]), torch.arange(100, 1900, 9)]
    batches = [sampler.sample(s) for s in seeds]
    files = record(tmp_path, iter(batches), 3, np.dtype(np.int32))
    assert (files.batches, files.hops, files.node_dtype) == (3, 3, "int32")
    assert files.bytes == sum((tmp_path / name).stat().st_size for name in FILES.values())
    # nodes as int32, and per hop one count per target and one source per edge (int32)
    edges = sum(b.num_dst + b.edge_index.shape[1] for batch in batches for b in batch.blocks)
    assert (tmp_path / FILES["samples_edges"]).stat().st_size == 4 * edges
    stored = StoredSamples.in_dir(tmp_path, files)
    for i, (s, want) in enumerate(zip(seeds, batches)):
        assert _same(stored.batch(i, s), want) and _same(stored.batch(i), want)
    assert stored.batch(0, torch.arange(1, 41)) is None and stored.batch(1, torch.tensor([8])) is None
    assert stored.batch(3) is None and stored.batch(-1) is None
    assert [x.tolist() for x in stored.all_nodes()] == [b.nodes.tolist() for b in batches]
    assert stored.loaded == 6


@pytest.fixture(scope="module")
def packed(plan_file: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("samples-packed") / "p"
    place(plan_file, dataset, out, PlaceOptions(pack=True, pack_epochs=1, **OPTS))
    return out


def test_the_placement_stores_the_trainer_s_draws(packed: Path) -> None:
    """Every replayed batch is stored as the trainer's sampler draws it, and verify re-draws one."""
    placed = open_placed(packed)
    pack = placed.manifest.pack
    assert pack is not None and pack.samples is not None and pack.samples.batches == pack.batches > 0
    assert all(pack.samples.keys[i] in placed.manifest.files for i in range(3))
    stored = StoredSamples.of(placed)
    assert stored is not None
    arrays = [placed.array(k) for k in ("indptr", "indices", "train")]
    live = list(replay_samples(*arrays, pack.fanouts, pack.batch_size, pack.seed, pack.epochs, pack.ranks))
    assert len(live) == stored.batches and all(_same(stored.batch(i), b) for i, b in enumerate(live))
    assert check(placed) == stored.batches


def _train(root: Path, tmp_path: Path, name: str, *extra: str) -> MetricsDoc:
    metrics = tmp_path / f"{name}.json"
    args = [
        "--data",
        str(root),
        "--device",
        "cpu",
        "--hidden",
        "8",
        "--eval-every",
        "9",
        "--metrics-json",
        str(metrics),
    ]
    assert train_main([*args, *extra]) == 0
    return MetricsDoc.read(metrics)


def test_stored_samples_train_to_the_parameters_of_live_sampling(packed: Path, tmp_path: Path) -> None:
    """One epoch with the stored samples and one sampling every batch: the same draws, so the
    same parameters bit for bit, and the same loss; the first loaded every step's batch, the
    second none. With --reuse-samples the second epoch loads them again; without it, samples."""
    stored = _train(packed, tmp_path, "stored", "--epochs", "1")
    live = _train(packed, tmp_path, "live", "--epochs", "1", "--live-sampling")
    assert stored.rank_param_digests == live.rank_param_digests
    assert stored.epochs[0].loss == live.epochs[0].loss
    steps = stored.epochs[0].iterations
    assert steps > 0 and stored.sampling.stored_batches == steps and live.sampling.stored_batches is None
    reuse = _train(packed, tmp_path, "reuse", "--epochs", "2", "--reuse-samples")
    fresh = _train(packed, tmp_path, "fresh", "--epochs", "2")
    assert reuse.sampling.stored_batches == 2 * steps and fresh.sampling.stored_batches == steps
    assert reuse.epochs[0].loss == fresh.epochs[0].loss == stored.epochs[0].loss


def test_a_batch_that_is_not_replayed_is_sampled(packed: Path) -> None:
    """The prepare step loads replayed batch 0 for its own seeds without sampling (the sampler
    only counts it, so its next draw is the one it would have made); other seeds under the same
    number, or a batch without a number, are sampled."""
    placed = open_placed(packed)
    pack = placed.manifest.pack
    stored = StoredSamples.of(placed)
    arrays = [placed.array(k) for k in ("indptr", "indices", "train")]
    first = next(replay_samples(*arrays, pack.fanouts, pack.batch_size, pack.seed, 1, pack.ranks))

    class Counting(NeighborSampler):
        drawn = 0

        def sample(self, seeds: torch.Tensor | np.ndarray) -> SampledBatch:
            Counting.drawn += 1
            return super().sample(seeds)

    sampler = Counting(arrays[0], arrays[1], pack.fanouts, seed=1)
    labels = np.asarray(placed.array("labels"))
    with TieredFeatureStore(placed, device="cpu", io="posix") as store:
        prepare = make_prepare(sampler, store, labels, torch.device("cpu"), 0, stored)
        assert _same(prepare(first.seeds).batch, first) and Counting.drawn == 0 and sampler._calls == 1
        prepare(first.seeds)  # as batch 1, whose seeds are others
        assert Counting.drawn == 1
        other = first.seeds + 1
        again = make_prepare(sampler, store, labels, torch.device("cpu"), 0, stored)
        assert torch.equal(again(other).batch.seeds, other) and Counting.drawn == 2
        unnumbered = make_prepare(sampler, store, labels, torch.device("cpu"), None, stored)
        unnumbered(first.seeds)
        assert Counting.drawn == 3


def test_another_seed_samples_every_batch(packed: Path, tmp_path: Path) -> None:
    doc = _train(packed, tmp_path, "seed1", "--epochs", "1", "--seed", "1")
    assert doc.sampling.stored_batches == 0 and doc.epochs[0].iterations > 0


@pytest.mark.parametrize("role", ["nodes", "edges", "index"])
def test_a_flipped_byte_in_the_samples_is_caught(role: str, packed: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    shutil.copytree(packed, out)
    m = PlacedManifest.read(out / "placed.json")
    assert m.pack is not None and m.pack.samples is not None
    path = out / m.files[getattr(m.pack.samples, role)].path
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(PlacedError, match=rf"{path.name}: checksum mismatch"):
        verify(out, sample=0)


def test_a_sample_that_is_not_the_sampler_s_is_caught(packed: Path, tmp_path: Path) -> None:
    """Read without checksums (as the trainer opens a placement), a changed edge source of the
    first batch is caught by verify's re-draw, and a changed count is one line, not a traceback."""
    out = tmp_path / "p"
    shutil.copytree(packed, out)
    placed = open_placed(out)
    stored = StoredSamples.of(placed)
    assert stored is not None
    path = out / FILES["samples_edges"]
    targets = int(stored.index[0, 0])  # batch 0 begins with its seeds' counts, then their sources
    edges = np.fromfile(path, dtype=np.int32)
    edges[targets] = (edges[targets] + 1) % int(stored.index[0, 1])
    edges.tofile(path)
    with pytest.raises(PlacedError, match="first stored batch is not the one the trainer's sampler draws"):
        check(open_placed(out))
    edges[0] += 1
    edges.tofile(path)
    with pytest.raises(PlacedError, match=f"{path.name}: batch 0's hop 1 counts"):
        StoredSamples.of(open_placed(out)).batch(0)


@pytest.mark.parametrize("point", ["place:sampling", "place:samples-stored"])
@pytest.mark.parametrize("budget", [None, "0.5x"])
def test_killed_while_storing_samples_resumes(
    point: str, budget: str | None, plan_file: Path, dataset: Path, tmp_path: Path
) -> None:
    """Killed after the first stored batch or after all of them, with and without a budget, the
    re-run finishes a placement whose samples verify (re-drawn) and train."""
    opts = {**OPTS, "pack": True, "pack_budget": budget}
    out, _, placed = test_pack._killed_and_rerun(point, plan_file, dataset, tmp_path, opts)
    assert placed.manifest.pack is not None and check(placed) == placed.manifest.pack.batches
    assert _train(out, tmp_path, "after", "--epochs", "1").sampling.stored_batches > 0
