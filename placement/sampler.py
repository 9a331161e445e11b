"""The neighbour sampler: one implementation for pre-sampling (placement) and for training.

PyG-style split of work: the sampler returns vertex ids and edges only; feature rows are fetched
elsewhere (the tiered feature store), so pre-sampling counts exactly the rows training will read.

Semantics (what the tests pin down):

* ``fanouts[0]`` is the first hop (the seeds' neighbours), as in PyG's ``num_neighbors``.
* Each target with degree d gets ``min(d, fanout)`` neighbours drawn uniformly **without
  replacement** (Floyd's algorithm, vectorised over targets; one Python step per fan-out slot,
  never per vertex). Draws are over positions in the CSR row, so a multigraph's repeated entries
  are distinct candidates.
* Every hop samples all vertices gathered so far (DGL "blocks"/MFGs): the GNN layer of that hop
  computes a new representation for each of them.
* Local ids: ``batch.nodes`` holds the seeds first, then each hop's new vertices (ascending id
  within a hop), so every hop's targets are a prefix of ``nodes``. ``blocks`` are outermost hop
  first, ``blocks[k].num_dst == blocks[k + 1].num_src``, ``blocks[0].num_src == len(nodes)`` and
  ``blocks[-1].num_dst == len(seeds)``.
* Randomness comes from a ``torch.Generator`` re-seeded from ``(seed, call number)`` on every
  call, so a fresh sampler with the same seed replays the same batches. CPU and CUDA generators
  produce different streams: results are reproducible per device, not across devices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

Array = np.ndarray | torch.Tensor

# Share of free GPU memory the CSR may take when put there automatically: the feature cache
# needs the rest.
CSR_GPU_SHARE = 0.25
# Elements per host-to-device copy when uploading a memory-mapped CSR (bounds host RAM use).
UPLOAD_CHUNK = 1 << 26


@dataclass
class SampledBlock:
    """One layer's bipartite graph: messages flow from ``nodes[:num_src]`` to ``nodes[:num_dst]``."""

    edge_index: torch.Tensor  # 2 x E int64: row 0 source position in batch.nodes, row 1 target
    num_dst: int
    num_src: int


@dataclass
class SampledBatch:
    """A mini-batch: seed ids, every vertex whose feature row is needed, and the blocks."""

    seeds: torch.Tensor
    nodes: torch.Tensor
    blocks: list[SampledBlock]

    def to(self, device: torch.device) -> SampledBatch:
        """The same batch with every tensor on ``device``."""
        blocks = [SampledBlock(b.edge_index.to(device), b.num_dst, b.num_src) for b in self.blocks]
        return SampledBatch(self.seeds.to(device), self.nodes.to(device), blocks)


def derive_seed(*parts: int) -> int:
    """A 63-bit generator seed mixed from integers (so (seed, 1) and (seed + 1, 0) differ)."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


# derive_seed streams: the sampler's own (0, 1) are its permutation and its draws; training's
# neighbour draws and evaluation's each have their own (the trainer's, replayed by ``moment place
# --pack``: placement.pack).
TRAIN_STREAM, EVAL_STREAM = 2, 3


def train_draw_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of ``rank``'s neighbour draws in training epoch ``epoch``: the trainer samples
    with it, and a packed placement replays the same batches to lay their rows out together."""
    return derive_seed(seed, TRAIN_STREAM, epoch, rank)


