"""Pre-sampling hotness: how often training will read each vertex's feature row.

``presample`` draws training batches over the train split (the trainer's fan-outs and batch
size; the trainer's sampling, compiled and several batches at once: ``placement.count_sampler``)
and counts, per vertex, the batches whose sampled vertex set contains it. A batch reads each of its unique vertices' feature rows once, so the
counts are feature-row reads: the quantity a cache placement wants to capture.

How many batches: by default (``epochs=None``) as many as the estimate needs. What a placement
takes from the counts is which rows are hottest and what share of reads the caches holding them
will catch; both come from the same sample, so the share is optimistic by as much as the ranking
is noise. ``split_half_gap`` measures that: rank the rows by one half of the sample, and compare
the share of reads the top k catch in that half with their share in the other half, at each
cache boundary k. Sampling checks this gap at 10, 20, 40, ... batches (the halves being the
batches before and after the previous check) and stops once it is at most ``TOLERANCE`` (0.005
of all reads), or after ``ADAPTIVE_EPOCHS`` epoch(s), reporting the gap it got to. ``epochs=N``
runs exactly N epochs (the gap is still measured, between the two halves, and reported).

The gap shrinks about as 1/batches on skewed graphs and more slowly on flat ones (a synthetic
IGB-layout graph of 3 M vertices, top 1% catching 2.7% of reads: 0.16 at 10 batches, 0.042 at
80, 0.014 at 320), so the batches needed are set by the graph, not by the size of an epoch: on
a large graph (IGB-full: about 20,000 batches an epoch at 60% training vertices) the estimate
converges in a fraction of one.

On disk a ``Hotness`` is two files and no pickle: the counts as ``.npy`` and the rest as a JSON
sidecar (same path, suffix ``.json``) that also records N and the total, so ``load`` can tell a
truncated, swapped or foreign file from a good one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from moment.contracts.hotness import HotnessError, HotnessMeta
from moment.fileio import atomic_file
from moment.progress import Update
from placement.count_sampler import CountSampler
from placement.dataset import Dataset

numba: ModuleType | None  # None: not installed (the same functions then run as Python)
try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; the kernels then run as Python
    numba = None

CURVE_POINTS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
TOLERANCE = 0.005  # split-half gap (share of all reads) at which the estimate counts as converged
MIN_BATCHES = 10  # the first convergence check; fewer batches rank vertices mostly by noise
ADAPTIVE_EPOCHS = 1  # the most it samples by default (the old fixed pass): never slower than that
DEFAULT_SHARE = 0.01  # the boundary checked when the caches give none: the hottest 1% of vertices
COUNT_TYPE = np.int32  # a vertex is read at most once per batch: 2^31 - 1 batches before int64 (``narrow``)
COUNT_DTYPES = ("int32", "int64")  # what a counts file may hold (int64: written before the counts were narrowed)


@dataclass
class Hotness:
    counts: np.ndarray  # int32 (int64 past 2^31 - 1), in memory and on disk, N: reads per vertex
    batches: int
    mean_unique_per_batch: float
    epochs: int
    fanouts: tuple[int, ...]
    batch_size: int
    bound: float | None = None  # split-half gap at the cache boundaries (None: too few batches to split)
    tolerance: float | None = None  # the gap adaptive sampling stopped at (None: a fixed number of epochs)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def curve(self, points: Sequence[float] = CURVE_POINTS) -> list[tuple[float, float]]:
        """(x, share of all reads that hit the hottest x of vertices) for each x in ``points``."""
        return access_curve(self.counts, points)

    def save(self, path: str | Path) -> None:
        """Write the counts to ``path`` (.npy) and the rest to its .json sidecar, each atomically."""
        path = Path(path)
        _atomic_save_npy(path, self.counts)  # as in memory: int32 where the counts fit
        HotnessMeta(
            num_nodes=int(self.counts.shape[0]),
            total=self.total,
            batches=self.batches,
            mean_unique_per_batch=float(self.mean_unique_per_batch),
            epochs=self.epochs,
            fanouts=[int(f) for f in self.fanouts],
            batch_size=self.batch_size,
            bound=self.bound,
            tolerance=self.tolerance,
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
            counts=narrow(counts),
            batches=meta.batches,
            mean_unique_per_batch=float(meta.mean_unique_per_batch),
            epochs=meta.epochs,
            fanouts=tuple(meta.fanouts),
            batch_size=meta.batch_size,
            bound=meta.bound,
            tolerance=meta.tolerance,
        )


def presample(
    dataset: Dataset,
    fanouts: Sequence[int],
    batch_size: int,
    epochs: int | None = None,
    seed: int = 0,
    progress: Update | None = None,
    boundaries: Sequence[int] = (),
    tolerance: float = TOLERANCE,
    threads: int | None = None,
) -> Hotness:
    """Count feature-row reads per vertex over sampled training batches.

    The batches are those of one training process: the train split shuffled per epoch (by
    ``(seed, epoch)``) and cut into ``batch_size`` seeds, each sampled with ``fanouts`` by
    :class:`placement.count_sampler.CountSampler` (the trainer's sampling, compiled, ``threads``
    batches at once). ``epochs=None``: until the split-half gap at ``boundaries`` (rows: the cache
    sizes, hottest first) is at most ``tolerance``, or ``ADAPTIVE_EPOCHS`` epochs; else exactly
    ``epochs``. ``progress(done, total)`` is called after every batch (``total``: the most
    batches it may take).
    """
    sampler = CountSampler(dataset.indptr(), dataset.indices(), fanouts, batch_size, seed=seed, threads=threads)
    train = np.asarray(dataset.split("train"), dtype=np.int64)
    n = dataset.num_nodes
    ks = _boundaries(boundaries, n)
    budget = epochs if epochs is not None else ADAPTIVE_EPOCHS
    per_epoch = -(-train.size // batch_size)
    total = budget * per_epoch
    counts = np.zeros(n, dtype=COUNT_TYPE)
    snapshot: np.ndarray | None = None  # the counts at the last check: the first half of the sample
    halves_at = MIN_BATCHES // 2 if epochs is None else max(1, total // 2)
    done = unique = 0
    bound = None
    for nodes in sampler.sets(seed_batches(train, batch_size, seed, budget)):
        counts[nodes] += 1  # nodes are unique within a batch, so no np.add.at needed
        unique += nodes.size
        done += 1
        if progress is not None:
            progress(done, total)
        if done == halves_at and done < total:
            if snapshot is not None:
                bound = split_half_gap(snapshot, counts, ks)
                if bound <= tolerance:
                    break  # converged
            if snapshot is None:
                snapshot = counts.copy()
            else:
                np.copyto(snapshot, counts)
            halves_at = 2 * done if epochs is None else -1
    else:  # the budget ran out: the last gap, between the sample before and after the last check
        bound = split_half_gap(snapshot, counts, ks) if snapshot is not None else None
    return Hotness(
        counts=counts,
        batches=done,
        mean_unique_per_batch=unique / done if done else 0.0,
        epochs=-(-done // per_epoch) if per_epoch else 0,
        fanouts=tuple(int(f) for f in fanouts),
        batch_size=batch_size,
        bound=bound,
        tolerance=tolerance if epochs is None else None,
    )


def seed_batches(train: np.ndarray, batch_size: int, seed: int, epochs: int) -> Iterator[np.ndarray]:
    """``epochs`` epochs of seed batches: the train ids shuffled per epoch, cut in order."""
    for epoch in range(epochs):
        order = np.random.default_rng([seed, 0, epoch]).permutation(train)
        yield from (order[a : a + batch_size] for a in range(0, order.size, batch_size))


def _boundaries(boundaries: Sequence[int], n: int) -> list[int]:
    """The cache boundaries worth checking (0 < k < N), else the hottest ``DEFAULT_SHARE``."""
    ks = sorted({int(k) for k in boundaries if 0 < int(k) < n})
    return ks or [max(1, int(n * DEFAULT_SHARE))]


def split_half_gap(first: np.ndarray, total: np.ndarray, ks: Sequence[int]) -> float:
    """How optimistic the sample's share of reads caught by the top k rows is, at most, over ``ks``.

    ``first`` counts the first half of the batches, ``total`` all of them (the second half is
    the difference). For each k: rank the rows by one half, take the share of that half's reads
    the top k catch minus the share of the other half's reads they catch, averaged over the two
    directions. Zero when the ranking is noise-free; at most the noise the caches' predicted
    share carries. O(N) per k, without temporaries of N entries."""
    first_reads = int(first.sum(dtype=np.int64))
    second_reads = int(total.sum(dtype=np.int64)) - first_reads
    if first_reads == 0 or second_reads == 0:
        return 1.0  # one half read nothing: no estimate at all
    reads = {True: (first_reads, second_reads), False: (second_reads, first_reads)}
    hists = {by_first: _half_histogram(first, total, by_first) for by_first in (True, False)}
    gaps = [0.0]
    for k in ks:
        gap = 0.0
        for by_first, hist in hists.items():
            own, other = _topk_sums(first, total, by_first, *_threshold(hist, k))
            gap += own / reads[by_first][0] - other / reads[by_first][1]
        gaps.append(gap / 2)
    return float(max(gaps))


def _threshold(hist: np.ndarray, k: int) -> tuple[int, int]:
    """(t, r): the top k rows are those counted above t plus the first r (by id) counted t."""
    above = np.cumsum(hist[::-1])[::-1]  # above[c]: rows counted >= c
    t = int(np.flatnonzero(above >= k)[-1])
    more = int(above[t + 1]) if t + 1 < above.size else 0
    return t, k - more


def _half_histogram_py(first: np.ndarray, total: np.ndarray, by_first: bool) -> np.ndarray:
    """Rows per count value of one half (``first``, or ``total - first``)."""
    hist = np.zeros(int(total.max()) + 1, dtype=np.int64)
    for v in range(total.size):
        hist[first[v] if by_first else total[v] - first[v]] += 1
    return hist


def _topk_sums_py(first: np.ndarray, total: np.ndarray, by_first: bool, t: int, r: int) -> tuple[int, int]:
    """Reads of the top rows (see ``_threshold``) in the half that ranks them and in the other."""
    own = other = taken = 0
    for v in range(total.size):
        a = first[v] if by_first else total[v] - first[v]
        if a > t or (a == t and taken < r):
            taken += a == t
            own += a
            other += total[v] - a
    return own, other


_half_histogram = numba.njit(cache=True)(_half_histogram_py) if numba is not None else _half_histogram_py
_topk_sums = numba.njit(cache=True)(_topk_sums_py) if numba is not None else _topk_sums_py


def count_type(counts: np.ndarray) -> np.dtype:
    """int32 where every count fits, else int64: the counts' type in memory and on disk."""
    if counts.dtype == COUNT_TYPE:
        return counts.dtype
    wide = counts.size and int(counts.max()) > np.iinfo(COUNT_TYPE).max
    return np.dtype(np.int64 if wide else COUNT_TYPE)


