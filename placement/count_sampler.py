"""The vertex sets of sampled batches, for counting: pre-sampling's compiled sampler.

Pre-sampling needs, per batch, only which vertices the trainer's sampler
(:class:`placement.sampler.NeighborSampler`) would read: not the sampled edges, the local ids or
the blocks. This draws the same thing, in distribution, with a compiled kernel that releases the
GIL, so several batches are drawn at once:

- the same hops: at hop h every vertex gathered so far (seeds, then each hop's new vertices) is a
  target; a target with at most ``fanout`` neighbours takes them all, else a uniform
  ``fanout``-subset (Floyd's algorithm, as the trainer's sampler);
- a vertex is in the set once, however many targets drew it.

The random draws differ from the trainer's (numba's generator, seeded per batch by
``(seed, batch)``), so the counts are another sample of the same distribution, reproducible for a
seed and independent of the number of threads. Where no row is longer than its hop's fanout the
sets are exactly the trainer's (tests/test_hotness.py checks both). Memory: per thread one byte
per vertex (a mark) and a buffer for one batch's vertex set.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

import numpy as np

from moment.cores import usable_cores

numba: ModuleType | None  # None: not installed (the same functions then run as Python)
try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the kernel then runs as Python
    numba = None

THREADS = 4  # the most batches drawn at once


def _draw_py(
    indptr: np.ndarray,
    indices: np.ndarray,
    seeds: np.ndarray,
    fanouts: np.ndarray,
    seed: int,
    seen: np.ndarray,
    out: np.ndarray,
) -> int:
    """Write the batch's vertex set (seeds first) to ``out``; return its size. ``seen`` is all
    zeros on entry and on return."""
    np.random.seed(seed)
    size = 0
    for i in range(seeds.size):
        v = seeds[i]
        if seen[v] == 0:
            seen[v] = 1
            out[size] = v
            size += 1
    picks = np.empty(max(1, int(fanouts.max())), dtype=np.int64)
    for h in range(fanouts.size):
        fanout = fanouts[h]
        targets = size
        for j in range(targets):
            t = out[j]
            start = indptr[t]
            deg = indptr[t + 1] - start
            take = deg if deg <= fanout else fanout
            for k in range(take):
                if deg <= fanout:
                    pos = k
                else:  # Floyd: step k draws from [0, deg - fanout + k], the top if already taken
                    last = deg - fanout + k
                    pos = np.random.randint(0, last + 1)
                    for q in range(k):
                        if picks[q] == pos:
                            pos = last
                            break
                    picks[k] = pos
                u = indices[start + pos]
                if seen[u] == 0:
                    seen[u] = 1
                    out[size] = u
                    size += 1
    for i in range(size):
        seen[out[i]] = 0
    return size


_draw = numba.njit(cache=True, nogil=True)(_draw_py) if numba is not None else _draw_py


def most_per_batch(batch_size: int, fanouts: Sequence[int], num_nodes: int) -> int:
    """The largest vertex set a batch can have: every draw new, or every vertex."""
    most = batch_size
    for f in fanouts:
        most += most * int(f)
        if most >= num_nodes:
            return num_nodes
    return most


class CountSampler:
    """Vertex sets of seed batches, drawn ``threads`` at a time, yielded in batch order."""

    def __init__(
        self,
        indptr: np.ndarray,
        indices: np.ndarray,
        fanouts: Sequence[int],
        batch_size: int,
        seed: int = 0,
        threads: int | None = None,
    ) -> None:
        self.indptr, self.indices = indptr, indices
        self.fanouts = np.asarray([int(f) for f in fanouts], dtype=np.int64)
        self.seed = int(seed)
        self.num_nodes = len(indptr) - 1
        self.threads = threads or usable_cores(THREADS)
        self._most = most_per_batch(batch_size, fanouts, self.num_nodes)
        self._local = threading.local()

    def _one(self, seeds: np.ndarray, index: int) -> np.ndarray:
        local = self._local
        if not hasattr(local, "seen"):
            local.seen = np.zeros(self.num_nodes, dtype=np.uint8)
            local.out = np.empty(self._most, dtype=np.int64)
        size = _draw(
            self.indptr, self.indices, seeds, self.fanouts, _batch_seed(self.seed, index), local.seen, local.out
        )
        return local.out[:size].copy()

    def sets(self, batches: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        """Each batch's vertex set, in order; at most ``threads`` drawn ahead of the consumer
        (which may stop early: what is in flight is dropped)."""
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="moment-presample") as pool:
            ahead: list[Future[np.ndarray]] = []
            for index, seeds in enumerate(batches):
                ahead.append(pool.submit(self._one, np.ascontiguousarray(seeds, dtype=np.int64), index))
                if len(ahead) > self.threads:
                    yield ahead.pop(0).result()
            for future in ahead:
                yield future.result()


def _batch_seed(seed: int, index: int) -> int:
    """A batch's own generator seed (numba's generator takes 32 bits)."""
    return int(np.random.SeedSequence([seed, 2, index]).generate_state(1)[0])
