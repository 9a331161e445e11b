"""Out-of-core, layer-wise, full-neighbourhood inference: embeddings and predictions for every vertex.

A sampled model is run over the *whole* in-neighbourhood of every vertex, one layer at a time
(the ATLAS / PyG ``BasicGNN.inference`` scheme), so nothing needs all vertices' activations in
memory:

* stage ``l`` (layer ``l + 1``) walks the destination vertices in chunks of ``batch_size`` new
  ids; for chunk ``D = [a, b)`` it reads the CSR rows of ``D`` (the in-neighbours), makes the
  bipartite graph whose sources are ``D`` itself first (so GAT's self loops and SAGE's root
  weight see the chunk's own rows) followed by its outside neighbours, gathers their rows of the
  previous layer — layer 0: the tiered feature store (GPU/CPU caches, SSD bins); later layers:
  the previous stage's memory-mapped ``.npy`` on disk — and writes the chunk's output rows into
  this stage's ``.npy``. Memory per chunk: its sources' rows, never N × hidden.
* the last stage (``export``) writes the arrays users get in **original** vertex ids (the
  placement relabelled them): ``embeddings.npy`` (the last hidden layer, after its ReLU: what the
  output layer reads), ``predictions.npy`` (argmax of the logits, int64), and with
  ``layers="all"`` ``logits.npy`` and every earlier hidden layer ``layerK.npy``.

Two engines compute a layer (``--engine``): ``broadcast`` (:mod:`trainer.broadcast`, the default
where the layer has a scatter form: SAGE) streams the layer's input once (a rank whose
destinations' sums do not fit ``--memory`` takes several partitions: the later ones stream the
messages the first relayed) and scatters messages into the destinations; ``gather`` (above, the reference; GAT, whose
attention needs each destination's in-edges together) gathers each chunk's in-neighbours. For
a broadcast layer a "chunk" below is a destination partition, sized from ``--memory``.

Ranks split each stage's vertices into contiguous ranges, one per rank, with a barrier between
stages: either separate processes (``python -m trainer.infer`` under torchrun, gloo barriers)
or, in one process, a loop over the ranks (:func:`run_in_process`).

Crash safety: the work happens in ``OUT.partial/data`` (``moment.outputs.Staging``). After each
chunk the rank flushes its rows and records ``(stage, chunks done)`` in its own progress file;
a re-run with the same inputs continues from there and writes the same bytes (the chunking is
fixed by the inputs, so every chunk is computed the same way; on the CPU, whose kernels are
deterministic: CUDA's scatter sums add in no fixed order, so there the last bits may differ).
``inference.json`` is written last, then the directory is published by one rename.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment import faults, procs
from moment.contracts.checkpoint import CheckpointError, DataIdentity
from moment.contracts.inference import (
    MANIFEST,
    ArrayEntry,
    InferenceError,
    InferenceManifest,
    LayerPrediction,
    LayerThroughput,
)
from moment.contracts.plan import PlanDoc, read_plan
from moment.errors import MomentError, UsageError
from moment.fileio import atomic_write_text, disk_read_bytes, reserve
from moment.options import OptionParser, add_arguments, to_argv
from moment.outputs import Kind, Staging, check_free_space, check_out, joined
from moment.progress import Progress, Reporter
from placement.placed import Placed, open_placed
from placement.writer import file_digest
from trainer import broadcast, checkpoint, infer_predict
from trainer.config import TrainConfig
from trainer.dist import DistEnv, lost_peer, select_device
from trainer.featurestore import TieredFeatureStore
from trainer.infer_options import RANK_OPTIONS, InferOptions
from trainer.models import BlockGNN, Scatter, build_model, scatter_form

EDGES_PER_VERTEX = 16  # a chunk of B destinations holds at most 16·B in-edges
WORK = "work"  # inside the staging data directory: the layers in new ids and the ranks' progress
INPUTS = "inputs.json"  # inside WORK: the key of the inputs this partial output is for

Features = Callable[[np.ndarray], torch.Tensor]  # new ids -> their feature rows (layer 1's input)


# -- inputs ------------------------------------------------------------------------------------


def checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory ``path`` names (the directory itself or its checkpoint.pt)."""
    path = Path(path)
    if path.is_file() and path.name == checkpoint.FILENAME:
        return path.parent
    if path.is_dir() and checkpoint.path_in(path).is_file():
        return path
    if path.is_file():
        raise CheckpointError(f"{path}: not a checkpoint file (expected {checkpoint.FILENAME} or its directory)")
    raise CheckpointError(f"{checkpoint.path_in(path) if path.is_dir() else path}: missing (a training checkpoint)")


@dataclass
class Loaded:
    """The model of a checkpoint, in eval mode, checked against the placed dataset."""

    placed: Placed
    identity: DataIdentity
    cfg: TrainConfig
    model: BlockGNN
    epoch: int
    history: list[dict[str, Any]]
    checkpoint_sha256: str
    widths: list[int]  # output width of each layer


