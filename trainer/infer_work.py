"""Inference's inputs and work directory: the checkpoint's model loaded and checked against the
placed dataset, the layout of the work files (one ``.npy`` per layer, in vertex ids), how a stage's
vertices are cut into ranks and chunks, each rank's progress file, and the device a rank runs on.
What the driver (:mod:`trainer.infer`) and each rank (:mod:`trainer.infer_rank`) share."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment import outputs
from moment.contracts.checkpoint import CheckpointError, DataIdentity
from moment.contracts.inference import (
    InferenceError,
)
from moment.contracts.plan import PlanDoc
from moment.fileio import atomic_write_text, reserve
from placement.digests import file_digest
from placement.placed import Placed, open_placed
from trainer import broadcast, checkpoint
from trainer.config import TrainConfig
from trainer.dist import DistEnv, select_device
from trainer.models import BlockGNN, Scatter, build_model, scatter_form

EDGES_PER_VERTEX = 16  # a chunk of B destinations holds at most 16·B in-edges
WORK = "work"  # inside the staging data directory: the layers in vertex ids and the ranks' progress
ALREADY = "same checkpoint, data and options"  # why an output already complete is left as it is


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


def load(data: Path, ckpt: Path, device: torch.device | None = None, placement: bool = True) -> Loaded:
    """Open the placed dataset and the checkpoint's model; refuse a checkpoint of other data (as
    ``moment train --resume`` does: same placement, same shapes; without ``placement``, a node
    past 0, another placement of the same data: the ranks check it is numbered as node 0's)."""
    placed = open_placed(data)
    identity = DataIdentity.of(placed.root, placed.manifest)
    directory = checkpoint_dir(ckpt)
    meta = checkpoint.read_meta(directory)
    assert meta is not None  # checkpoint_dir found the file
    cfg = TrainConfig.from_dict(meta.config)
    body = checkpoint.load(directory, cfg, identity, placement)  # refuses other data, naming the file and what differs
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
    digest = file_digest(checkpoint.path_in(directory), "sha256")
    return Loaded(
        placed, identity, cfg, model, meta.epoch, list(meta.history), digest, _widths(model, placed.feature_dim, device)
    )


def layer_form(loaded: Loaded, engine: str, layer: int, device: torch.device | None = None) -> Scatter | None:
    """The scatter form the broadcast engine runs layer ``layer`` (1-based) with; None: the
    gather engine runs it (asked for, or the layer has none). ``device``: the form of a copy of
    the layer there, where the model lives elsewhere (the launcher times a rank's device with
    the model it loaded on the CPU)."""
    if engine != "broadcast":
        return None
    conv = loaded.model.convs[layer - 1]
    if device is not None and any(p.device != device for p in conv.parameters()):
        conv = copy.deepcopy(conv).to(device)
    return scatter_form(loaded.cfg.model, conv)


def rank_budget(memory: int, ranks: int) -> int:
    """A rank's share of ``--memory``, a node's: ``ranks`` ranks of one node run side by side."""
    return memory // ranks


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


@dataclass(frozen=True)
class Layout:
    """Every array of a run: the layers in vertex ids (work files) and the exported ones."""

    num_nodes: int
    widths: tuple[int, ...]
    dtype: str
    layers: str

    @property
    def depth(self) -> int:
        return len(self.widths)

    def work(self, layer: int) -> tuple[str, tuple[int, int], str]:
        """Work file of layer ``layer`` (1-based): its output for every vertex, in vertex ids."""
        last = layer == self.depth
        return f"{WORK}/h{layer}.npy", (self.num_nodes, self.widths[layer - 1]), "float32" if last else self.dtype

    def exports(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """name -> (file, shape, dtype) of the arrays users get, in the dataset's ids."""
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

    def files(self, exports: bool = True) -> list[tuple[str, tuple[int, ...], str]]:
        """The work files, and with ``exports`` the exported arrays (a node past 0 exports nothing)."""
        return [self.work(k) for k in range(1, self.depth + 1)] + (list(self.exports().values()) if exports else [])

    def nbytes(self, exports: bool = True) -> int:
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in self.files(exports))

    def create(self, data: Path, exports: bool = True) -> None:
        (data / WORK).mkdir(parents=True, exist_ok=True)
        for path, shape, dt in self.files(exports):
            np.lib.format.open_memmap(data / path, mode="w+", dtype=dt, shape=shape).flush()
            reserve(data / path)  # written through memory maps: a full disk now, not SIGBUS later

    def open(self, data: Path, path: str) -> np.memmap:
        return np.load(data / path, mmap_mode="r+")


def stages(depth: int) -> list[str]:
    """The stages every rank goes through, with a barrier after each."""
    return [f"layer {k}" for k in range(1, depth + 1)] + ["export"]


def rank_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``n`` vertices (global ranks: node by node)."""
    return n * rank // world, n * (rank + 1) // world


def node_range(n: int, node: int, world: int, per_node: int) -> tuple[int, int]:
    """Node ``node``'s contiguous share of ``n`` vertices: its ``per_node`` ranks' ranges together."""
    return rank_range(n, node * per_node, world)[0], rank_range(n, (node + 1) * per_node - 1, world)[1]


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


def device_for(env: DistEnv | None = None, plan: PlanDoc | None = None, requested: str = "auto") -> torch.device:
    """The rank's device: with ``requested`` "cuda" (or "auto" where there is CUDA) its GPU — the
    one the plan gives it, found by PCI address, and the rank pinned to that GPU's socket, as
    training chooses — else the CPU."""
    env = env or DistEnv(rank=0, world_size=1, local_rank=0, launched=False)
    return select_device(resolved_device(requested), env, plan)[0]


def resolved_device(requested: str) -> str:
    """``--device auto``: cuda where there is CUDA, else cpu; the others as given."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def default_memory(placed: Placed | None = None) -> int:
    """A broadcast pass's default budget (:func:`trainer.broadcast.default_memory`), leaving room
    for the cache bins layer 1 loads into memory."""
    cached = sum(b.bytes for b in placed.bins if b.tier != "ssd") if placed is not None else 0
    return broadcast.default_memory(cached)


def read_inputs(data: Path) -> dict[str, Any]:
    """What ``moment infer`` recorded in the work directory (its inputs' key, the broadcast budget)."""
    return outputs.read_inputs(data / WORK)
