"""``moment infer`` across nodes: each node computes the vertex ranges of its global ranks in a
work directory of its own, and after every layer the nodes exchange their rows over the process
group, so that every node holds the whole layer, the next layer's input, on its own disk.

* Ranks take contiguous ranges of vertex ids over the global ranks (node by node), as the ranks
  of one node do: a job of N nodes × R ranks computes every row as one node with N × R ranks
  would, so its output is that run's, byte for byte (on the CPU). Every node's placed dataset
  numbers the vertices as the dataset does (whatever its layout or caches: a placement only adds
  the row map its feature store reads through), so the work files, the exchange and every sum
  are in one numbering on every node.
* The exchange (:class:`Exchange`): after a layer, each node's local rank 0 broadcasts its
  node's rows (one contiguous range) to the other nodes' local ranks 0 in pieces of
  :data:`PIECE_BYTES`, and writes the rows it receives into its node's file. Nothing is shared
  between the nodes but the network: ``--data``, ``--checkpoint`` and the work files are each
  node's own.
* Node 0 alone exports (its ranks split the output's rows) and writes ``--out`` and
  ``inference.json``; the other nodes' work directories are scratch, removed when the job ends.
  Every rank's progress record is gathered into node 0's work directory at the end
  (:func:`gather_progress`), for inference.json's throughput.
* Resume: a rank records a layer only once its rows are exchanged; a resumed job starts at the
  first stage some rank has not recorded (:func:`first_stage`), every rank taking part in that
  stage's exchange again (the same rows rewritten), so a node that lost its work directory
  recomputes its ranges and receives the others'.
* Nothing to do: only node 0 can see that its --out already holds this inference, so its ranks
  still meet the others' and say so in the start-up check's collective; every rank stops there,
  and the other nodes' local ranks 0 leave a note (:func:`note_finished`) for their launchers,
  which say so too (:func:`node_outcome`) instead of waiting for a node 0 that never comes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moment.fileio import atomic_write_text
from trainer.dist import DistEnv, all_gather
from trainer.infer_work import ALREADY, WORK, Layout, RankProgress, node_range

PIECE_BYTES = 1 << 26  # rows broadcast at a time (64 MiB): bounds the buffers, not the bytes sent
FINISHED = "finished-on-node-0.json"  # in a node's work files: node 0's --out already held this inference
ARRAYS_MADE = "arrays-made"  # in a node's work files past node 0: its ranks made its arrays (make_arrays)


class Exchange:
    """The rows of each layer, sent from the node that computed them to every other node."""

    def __init__(self, env: DistEnv, per_node: int, layout: Layout, data: Path) -> None:
        self.env, self.per_node, self.layout, self.data = env, per_node, layout, data
        self.nodes = env.world_size // per_node
        self.node, self.local = env.rank // per_node, env.rank % per_node
        leaders = [k * per_node for k in range(self.nodes)]
        # every rank makes the group (a collective); only the nodes' local ranks 0 are in it
        self.leaders = dist.new_group(leaders, backend="gloo") if per_node > 1 else None

    def layer(self, layer: int) -> None:
        """Layer ``layer``'s rows of every node into this node's file (called by every rank)."""
        dist.barrier()  # every rank's rows of the layer are in its node's file
        if self.local == 0:
            self._send_and_receive(layer)
        dist.barrier()  # the node's file is whole before any of its ranks reads it

    def _send_and_receive(self, layer: int) -> None:
        path, (n, width), dtype = self.layout.work(layer)
        rows = self.layout.open(self.data, path)
        row_bytes = width * np.dtype(dtype).itemsize
        step = max(1, PIECE_BYTES // row_bytes)
        for k in range(self.nodes):
            lo, hi = node_range(n, k, self.env.world_size, self.per_node)
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                if k == self.node:
                    buf = torch.from_numpy(np.ascontiguousarray(rows[a:b]).view(np.uint8).reshape(-1))
                else:
                    buf = torch.empty((b - a) * row_bytes, dtype=torch.uint8)
                dist.broadcast(buf, src=k * self.per_node, group=self.leaders)
                if k != self.node:
                    rows[a:b] = buf.numpy().view(dtype).reshape(b - a, width)
        rows.flush()


def first_stage(state: RankProgress) -> int:
    """The first stage some rank has not recorded: where every rank of a resumed job starts."""
    return min(all_gather(state.stage))


def gather_progress(env: DistEnv, per_node: int, state: RankProgress, data: Path) -> None:
    """Every rank's progress record, written by node 0's local rank 0 into node 0's work
    directory beside its own ranks' (the throughput in inference.json counts every rank)."""
    everyone = all_gather((env.rank, state.stage, state.chunks, state.timing))
    if env.rank != 0:
        return
    for rank, stage, chunks, timing in everyone:
        if rank >= per_node:  # another node's rank
            RankProgress(stage, chunks, timing).write(data, rank)


def make_arrays(env: DistEnv, layout: Layout, data: Path) -> None:
    """A node past 0 makes its work files here, after the start-up check, not when its launcher
    prepares: only node 0 can see whether its --out already holds this inference, and then this
    node has nothing to compute (its local rank 0, once per work directory; its ranks wait in
    the next collective)."""
    if env.node_rank == 0 or env.local_rank != 0 or (data / WORK / ARRAYS_MADE).is_file():
        return
    if not any((data / WORK).glob("progress-*.json")):  # else its launcher made them (before this): rows kept
        layout.create(data, exports=False)
    (data / WORK / ARRAYS_MADE).touch()


def note_finished(data: Path, where: str) -> None:
    """Tell this node's launcher that node 0's --out (``where``: ``HOST:OUT``) already held this
    inference: the job stopped at its start-up check, nothing computed."""
    atomic_write_text(data / WORK / FINISHED, json.dumps({"node0_out": where}) + "\n")


def node_outcome(data: Path, node: int) -> str:
    """What node ``node`` (past 0) did, in one line: its ranges, or nothing where node 0's --out
    already held this inference (:func:`note_finished`)."""
    path = data / WORK / FINISHED
    if not path.is_file():
        return f"node {node}: its vertex ranges done; node 0 wrote the output to its --out"
    where = json.loads(path.read_text())["node0_out"]
    return f"node {node}: node 0 already holds this inference in {where} ({ALREADY}): nothing to do"