def load(data: Path, ckpt: Path, device: torch.device | None = None) -> Loaded:
    """Open the placed dataset and the checkpoint's model; refuse a checkpoint of other data (as
    ``moment train --resume`` does: same placement, same shapes)."""
    placed = open_placed(data)
    identity = DataIdentity.of(placed.root, placed.manifest)
    directory = checkpoint_dir(ckpt)
    meta = checkpoint.read_meta(directory)
    assert meta is not None  # checkpoint_dir found the file
    cfg = TrainConfig.from_dict(meta.config)
    body = checkpoint.load(directory, cfg, identity)  # refuses other data, naming the file and what differs
    assert body is not None
    model = build_model(cfg, placed.feature_dim, identity.num_classes)
    try:
        model.load_state_dict(body["model"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"{checkpoint.path_in(directory)}: its weights do not fit the model its config "
            f"describes ({str(exc).splitlines()[0]})"
        ) from None
    device = device or torch.device("cpu")
    model.to(device).eval()
    digest = file_digest(checkpoint.path_in(directory))
    return Loaded(
        placed, identity, cfg, model, meta.epoch, list(meta.history), digest, _widths(model, placed.feature_dim, device)
    )


def layer_form(loaded: Loaded, engine: str, layer: int) -> Scatter | None:
    """The scatter form the broadcast engine runs layer ``layer`` (1-based) with; None: the
    gather engine runs it (asked for, or the layer has none)."""
    if engine != "broadcast":
        return None
    return scatter_form(loaded.cfg.model, loaded.model.convs[layer - 1])


def rank_budget(memory: int, world: int) -> int:
    """A rank's share of ``--memory`` (ranks of one node run side by side)."""
    return memory // world


def layer_engines(loaded: Loaded, engine: str) -> list[str]:
    """The engine that runs each layer."""
    return ["broadcast" if layer_form(loaded, engine, k) else "gather" for k in range(1, len(loaded.widths) + 1)]


def _widths(model: BlockGNN, in_dim: int, device: torch.device) -> list[int]:
    """Each layer's output width, by running it on one vertex (any PyG-style conv plugs in)."""
    widths, x = [], torch.zeros(1, in_dim, device=device)
    empty = torch.zeros(2, 0, dtype=torch.int64, device=device)
    with torch.inference_mode():
        for i in range(len(model.convs)):
            x = model.layer(i, x, 1, empty)
            widths.append(int(x.shape[1]))
    return widths


def input_row_bytes(loaded: Loaded, layout: Layout, layer: int) -> int:
    """Bytes of one row of layer ``layer``'s input as stored: the placed features for layer 1,
    the previous layer's work file after."""
    if layer == 1:
        return loaded.placed.feature_dim * loaded.placed.feature_dtype.itemsize
    return loaded.widths[layer - 2] * np.dtype(layout.work(layer - 1)[2]).itemsize


# -- prediction ---------------------------------------------------------------------------------


def predict(
    loaded: Loaded, layout: Layout, opts: InferOptions, memory: int, device: torch.device
) -> list[LayerPrediction]:
    """Each layer's prediction (:mod:`trainer.infer_predict`): passes, bytes, memory, time on the
    plan's machine (``opts.rates``; compute measured here on ``device``)."""
    placed = loaded.placed
    indptr, index_bytes = placed.array("indptr"), placed.array("indices").dtype.itemsize
    ranges = [rank_range(layout.num_nodes, r, opts.nproc) for r in range(opts.nproc)]
    bins = [(b.name, b.tier, b.bytes) for b in sorted(placed.bins, key=lambda b: b.start)]
    out = []
    for k in range(1, layout.depth + 1):
        form = layer_form(loaded, opts.engine, k)
        in_width = placed.feature_dim if k == 1 else loaded.widths[k - 2]
        out_row = loaded.widths[k - 1] * np.dtype(layout.work(k)[2]).itemsize
        shape = infer_predict.Shape(
            k, in_width, loaded.widths[k - 1], input_row_bytes(loaded, layout, k), out_row, form
        )
        if form is None:
            out.append(infer_predict.predict_gather(shape, indptr, index_bytes, opts.batch_size))
            continue
        budget = rank_budget(memory, opts.nproc)
        largest = max(
            b - a
            for lo, hi in ranges
            for a, b in broadcast.partitions(indptr, lo, hi, shape.width, in_width, opts.batch_size, budget)
        )
        with torch.inference_mode():
            compute = infer_predict.calibrate(
                form, in_width, shape.width, opts.batch_size, device, largest, layout.num_nodes
            )
        out.append(
            infer_predict.predict_broadcast(
                shape,
                indptr,
                index_bytes,
                ranges,
                opts.batch_size,
                budget,
                bins if k == 1 else None,
                opts.rates,
                compute,
            )
        )
    return out


def dry_run(opts: InferOptions) -> Iterator[str]:
    """``moment infer --dry-run``: what a run would do and cost, per layer; nothing written."""
    opts.check()
    plan = read_plan(opts.plan) if opts.plan is not None else None
    device = device_for(plan=plan, requested=opts.device)
    loaded = load(opts.data, opts.checkpoint, device)
    layout = Layout(loaded.placed.num_nodes, tuple(loaded.widths), opts.dtype, opts.layers)
    memory = opts.memory or default_memory(loaded.placed)
    yield (
        f"{layout.num_nodes:,} vertices, {loaded.placed.num_edges:,} edges, {opts.nproc} rank"
        f"{'s' if opts.nproc != 1 else ''}, --memory {memory / 1e9:.3g} GB; compute timed on {device}"
        + (f", reads at the rates of {opts.rates.machine}" if opts.rates is not None else ", no plan: no time")
    )
    for k, pr in enumerate(predict(loaded, layout, opts, memory, device), 1):
        yield layer_line(k, pr)


def layer_line(layer: int, pr: LayerPrediction) -> str:
    """One layer's prediction for people."""
    ratio = pr.read_bytes / pr.input_bytes if pr.input_bytes else 0.0
    how = f"{pr.passes} pass{'es' if pr.passes != 1 else ''}" if pr.passes is not None else "gathered"
    if pr.passes is not None and pr.input_streams is not None and pr.input_streams < pr.passes:
        how += f" ({pr.input_streams} over the input, the others over its relayed messages)"
    spilled = f", {pr.spilled_edge_bytes / 1e9:.3g} GB of edges spilled" if pr.spilled_edge_bytes else ""
    when = (
        f"{pr.seconds:.1f} s ({'reads' if (pr.read_s or 0) >= (pr.compute_s or 0) else 'compute'} bound: "
        f"reads {pr.read_s or 0:.1f} s, compute {pr.compute_s or 0:.1f} s; then writes {pr.write_s or 0:.1f} s)"
        if pr.seconds is not None
        else "time not predicted"
    )
    return (
        f"layer {layer}: {pr.engine}, {how}, reads {pr.read_bytes / 1e9:.3g} GB = {ratio:.2f}× its input "
        f"({pr.input_bytes / 1e9:.3g} GB){spilled}; memory {pr.memory_bytes / 1e9:.3g} GB a rank; {when}"
        + (f"; {pr.note}" if pr.note else "")
    )


# -- the work directory -------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Every array of a run: the layers in new ids (work files) and the exported ones."""

    num_nodes: int
    widths: tuple[int, ...]
    dtype: str
    layers: str

    @property
    def depth(self) -> int:
        return len(self.widths)

    def work(self, layer: int) -> tuple[str, tuple[int, int], str]:
        """Work file of layer ``layer`` (1-based): its output for every vertex, in new ids."""
        last = layer == self.depth
        return f"{WORK}/h{layer}.npy", (self.num_nodes, self.widths[layer - 1]), "float32" if last else self.dtype

    def exports(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """name -> (file, shape, dtype) of the arrays users get, in original ids."""
        n, emb_layer = self.num_nodes, max(self.depth - 1, 1)
        out: dict[str, tuple[str, tuple[int, ...], str]] = {
            "embeddings": ("embeddings.npy", (n, self.widths[emb_layer - 1]), self.work(emb_layer)[2]),
            "predictions": ("predictions.npy", (n,), "int64"),
        }
        if self.layers == "all":
            out["logits"] = ("logits.npy", (n, self.widths[-1]), "float32")
            for k in range(1, self.depth - 1):
                out[f"layer{k}"] = (f"layer{k}.npy", (n, self.widths[k - 1]), self.dtype)
        return out

    def sources(self) -> dict[str, int]:
        """name -> the layer (1-based) each export copies rows of."""
        src = {"embeddings": max(self.depth - 1, 1), "predictions": self.depth, "logits": self.depth}
        src.update({f"layer{k}": k for k in range(1, self.depth - 1)})
        return {k: v for k, v in src.items() if k in self.exports()}

    def nbytes(self) -> int:
        files = [self.work(k) for k in range(1, self.depth + 1)] + list(self.exports().values())
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in files)

    def create(self, data: Path) -> None:
        (data / WORK).mkdir(parents=True, exist_ok=True)
        for path, shape, dt in [self.work(k) for k in range(1, self.depth + 1)] + list(self.exports().values()):
            np.lib.format.open_memmap(data / path, mode="w+", dtype=dt, shape=shape).flush()
            reserve(data / path)  # written through memory maps: a full disk now, not SIGBUS later

    def open(self, data: Path, path: str) -> np.memmap:
        return np.load(data / path, mmap_mode="r+")


def stages(depth: int) -> list[str]:
    """The stages every rank goes through, with a barrier after each."""
    return [f"layer {k}" for k in range(1, depth + 1)] + ["export"]


def rank_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``n`` vertices."""
    return n * rank // world, n * (rank + 1) // world


def chunks(lo: int, hi: int, size: int, indptr: np.ndarray | None = None) -> list[tuple[int, int]]:
    """``[lo, hi)`` in chunks of at most ``size`` vertices and, with ``indptr``, at most
    ``EDGES_PER_VERTEX * size`` in-edges (a chunk's memory grows with its edges: each edge's
    source row is gathered; a vertex with more in-edges than that is a chunk of its own)."""
    out, a = [], lo
    while a < hi:
        b = min(a + size, hi)
        if indptr is not None:
            ptr = np.asarray(indptr[a : b + 1])
            fit = int(np.searchsorted(ptr, ptr[0] + EDGES_PER_VERTEX * size, side="right")) - 1
            b = a + max(fit, 1)
        out.append((a, b))
        a = b
    return out


@dataclass
class RankProgress:
    """What one rank has finished: every stage before ``stage``, and ``chunks`` chunks of it;
    vertices and seconds per stage in the runs that did them (throughput)."""

    stage: int = 0
    chunks: int = 0
    # stage -> [vertices, seconds, bytes the engine asked for, bytes read from the disk]
    timing: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def path(data: Path, rank: int) -> Path:
        return data / WORK / f"progress-{rank}.json"

    @classmethod
    def read(cls, data: Path, rank: int) -> RankProgress:
        try:
            doc = json.loads(cls.path(data, rank).read_text())
            timing = {k: [*map(float, v), 0.0, 0.0][:4] for k, v in doc["timing"].items()}
            return cls(int(doc["stage"]), int(doc["chunks"]), timing)
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InferenceError(
                f"{cls.path(data, rank)}: damaged progress record ({exc}); remove {data.parent} to start over"
            ) from None

    def write(self, data: Path, rank: int) -> None:
        atomic_write_text(
            self.path(data, rank),
            json.dumps({"stage": self.stage, "chunks": self.chunks, "timing": self.timing}) + "\n",
        )


# -- one chunk ----------------------------------------------------------------------------------


def bipartite(indptr: np.ndarray, indices: np.ndarray, a: int, b: int) -> tuple[np.ndarray, torch.Tensor]:
    """The full in-neighbourhood of destinations ``[a, b)`` as a bipartite graph: source ids (the
    destinations first, then their other in-neighbours ascending) and the 2 × E edge index (row
    0: source position, row 1: destination position)."""
    ptr = np.asarray(indptr[a : b + 1], dtype=np.int64)
    nbr = np.asarray(indices[ptr[0] : ptr[-1]]).astype(np.int64, copy=False)
    dst = np.repeat(np.arange(b - a, dtype=np.int64), np.diff(ptr))
    inside = (nbr >= a) & (nbr < b)
    outside = np.unique(nbr[~inside])
    local = np.empty_like(nbr)
    local[inside] = nbr[inside] - a
    local[~inside] = (b - a) + np.searchsorted(outside, nbr[~inside])
    src = np.concatenate([np.arange(a, b, dtype=np.int64), outside])
    return src, torch.from_numpy(np.stack([local, dst]))


class Rank:
    """One rank's share of the work: its model, feature store, CSR and arrays."""

    def __init__(
        self,
        loaded: Loaded,
        data: Path,
        layout: Layout,
        batch_size: int,
        rank: int,
        world: int,
        device: torch.device,
        features: Features | None = None,
        engine: str = "gather",
        memory: int = 0,
    ) -> None:
        """``features``: where layer 1 reads its input rows (default: the placed tiers);
        ``engine``, ``memory``: the engine asked for and a broadcast pass's memory budget."""
        self.m, self.data, self.layout, self.batch = loaded, data, layout, batch_size
        self.features = features
        self.engine, self.memory = engine, memory
        self.rank, self.world, self.device = rank, world, device
        placed = loaded.placed
        self.indptr, self.indices = placed.array("indptr"), placed.array("indices")
        self.old_to_new = placed.array("old_to_new")
        self._store: TieredFeatureStore | None = None
        self.asked = 0  # bytes of input rows, CSR and spilled edges the chunks asked for (run_stage resets)

    @property
    def store(self) -> TieredFeatureStore:
        if self._store is None:  # only layer 1 reads features: a resumed run past it never loads the caches
            self._store = TieredFeatureStore(self.m.placed, device=self.device)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def form(self, layer: int) -> Scatter | None:
        """Layer ``layer``'s scatter form when the broadcast engine runs it, else None (gather)."""
        return layer_form(self.m, self.engine, layer)

    def chunks_of(self, stage: int) -> list[tuple[int, int]]:
        """This rank's chunks of ``stage``: new ids bounded by edges for a gathered layer, the
        destination partitions of a broadcast one, old ids for the export."""
        lo, hi = rank_range(self.layout.num_nodes, self.rank, self.world)
        if stage < self.layout.depth and self.form(stage + 1) is not None:
            width, in_width = self.m.widths[stage], self._in_width(stage + 1)
            budget = rank_budget(self.memory, self.world)
            return broadcast.partitions(self.indptr, lo, hi, width, in_width, self.batch, budget)
        return chunks(lo, hi, self.batch, self.indptr if stage < self.layout.depth else None)

    def _in_width(self, layer: int) -> int:
        return self.m.placed.feature_dim if layer == 1 else self.m.widths[layer - 2]

    def _in_row_bytes(self, layer: int) -> int:
        """Bytes of one row of layer ``layer``'s input as stored (the features; the work file)."""
        return input_row_bytes(self.m, self.layout, layer)

    def _csr_bytes(self, a: int, b: int) -> int:
        return (b - a + 1) * self.indptr.dtype.itemsize + int(
            self.indptr[b] - self.indptr[a]
        ) * self.indices.dtype.itemsize

    def block_rows(self, layer: int, s0: int, s1: int) -> torch.Tensor:
        """Rows ``[s0, s1)`` of layer ``layer``'s input (a broadcast pass's source block): from the
        tiers for layer 1, else a sequential slice of the previous layer's file."""
        if layer == 1:
            return self.inputs(1, np.arange(s0, s1, dtype=np.int64))
        prev = self.layout.open(self.data, self.layout.work(layer - 1)[0])
        return torch.from_numpy(np.array(prev[s0:s1])).to(self.device, torch.float32)

    def inputs(self, layer: int, src: np.ndarray) -> torch.Tensor:
        """Rows of layer ``layer``'s input for new ids ``src`` (float32, on the device)."""
        if layer == 1 and self.features is not None:
            x = self.features(src)
        elif layer == 1:
            x = self.store.get(torch.from_numpy(src))
        else:
            prev = self.layout.open(self.data, self.layout.work(layer - 1)[0])
            x = torch.from_numpy(np.asarray(prev[src]))
        return x.to(self.device, torch.float32)

    def relay_paths(self, layer: int) -> tuple[Path, Path]:
        """The files of this rank's relay of layer ``layer`` (messages, root terms)."""
        return (
            self.data / WORK / f"relay-{self.rank}-h{layer}-messages.npy",
            self.data / WORK / f"relay-{self.rank}-h{layer}-roots.npy",
        )

    def relay(self, layer: int, c: int) -> broadcast.Relay | None:
        """The relay partition ``c`` of layer ``layer`` writes (the first) or reads (a later
        one), where this rank's partitions relay their messages (:func:`trainer.broadcast.relays`)."""
        parts, width = self.chunks_of(layer - 1), self.m.widths[layer - 1]
        if not broadcast.relays(len(parts), width, self._in_row_bytes(layer)):
            return None
        (messages, roots), r0 = self.relay_paths(layer), parts[0][1]
        if c == 0:
            for path, rows in ((messages, self.layout.num_nodes), (roots, parts[-1][1] - r0)):
                np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, width)).flush()
                reserve(path)  # a full disk now, not SIGBUS later
            return broadcast.Relay(np.load(messages, mmap_mode="r+"), np.load(roots, mmap_mode="r+"), r0, True)
        if not (messages.is_file() and roots.is_file()):
            raise InferenceError(
                f"{messages}: missing (the messages layer {layer}'s first partition relays to the others); "
                f"remove {self.data.parent} to start over"
            )
        return broadcast.Relay(np.load(messages, mmap_mode="r"), np.load(roots, mmap_mode="r"), r0, False)

    def run_layer_chunk(
        self, layer: int, a: int, b: int, out: np.memmap, update: Callable[[int], None] | None = None, index: int = 0
    ) -> int:
        """Layer ``layer``'s rows of destinations ``[a, b)`` (chunk ``index`` of this rank) into
        ``out``; the vertices it already reported to ``update`` (a broadcast partition reports as
        its stream advances)."""
        form = self.form(layer)
        if form is not None:
            relay = self.relay(layer, index)

            def write(row: int, h: torch.Tensor) -> None:
                out[row : row + h.shape[0]] = h.cpu().numpy().astype(out.dtype, copy=False)

            with torch.inference_mode():
                done = broadcast.run_partition(
                    form,
                    functools.partial(self.m.model.after, layer - 1),
                    self.indptr,
                    self.indices,
                    a,
                    b,
                    functools.partial(self.block_rows, layer),
                    self.batch,
                    self.layout.num_nodes,
                    self.m.widths[layer - 1],
                    self.device,
                    write,
                    update,
                    memory=rank_budget(self.memory, self.world),
                    in_width=self._in_width(layer),
                    scratch=self.data / WORK / f"edges-{self.rank}.bin",
                    relay=relay,
                )
            if relay is not None and relay.writing:  # complete before the partition is recorded
                relay.messages.flush()
                relay.roots.flush()
            relayed = (done.message_rows + done.root_rows) * 4 * self.m.widths[layer - 1]
            self.asked += done.input_rows * self._in_row_bytes(layer) + relayed
            self.asked += self._csr_bytes(a, b) + done.spilled_bytes
            return b - a if update else 0
        src, edge_index = bipartite(self.indptr, self.indices, a, b)
        self.asked += src.size * self._in_row_bytes(layer) + self._csr_bytes(a, b)
        with torch.inference_mode():
            h = self.m.model.layer(layer - 1, self.inputs(layer, src), b - a, edge_index.to(self.device))
        out[a:b] = h.cpu().numpy().astype(out.dtype, copy=False)
        return 0

    def run_export_chunk(self, a: int, b: int, arrays: dict[str, np.memmap], works: dict[int, np.memmap]) -> None:
        new = np.asarray(self.old_to_new[a:b])
        order = np.argsort(new, kind="stable")  # read the work files in ascending rows
        rows = {k: np.empty((b - a, *w.shape[1:]), dtype=w.dtype) for k, w in works.items()}
        for k, w in works.items():
            rows[k][order] = w[new[order]]
        for name, layer in self.layout.sources().items():
            if name == "predictions":
                arrays[name][a:b] = rows[layer].argmax(axis=1)
            else:
                arrays[name][a:b] = rows[layer]

    def run_stage(self, stage: int, progress: RankProgress, update: Callable[[int], None] | None = None) -> None:
        """Do this rank's chunks of ``stage`` that ``progress`` does not record as done."""
        depth = self.layout.depth
        if progress.stage > stage:
            return
        if progress.stage < stage:
            progress.stage, progress.chunks = stage, 0
        todo = self.chunks_of(stage)
        name = stages(depth)[stage]
        if stage < depth:
            out = self.layout.open(self.data, self.layout.work(stage + 1)[0])
            arrays: dict[str, np.memmap] = {}
            works: dict[int, np.memmap] = {}
        else:
            out = None
            arrays = {k: self.layout.open(self.data, f) for k, (f, _, _) in self.layout.exports().items()}
            works = {
                k: self.layout.open(self.data, self.layout.work(k)[0]) for k in set(self.layout.sources().values())
            }
        for c in range(progress.chunks, len(todo)):
            a, b = todo[c]
            start, shown, disk = time.perf_counter(), 0, disk_read_bytes()
            self.asked = 0
            if out is not None:
                shown = self.run_layer_chunk(stage + 1, a, b, out, update, c)
                out.flush()
            else:
                self.run_export_chunk(a, b, arrays, works)
                for arr in arrays.values():
                    arr.flush()
            faults.point(f"infer:{name.replace(' ', '')}:chunk{c}")  # rows written, not yet recorded
            seconds = time.perf_counter() - start
            done = progress.timing.setdefault(name, [0, 0.0, 0.0, 0.0])
            done[0] += b - a
            done[1] += seconds
            done[2] += self.asked
            done[3] += disk_read_bytes() - disk
            progress.chunks = c + 1
            progress.write(self.data, self.rank)
            if update:
                update(b - a - shown)
        progress.stage, progress.chunks = stage + 1, 0
        progress.write(self.data, self.rank)
        if stage < depth:  # the layer's relay, if it had one, has served every partition
            for path in self.relay_paths(stage + 1):
                path.unlink(missing_ok=True)