def num_batches(n: int, batch_size: int, world_size: int = 1, rank: int = 0, drop_last_uneven: bool = False) -> int:
    """Batches ``rank`` gets from ``NeighborSampler.batches`` over ``n`` ids.

    Without ``drop_last_uneven`` rank r's share is ``n // world_size`` ids plus one for the first
    ``n % world_size`` ranks, so counts can differ by one batch between ranks. With it, every
    rank's share is ``n // world_size`` and all ranks run the same number of steps (what DDP needs).
    """
    share = n // world_size + (0 if drop_last_uneven or rank >= n % world_size else 1)
    return -(-share // batch_size)


class NeighborSampler:
    """Uniform multi-hop neighbour sampling over a CSR graph (in memory, memory-mapped or on GPU)."""

    def __init__(
        self,
        indptr: Array,
        indices: Array,
        fanouts: Sequence[int],
        device: str | torch.device = "cpu",
        seed: int = 0,
        csr_on_device: bool | None = None,
    ) -> None:
        """``csr_on_device``: put the CSR on a CUDA ``device`` (None: when it takes at most
        ``CSR_GPU_SHARE`` of free GPU memory). Otherwise it stays on the host (a numpy memmap stays
        a memmap: only the pages a batch touches are read) and results are moved to ``device``."""
        if not fanouts or any(int(f) <= 0 for f in fanouts):
            raise ValueError(f"fanouts must be positive integers, got {tuple(fanouts)}")
        if len(indptr) < 1:
            raise ValueError("indptr needs at least one entry (N + 1 for N vertices)")
        self.fanouts = tuple(int(f) for f in fanouts)
        self.device = torch.device(device)
        self.seed = int(seed)
        self.num_nodes = len(indptr) - 1
        self._calls = 0
        on_gpu = self.device.type == "cuda" and (
            csr_on_device if csr_on_device is not None else _fits_on_gpu(indptr, indices, self.device)
        )
        self._work = self.device if on_gpu else torch.device("cpu")
        self.indptr = _place(indptr, self._work, torch.int64)
        self.indices = _place(indices, self._work, None)

    # -- sampling --------------------------------------------------------------------------

    def sample(self, seeds: torch.Tensor | np.ndarray) -> SampledBatch:
        """Sample ``len(fanouts)`` hops around ``seeds`` (unique vertex ids)."""
        gen = torch.Generator(device=self._work)
        gen.manual_seed(derive_seed(self.seed, 1, self._calls))
        self._calls += 1
        seeds = torch.as_tensor(seeds).to(device=self._work, dtype=torch.int64)
        if torch.unique(seeds).numel() != seeds.numel():
            raise ValueError("seeds must be unique vertex ids")
        nodes = seeds
        blocks: list[SampledBlock] = []
        for fanout in self.fanouts:
            num_dst = nodes.numel()
            dst, src = self._sample_hop(nodes, fanout, gen)
            nodes, src_local = _append_unique(nodes, src)
            edge_index = torch.stack([src_local, dst])
            blocks.append(SampledBlock(edge_index, num_dst=num_dst, num_src=nodes.numel()))
        blocks.reverse()
        return SampledBatch(seeds, nodes, blocks).to(self.device)

    def skip(self) -> None:
        """Count a batch whose sample came from elsewhere (a placement's stored samples), so the
        next ``sample`` draws what it would have drawn after sampling that batch here."""
        self._calls += 1

    def _sample_hop(
        self, targets: torch.Tensor, fanout: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(local target index, global source id) of every sampled edge into ``targets``."""
        start = _gather(self.indptr, targets)
        deg = _gather(self.indptr, targets + 1) - start
        counts = deg.clamp(max=fanout)
        dst = torch.repeat_interleave(torch.arange(targets.numel(), device=self._work), counts)
        # Offset of each edge inside its target's row: 0..deg-1 for rows taken whole ...
        first_edge = torch.cumsum(counts, 0) - counts
        offsets = torch.arange(dst.numel(), device=self._work) - first_edge[dst]
        # ... and a uniform fanout-subset for rows longer than fanout (their edges are contiguous
        # blocks of `fanout` in target order, so the row-major subset matrix lines up).
        long_rows = deg > fanout
        if bool(long_rows.any()):
            offsets[long_rows[dst]] = _floyd(deg[long_rows], fanout, gen).reshape(-1)
        src = _gather(self.indices, start[dst] + offsets)
        return dst, src.to(torch.int64)

    # -- seed batches ----------------------------------------------------------------------

    def batches(
        self,
        ids: np.ndarray | torch.Tensor,
        batch_size: int,
        shuffle: bool = True,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last_uneven: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Seed batches (CPU int64) of ``rank``'s share of ``ids`` for one epoch.

        Every rank draws the same permutation (seeded by ``(seed, epoch)``) and takes the strided
        share ``perm[rank::world_size]``, so across ranks each id is used exactly once per epoch.
        Ranks may then differ by one batch (see ``num_batches``); ``drop_last_uneven`` first drops
        the ``len(ids) % world_size`` last ids of the permutation (different ids each epoch) so
        all ranks run the same number of equally sized steps.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        ids_t = torch.from_numpy(np.array(ids, dtype=np.int64)) if isinstance(ids, np.ndarray) else ids.cpu().long()
        n = ids_t.numel()
        if shuffle:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, 0, epoch))
            ids_t = ids_t[torch.randperm(n, generator=gen)]
        if drop_last_uneven:
            ids_t = ids_t[: n - n % world_size]
        share = ids_t[rank::world_size]
        if share.numel():  # an empty share is no batch (split would give one empty tensor)
            yield from share.split(batch_size)


def _floyd(deg: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """A uniform k-subset of range(d) for each row's d > k: rows x k offsets (Floyd's algorithm).

    Step s draws t uniformly from [0, d - k + s]; if t was already chosen it takes d - k + s
    itself. Every k-subset comes out equally likely, with k vectorised steps and no rejection.
    All draws are made up front (step-major, so each step reads contiguous memory).
    """
    device = deg.device
    last = deg.unsqueeze(0) - k + torch.arange(k, device=device).unsqueeze(1)  # k x rows: d - k + s
    draw = torch.rand(last.shape, dtype=torch.float64, device=device, generator=gen)
    picks = torch.minimum((draw * (last + 1)).to(torch.int64), last)
    for s in range(1, k):
        seen = (picks[:s] == picks[s]).any(dim=0)
        picks[s] = torch.where(seen, last[s], picks[s])
    return picks.t()


def _append_unique(nodes: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend unique ``nodes`` by ``new``'s unseen ids; the local ids of ``new``.

    ``nodes`` keeps its positions (its ids are unique), the unseen ids follow in ascending id
    order: one sort-based unique, no first-occurrence pass, and ascending ids keep later
    feature-row reads close together on disk.
    """
    n = nodes.numel()
    uniq, inverse = torch.unique(torch.cat([nodes, new]), return_inverse=True)
    local = torch.empty(uniq.numel(), dtype=torch.int64, device=uniq.device)
    is_old = torch.zeros(uniq.numel(), dtype=torch.bool, device=uniq.device)
    is_old[inverse[:n]] = True
    local[inverse[:n]] = torch.arange(n, device=uniq.device)
    fresh = uniq[~is_old]
    local[~is_old] = torch.arange(n, n + fresh.numel(), device=uniq.device)
    return torch.cat([nodes, fresh]), local[inverse[n:]]


def _gather(arr: Array, pos: torch.Tensor) -> torch.Tensor:
    """``arr[pos]`` as a tensor; a numpy memmap reads only the pages holding those entries."""
    if isinstance(arr, torch.Tensor):
        return arr[pos]
    return torch.from_numpy(np.asarray(arr[pos.numpy()]))


def _is_host_numpy(arr: Array) -> bool:
    """Numpy arrays torch cannot share zero-copy (memmaps, read-only) stay numpy on the host."""
    return isinstance(arr, np.ndarray) and (isinstance(arr, np.memmap) or not arr.flags.writeable)


def _place(arr: Array, device: torch.device, dtype: torch.dtype | None) -> Array:
    """The array on ``device``, as int64 for indptr (``dtype``); indices keep int32 if given so."""
    if isinstance(arr, np.ndarray) and dtype is not None and arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    if isinstance(arr, torch.Tensor):
        return arr.to(device=device, dtype=dtype or arr.dtype)
    if device.type == "cpu":
        return arr if _is_host_numpy(arr) else torch.from_numpy(np.ascontiguousarray(arr))
    out = torch.empty(arr.shape[0], dtype=torch.from_numpy(np.empty(0, arr.dtype)).dtype, device=device)
    for lo in range(0, arr.shape[0], UPLOAD_CHUNK):
        out[lo : lo + UPLOAD_CHUNK] = torch.from_numpy(np.array(arr[lo : lo + UPLOAD_CHUNK]))
    return out


def csr_bytes(indptr: Array, indices: Array) -> int:
    """Bytes of the CSR as sampling holds it: indptr as int64, indices in their own type."""
    itemsize = indices.element_size() if isinstance(indices, torch.Tensor) else indices.dtype.itemsize
    return len(indptr) * 8 + len(indices) * itemsize


def fits_on_gpu(nbytes: int, free: int) -> bool:
    """Whether a CSR of ``nbytes`` goes on a GPU with ``free`` bytes: at most ``CSR_GPU_SHARE``."""
    return nbytes <= CSR_GPU_SHARE * free


def _fits_on_gpu(indptr: Array, indices: Array, device: torch.device) -> bool:
    return fits_on_gpu(csr_bytes(indptr, indices), torch.cuda.mem_get_info(device)[0])
