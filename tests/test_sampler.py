"""placement.sampler: sampled edges are real, fan-outs respected, uniform, reproducible, any CSR storage."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from placement.sampler import NeighborSampler, SampledBatch, num_batches


def random_csr(n: int = 400, max_deg: int = 30, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A graph without repeated neighbours; about a tenth of the vertices have none."""
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, n)
    deg[rng.random(n) < 0.1] = 0
    rows = [np.sort(rng.choice(n, d, replace=False)) for d in deg]
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    return indptr, np.concatenate(rows).astype(np.int64)


def shared_neighbours_csr(targets: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Vertices 0..targets-1 all have the same neighbours targets..targets+degree-1."""
    indptr = np.concatenate([np.arange(targets + 1) * degree, np.full(degree, targets * degree)]).astype(np.int64)
    indices = np.tile(np.arange(targets, targets + degree), targets)
    return indptr, indices


def rows_of(indptr: np.ndarray, indices: np.ndarray, v: int) -> set[int]:
    return set(indices[indptr[v] : indptr[v + 1]].tolist())


def as_tuple(batch: SampledBatch) -> tuple[list[int], list[list[list[int]]]]:
    return batch.nodes.tolist(), [b.edge_index.tolist() for b in batch.blocks]


@pytest.fixture(scope="module")
def graph() -> tuple[np.ndarray, np.ndarray]:
    return random_csr()


def test_edges_exist_and_each_target_gets_min_deg_fanout_distinct(graph: tuple[np.ndarray, np.ndarray]) -> None:
    indptr, indices = graph
    fanouts = (6, 3)
    sampler = NeighborSampler(indptr, indices, fanouts, seed=1)
    seeds = torch.from_numpy(np.random.default_rng(1).choice(400, 60, replace=False))
    batch = sampler.sample(seeds)
    nodes = batch.nodes.tolist()
    for block, fanout in zip(batch.blocks, reversed(fanouts), strict=True):
        per_target: dict[int, list[int]] = {t: [] for t in range(block.num_dst)}
        for src, dst in block.edge_index.t().tolist():
            assert src < block.num_src and dst < block.num_dst
            per_target[dst].append(nodes[src])
        for t, sources in per_target.items():
            row = rows_of(indptr, indices, nodes[t])
            assert set(sources) <= row, f"sampled a non-edge into vertex {nodes[t]}"
            assert len(sources) == len(set(sources)) == min(len(row), fanout)


def test_layout_seeds_first_unique_nodes_chained_blocks(graph: tuple[np.ndarray, np.ndarray]) -> None:
    indptr, indices = graph
    sampler = NeighborSampler(indptr, indices, (5, 4, 3), seed=2)
    seeds = torch.tensor([7, 3, 199, 42, 0])
    batch = sampler.sample(seeds)
    assert batch.nodes.dtype == torch.int64
    assert batch.nodes[: seeds.numel()].tolist() == seeds.tolist()
    assert batch.seeds.tolist() == seeds.tolist()
    assert batch.nodes.unique().numel() == batch.nodes.numel()
    assert len(batch.blocks) == 3
    assert batch.blocks[0].num_src == batch.nodes.numel()
    assert batch.blocks[-1].num_dst == seeds.numel()
    for outer, inner in zip(batch.blocks, batch.blocks[1:]):
        assert outer.num_dst == inner.num_src
    for block in batch.blocks:
        assert block.edge_index.shape[0] == 2 and block.edge_index.dtype == torch.int64
        assert block.num_dst <= block.num_src
    # Every sampled source of the innermost hop is among the vertices the next hop samples.
    assert int(batch.blocks[-1].edge_index[0].max()) < batch.blocks[-1].num_src


def test_zero_degree_vertices() -> None:
    indptr = np.array([0, 0, 2, 2, 3], dtype=np.int64)  # 0 and 2 have no neighbours
    indices = np.array([0, 3, 2], dtype=np.int64)
    sampler = NeighborSampler(indptr, indices, (4, 4))
    lonely = sampler.sample(torch.tensor([0, 2]))
    assert lonely.nodes.tolist() == [0, 2]
    assert all(b.edge_index.shape == (2, 0) for b in lonely.blocks)
    mixed = sampler.sample(torch.tensor([1]))
    assert mixed.nodes.tolist() == [1, 0, 3, 2]
    assert sorted(map(tuple, mixed.blocks[1].edge_index.t().tolist())) == [(1, 0), (2, 0)]
    assert sorted(map(tuple, mixed.blocks[0].edge_index.t().tolist())) == [(1, 0), (2, 0), (3, 2)]
    empty = sampler.sample(torch.tensor([], dtype=torch.int64))
    assert empty.nodes.numel() == 0 and all(b.edge_index.shape == (2, 0) for b in empty.blocks)


def test_marginals_uniform_on_a_high_degree_vertex() -> None:
    targets, degree, fanout = 500, 100, 10
    indptr, indices = shared_neighbours_csr(targets, degree)
    sampler = NeighborSampler(indptr, indices, (fanout,), seed=3)
    freq = np.zeros(degree)
    for _ in range(4):
        batch = sampler.sample(torch.arange(targets))
        sources = batch.nodes[batch.blocks[0].edge_index[0]] - targets
        freq += np.bincount(sources.numpy(), minlength=degree)
    expected = 4 * targets * fanout / degree
    chi2 = float(((freq - expected) ** 2 / expected).sum())
    # 99 degrees of freedom: mean 99, sd 14; sampling without replacement only lowers it.
    assert chi2 < 99 + 6 * 14, chi2


def test_subsets_uniform_without_replacement() -> None:
    targets, degree, fanout = 3000, 5, 2
    indptr, indices = shared_neighbours_csr(targets, degree)
    batch = NeighborSampler(indptr, indices, (fanout,), seed=4).sample(torch.arange(targets))
    src, dst = batch.nodes[batch.blocks[0].edge_index].numpy()
    pairs: dict[int, list[int]] = {}
    for s, d in zip(src.tolist(), dst.tolist()):
        pairs.setdefault(d, []).append(s)
    subsets = Counter(tuple(sorted(p)) for p in pairs.values())
    assert len(subsets) == 10 and all(len(set(s)) == 2 for s in subsets)
    expected = targets / 10
    chi2 = sum((c - expected) ** 2 / expected for c in subsets.values())
    assert chi2 < 9 + 6 * 4.3, chi2  # 9 degrees of freedom


def test_reproducible_for_a_seed(graph: tuple[np.ndarray, np.ndarray]) -> None:
    indptr, indices = graph
    seeds = torch.arange(0, 400, 7)

    def run(seed: int) -> list:
        sampler = NeighborSampler(indptr, indices, (5, 5), seed=seed)
        return [as_tuple(sampler.sample(seeds)) for _ in range(3)]

    first = run(11)
    assert first == run(11)
    assert first != run(12)
    assert first[0] != first[1], "successive calls draw afresh"


def test_int32_int64_torch_and_memmap_csr_agree(graph: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    indptr, indices = graph
    np.save(tmp_path / "indptr.npy", indptr)
    np.save(tmp_path / "indices.npy", indices.astype(np.int32))
    mm_indptr = np.load(tmp_path / "indptr.npy", mmap_mode="r")
    mm_indices = np.load(tmp_path / "indices.npy", mmap_mode="r")
    variants = {
        "int64": NeighborSampler(indptr, indices, (4, 3), seed=5),
        "int32": NeighborSampler(indptr, indices.astype(np.int32), (4, 3), seed=5),
        "torch": NeighborSampler(torch.from_numpy(indptr), torch.from_numpy(indices.astype(np.int32)), (4, 3), seed=5),
        "memmap": NeighborSampler(mm_indptr, mm_indices, (4, 3), seed=5),
    }
    assert variants["int32"].indices.dtype == torch.int32
    assert variants["torch"].indices.dtype == torch.int32
    assert isinstance(variants["memmap"].indices, np.memmap), "a memmap must not be read into memory"
    seeds = torch.tensor([5, 17, 250, 399, 1])
    results = {name: as_tuple(s.sample(seeds)) for name, s in variants.items()}
    assert all(r == results["int64"] for r in results.values())


def test_rejects_duplicate_seeds_and_bad_fanouts(graph: tuple[np.ndarray, np.ndarray]) -> None:
    indptr, indices = graph
    with pytest.raises(ValueError, match="unique"):
        NeighborSampler(indptr, indices, (2,)).sample(torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="fanouts"):
        NeighborSampler(indptr, indices, (10, 0))


def test_batches_cover_each_id_once_across_ranks() -> None:
    ids = np.random.default_rng(6).choice(10_000, 1001, replace=False)
    sampler = NeighborSampler(np.zeros(10_001, dtype=np.int64), np.zeros(0, dtype=np.int64), (1,), seed=6)
    shares = [torch.cat(list(sampler.batches(ids, 64, epoch=0, rank=r, world_size=2))) for r in range(2)]
    assert sorted(torch.cat(shares).tolist()) == sorted(ids.tolist())
    assert not set(shares[0].tolist()) & set(shares[1].tolist())
    for r in range(2):
        got = list(sampler.batches(ids, 64, epoch=0, rank=r, world_size=2))
        assert all(b.dtype == torch.int64 and 0 < b.numel() <= 64 for b in got)
        assert len(got) == num_batches(ids.size, 64, world_size=2, rank=r)
    again = torch.cat(list(sampler.batches(ids, 64, epoch=0, rank=0, world_size=2)))
    other_epoch = torch.cat(list(sampler.batches(ids, 64, epoch=1, rank=0, world_size=2)))
    assert again.tolist() == shares[0].tolist()
    assert other_epoch.tolist() != shares[0].tolist()
    assert list(torch.cat(list(sampler.batches(ids, 64, shuffle=False))).numpy()) == list(ids)


def test_drop_last_uneven_gives_every_rank_the_same_steps() -> None:
    sampler = NeighborSampler(np.zeros(101, dtype=np.int64), np.zeros(0, dtype=np.int64), (1,))
    ids = np.arange(100)  # 100 ids over 3 ranks, batches of 11: shares 34/33/33 -> 4/3/3 batches
    uneven = [len(list(sampler.batches(ids, 11, rank=r, world_size=3))) for r in range(3)]
    assert uneven == [4, 3, 3] == [num_batches(100, 11, 3, rank=r) for r in range(3)]
    even = [list(sampler.batches(ids, 11, rank=r, world_size=3, drop_last_uneven=True)) for r in range(3)]
    assert [len(b) for b in even] == [num_batches(100, 11, 3, drop_last_uneven=True)] * 3 == [3, 3, 3]
    used = torch.cat([torch.cat(b) for b in even])
    assert used.numel() == 99 and used.unique().numel() == 99


@pytest.mark.gpu
@pytest.mark.parametrize("csr_on_device", [True, False])
def test_cuda_device(graph: tuple[np.ndarray, np.ndarray], csr_on_device: bool) -> None:
    indptr, indices = graph
    sampler = NeighborSampler(indptr, indices.astype(np.int32), (4, 3), device="cuda", csr_on_device=csr_on_device)
    batch = sampler.sample(torch.tensor([5, 17, 250], device="cuda"))
    assert batch.nodes.is_cuda and all(b.edge_index.is_cuda for b in batch.blocks)
    nodes = batch.nodes.cpu().tolist()
    for src, dst in batch.blocks[-1].edge_index.t().cpu().tolist():
        assert nodes[src] in rows_of(indptr, indices, nodes[dst])
