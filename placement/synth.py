"""Synthetic power-law graphs of any size, generated out of core (``moment dataset synth``).

The model is Chung–Lu with planted communities:

* vertices come in groups of ``classes`` consecutive ids holding one vertex of every class, in a
  per-group random order (classes are spread over all id ranges, never contiguous); a group shares
  one power-law weight (Pareto, exponent ``ALPHA``, capped at √N), jittered per vertex;
* v's out-degree is 1 + Poisson((avg_degree − 1) · w_v / mean w), so E ≈ N · avg_degree;
* each neighbour u is drawn with probability ∝ weight, then with probability ``P_IN`` moved to the
  vertex of v's class in u's group: the graph is homophilous, yet in-degrees stay as skewed as the
  weights because a group shares u's weight (this skew is what makes feature accesses skewed);
* features = class centroid (norm ≈ ``SIGNAL``) + unit Gaussian noise, so features alone give a
  middling accuracy and aggregating neighbours more.

Randomness comes from streams seeded by (seed, stage, block of ``RNG_BLOCK`` vertices) or from a
counter-based hash of the vertex id, so any block can be produced on its own and the files are
byte-identical for a seed whatever ``chunk_nodes`` is. Memory is one block plus 8 bytes per vertex
(the cumulative weights that neighbour sampling searches); every array goes straight to disk.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from moment.errors import UsageError
from moment.progress import Progress
from placement.dataset import (
    FEATURE_DTYPES,
    FILES,
    Dataset,
    DatasetError,
    check_free_space,
    label_type,
    open_dataset,
    staging,
    write_manifest,
)

RNG_BLOCK = 1 << 12  # vertices per random stream: chunk_nodes is rounded to a multiple of it
EDGE_SLICE = 1 << 21  # edges sampled at once (~50 bytes each): bounds memory whatever the degrees
ALPHA = 2.2  # power-law exponent of the weights, hence of the in- and out-degrees
P_IN = 0.7  # probability that a neighbour is moved into the source's class
SIGNAL = 2.5  # norm of a class centroid, against unit noise per dimension
PERMUTATIONS = 256  # class orders that groups pick from
_STAGES = ("layout", "weight", "jitter", "degrees", "edges", "centroids", "features", "splits")
_HEADER = 128  # bytes of an .npy header (numpy pads it to 64-byte multiples; 128 is typical)


def synthesize(
    out: str | Path,
    nodes: int,
    avg_degree: float,
    dim: int,
    dtype: str = "float16",
    seed: int = 0,
    classes: int = 16,
    train_fraction: float = 0.01,
    val_fraction: float = 0.005,
    test_fraction: float = 0.005,
    chunk_nodes: int = 1 << 20,
    progress: Progress | None = None,
    replace: bool = False,
) -> Dataset:
    """Write a synthetic dataset directory at ``out`` block by block and open it.

    If ``out`` already holds the dataset these arguments generate, it is returned as it is (an
    identical re-run is a no-op); another dataset there is refused, or replaced with ``replace``."""
    spec = _Spec(
        nodes,
        float(avg_degree),
        dim,
        dtype,
        seed,
        classes,
        (train_fraction, val_fraction, test_fraction),
        _round_chunk(chunk_nodes),
    )
    spec.validate()
    out = Path(out)
    model = _Model(spec)
    same = _generated_by(out, spec, model)
    if same is not None:
        return same
    check_free_space(out, sum(estimate(nodes, avg_degree, dim, dtype, spec.fractions, spec.classes).values()))
    with staging(out, replace=replace) as tmp:
        cum = _weights(spec, model, progress)
        edges = _degrees(tmp, spec, cum, progress)
        _edges(tmp, spec, model, cum, edges, progress)
        del cum
        _features(tmp, spec, model, progress)
        _splits(tmp, spec, progress)
        write_manifest(tmp, _meta(out, spec, model, edges))
    return open_dataset(out)


def estimate(
    nodes: int,
    avg_degree: float,
    dim: int,
    dtype: str,
    fractions: tuple[float, float, float] = (0.01, 0.005, 0.005),
    classes: int = 16,
) -> dict[str, int]:
    """Expected bytes of each file (keys of ``FILES``), to check disk space before starting."""
    edges = round(nodes * avg_degree)
    split = [_HEADER + 8 * max(1, round(f * nodes)) for f in fractions]
    return {
        "indptr": _HEADER + 8 * (nodes + 1),
        "indices": _HEADER + _index_dtype(nodes).itemsize * edges,
        "features": _HEADER + nodes * dim * np.dtype(dtype).itemsize,
        "labels": _HEADER + label_type(classes).itemsize * nodes,
        "train": split[0],
        "val": split[1],
        "test": split[2],
    }


@dataclass(frozen=True)
class _Spec:
    nodes: int
    avg_degree: float
    dim: int
    dtype: str
    seed: int
    classes: int
    fractions: tuple[float, float, float]
    chunk: int

    def validate(self) -> None:
        """Reject arguments that cannot make a dataset, naming the argument (a usage error)."""
        if self.nodes < 3:
            raise UsageError(f"nodes: need at least 3 (one per split), got {self.nodes}")
        if not (math.isfinite(self.avg_degree) and self.avg_degree >= 1):
            raise UsageError(f"avg_degree: need a number >= 1 (every vertex has a neighbour), got {self.avg_degree}")
        if self.dim < 1:
            raise UsageError(f"dim: need at least 1, got {self.dim}")
        if self.dtype not in FEATURE_DTYPES:
            raise UsageError(f"dtype: expected one of {', '.join(FEATURE_DTYPES)}, got {self.dtype!r}")
        if self.classes < 2:
            raise UsageError(f"classes: need at least 2, got {self.classes}")
        if self.seed < 0:
            raise UsageError(f"seed: need a non-negative integer, got {self.seed}")
        for name, f in zip(("train", "val", "test"), self.fractions):
            if not 0 < f < 1:
                raise UsageError(f"{name}_fraction: need a number in (0, 1), got {f}")
        if sum(self.split_sizes()) > self.nodes:
            raise UsageError(f"train/val/test fractions {self.fractions} ask for more than the {self.nodes} vertices")

    def split_sizes(self) -> list[int]:
        return [max(1, round(f * self.nodes)) for f in self.fractions]


class _Model:
    """The planted structure: each vertex's class and weight, and its same-class group-mates."""

    def __init__(self, spec: _Spec) -> None:
        self.n, self.k = spec.nodes, spec.classes
        rng = _stream(spec.seed, "layout", 0)
        self.order = np.stack([rng.permutation(self.k) for _ in range(PERMUTATIONS)])  # class at each offset
        self.slot = np.argsort(self.order, axis=1)  # offset of each class
        self.cap = math.sqrt(self.n)
        self.salts = {s: _salt(spec.seed, s) for s in ("layout", "weight", "jitter")}

    def _table(self, groups: np.ndarray) -> np.ndarray:
        return (_mix(groups, self.salts["layout"]) % np.uint64(PERMUTATIONS)).astype(np.intp)

    def classes_of(self, ids: np.ndarray) -> np.ndarray:
        groups, offsets = np.divmod(ids, self.k)
        return self.order[self._table(groups), offsets]

    def weights(self, ids: np.ndarray) -> np.ndarray:
        """Pareto weight of the group (the same for its members, so a move keeps it) × jitter."""
        tail = 1.0 - _unit(ids // self.k, self.salts["weight"])  # (0, 1]
        group = np.minimum(tail ** (-1.0 / (ALPHA - 1.0)), self.cap)
        return group * (0.5 + _unit(ids, self.salts["jitter"]))

    def mates(self, ids: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """The vertex of each class in each id's group (the id itself where the last group is short)."""
        groups = ids // self.k
        mate = groups * self.k + self.slot[self._table(groups), classes]
        return np.where(mate < self.n, mate, ids)


def _weights(spec: _Spec, model: _Model, progress: Progress | None) -> np.ndarray:
    """Cumulative vertex weights (float64, 8 bytes per vertex): what neighbour draws search."""
    cum = np.empty(spec.nodes, dtype=np.float64)
    total = 0.0
    for a, b in _chunks("weights", spec.nodes, spec.chunk, progress):
        np.cumsum(model.weights(np.arange(a, b, dtype=np.int64)), out=cum[a:b])
        cum[a:b] += total
        total = float(cum[b - 1])
    return cum


def _degrees(tmp: Path, spec: _Spec, cum: np.ndarray, progress: Progress | None) -> int:
    """Draw every out-degree and write indptr; returns the edge count."""
    scale = (spec.avg_degree - 1.0) * spec.nodes / float(cum[-1])
    edges = 0
    with _Npy(tmp / FILES["indptr"], np.int64, (spec.nodes + 1,)) as indptr:
        indptr.write(np.zeros(1))
        for a, b in _chunks("degrees", spec.nodes, spec.chunk, progress):
            w = np.diff(cum[a:b], prepend=cum[a - 1] if a else 0.0)
            deg = np.empty(b - a, dtype=np.int64)
            for s, t in _rng_blocks(a, b):
                rng = _stream(spec.seed, "degrees", s // RNG_BLOCK)
                deg[s - a : t - a] = 1 + rng.poisson(w[s - a : t - a] * scale)
            ends = edges + np.cumsum(deg)
            indptr.write(ends)
            edges = int(ends[-1])
    return edges


def _edges(tmp: Path, spec: _Spec, model: _Model, cum: np.ndarray, edges: int, progress: Progress | None) -> None:
    """Sample every row's neighbours, slice by slice, straight into indices.npy."""
    indptr = np.load(tmp / FILES["indptr"], mmap_mode="r")
    with _Npy(tmp / FILES["indices"], _index_dtype(spec.nodes), (edges,)) as indices:
        for a, b in _chunks("edges", spec.nodes, spec.chunk, progress):
            ptr = np.asarray(indptr[a : b + 1])
            for s, t in _edge_slices(a, b, ptr):
                indices.write(_sample(spec, model, cum, s, ptr[s - a : t - a + 1]))


def _edge_slices(a: int, b: int, ptr: np.ndarray) -> Iterator[tuple[int, int]]:
    """Runs of whole RNG blocks in [a, b) holding at most EDGE_SLICE edges (or a single block)."""
    start = a
    for s, t in _rng_blocks(a, b):
        if s > start and ptr[t - a] - ptr[start - a] > EDGE_SLICE:
            yield start, s
            start = s
    yield start, b


def _sample(spec: _Spec, model: _Model, cum: np.ndarray, a: int, ptr: np.ndarray) -> np.ndarray:
    """Neighbours of vertices a .. a+len(ptr)-2: weighted draws, a share moved into the source's class."""
    base, m = int(ptr[0]), int(ptr[-1] - ptr[0])
    draw = np.empty(m, dtype=np.float64)
    move = np.empty(m, dtype=bool)
    for s, t in _rng_blocks(a, a + len(ptr) - 1):
        lo, hi = ptr[s - a] - base, ptr[t - a] - base
        rng = _stream(spec.seed, "edges", s // RNG_BLOCK)
        draw[lo:hi] = rng.random(hi - lo)
        move[lo:hi] = rng.random(hi - lo) < P_IN
    draw *= cum[-1]
    order = np.argsort(draw)  # sorted keys make the search cache-friendly (~10x faster)
    target = np.empty(m, dtype=np.int64)
    target[order] = np.searchsorted(cum, draw[order], side="right")
    del draw, order
    np.minimum(target, spec.nodes - 1, out=target)  # a draw that rounds up to the total weight
    source_class = np.repeat(model.classes_of(np.arange(a, a + len(ptr) - 1, dtype=np.int64)), np.diff(ptr))
    target[move] = model.mates(target[move], source_class[move])
    return target


def _features(tmp: Path, spec: _Spec, model: _Model, progress: Progress | None) -> None:
    """Labels and features (centroid of the class + unit noise), one RNG block of rows at a time."""
    centroids = _stream(spec.seed, "centroids", 0).standard_normal((spec.classes, spec.dim)).astype(np.float32)
    centroids *= SIGNAL / math.sqrt(spec.dim)
    with (
        _Npy(tmp / FILES["labels"], label_type(spec.classes), (spec.nodes,)) as labels,
        _Npy(tmp / FILES["features"], spec.dtype, (spec.nodes, spec.dim)) as features,
    ):
        for a, b in _chunks("features", spec.nodes, spec.chunk, progress):
            for s, t in _rng_blocks(a, b):
                cls = model.classes_of(np.arange(s, t, dtype=np.int64))
                rng = _stream(spec.seed, "features", s // RNG_BLOCK)
                rows = rng.standard_normal((t - s, spec.dim), dtype=np.float32)
                rows += centroids[cls]
                labels.write(cls)
                features.write(rows)


def _splits(tmp: Path, spec: _Spec, progress: Progress | None) -> None:
    """Disjoint random splits of exact sizes, ascending, without a permutation of all N.

    Each RNG block takes a hypergeometric share of what is left of each split, then shuffles it:
    exactly a uniformly random choice of disjoint subsets, written in id order.
    """
    sizes = spec.split_sizes()
    remaining = np.array([*sizes, spec.nodes - sum(sizes)], dtype=np.int64)
    rng = _stream(spec.seed, "splits", 0)
    with ExitStack() as stack:
        files = [
            stack.enter_context(_Npy(tmp / FILES[key], np.int64, (size,)))
            for key, size in zip(("train", "val", "test"), sizes)
        ]
        for a, b in _chunks("splits", spec.nodes, spec.chunk, progress):
            for s, t in _rng_blocks(a, b):
                counts = rng.multivariate_hypergeometric(remaining, t - s, method="marginals")
                remaining -= counts
                which = np.repeat(np.arange(4), counts)
                rng.shuffle(which)
                for k, file in enumerate(files):
                    file.write(s + np.flatnonzero(which == k))


class _Npy:
    """An .npy file written front to back: the header, then blocks as they come.

    Plain writes rather than a memory map keep resident memory at one block, however large the file.
    """

    def __init__(self, path: Path, dtype: DTypeLike, shape: tuple[int, ...]) -> None:
        self.dtype = np.dtype(dtype)
        self.fh = open(path, "wb")  # noqa: SIM115 - closed by __exit__
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(self.fh, header)

    def write(self, block: np.ndarray) -> None:
        self.fh.write(np.ascontiguousarray(block, dtype=self.dtype).data)

    def __enter__(self) -> _Npy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.fh.close()


def _meta(out: Path, spec: _Spec, model: _Model, edges: int) -> dict[str, Any]:
    return {
        "name": out.absolute().name,
        "num_nodes": spec.nodes,
        "num_edges": edges,
        "feature_dim": spec.dim,
        "feature_dtype": spec.dtype,
        "num_classes": spec.classes,
        "directed": True,  # statistically symmetric (Chung-Lu), but reverse edges are not mirrored
        "generator": {
            "kind": "chung-lu",
            "seed": spec.seed,
            "avg_degree": spec.avg_degree,
            "alpha": ALPHA,
            "weight_cap": model.cap,
            "p_in": P_IN,
            "signal": SIGNAL,
            "fractions": list(spec.fractions),
            "rng_block": RNG_BLOCK,
        },
    }


def _generated_by(out: Path, spec: _Spec, model: _Model) -> Dataset | None:
    """The dataset at ``out`` if these arguments generated it (same generator record), else None."""
    if not (out / "dataset.json").is_file() or (out.with_name(out.name + ".partial")).exists():
        return None
    try:
        ds = open_dataset(out)
    except DatasetError:
        return None
    want = _meta(out, spec, model, ds.num_edges)
    keys = ("num_nodes", "feature_dim", "feature_dtype", "num_classes", "generator")
    return ds if all(ds.meta.get(k) == want[k] for k in keys) else None


def _chunks(stage: str, n: int, size: int, progress: Progress | None) -> Iterator[tuple[int, int]]:
    """[a, b) blocks of ``size`` ids, each reported done (the CLI draws one bar per stage)."""
    if progress:
        progress(stage, 0, n)
    for a in range(0, n, size):
        b = min(a + size, n)
        yield a, b
        if progress:
            progress(stage, b, n)


def _rng_blocks(a: int, b: int) -> Iterator[tuple[int, int]]:
    """The RNG blocks in [a, b); a is always a block start."""
    for s in range(a, b, RNG_BLOCK):
        yield s, min(s + RNG_BLOCK, b)


def _round_chunk(chunk_nodes: int) -> int:
    if chunk_nodes < 1:
        raise UsageError(f"chunk_nodes: need at least 1, got {chunk_nodes}")
    return -(-chunk_nodes // RNG_BLOCK) * RNG_BLOCK


def _stream(seed: int, stage: str, block: int) -> np.random.Generator:
    return np.random.default_rng([seed, _STAGES.index(stage), block])


def _salt(seed: int, stage: str) -> np.uint64:
    return np.random.SeedSequence([seed, _STAGES.index(stage)]).generate_state(1, np.uint64)[0]


def _mix(keys: np.ndarray, salt: np.uint64) -> np.ndarray:
    """splitmix64 of key ^ salt: random numbers addressed by id, so blocks need no shared state."""
    z = keys.astype(np.uint64) ^ salt
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _unit(keys: np.ndarray, salt: np.uint64) -> np.ndarray:
    """Uniform [0, 1) addressed by key."""
    return (_mix(keys, salt) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _index_dtype(nodes: int) -> np.dtype:
    return np.dtype(np.int32 if nodes < 2**31 else np.int64)
