"""Stored samples of a packed placement (``moment place --pack``): the replayed training batches,
as the trainer's sampler drew them, kept so that training loads them instead of sampling
(DiskGNN's offline sampling: a step then only reads features).

The replay samples every batch of the first ``--pack-epochs`` epochs once
(:func:`placement.pack.replay_samples`) and writes it here; both packing passes then read the
batches' vertices back (:meth:`StoredSamples.nodes_of`) instead of sampling again. Three files in
the placed directory, each a ``files`` entry of the manifest (size, checksum: ``moment verify``
checks them, and re-samples the first batch to compare), no pickle:

* ``samples_nodes.bin``: every batch's vertices (``SampledBatch.nodes``: its seeds, then each
  hop's new vertices), batch after batch, as ``node_dtype`` (int32 where the ids fit);
* ``samples_edges.bin`` (int32): per batch, hop by hop in sampling order (the seeds' hop first):
  each target's number of sampled neighbours, then each sampled edge's source as a position in
  the batch's vertices. The sampler emits a hop's edges target by target, so the counts give
  the targets (``edge_index`` row 1);
* ``samples_index.npy`` (int64, a row per batch): the vertices gathered after 0, 1, ... hops
  (the first is the seeds, the last all of them), then each hop's edges.

They lie in the placed directory, not beside the SSD bins, and do not count against
``--pack-budget`` (the disk the feature copies may take); ``moment place`` reports their size.
The trainer loads a batch only where its seeds are the stored batch's (the same seed, ranks and
batch size draw the same permutation) and its fan-outs the replayed ones; otherwise it samples.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moment import faults
from moment.contracts.placed import PlacedError, SampleFiles
from moment.progress import Update
from moment.ssd_reads import span_pages
from placement import relabel as rl

if TYPE_CHECKING:
    import torch

    from placement.placed import Placed
    from placement.sampler import SampledBatch

# each file's role -> its key in the manifest's ``files`` and its name in the placed directory
KEYS = {"nodes": "samples_nodes", "edges": "samples_edges", "index": "samples_index"}
FILES = {KEYS["nodes"]: "samples_nodes.bin", KEYS["edges"]: "samples_edges.bin", KEYS["index"]: "samples_index.npy"}
EDGE_DTYPE = np.dtype(np.int32)


def record(
    data: Path,
    batches: Iterable[SampledBatch],
    hops: int,
    node_dtype: np.dtype,
    progress: Update | None = None,
    total: int = 0,
) -> SampleFiles:
    """Write ``batches`` (CPU tensors) into ``data``'s sample files, streamed (one batch in
    memory), fsync'ed; what the manifest records of them."""
    rows = []
    path = {role: data / FILES[key] for role, key in KEYS.items()}
    with open(path["nodes"], "wb") as nodes, open(path["edges"], "wb") as edges:
        for i, batch in enumerate(batches):
            sampled = batch.blocks[::-1]  # sampling order: the seeds' hop first
            for b in sampled:
                src, dst = b.edge_index[0].numpy(), b.edge_index[1].numpy()
                edges.write(memoryview(np.bincount(dst, minlength=b.num_dst).astype(EDGE_DTYPE)))
                edges.write(memoryview(src.astype(EDGE_DTYPE)))
            nodes.write(memoryview(np.ascontiguousarray(batch.nodes.numpy(), dtype=node_dtype)))
            levels = [sampled[0].num_dst] + [b.num_src for b in sampled]
            rows.append(levels + [b.edge_index.shape[1] for b in sampled])
            if progress is not None:
                progress(i + 1, max(total, i + 1))
            if i == 0:
                faults.point("place:sampling")  # a batch written, the others not
        for fh in (nodes, edges):
            fh.flush()
            os.fsync(fh.fileno())
    index = np.array(rows, dtype=np.int64).reshape(-1, 2 * hops + 1)
    with open(path["index"], "wb") as fh:
        np.save(fh, index, allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
    return SampleFiles.model_validate(
        {
            **KEYS,
            "node_dtype": np.dtype(node_dtype).name,
            "hops": hops,
            "batches": len(rows),
            "bytes": sum(p.stat().st_size for p in path.values()),
        }
    )


def present(data: Path, files: SampleFiles) -> bool:
    """Whether the sample files a killed run recorded are all still in ``data``, at their size."""
    try:
        return sum((data / name).stat().st_size for name in FILES.values()) == files.bytes
    except OSError:
        return False


class StoredSamples:
    """The stored samples of a placed (or staging) directory, mapped, read a batch at a time."""

    def __init__(self, files: SampleFiles, paths: dict[str, Path]) -> None:
        """``paths``: each file (by role: nodes, edges, index)."""
        self.paths = paths
        self.hops, self.dtype = files.hops, np.dtype(files.node_dtype)
        self.index = np.load(paths["index"])
        if self.index.shape != (files.batches, 2 * self.hops + 1):
            raise PlacedError(
                f"{paths['index']}: {self.index.shape} entries, the manifest says ({files.batches}, {2 * self.hops + 1})"
            )
        levels, counts = self.index[:, : self.hops + 1], self.index[:, self.hops + 1 :]
        self.node_at = np.concatenate(([0], np.cumsum(levels[:, -1])))
        self.edge_at = np.concatenate(([0], np.cumsum(levels[:, :-1].sum(axis=1) + counts.sum(axis=1))))
        self.loaded = 0  # batches ``batch`` returned
        # bytes of the pages ``batch`` read of each file (a key of placed.json ``files``): what a
        # batch loaded instead of sampled reads from disk (metrics.json ``placed_read_bytes``)
        self.keys = {"nodes": files.nodes, "edges": files.edges}
        self.read_bytes = dict.fromkeys(self.keys.values(), 0)
        self.nodes = _mapped(paths["nodes"], self.dtype, int(self.node_at[-1]))
        self.edges = _mapped(paths["edges"], EDGE_DTYPE, int(self.edge_at[-1]))

    @classmethod
    def in_dir(cls, data: Path, files: SampleFiles) -> StoredSamples:
        """The samples ``record`` wrote into ``data`` (a staging directory)."""
        return cls(files, {role: data / FILES[key] for role, key in KEYS.items()})

    @classmethod
    def of(cls, placed: Placed) -> StoredSamples | None:
        """A placed dataset's stored samples (None: it has none)."""
        pack = placed.manifest.pack
        if pack is None or pack.samples is None:
            return None
        return cls(pack.samples, {role: placed.file(key) for role, key in zip(KEYS, pack.samples.keys)})

    @property
    def batches(self) -> int:
        return int(self.index.shape[0])

    def nodes_of(self, i: int) -> np.ndarray:
        """Batch ``i``'s vertices (seeds first)."""
        return np.asarray(self.nodes[self.node_at[i] : self.node_at[i + 1]])

    def pages(self) -> dict[str, np.ndarray]:
        """Per file key, the bytes of the pages loading each batch reads of it (its vertices and
        its edges, each one slice): the replay's count, :meth:`batch`'s when it loads them all."""
        nodes, edges = self.node_at * self.dtype.itemsize, self.edge_at * EDGE_DTYPE.itemsize
        return {
            self.keys["nodes"]: span_pages(nodes[:-1], np.diff(nodes)),
            self.keys["edges"]: span_pages(edges[:-1], np.diff(edges)),
        }

    def _read(self, role: str, first: int, count: int, itemsize: int) -> None:
        self.read_bytes[self.keys[role]] += int(span_pages(first * itemsize, count * itemsize))

    def all_nodes(self) -> Iterator[np.ndarray]:
        """Every batch's vertices, in replay order."""
        return (self.nodes_of(i) for i in range(self.batches))

    def batch(self, i: int, seeds: torch.Tensor | None = None) -> SampledBatch | None:
        """Batch ``i`` as the sampler returned it (CPU tensors); None where ``i`` is not a stored
        batch or ``seeds`` (given) are not its seeds."""
        import torch

        from placement.sampler import SampledBatch, SampledBlock

        if not 0 <= i < self.batches:
            return None
        row = self.index[i]
        levels, counts = row[: self.hops + 1], row[self.hops + 1 :]
        nodes = self.nodes_of(i)
        if seeds is not None and seeds.numel() != levels[0]:
            return None
        if seeds is not None and not np.array_equal(nodes[: levels[0]], seeds.numpy()):
            self._read("nodes", int(self.node_at[i]), int(levels[0]), self.dtype.itemsize)  # the seeds compared
            return None
        self._read("nodes", int(self.node_at[i]), nodes.size, self.dtype.itemsize)
        self._read("edges", int(self.edge_at[i]), int(self.edge_at[i + 1] - self.edge_at[i]), EDGE_DTYPE.itemsize)
        at = int(self.edge_at[i])
        blocks = []
        for k in range(self.hops):
            targets, n = int(levels[k]), int(counts[k])
            per = np.asarray(self.edges[at : at + targets], dtype=np.int64)
            src = np.asarray(self.edges[at + targets : at + targets + n], dtype=np.int64)
            if int(per.sum()) != n or bool((per < 0).any()):
                raise PlacedError(
                    f"{self.paths['edges']}: batch {i}'s hop {k + 1} counts {int(per.sum())} edges, its index {n}: damaged"
                )
            # numpy, not torch: torch splits these over its intra-op threads, which spin where the
            # cores are busy training (this runs on the prefetch thread)
            dst = np.repeat(np.arange(targets, dtype=np.int64), per)
            edge_index = torch.from_numpy(np.stack([src, dst]))
            blocks.append(SampledBlock(edge_index, num_dst=targets, num_src=int(levels[k + 1])))
            at += targets + n
        blocks.reverse()
        self.loaded += 1
        ids = torch.from_numpy(np.asarray(nodes, dtype=np.int64))
        return SampledBatch(ids[: levels[0]], ids, blocks)


def _mapped(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if path.stat().st_size != count * dtype.itemsize:
        raise PlacedError(f"{path}: {path.stat().st_size} bytes, its index says {count * dtype.itemsize}")
    if count == 0:  # an empty file cannot be mapped
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def check(placed: Placed) -> int:
    """``moment verify``: the first stored batch against the trainer's sampler drawing it again
    (the files' checksums are checked with every other file's); the batches stored. A sample
    that is not the replay's (a bug in writing it, another sampler) is one line."""
    import torch

    from placement.pack import replay_samples

    stored, pack = StoredSamples.of(placed), placed.manifest.pack
    if stored is None or pack is None or stored.batches == 0:
        return 0 if stored is None else stored.batches
    indptr, indices, train = (placed.array(k) for k in ("indptr", "indices", "train"))
    live = next(replay_samples(indptr, indices, train, pack.fanouts, pack.batch_size, pack.seed, 1, pack.ranks))
    got = stored.batch(0)
    same = (
        got is not None
        and torch.equal(got.nodes, live.nodes)
        and len(got.blocks) == len(live.blocks)
        and all(
            (a.num_dst, a.num_src) == (b.num_dst, b.num_src) and torch.equal(a.edge_index, b.edge_index)
            for a, b in zip(got.blocks, live.blocks)
        )
    )
    if not same:
        raise PlacedError(
            f"{placed.file(pack.samples.nodes if pack.samples else '')}: the first stored batch is not the one the "
            "trainer's sampler draws: run `moment place` again"
        )
    return stored.batches


def bytes_bound(batches: int, batch_size: int, fanouts: list[int], unique: float, num_nodes: int) -> int:
    """At most the bytes :func:`record` writes for ``batches`` batches (the free-space check's
    figure): ``unique`` vertices each (pre-sampling's mean), and per hop a count per target and
    at most ``fanout`` edges each, targets at most ``batch_size`` × the fan-outs so far + 1."""
    node_bytes = np.dtype(rl.id_type(num_nodes)).itemsize
    targets, edges = float(batch_size), 0.0
    for f in fanouts:
        edges += min(targets, unique, num_nodes) * (1 + f)
        targets *= 1 + f
    return int(batches * (unique * node_bytes + EDGE_DTYPE.itemsize * edges)) + 128 * (batches + 1)
