"""One epoch of training or evaluation: each rank's seed batches (``epoch_batches``: one shuffled
permutation, strided over ranks, the uneven remainder dropped, so DDP's collectives line up and
each training vertex is a seed at most once per epoch), the sampler and the batch preparation the
prefetcher runs, and the steps themselves. :mod:`trainer.loop` runs the epochs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count, islice

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from placement.sampler import NeighborSampler
from placement.samples import StoredSamples
from trainer.config import TrainConfig
from trainer.featurestore import TieredFeatureStore
from trainer.prefetch import Prepared


def epoch_batches(
    sampler: NeighborSampler, ids: np.ndarray, cfg: TrainConfig, epoch: int, rank: int, world_size: int
) -> Iterator[torch.Tensor]:
    """Seed batches of ``rank`` for one training epoch: all ranks run the same number of steps,
    each id is a seed at most once per epoch across ranks (all but ``len(ids) % world_size``)."""
    batches = sampler.batches(
        ids, cfg.resolved_batch_size, shuffle=True, epoch=epoch, rank=rank, world_size=world_size, drop_last_uneven=True
    )
    return islice(batches, cfg.max_batches_per_epoch)


def eval_batches(
    sampler: NeighborSampler, ids: np.ndarray, cfg: TrainConfig, rank: int, world_size: int
) -> Iterator[torch.Tensor]:
    """Seed batches of ``rank`` for an evaluation pass over a split: every id once across ranks,
    in one fixed pseudo-random order (the same every epoch and run), not the split's stored order.
    A split stored by vertex id is often stored by degree too (a crawl's order, a generator's):
    in that order the first batch of a synthesized 5 M-vertex graph sampled 335,383 vertices, the
    next 36,519 and 18,123, against 127,500-132,082 for a shuffled training batch, and that one
    batch set the step's memory peak (on a GPU, its GPU memory too), 11 bytes a vertex above
    what training needed. Shuffled, each batch is a training-sized one."""
    return sampler.batches(ids, cfg.resolved_batch_size, shuffle=True, epoch=0, rank=rank, world_size=world_size)


def epoch_sampler(base: NeighborSampler, seed: int) -> NeighborSampler:
    """A sampler sharing ``base``'s CSR (wherever it lives) with its own seed and call count."""
    on_gpu = isinstance(base.indptr, torch.Tensor) and base.indptr.is_cuda
    return NeighborSampler(base.indptr, base.indices, base.fanouts, base.device, seed=seed, csr_on_device=on_gpu)


def make_prepare(
    sampler: NeighborSampler,
    store: TieredFeatureStore,
    labels: np.ndarray,
    device: torch.device,
    first_batch: int | None = None,
    stored: StoredSamples | None = None,
) -> Callable[[torch.Tensor], Prepared]:
    """Seeds → sampled blocks, their features (float32) and the seeds' labels, on ``device``.
    ``first_batch``: the replay index of the first batch (a packed placement's replayed batches,
    ``TieredFeatureStore.chunks.first_batch``: their chunks and ``stored`` samples, loaded instead
    of sampled where the seeds are the stored batch's); the prefetcher prepares batches in order."""
    numbers = count(first_batch) if first_batch is not None else None

    def prepare(seeds: torch.Tensor) -> Prepared:
        which = next(numbers) if numbers is not None else None
        loaded = stored.batch(which, seeds) if stored is not None and which is not None else None
        if loaded is None:
            batch = sampler.sample(seeds)
        else:
            sampler.skip()
            batch = loaded.to(device)
        x = store.get(batch.nodes, batch=which).to(device, torch.float32, non_blocking=True)
        y = torch.from_numpy(np.asarray(labels[seeds.numpy()], dtype=np.int64)).to(device, non_blocking=True)
        return Prepared(batch, x, y)

    return prepare


# -- one epoch -------------------------------------------------------------------------------


@dataclass
class EpochResult:
    train_s: float
    iterations: int
    seeds: int
    loss_sum: float
    data_wait_s: float


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Prepared],
    device: torch.device,
    on_step: Callable[[], None],
) -> EpochResult:
    """Forward, backward and step per batch; time per iteration includes waiting for data."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    iterations = seeds = 0
    wait = 0.0
    start = time.perf_counter()
    it = iter(batches)
    while True:
        t = time.perf_counter()
        item = next(it, None)
        wait += time.perf_counter() - t
        if item is None:
            break
        loss = F.cross_entropy(model(item.x, item.batch.blocks), item.y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        iterations += 1
        seeds += int(item.y.numel())
        on_step()
    total = float(loss_sum)  # waits for the last step's kernels
    return EpochResult(time.perf_counter() - start, iterations, seeds, total, wait)


@torch.no_grad()
def evaluate(module: nn.Module, batches: Iterator[Prepared]) -> tuple[int, int]:
    """(correct, total) on this rank's share of a split."""
    module.eval()
    correct = total = 0
    for item in batches:
        pred = module(item.x, item.batch.blocks).argmax(dim=-1)
        correct += int((pred == item.y).sum())
        total += int(item.y.numel())
    return correct, total


# -- the run ---------------------------------------------------------------------------------
