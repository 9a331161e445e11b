"""``moment infer`` across nodes: each node computes the vertex ranges of its global ranks in a
work directory of its own, and after every layer the nodes exchange their rows over the process
group, so that every node holds the whole layer, the next layer's input, on its own disk.

* Ranks take contiguous ranges of node 0's placement ids over the global ranks (node by node),
  as the ranks of one node do: a job of N nodes × R ranks computes every row as one node with
  N × R ranks would, so its output is that run's, byte for byte (on the CPU).
* A node whose placement numbers the vertices otherwise (another layout or cache size:
  :func:`trainer.nodes.check_same_inference` names it) works in node 0's numbering all the same
  (:class:`JobIds`): node 0's ``new_to_old`` is broadcast to it once per run, from which it maps
  node 0's ids to its own (layer 1 reads its own tiers through that map) and rewrites the
  in-edges of its ranges in node 0's ids, each row in the CSR's order (the source's, as on node
  0). Its work files are then in node 0's ids, so the exchange and every sum are a one-node
  run's: the broadcast engine adds a destination's messages by source block, so computing in
  the node's own numbering would add them in another order (other bits). Where every node
  numbers alike nothing is translated.
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
  recomputes its ranges and receives the others'. A renumbered node's :class:`JobIds` are made
  again by every run that has a layer left (node 0's placement may have changed in between).
* Nothing to do: only node 0 can see that its --out already holds this inference, so its ranks
  still meet the others' and say so in the start-up check's collective; every rank stops there,
  and the other nodes' local ranks 0 leave a note (:func:`note_finished`) for their launchers,
  which say so too (:func:`node_outcome`) instead of waiting for a node 0 that never comes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moment.fileio import atomic_write_text, reserve
from placement.placed import Placed
from placement.relabel import mapped_rows, row_extents
from trainer.dist import DistEnv, all_gather
from trainer.infer_work import ALREADY, WORK, Layout, RankProgress, node_range

PIECE_BYTES = 1 << 26  # rows broadcast at a time (64 MiB): bounds the buffers, not the bytes sent
FINISHED = "finished-on-node-0.json"  # in a node's work files: node 0's --out already held this inference
ARRAYS_MADE = "arrays-made"  # in a node's work files past node 0: its ranks made its arrays (make_arrays)
ID_ROWS = PIECE_BYTES // 8  # ids broadcast (and rows of the CSR rewritten) at a time
# A renumbered node's work files in node 0's ids (JobIds); FROM_JOB only while they are made.
TO_MINE, FROM_JOB, JOB_INDPTR, JOB_INDICES = (
    f"{WORK}/job-{k}.npy" for k in ("to-mine", "from-mine", "indptr", "indices")
)


@dataclass(frozen=True)
class JobIds:
    """Node 0's numbering (the job's) on a node whose placement numbers the vertices otherwise:
    ``to_mine``, node 0's id → this node's (layer 1 reads this node's tiers through it);
    ``indptr``, ``indices``: the in-edges of this node's range in node 0's ids, N + 1 offsets
    (rows outside the range empty), each row in the CSR's order, as node 0 holds it."""

    to_mine: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray

    @classmethod
    def open(cls, data: Path) -> JobIds:
        return cls(*(np.load(data / f, mmap_mode="r") for f in (TO_MINE, JOB_INDPTR, JOB_INDICES)))


class Exchange:
    """The rows of each layer, sent from the node that computed them to every other node."""

    def __init__(self, env: DistEnv, per_node: int, layout: Layout, data: Path) -> None:
        self.env, self.per_node, self.layout, self.data = env, per_node, layout, data
        self.nodes = env.world_size // per_node
        self.node, self.local = env.rank // per_node, env.rank % per_node
        leaders = [k * per_node for k in range(self.nodes)]
        # every rank makes the group (a collective); only the nodes' local ranks 0 are in it
        self.leaders = dist.new_group(leaders, backend="gloo") if per_node > 1 else None

    def numbering(self, placed: Placed, renumbered: tuple[int, ...]) -> JobIds | None:
        """Node 0's numbering on every node in ``renumbered`` (called by every rank when that is
        not empty): node 0's ``new_to_old`` broadcast in pieces, this node's :class:`JobIds`
        made by its local rank 0 (None: this node numbers as node 0 does)."""
        if self.local == 0:
            self._send_numbering(placed, self.node in renumbered)
        dist.barrier()  # the node's files are whole before any of its ranks opens them
        return JobIds.open(self.data) if self.node in renumbered else None

    def _send_numbering(self, placed: Placed, mine: bool) -> None:
        n = placed.num_nodes
        if mine:
            own = np.asarray(placed.array("old_to_new"))
            to_mine, from_job = (_created(self.data / f, np.int64, (n,)) for f in (TO_MINE, FROM_JOB))
        for a in range(0, n, ID_ROWS):
            b = min(a + ID_ROWS, n)
            if self.node == 0:
                buf = torch.from_numpy(np.asarray(placed.array("new_to_old")[a:b], dtype=np.int64))
            else:
                buf = torch.empty(b - a, dtype=torch.int64)
            dist.broadcast(buf, src=0, group=self.leaders)
            if mine:
                ids = own[buf.numpy()]
                to_mine[a:b] = ids
                from_job[ids] = np.arange(a, b, dtype=np.int64)
        if mine:
            to_mine.flush()
            lo, hi = node_range(n, self.node, self.env.world_size, self.per_node)
            job_csr(placed, np.asarray(to_mine), np.asarray(from_job), lo, hi, self.data)
            del from_job
            (self.data / FROM_JOB).unlink()

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


def renumbered_note(nodes: tuple[int, ...]) -> str:
    """What rank 0 says of the nodes numbered otherwise than node 0."""
    return (
        f"node(s) {', '.join(map(str, nodes))} number the vertices otherwise than node 0 (another layout or cache "
        "size): they compute in node 0's vertex ids (its new_to_old sent to them, their ranges' in-edges rewritten, "
        "layer 1's rows read through the map)"
    )


def _created(path: Path, dtype: type, shape: tuple[int, ...]) -> np.memmap:
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    reserve(path)  # written through a memory map: a full disk now, not SIGBUS later
    return rows


def job_csr(placed: Placed, to_mine: np.ndarray, from_job: np.ndarray, lo: int, hi: int, data: Path) -> None:
    """The in-edges of node 0's ids ``[lo, hi)`` in node 0's ids, from this node's CSR
    (``to_mine``: node 0's id → this node's; ``from_job``: its inverse), into :data:`JOB_INDPTR`
    and :data:`JOB_INDICES`: row ``v`` is this node's row of ``to_mine[v]`` with every neighbour
    mapped back, in the CSR's order (both placements keep the source's order in a row), so it is
    node 0's row. :data:`ID_ROWS` rows at a time, written through memory maps."""
    n = to_mine.size
    indptr, indices = np.asarray(placed.array("indptr")), np.asarray(placed.array("indices"))
    ptr = _created(data / JOB_INDPTR, np.int64, (n + 1,))
    pieces = [(a, min(a + ID_ROWS, hi)) for a in range(lo, hi, ID_ROWS)]

    def extents(a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        starts, lens = np.empty(b - a, dtype=np.int64), np.empty(b - a, dtype=np.int64)
        row_extents(to_mine, indptr, a, starts, lens)
        return starts, lens

    end = 0
    for a, b in pieces:
        ptr[a + 1 : b + 1] = end + np.cumsum(extents(a, b)[1])
        end = int(ptr[b])
    ptr[hi + 1 :] = end  # rows past the range are empty (those before it are zeros already)
    ptr.flush()
    out = _created(data / JOB_INDICES, indices.dtype.type, (end,))
    flat = np.asarray(out)
    for a, b in pieces:
        mapped_rows(indices, *extents(a, b), from_job, flat[int(ptr[a]) : int(ptr[b])])
    out.flush()


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
