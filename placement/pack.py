"""Packed SSD bins (``moment place --pack``): the rows one batch reads, laid out together.

A feature row smaller than a page, read at random, moves its whole 4 KiB page (a 512-byte row
eight times its bytes: :mod:`moment.ssd_reads`). DiskGNN removes this by sampling the coming
epochs' batches offline and packing the rows each batch needs contiguously on disk. Here the
placement replays the trainer's own batches for the first ``epochs`` epochs (same sampler, seed,
fan-outs, batch size and ranks: :func:`placement.sampler.train_draw_seed`) over the dataset's
graph (sampled once and stored, :mod:`placement.samples`: the trainer loads them, and the passes
below read their vertices back), and gives every SSD row its position in its bin's file in the order batches first read it
(then by the second batch that reads it, so rows a later batch reads again lie together inside
the earlier batch's group; then by id); rows no replayed batch read follow in id order. Vertex ids do not
change, so the trainer's batches are the ones replayed: each packed bin gets a slot map
(``pack_<bin>.npy``: the file row of each of its rows, in id order) that the feature store and
``moment verify`` read through. A row read by three or more batches lies where the first two
put it; the others read it there. Where many batches read the same rows, :mod:`placement.chunks`
(``--pack-budget``) does better with extra disk: per-batch copies and a shared cache.

The replay also counts what its batches move from the SSDs, page by page (the readers' count,
:func:`moment.ssd_reads.pages_read`), packed and unpacked, and the reads (runs of consecutive
file rows): the prediction's amplification and read size (``Workload.ssd_pack_amplification``,
``ssd_pack_bytes``), which the trainer's page count is compared with.

A packed bin is written from its unpacked copy (the one-pass bin writer's output) in file order,
checksummed on the way; the copy is removed once every packed bin and the state saying so are on
disk, so a killed run resumes without redoing either pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moment.contracts.placed import PackSummary
from moment.fileio import atomic_write_text
from moment.progress import Update
from moment.ssd_reads import pages_read
from placement.digests import PLACED_DIGEST, UNRECORDED_DIGEST, new_hasher
from placement.samples import present
from placement.writer import CHUNK_BYTES, Written

if TYPE_CHECKING:
    from placement.sampler import SampledBatch

STATE = "pack-state.json"  # in the staging directory: the packed bins, once all are written


def replay_samples(
    indptr: np.ndarray,
    indices: np.ndarray,
    train: np.ndarray,
    fanouts: Sequence[int],
    batch_size: int,
    seed: int,
    epochs: int,
    ranks: int,
) -> Iterator[SampledBatch]:
    """Every training batch of ``epochs`` epochs on ``ranks`` ranks (dataset ids), as the trainer
    samples them on the CPU (``trainer.loop``: the base sampler's permutation, each rank's
    strided share, that rank's draws), epoch by epoch, rank by rank."""
    from placement.sampler import NeighborSampler, train_draw_seed  # torch: only when packing

    base = NeighborSampler(indptr, indices, fanouts, seed=seed)
    for epoch in range(epochs):
        for rank in range(ranks):
            draws = NeighborSampler(base.indptr, base.indices, fanouts, seed=train_draw_seed(seed, epoch, rank))
            seeds = base.batches(
                train, batch_size, shuffle=True, epoch=epoch, rank=rank, world_size=ranks, drop_last_uneven=True
            )
            for batch in seeds:
                yield draws.sample(batch)


def replay_batches(train: int, batch_size: int, epochs: int, ranks: int) -> int:
    """Batches :func:`replay_samples` yields."""
    from placement.sampler import num_batches  # torch: only when packing

    return epochs * ranks * num_batches(train, batch_size, ranks, drop_last_uneven=True)


@dataclass
class PackPlan:
    slots: list[np.ndarray]  # per SSD bin: the file row of each of its rows (in id order)
    batches: int
    useful_bytes: int  # feature bytes of the SSD rows the replayed batches read
    unpacked_bytes: int  # pages those reads move with rows in id order
    packed_bytes: int  # ... and with the packed layout
    reads: int  # runs of consecutive file rows read in the packed layout


def pages_and_runs(rows: np.ndarray, row_bytes: int) -> tuple[int, int]:
    """Bytes of the pages reads of sorted, unique file ``rows`` touch, and the runs they form."""
    if rows.size == 0:
        return 0, 0
    starts = np.flatnonzero(np.diff(rows) != 1) + 1
    first = np.concatenate(([0], starts))
    lengths = np.diff(np.append(first, rows.size))
    return pages_read(rows[first] * row_bytes, lengths * row_bytes), int(first.size)


NEVER = np.iinfo(np.int32).max  # the batch that reads a row no replayed batch reads (batches: int32)


class SsdRows:
    """The SSD bins (consecutive id ranges ``starts``/``counts``) as one row space: row
    ``id - starts[0]``; bin ``b`` holds rows ``[local[b], local[b] + sizes[b])``."""

    def __init__(self, starts: Sequence[int], counts: Sequence[int]) -> None:
        self.base = int(starts[0]) if len(starts) else 0
        self.local = np.asarray(starts, dtype=np.int64) - self.base
        self.sizes = np.asarray(counts, dtype=np.int64)
        self.total = int(self.sizes.sum())

    def of(self, nodes: np.ndarray) -> np.ndarray:
        """The sorted SSD rows of a batch's vertices (the others dropped)."""
        nodes = np.asarray(nodes)
        return np.sort(nodes[(nodes >= self.base) & (nodes < self.base + self.total)].astype(np.int64)) - self.base

    def split(self, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """Sorted rows ``ids`` bin by bin: (bin, its rows as bin rows), bins without rows skipped."""
        k = np.searchsorted(self.local, ids, side="right") - 1
        edges = np.searchsorted(k, np.arange(len(self.sizes) + 1))
        for b in np.flatnonzero(np.diff(edges)):
            yield int(b), ids[edges[b] : edges[b + 1]] - self.local[b]


@dataclass
class Readers:
    """Per SSD row: the first and second replayed batch that read it (NEVER: none), how many did
    and, with ``hashes``, its MinHash signature; the (batch, SSD bin) pairs with rows."""

    first: np.ndarray
    second: np.ndarray
    count: np.ndarray
    pairs: int = 0  # (batch, bin) pairs where the batch reads rows of the bin
    signature: np.ndarray | None = None  # (hashes, rows) int32: min over the row's readers of each hash


MINHASH_PRIME = (1 << 31) - 1  # the hashes (a·batch + b) mod p are < 2³¹: int32


def minhashes(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` universal hashes of batch numbers, (a·i + b) mod p, drawn from ``seed`` (placements
    are reproducible): their a and b."""
    rng = np.random.default_rng([seed, 0x6D696E68])  # its own stream: not the sampler's draws
    return rng.integers(1, MINHASH_PRIME, k, dtype=np.int64), rng.integers(0, MINHASH_PRIME, k, dtype=np.int64)


def readers(
    batches: Iterable[np.ndarray],
    rows: SsdRows,
    progress: Update | None = None,
    total: int = 0,
    hashes: int = 0,
    seed: int = 0,
) -> tuple[Readers, int]:
    """The replay's first pass: who reads each SSD row (with ``hashes`` > 0, also the MinHash
    signature of its set of readers); and the batches there were."""
    first = np.full(rows.total, NEVER, dtype=np.int32)
    second = first.copy()
    count = np.zeros(rows.total, dtype=np.int32)
    signature = np.full((hashes, rows.total), MINHASH_PRIME, dtype=np.int32) if hashes else None
    a, b = minhashes(hashes, seed)
    done = pairs = 0
    for i, nodes in enumerate(batches):
        ids = rows.of(nodes)
        seen = first[ids] != NEVER
        again = ids[seen]
        second[again[second[again] == NEVER]] = i
        first[ids[~seen]] = i
        count[ids] += 1
        if signature is not None:
            h = ((a * i + b) % MINHASH_PRIME).astype(np.int32)
            signature[:, ids] = np.minimum(signature[:, ids], h[:, None])
        pairs += np.unique(np.searchsorted(rows.local, ids, side="right")).size
        done += 1
        if progress is not None:
            progress(done, max(2 * total, 2 * done))
    return Readers(first, second, count, pairs, signature), done


def minhash_order(who: Readers, rows: np.ndarray) -> np.ndarray:
    """``rows`` ordered by their MinHash signatures (HashOrder): rows whose sets of readers are
    alike (equal hashes, with a chance of their sets' Jaccard similarity) lie together, so a
    batch's rows share pages with rows of batches that read much the same; then as given."""
    assert who.signature is not None, "readers(hashes=...) computes the signatures"
    sig = who.signature[:, rows]
    return rows[np.lexsort((np.arange(rows.size), *sig[::-1]))]  # primary: the first hash


def first_reader_order(who: Readers, rows: np.ndarray) -> np.ndarray:
    """``rows`` (of the row space) ordered by the first batch that reads them, then the second
    (rows a later batch reads again lie together inside the earlier batch's group), then as given."""
    return rows[np.lexsort((who.second[rows], who.first[rows]))]  # stable: ties keep their order


def plan_pack(
    batches: Callable[[], Iterable[np.ndarray]],
    starts: Sequence[int],
    counts: Sequence[int],
    row_bytes: int,
    progress: Update | None = None,
    total: int = 0,
) -> PackPlan:
    """File rows of the SSD bins (consecutive id ranges ``starts``/``counts``) for the batches
    ``batches()`` yields (called twice: once to order, once to count), and what they move.

    Rows are ordered by the first batch that reads them, then by the second (so the rows a later
    batch reads again lie together inside the earlier batch's group), then by id; rows no batch
    reads come last."""
    rows = SsdRows(starts, counts)
    who, done = readers(batches(), rows, progress, total)
    slot = np.empty(rows.total, dtype=np.int64)
    for b in range(len(rows.sizes)):
        lo = int(rows.local[b])
        order = first_reader_order(who, np.arange(lo, lo + rows.sizes[b]))
        slot[order] = np.arange(rows.sizes[b])
    plan = PackPlan([slot[lo : lo + n].copy() for lo, n in zip(rows.local, rows.sizes)], 0, 0, 0, 0, 0)
    for nodes in batches():
        ids = rows.of(nodes)
        for b, part in rows.split(ids):
            plan.unpacked_bytes += pages_and_runs(part, row_bytes)[0]
            counted(plan, pages_and_runs(np.sort(slot[part + rows.local[b]]), row_bytes))
        batch_counted(plan, ids.size * row_bytes, progress, done, total)
    return plan


def counted(plan: Any, moved_runs: tuple[int, int]) -> None:
    """Add packed reads (bytes moved, runs) to a plan's count."""
    plan.packed_bytes += moved_runs[0]
    plan.reads += moved_runs[1]


def batch_counted(plan: Any, useful: int, progress: Update | None, done: int, total: int) -> None:
    """One more batch counted (its ``useful`` feature bytes) in the replay's second pass."""
    plan.useful_bytes += useful
    plan.batches += 1
    if progress is not None:
        progress(done + plan.batches, max(2 * total, done + plan.batches))


def write_packed(src: Path, dst: Path, name: str, slots: np.ndarray, row_bytes: int) -> Written:
    """``dst``: the rows of ``src`` (in id order) at the file rows ``slots`` says, written front
    to back, checksummed on the way and fsync'ed."""
    order = np.empty_like(slots)
    order[slots] = np.arange(slots.size, dtype=slots.dtype)  # the id-order row at each file row
    rows = (  # (an empty file cannot be mapped)
        np.memmap(src, dtype=np.uint8, mode="r", shape=(slots.size, row_bytes))
        if slots.size
        else np.empty((0, row_bytes), dtype=np.uint8)
    )
    step = max(1, CHUNK_BYTES // row_bytes)
    hasher = new_hasher(PLACED_DIGEST)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb", buffering=0) as fh:
        for at in range(0, slots.size, step):
            block = np.ascontiguousarray(rows[order[at : at + step]])
            view = memoryview(block.reshape(-1))
            hasher.update(view)
            while len(view):
                view = view[fh.write(view) :]
        os.fsync(fh.fileno())
    size = dst.stat().st_size
    if size != slots.size * row_bytes:
        raise RuntimeError(f"{dst}: wrote {size} bytes, expected {slots.size * row_bytes}")
    return Written(name, dst, size, hasher.hexdigest(), PLACED_DIGEST)


def save_state(work: Path, key: str, written: list[Written], summary: PackSummary) -> None:
    files = [{**asdict(w), "path": str(w.path)} for w in written]
    state = {"key": key, "written": files, "summary": summary.model_dump(mode="json")}
    atomic_write_text(work / STATE, json.dumps(state))


def load_state(work: Path, key: str) -> tuple[list[Written], PackSummary] | None:
    """The packed bins and summary a killed run finished, if it was for these inputs and every
    bin it lists is still there at its size."""
    try:
        state = json.loads((work / STATE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("key") != key:
        return None
    written = [  # a state written before it recorded the algorithm: SHA-256, the only one then
        Written(w["name"], Path(w["path"]), int(w["bytes"]), w["digest"], w.get("algorithm", UNRECORDED_DIGEST))
        for w in state["written"]
    ]
    summary = PackSummary.model_validate(state["summary"])
    files = [(w.path, w.bytes) for w in written]
    for c in summary.chunks.bins.values() if summary.chunks else ():  # written under their .partial names
        files += [(_partial(work, f.path), f.bytes) for f in (c.chunks, c.shared)]
    if any(not path.is_file() or path.stat().st_size != size for path, size in files):
        return None
    if summary.samples is not None and not present(work, summary.samples):
        return None
    return written, summary


def _partial(work: Path, path: str) -> Path:
    final = Path(path) if Path(path).is_absolute() else work / path
    return final.with_name(final.name + ".partial")