# -- the whole run ------------------------------------------------------------------------------


def _validate(root: Path) -> InferenceManifest:
    m = InferenceManifest.read(root / MANIFEST)
    for entry in m.arrays.values():
        path = root / entry.path
        if not path.is_file() or path.stat().st_size != entry.bytes:
            raise InferenceError(f"{path}: missing or not the size {root / MANIFEST} records")
    return m


def _owned(root: Path) -> list[Path]:
    m = _validate(root)
    return [*(root / e.path for e in m.arrays.values()), root / MANIFEST]


KIND = Kind("directory of inference outputs", MANIFEST, "moment infer", _validate, _owned, InferenceError)


def _key(loaded: Loaded, opts: InferOptions) -> str:
    parts = {
        "placed": loaded.identity.placed_sha256,
        "checkpoint": loaded.checkpoint_sha256,
        "nproc": opts.nproc,
        "layers": opts.layers,
        "dtype": opts.dtype,
        "batch_size": opts.batch_size,
        "engines": layer_engines(loaded, opts.engine),
        "version": 2,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def device_for(env: DistEnv | None = None, plan: PlanDoc | None = None, requested: str = "auto") -> torch.device:
    """The rank's device: with ``requested`` "cuda" (or "auto" where there is CUDA) its GPU — the
    one the plan gives it, found by PCI address, and the rank pinned to that GPU's socket, as
    training chooses — else the CPU."""
    env = env or DistEnv(rank=0, world_size=1, local_rank=0, launched=False)
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return select_device(requested, env, plan)[0]


@dataclass
class Prepared:
    stage: Staging
    loaded: Loaded
    layout: Layout
    key: str
    done: InferenceManifest | None = None  # the output is already there (nothing to do)
    memory: int = 0  # a broadcast pass's budget: the first run's, kept by a resumed one
    predicted: list[LayerPrediction] = field(default_factory=list)  # per layer, made before the run


def prepare(opts: InferOptions, log: Callable[[str], None] = lambda _: None) -> Prepared:
    """Check the inputs, take (or resume) ``OUT.partial`` and create the arrays of a fresh run."""
    opts.check()
    if opts.plan is not None:
        read_plan(opts.plan)
    loaded = load(opts.data, opts.checkpoint)
    layout = Layout(loaded.placed.num_nodes, tuple(loaded.widths), opts.dtype, opts.layers)
    if opts.nproc > layout.num_nodes:
        raise UsageError(f"--nproc {opts.nproc}: more ranks than the {layout.num_nodes} vertices")
    key = _key(loaded, opts)
    out = Path(opts.out)
    stage = Staging(out, KIND)
    if stage.resume():
        if stage.old.exists() or (stage.data / MANIFEST).exists():
            log(f"finishing the publication of an interrupted `moment infer` into {out}")
            stage.publish("infer")
            stage = Staging(out, KIND)
        elif stage.data.exists() and _inputs_key(stage.data) != key:
            log(f"{stage.dir}: left by an interrupted run with other inputs: starting over")
            shutil.rmtree(stage.data)  # inside our own locked staging directory
        elif stage.data.exists():
            log(f"resuming the interrupted `moment infer` in {stage.dir}")
    if check_out(out, KIND) and not stage.data.exists():
        current = _validate(out)
        if current.key == key:
            stage.release()
            log(f"{out} already holds this inference (same checkpoint, data and options): nothing to do")
            return Prepared(stage, loaded, layout, key, done=current)
    memory = opts.memory or default_memory(loaded.placed)
    if not stage.data.exists():
        check_free_space({out: layout.nbytes()}, InferenceError)
        stage.create()
        layout.create(stage.data)
        atomic_write_text(stage.data / WORK / INPUTS, json.dumps({"key": key, "memory": memory}) + "\n")
    else:  # the partitions (the chunks progress counts) were cut by the first run's budget
        first = int(_inputs(stage.data).get("memory") or memory)
        if opts.memory and opts.memory != first:
            log(f"keeping the interrupted run's --memory {first / 1e9:.3g} GB (its partitions are half done)")
        memory = first
    plan = read_plan(opts.plan) if opts.plan is not None else None
    predicted = predict(loaded, layout, opts, memory, device_for(plan=plan, requested=opts.device))
    return Prepared(stage, loaded, layout, key, memory=memory, predicted=predicted)


def default_memory(placed: Placed | None = None) -> int:
    """A broadcast pass's default budget (:func:`trainer.broadcast.default_memory`), leaving room
    for the cache bins layer 1 loads into memory."""
    cached = sum(b.bytes for b in placed.bins if b.tier != "ssd") if placed is not None else 0
    return broadcast.default_memory(cached)


def _inputs(data: Path) -> dict[str, Any]:
    try:
        doc = json.loads((data / WORK / INPUTS).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _inputs_key(data: Path) -> str | None:
    return _inputs(data).get("key")


def run_in_process(
    p: Prepared, opts: InferOptions, progress: Progress | None = None, features: Features | None = None
) -> None:
    """Every rank's work in this process: stage by stage, each rank's chunks in turn (the barrier
    between stages is the loop's order). ``features``: another source of layer 1's input rows
    (scripts/bench_infer.py compares a memory-mapped feature file with the tiers)."""
    device = device_for(plan=read_plan(opts.plan) if opts.plan is not None else None, requested=opts.device)
    if device != torch.device("cpu"):
        p.loaded.model.to(device)
    ranks = [
        Rank(p.loaded, p.stage.data, p.layout, opts.batch_size, r, opts.nproc, device, features, opts.engine, p.memory)
        for r in range(opts.nproc)
    ]
    states = [RankProgress.read(p.stage.data, r) for r in range(opts.nproc)]
    try:
        for s, name in enumerate(stages(p.layout.depth)):
            update = _bar(progress, name, p.layout.num_nodes, sum(_done(r, st, s) for r, st in zip(ranks, states)))
            for rank, state in zip(ranks, states):
                rank.run_stage(s, state, update)
    finally:
        for rank in ranks:
            rank.close()


def _done(rank: Rank, state: RankProgress, stage: int) -> int:
    """Vertices of ``stage`` this rank already did (for the progress bar of a resumed run)."""
    if state.stage > stage:
        return sum(b - a for a, b in rank.chunks_of(stage))
    if state.stage < stage:
        return 0
    return sum(b - a for a, b in rank.chunks_of(stage)[: state.chunks])


def _bar(progress: Progress | None, name: str, total: int, done: int) -> Callable[[int], None] | None:
    if progress is None:
        return None
    stage, state = f"infer: {name}", [done]
    progress(stage, done, total)

    def step(k: int) -> None:
        state[0] += k
        progress(stage, state[0], total)

    return step


def finish(p: Prepared, opts: InferOptions, log: Callable[[str], None] = lambda _: None) -> InferenceManifest:
    """Accuracy, checksums, the manifest; the work files removed; the output published."""
    data, layout, loaded = p.stage.data, p.layout, p.loaded
    states = [RankProgress.read(data, r) for r in range(opts.nproc)]
    if any(s.stage < len(stages(layout.depth)) for s in states):
        raise InferenceError(f"{data}: a rank did not finish (progress {[(s.stage, s.chunks) for s in states]})")
    placed = loaded.placed
    logits = np.load(data / layout.work(layout.depth)[0], mmap_mode="r")
    labels = placed.array("labels")
    accuracy = {}
    for split in ("test", "val"):
        ids = np.sort(np.asarray(placed.array(split)))
        if ids.size:
            accuracy[split] = float((np.asarray(logits[ids]).argmax(axis=1) == np.asarray(labels[ids])).mean())
    throughput = []
    engines = layer_engines(loaded, opts.engine)
    for i, name in enumerate(stages(layout.depth)):
        vertices = sum(int(s.timing.get(name, [0, 0.0])[0]) for s in states)
        measured = {}
        if i < layout.depth:
            measured = {
                "read_bytes": sum(int(s.timing.get(name, [0] * 4)[2]) for s in states),
                "disk_read_bytes": sum(int(s.timing.get(name, [0] * 4)[3]) for s in states),
                "predicted": p.predicted[i] if i < len(p.predicted) else None,
            }
        # ranks run a stage side by side: its time is the slowest rank's (in one process, their sum)
        per_rank = [float(s.timing.get(name, [0, 0.0])[1]) for s in states]
        seconds = max(per_rank) if _ran_in_ranks(data) else sum(per_rank)
        throughput.append(
            LayerThroughput(
                stage=name,
                vertices=vertices,
                seconds=seconds,
                vertices_per_s=vertices / seconds if seconds > 0 else 0.0,
                **(_engine_entry(p, opts, i, engines[i]) if i < layout.depth else {}),
                **measured,
            )
        )
    del logits
    arrays = {}
    for name, (path, shape, dt) in layout.exports().items():
        arrays[name] = ArrayEntry(
            path=path, shape=list(shape), dtype=dt, bytes=(data / path).stat().st_size, sha256=file_digest(data / path)
        )
    shutil.rmtree(data / WORK)  # the layers in new ids: scratch of this run, inside its locked staging directory
    manifest = InferenceManifest(
        key=p.key,
        model=loaded.cfg.to_dict(),
        checkpoint_sha256=loaded.checkpoint_sha256,
        checkpoint_epoch=loaded.epoch,
        data=loaded.identity,
        dtype=opts.dtype,
        layers=opts.layers,
        nproc=opts.nproc,
        batch_size=opts.batch_size,
        engine=opts.engine,
        memory=p.memory if "broadcast" in engines else None,
        arrays=arrays,
        accuracy=accuracy,
        training_accuracy=training_accuracy(loaded.history),
        throughput=throughput,
    )
    manifest.write(data / MANIFEST)
    faults.point("infer:manifest")
    for note in p.stage.publish("infer"):
        log(f"note: {note}")
    return manifest


def _engine_entry(p: Prepared, opts: InferOptions, stage: int, engine: str) -> dict[str, Any]:
    """What inference.json says of layer ``stage + 1``'s engine: its partitions (all ranks) when
    broadcast; why not, when the broadcast engine was asked for and the layer has no scatter form."""
    if engine == "gather":
        note = None if opts.engine == "gather" else f"{p.loaded.cfg.model} has no scatter form"
        return {"engine": engine, "note": note}
    world, layer = opts.nproc, stage + 1
    in_width = p.loaded.placed.feature_dim if layer == 1 else p.loaded.widths[layer - 2]
    indptr = p.loaded.placed.array("indptr")
    width, budget = p.loaded.widths[stage], rank_budget(p.memory, world)
    ranges = [rank_range(p.layout.num_nodes, r, world) for r in range(world)]
    parts = [
        (a, b)
        for lo, hi in ranges
        for a, b in broadcast.partitions(indptr, lo, hi, width, in_width, opts.batch_size, budget)
    ]
    spilled = sum(
        not broadcast.edges_in_memory(b - a, int(indptr[b] - indptr[a]), width, in_width, opts.batch_size, budget)
        for a, b in parts
    )
    return {"engine": engine, "partitions": len(parts), "edges_on_disk": spilled}


RANKS_MARKER = "ranks"  # inside WORK: the stages ran in separate processes (timings overlap)


def _ran_in_ranks(data: Path) -> bool:
    return (data / WORK / RANKS_MARKER).exists()


def infer(
    opts: InferOptions,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _: None,
    launch: Callable[[list[str]], int] | None = None,
) -> InferenceManifest:
    """``moment infer``: prepare, run every rank (in this process, or ``launch``-ed under
    torchrun when ``nproc > 1`` and ``launch`` is given), finish and publish."""
    p = prepare(opts, log)
    if p.done is not None:
        return p.done
    try:
        if opts.nproc > 1 and launch is not None:
            (p.stage.data / WORK / RANKS_MARKER).touch()
            code = launch(torchrun_command(opts, p.stage.data))
            if code != 0:
                raise InferenceError(
                    f"inference ranks failed with exit code {code}; run the same command again "
                    f"to continue from the last finished chunk"
                )
        else:
            run_in_process(p, opts, progress)
        return finish(p, opts, log)
    except BaseException:
        p.stage.unlock()
        raise


def torchrun_command(opts: InferOptions, data: Path, python: str = sys.executable) -> list[str]:
    """``python -m trainer.torchrun --standalone --nproc-per-node N -m trainer.infer ...``: the
    ranks get their options (:data:`RANK_OPTIONS`) and the work directory; they read the
    broadcast budget ``prepare`` recorded there."""
    from trainer.launch import torchrun_command as launcher

    argv = [*to_argv(opts, only=RANK_OPTIONS), "--work", str(data)]
    return launcher("trainer.infer", argv, opts.nproc, python=python)


def summary(m: InferenceManifest) -> Iterator[str]:
    """Lines for people: throughput per stage, accuracy beside training's sampled evaluation."""
    for t in m.throughput:
        how = ""
        if t.engine == "broadcast":
            how = f", broadcast engine, {t.partitions} partition{'s' if t.partitions != 1 else ''}"
        elif t.engine == "gather":
            how = f", gather engine ({t.note})" if t.note else ", gather engine"
        line = f"{t.stage}: {t.vertices:,} vertices in {t.seconds:.2f} s ({t.vertices_per_s:,.0f} vertices/s{how})"
        if (pr := t.predicted) is not None and t.read_bytes is not None:
            line += f"; read {t.read_bytes / 1e9:.3g} GB ({(t.disk_read_bytes or 0) / 1e9:.3g} GB from disk), "
            line += f"predicted {pr.read_bytes / 1e9:.3g} GB"
            if pr.seconds is not None:
                line += f" and {pr.seconds:.2f} s on {pr.machine}" if pr.machine else f" and {pr.seconds:.2f} s"
        yield line
    acc = ", ".join(f"{k} {v:.1%}" for k, v in m.accuracy.items())
    sampled = ", ".join(f"{k} {v:.1%}" for k, v in m.training_accuracy.items())
    beside = f"; training's sampled evaluation (epoch {m.checkpoint_epoch}): {sampled}" if sampled else ""
    yield f"accuracy over the full neighbourhood: {acc}{beside}"


def training_accuracy(history: list[dict[str, Any]]) -> dict[str, float]:
    """The last sampled validation accuracy a checkpoint's history records (empty if none)."""
    sampled = [h["val_acc"] for h in history if isinstance(h.get("val_acc"), (int, float))]
    return {"val": float(sampled[-1])} if sampled else {}


# -- one rank under torchrun --------------------------------------------------------------------


def rank_main(argv: list[str] | None = None) -> int:
    """``python -m trainer.infer`` on every rank: the stages of this rank, gloo barriers between;
    exit status 0, 1 (one line), or 128 + the signal that stopped it (quietly: the launcher
    reports it)."""
    ap = OptionParser(prog="python -m trainer.infer")
    add_arguments(ap, InferOptions, only=RANK_OPTIONS)
    ap.add_argument("--work", required=True, help="the staging data directory `moment infer` prepared")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        with procs.interruptible():
            procs.guard()  # stops by itself when its launcher is gone
            with joined(Path(args.work).parent, "moment infer"):  # OUT.partial is this job's while it runs
                _rank(args, rank, int(os.environ.get("WORLD_SIZE", "1")))
        return 0
    except KeyboardInterrupt as exc:  # the launcher stops the job and reports it
        return procs.stopped(getattr(exc, "exit_code", 130), True)
    except torch.distributed.DistError as exc:  # a peer is gone
        if (signum := procs.stopping()) is not None:
            return procs.stopped(128 + signum, True)
        print(f"trainer.infer rank {rank}: error: stopped: {lost_peer(exc)}", file=sys.stderr)
        return 1
    except (MomentError, OSError) as exc:
        if (signum := procs.stopping()) is not None:
            return procs.stopped(128 + signum, True)
        if isinstance(exc, OSError):  # a full disk, a read-only target: the file and the reason
            exc = MomentError(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
        print(f"trainer.infer rank {rank}: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _rank(args: argparse.Namespace, rank: int, world: int) -> None:
    import torch.distributed as dist

    device = device_for(DistEnv.from_environ(), read_plan(args.plan) if args.plan else None, args.device)
    loaded = load(Path(args.data), Path(args.checkpoint), device)
    data = Path(args.work)
    if not (data / WORK / INPUTS).is_file():
        raise InferenceError(f"{data}: not a work directory prepared by `moment infer`")
    layout = Layout(loaded.placed.num_nodes, tuple(loaded.widths), args.dtype, args.layers)
    if world > 1:
        dist.init_process_group("gloo")
    memory = int(_inputs(data).get("memory") or default_memory(loaded.placed))
    worker = Rank(loaded, data, layout, args.batch_size, rank, world, device, None, args.engine, memory)
    state = RankProgress.read(data, rank)
    report = Reporter().__enter__() if rank == 0 else None
    try:
        for s, name in enumerate(stages(layout.depth)):
            total = sum(b - a for a, b in worker.chunks_of(s))
            update = _bar(report, f"{name} (rank 0)", total, _done(worker, state, s))
            worker.run_stage(s, state, update)
            if world > 1:
                dist.barrier()
    finally:
        worker.close()
        if report is not None:
            report.__exit__()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(rank_main())
