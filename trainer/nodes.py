"""Several nodes, one model: what every node's placed dataset must agree on, checked at start.

Each node trains from a placement of its own (its plan, its SSDs, its bins), so placed.json and
the relabelled ids may differ between nodes: ``moment place`` numbers vertices bin by bin, and
another layout or cache size puts other vertices in the bins (so the ids agree only between
placements of one plan and caches). What must not differ is the data itself: the source's size
and feature type, the classes, and the splits (compared as sets of source ids); nor may the
run's configuration (epochs, batch size, model, seed, whether checkpoints are written: the steps
and collectives every rank takes), beyond what is each node's own (:data:`PER_NODE`).

The splits are stored sorted by placement id, and every rank draws its seeds from positions in
the train split (one permutation per epoch, strided over the global ranks). Where the nodes'
placements number the vertices alike (the same relabelling) that order is one order everywhere,
and a run of N nodes is a run of one node with as many ranks. Where they do not, every node
puts its splits in the source's order (:func:`source_order`), so that position i is the same
vertex on every node and each training vertex is still a seed once per epoch.

One collective (``all_gather`` of each rank's :class:`NodeData`) compares every node with node 0;
a node that differs is named in one line (on rank 0 and on that node's local rank 0).

Checkpoints are node 0's: global rank 0 writes them, and a resumed run (``--resume``, or a
restarted worker group) takes the one rank 0 reads, sent to every rank (:func:`resumed`), so
``--checkpoint-dir`` may be shared storage or node 0's own disk.
"""

from __future__ import annotations

import hashlib
import io
import socket
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from moment.errors import MomentError
from placement.placed import Placed
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.dist import DistEnv, PeerFailedError, all_gather, broadcast_bytes, together

SPLITS = ("train", "val", "test")
# Options that are each node's own: its files, its memory file system, its devices and readers.
PER_NODE = ("data", "plan", "shm_dir", "io", "metrics_json", "checkpoint_dir", "overwrite", "prefetch", "device")
PER_NODE += ("sampling", "host_gather")


def shared_config(cfg: TrainConfig) -> dict[str, object]:
    """The configuration every node must run alike (fan-outs and batch size as resolved from
    each node's placement)."""
    out = {k: v for k, v in cfg.to_dict().items() if k not in PER_NODE}
    out["checkpoints"] = cfg.checkpoint_dir is not None  # rank 0 writes them, every rank takes part
    out["backend"] = cfg.resolved_backend()
    return out


class NodeDataError(MomentError):
    """A node's placed dataset holds other data than node 0's."""


@dataclass(frozen=True)
class NodeData:
    """What two nodes' placements of one dataset share, whatever their layouts."""

    num_nodes: int
    num_edges: int
    feature_dim: int
    feature_dtype: str
    num_classes: int
    splits: dict[str, str]  # split → sha256 of its source ids, in the source's order
    train_labels: str  # sha256 of the training vertices' labels, in the source's order
    relabel: str  # sha256 of new_to_old (differs between layouts: a note, not a refusal)

    @classmethod
    def of(cls, placed: Placed) -> NodeData:
        m = placed.manifest
        new_to_old = placed.array("new_to_old")
        splits = {}
        for split in SPLITS:
            ids = np.asarray(placed.array(split), dtype=np.int64)
            splits[split] = _digest(np.sort(np.asarray(new_to_old[ids], dtype=np.int64)))
        train = source_order(placed, placed.array("train"))
        labels = np.asarray(placed.array("labels")[train], dtype=np.int64)
        return cls(
            m.num_nodes,
            m.num_edges,
            m.feature_dim,
            m.feature_dtype,
            m.num_classes,
            splits,
            _digest(labels),
            m.files["new_to_old"].digest,
        )

    def difference(self, node0: NodeData) -> str | None:
        """What differs from node 0's data (None: the same data)."""
        mine, theirs = asdict(self), asdict(node0)
        for key in ("num_nodes", "num_edges", "feature_dim", "feature_dtype", "num_classes"):
            if mine[key] != theirs[key]:
                return f"{key} {mine[key]}, node 0 has {theirs[key]}"
        for split in SPLITS:
            if self.splits[split] != node0.splits[split]:
                return f"its {split} split holds other vertices ({_short(self.splits[split])} vs {_short(node0.splits[split])})"
        if self.train_labels != node0.train_labels:
            return f"its training labels differ ({_short(self.train_labels)} vs {_short(node0.train_labels)})"
        return None


