"""Several nodes, one model: what every node's placed dataset must agree on, checked at start.

Each node trains from a placement of its own (its plan, its SSDs, its bins), so placed.json and
the row maps may differ between nodes: another layout or cache size puts other vertices in the
bins. The vertex ids do not differ: a placed dataset numbers vertices as its dataset does (its
graph, labels and splits are the dataset's files). What must not differ is the data itself: the
source's size and feature type, the classes, and the splits (their ids in their stored order);
nor may the run's configuration (epochs, batch size, model, seed, whether checkpoints are
written: the steps and collectives every rank takes), beyond what is each node's own
(:data:`PER_NODE`).

Every rank draws its seeds from positions in the train split (one permutation per epoch,
strided over the global ranks); the split being the same array on every node, a run of N nodes
is a run of one node with as many ranks.

One collective (``all_gather`` of each rank's :class:`NodeData`) compares every node with node 0;
a node that differs is named in one line (on rank 0 and on that node's local rank 0).

Metrics are node 0's too (``--metrics-json`` on rank 0), with each node's part of every epoch
(:func:`per_node`: its seeds/s, its ranks' wait for data, the read shares of its own tiers and
bins beside its own placement's prediction) and the straggler named: DDP's all-reduce makes
every node wait for the slowest, so the slow node is the one whose ranks wait for data while the
others wait in the all-reduce (:func:`straggler`).

Inference across nodes (:func:`check_same_inference`) checks the same data and the options that
shape its arrays (:mod:`trainer.infer_nodes`). Its collective also carries node 0's word that its
--out is already complete, so that every node stops there, together.

Checkpoints are node 0's: global rank 0 writes them, and a resumed run (``--resume``, or a
restarted worker group) takes the one rank 0 reads, sent to every rank (:func:`resumed`), so
``--checkpoint-dir`` may be shared storage or node 0's own disk.
"""

from __future__ import annotations

import hashlib
import io
import socket
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from moment.errors import MomentError
from placement.placed import Placed
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.dist import DistEnv, PeerFailedError, all_gather, broadcast_bytes, together
from trainer.metrics import merge_stats, read_shares

SPLITS = ("train", "val", "test")
# A straggler: a node whose ranks waited for data this many times as long as the other nodes'
# (median), and at least this share of the epoch longer.
STRAGGLER_RATIO, STRAGGLER_SHARE = 2.0, 0.10
# Options that are each node's own: its files, its memory file system, its devices and readers.
PER_NODE: tuple[str, ...] = (
    "data",
    "plan",
    "shm_dir",
    "io",
    "metrics_json",
    "checkpoint_dir",
    "overwrite",
    "prefetch",
    "device",
)
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
    splits: dict[str, str]  # split → sha256 of its ids (int64), in their stored order (the seeds' order)
    train_labels: str  # sha256 of the training vertices' labels (int64), in the train split's order

    @classmethod
    def of(cls, placed: Placed) -> NodeData:
        m = placed.manifest
        splits = {split: _digest(np.asarray(placed.array(split), dtype=np.int64)) for split in SPLITS}
        train = np.asarray(placed.array("train"), dtype=np.int64)
        labels = np.asarray(placed.array("labels")[train], dtype=np.int64)
        return cls(m.num_nodes, m.num_edges, m.feature_dim, m.feature_dtype, m.num_classes, splits, _digest(labels))

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


@dataclass
class Nodes:
    """What the start-up check found: each node's own prediction (for the metrics)."""

    predictions: list[dict[str, Any]] | None = None


def check_same_data(env: DistEnv, placed: Placed, cfg: TrainConfig) -> Nodes:
    """Refuse to train when any node's placed dataset holds other data than node 0's, or runs
    another configuration (one collective, which also brings every node's prediction). A lone
    node checks nothing."""
    if env.nodes <= 1:
        return Nodes()
    everyone = compare_nodes(env, placed, shared_config(cfg))
    predictions = sorted({info["node"]: info for info, _, _ in everyone}.values(), key=lambda i: i["node"])
    return Nodes(predictions=predictions)


@dataclass(frozen=True)
class SameInference:
    """What inference's start-up check found: node 0's word that its --out already holds this
    inference (``HOST:OUT``, else None: every node has work)."""

    finished: str | None = None