def narrow(counts: np.ndarray) -> np.ndarray:
    """Counts as int32 where they fit (half the memory of int64; a placement holds them throughout)."""
    return counts.astype(count_type(counts))  # a copy: never a view of the file


def access_curve(counts: np.ndarray, points: Sequence[float] = CURVE_POINTS) -> list[tuple[float, float]]:
    """Share of reads caught by the hottest ``x`` of vertices (the top ceil(x * N)), per x.

    Works from a histogram of count values rather than a sort: O(N) time and O(max count) memory,
    and the same numbers as sorting the counts in descending order and taking prefix sums.
    """
    n = counts.shape[0]
    total = int(counts.sum())
    freq = np.zeros(int(counts.max(initial=0)) + 1, dtype=np.int64)
    for lo in range(0, n, 1 << 20):  # np.bincount casts to int64: by slices, not an N-entry temporary
        part = np.bincount(counts[lo : lo + (1 << 20)])
        freq[: part.size] += part
    freq = freq[::-1]  # vertices per count value, hottest value first
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


def _atomic_save_npy(path: Path, counts: np.ndarray, chunk: int = 1 << 22) -> None:
    """Counts as an .npy of ``count_type`` (int32 where they fit: half of int64's bytes to write
    and hash) through a temporary file, so readers never see half a file; ``chunk`` entries at
    a time."""
    dtype = count_type(counts)
    with atomic_file(path, binary=True) as fh:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
        np.lib.format.write_array_header_1_0(fh, {**header, "shape": counts.shape})
        for lo in range(0, counts.size, chunk):
            fh.write(np.ascontiguousarray(counts[lo : lo + chunk], dtype=dtype).data)


def _read_counts(path: Path) -> np.ndarray:
    try:
        counts = np.load(path, allow_pickle=False, mmap_mode="r")  # int64 ones narrowed to int32 by the caller
    except FileNotFoundError:
        raise HotnessError(f"{path}: missing (hotness counts)") from None
    except (OSError, ValueError, EOFError) as exc:
        raise HotnessError(f"{path}: not a readable .npy file ({str(exc).splitlines()[0]})") from None
    if not isinstance(counts, np.ndarray) or counts.dtype.name not in COUNT_DTYPES or counts.ndim != 1:
        raise HotnessError(
            f"{path}: counts must be a 1-D {' or '.join(COUNT_DTYPES)} array, got {getattr(counts, 'dtype', '?')} "
            f"{getattr(counts, 'shape', '')}"
        )
    return counts