def source_order(placed: Placed, ids: np.ndarray) -> np.ndarray:
    """Placement ids ``ids`` ordered by their source ids: the one order every node's split has."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids[np.argsort(np.asarray(placed.array("new_to_old")[ids]), kind="stable")]


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


def _short(digest: str) -> str:
    return f"sha256 {digest[:12]}…"


def config_difference(mine: dict[str, object], node0: dict[str, object]) -> str | None:
    """The first option a node runs otherwise than node 0 (None: none)."""
    for key, value in mine.items():
        if node0.get(key) != value:
            return f"{key} {value!r}, node 0 has {node0.get(key)!r}"
    return None


def check_same_data(env: DistEnv, placed: Placed, cfg: TrainConfig) -> tuple[list[str], bool]:
    """Refuse to train when any node's placed dataset holds other data than node 0's, or runs
    another configuration (one collective). Else the notes to print, and whether the nodes
    number the vertices differently (then each puts its splits in :func:`source_order`). A lone
    node checks nothing."""
    if env.nodes <= 1:
        return [], False
    mine = (env.node_rank, socket.gethostname(), str(placed.root), NodeData.of(placed), shared_config(cfg))
    everyone = all_gather(mine)
    node0, config0 = everyone[0][3], everyone[0][4]
    problems = {}
    for node, host, root, data, config in everyone:
        if node in problems:
            continue
        if (why := data.difference(node0)) is not None:
            problems[node] = f"node {node} ({host}, --data {root}) holds other data than node 0: {why}"
        elif (why := config_difference(config, config0)) is not None:
            problems[node] = f"node {node} ({host}) runs other options than node 0: {why} (give every node the same)"
    if problems:
        first = problems[min(problems)]
        if env.rank == 0 or (env.local_rank == 0 and env.node_rank in problems):
            raise NodeDataError(problems.get(env.node_rank, first))
        raise PeerFailedError(first)
    relabelled = sorted({node for node, _, _, data, _ in everyone if data.relabel != node0.relabel})
    if not relabelled:
        return [], False
    note = (
        f"node(s) {', '.join(map(str, relabelled))} number the vertices otherwise than node 0 (another layout or "
        "cache size): every node takes its seeds in the source's order; samples differ from a one-node run's"
    )
    return [note], True


def resumed(
    cfg: TrainConfig, identity: checkpoint.DataIdentity, env: DistEnv, device: torch.device
) -> dict[str, Any] | None:
    """The checkpoint a resumed run continues (None: there is none). On one node each rank reads
    it; on several, rank 0 reads (and checks) node 0's and sends it to every rank, so the nodes
    resume one state whether or not they see node 0's --checkpoint-dir."""
    if env.nodes <= 1 or not torch.distributed.is_initialized():
        return checkpoint.load(cfg.checkpoint_dir or "", cfg, identity)
    blob: list[bytes] = []

    def read() -> None:
        body = checkpoint.load(cfg.checkpoint_dir or "", cfg, identity) if env.rank == 0 else None
        if body is not None:
            buf = io.BytesIO()
            torch.save(body, buf)
            blob.append(buf.getvalue())

    together(read)  # a damaged checkpoint: one line on rank 0, the others stop quietly
    data = broadcast_bytes(blob[0] if blob else None, device)
    return None if data is None else torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