def check_same_inference(
    env: DistEnv, placed: Placed, shared: dict[str, object], finished: str | None = None
) -> SameInference:
    """Refuse to infer across nodes when a node holds other data than node 0's or runs other
    options (``shared``: the checkpoint's digest, the options that shape the arrays). A lone
    node checks nothing.

    The same collective tells every node whether node 0's --out already holds this inference
    (``finished``: node 0's --out, given on node 0 only; the other nodes cannot see its disk):
    where it is returned as ``HOST:OUT`` on every rank, and no node has work."""
    if env.nodes <= 1:
        return SameInference(finished)
    everyone = compare_nodes(env, placed, shared, extra={"finished": finished})
    node0_info = everyone[0][0]
    return SameInference(f"{node0_info['host']}:{node0_info['finished']}" if node0_info.get("finished") else None)


def compare_nodes(
    env: DistEnv,
    placed: Placed,
    shared: dict[str, object],
    extra: dict[str, Any] | None = None,
) -> list[tuple[dict[str, Any], NodeData, dict[str, object]]]:
    """Every rank's node, data and ``shared`` options (one collective), in rank order; a node
    whose data or options differ from node 0's is refused in one line naming it, on rank 0 and on
    that node's local rank 0. ``extra``: more of this rank's facts for the others, not compared."""
    host, pred = socket.gethostname(), placed.manifest.prediction
    mine = {
        "node": env.node_rank,
        "host": host,
        "data": str(placed.root),
        "iteration_s": pred.iteration_s,
        "tier_shares": pred.tier_shares.model_dump(),
        "bin_shares": dict(pred.bin_shares),
        **(extra or {}),
    }
    everyone = all_gather((mine, NodeData.of(placed), shared))
    node0, config0 = everyone[0][1], everyone[0][2]
    problems = {}
    for info, data, config in everyone:
        node, host = info["node"], info["host"]
        if node in problems:
            continue
        if (why := data.difference(node0)) is not None:
            problems[node] = f"node {node} ({host}, --data {info['data']}) holds other data than node 0: {why}"
        elif (why := config_difference(config, config0)) is not None:
            problems[node] = f"node {node} ({host}) runs other options than node 0: {why} (give every node the same)"
    if problems:
        first = problems[min(problems)]
        if env.rank == 0 or (env.local_rank == 0 and env.node_rank in problems):
            raise NodeDataError(problems.get(env.node_rank, first))
        raise PeerFailedError(first)
    return everyone


def per_node(timing: list[tuple[int, str, float, int, float]], stats: list[dict[str, Any]], train_s: float) -> dict:
    """Each node's part of an epoch, from every rank's ``(node, host, train_s, seeds, data_wait_s)``
    and feature-store stats (rank order), and the straggler among them (metrics.json)."""
    groups: dict[tuple[int, str], list[tuple[int, float, dict[str, Any]]]] = {}
    for (node, host, _, seeds, wait), s in zip(timing, stats):
        groups.setdefault((node, host), []).append((seeds, wait, s))
    nodes = []
    for (node, host), members in sorted(groups.items()):
        seeds = sum(m[0] for m in members)
        nodes.append(
            {
                "node": node,
                "host": host,
                "ranks": len(members),
                "seeds": seeds,
                "seeds_per_s": seeds / max(train_s, 1e-12),
                "data_wait_s": statistics.mean(m[1] for m in members),
                **read_shares(merge_stats([m[2] for m in members])),
            }
        )
    return {"nodes": nodes, "straggler": straggler(nodes, train_s)}


def straggler(nodes: list[dict[str, Any]], train_s: float) -> str | None:
    """The node the others waited for, in words (None: none stood out): the one whose ranks
    waited longest for data, when that is :data:`STRAGGLER_RATIO` times the other nodes' median
    and :data:`STRAGGLER_SHARE` of the epoch more."""
    if len(nodes) < 2:
        return None
    worst = max(nodes, key=lambda n: n["data_wait_s"])
    typical = statistics.median(n["data_wait_s"] for n in nodes if n is not worst)
    wait = worst["data_wait_s"]
    if wait < STRAGGLER_RATIO * typical or wait - typical < STRAGGLER_SHARE * train_s:
        return None
    return (
        f"node {worst['node']} ({worst['host']}): its ranks waited {wait:.2f} s for data, the other nodes' "
        f"{typical:.2f} s, of a {train_s:.2f} s epoch: DDP's all-reduce makes every node wait for it"
    )


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
