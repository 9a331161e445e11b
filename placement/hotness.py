"""Pre-sampling hotness: how often training will read each vertex's feature row.

``presample`` runs the training sampler (``placement.sampler.NeighborSampler``, same fan-outs,
batch size and seed) over the train split and counts, per vertex, the batches whose sampled
vertex set contains it. A batch reads each of its unique vertices' feature rows once, so the
counts are feature-row reads: the quantity a cache placement wants to capture.

On disk a ``Hotness`` is two files and no pickle: the counts as ``.npy`` and the rest as a JSON
sidecar (same path, suffix ``.json``) that also records N and the total, so ``load`` can tell a
truncated, swapped or foreign file from a good one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moment.contracts.hotness import HotnessError, HotnessMeta
from moment.fileio import atomic_file
from moment.progress import Update
from placement.dataset import Dataset
from placement.sampler import NeighborSampler, num_batches

CURVE_POINTS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass
class Hotness:
    counts: np.ndarray  # int64, N: feature-row reads per vertex over all pre-sampled batches
    batches: int
    mean_unique_per_batch: float
    epochs: int
    fanouts: tuple[int, ...]
    batch_size: int

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def curve(self, points: Sequence[float] = CURVE_POINTS) -> list[tuple[float, float]]:
        """(x, share of all reads that hit the hottest x of vertices) for each x in ``points``."""
        return access_curve(self.counts, points)

    def save(self, path: str | Path) -> None:
        """Write the counts to ``path`` (.npy) and the rest to its .json sidecar, each atomically."""
        path = Path(path)
        _atomic_save_npy(path, np.ascontiguousarray(self.counts, dtype=np.int64))
        HotnessMeta(
            num_nodes=int(self.counts.shape[0]),
            total=self.total,
            batches=self.batches,
            mean_unique_per_batch=float(self.mean_unique_per_batch),
            epochs=self.epochs,
            fanouts=[int(f) for f in self.fanouts],
            batch_size=self.batch_size,
        ).write(sidecar(path))

    @classmethod
    def load(cls, path: str | Path, num_nodes: int | None = None) -> Hotness:
        """Read a saved ``Hotness``; ``num_nodes`` (the dataset's N) is checked when given."""
        path = Path(path)
        meta = HotnessMeta.read(sidecar(path))
        counts = _read_counts(path)
        if counts.shape != (meta.num_nodes,):
            raise HotnessError(f"{path}: counts have shape {counts.shape}, the sidecar says ({meta.num_nodes},)")
        if num_nodes is not None and meta.num_nodes != num_nodes:
            raise HotnessError(f"{path}: counts are for {meta.num_nodes} vertices, the dataset has {num_nodes}")
        if counts.size and int(counts.min()) < 0:
            raise HotnessError(f"{path}: negative counts (not a hotness file?)")
        if int(counts.sum()) != meta.total:
            raise HotnessError(
                f"{path}: counts sum to {int(counts.sum())}, the sidecar says {meta.total} (corrupt or mismatched pair)"
            )
        return cls(
            counts=counts,
            batches=meta.batches,
            mean_unique_per_batch=float(meta.mean_unique_per_batch),
            epochs=meta.epochs,
            fanouts=tuple(meta.fanouts),
            batch_size=meta.batch_size,
        )


def presample(
    dataset: Dataset,
    fanouts: Sequence[int],
    batch_size: int,
    epochs: int = 1,
    seed: int = 0,
    progress: Update | None = None,
    device: str = "cpu",
) -> Hotness:
    """Count feature-row reads per vertex over ``epochs`` of sampled training batches.

    Uses the training sampler exactly as one training process does (``batches`` with shuffle,
    epoch by epoch, then ``sample``), so a sampler built with the same seed replays these batches.
    ``progress(done, total)`` is called after every batch.
    """
    sampler = NeighborSampler(dataset.indptr(), dataset.indices(), fanouts, device=device, seed=seed)
    train = dataset.split("train")
    counts = np.zeros(dataset.num_nodes, dtype=np.int64)
    total = epochs * num_batches(train.size, batch_size)
    done = 0
    unique = 0
    for epoch in range(epochs):
        for seeds in sampler.batches(train, batch_size, shuffle=True, epoch=epoch):
            nodes = sampler.sample(seeds).nodes.cpu().numpy()
            counts[nodes] += 1  # nodes are unique within a batch, so no np.add.at needed
            unique += nodes.size
            done += 1
            if progress is not None:
                progress(done, total)
    return Hotness(
        counts=counts,
        batches=done,
        mean_unique_per_batch=unique / done if done else 0.0,
        epochs=epochs,
        fanouts=tuple(int(f) for f in fanouts),
        batch_size=batch_size,
    )


def access_curve(counts: np.ndarray, points: Sequence[float] = CURVE_POINTS) -> list[tuple[float, float]]:
    """Share of reads caught by the hottest ``x`` of vertices (the top ceil(x * N)), per x.

    Works from a histogram of count values rather than a sort: O(N) time and O(max count) memory,
    and the same numbers as sorting the counts in descending order and taking prefix sums.
    """
    n = counts.shape[0]
    total = int(counts.sum())
    freq = np.bincount(counts)[::-1]  # vertices per count value, hottest value first
    values = np.arange(freq.size - 1, -1, -1, dtype=np.int64)
    vertices_through = np.cumsum(freq)  # vertices with count >= values[g]
    reads_through = np.cumsum(freq * values)
    curve = []
    for x in points:
        k = min(n, int(np.ceil(x * n * (1 - 1e-12))))  # x = rows / N gives back rows, not rows + 1 by rounding
        g = int(np.searchsorted(vertices_through, k))  # first group that reaches k vertices
        before = (int(vertices_through[g - 1]), int(reads_through[g - 1])) if g > 0 else (0, 0)
        reads = before[1] + (k - before[0]) * int(values[g]) if k > 0 else 0
        curve.append((float(x), reads / total if total else 0.0))
    return curve


def hottest_first(counts: np.ndarray) -> np.ndarray:
    """Vertex ids by descending count, ties by ascending id (= ``np.argsort(-counts, kind="stable")``),
    with DDAK's fast ordering (a compiled counting sort: counts are small integers)."""
    from placement.ddak import hotness_order

    return hotness_order(counts)


def sidecar(path: Path) -> Path:
    """The JSON file that accompanies a counts file."""
    return path.with_suffix(".json")


def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    """np.save through a temporary file, so readers never see half a file."""
    with atomic_file(path, binary=True) as fh:
        np.save(fh, array, allow_pickle=False)


def _read_counts(path: Path) -> np.ndarray:
    try:
        counts = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise HotnessError(f"{path}: missing (hotness counts)") from None
    except (OSError, ValueError, EOFError) as exc:
        raise HotnessError(f"{path}: not a readable .npy file ({str(exc).splitlines()[0]})") from None
    if not isinstance(counts, np.ndarray) or counts.dtype != np.int64 or counts.ndim != 1:
        raise HotnessError(
            f"{path}: counts must be a 1-D int64 array, got {getattr(counts, 'dtype', '?')} {getattr(counts, 'shape', '')}"
        )
    return counts
