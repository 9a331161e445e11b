"""One inference rank: a stage's chunks computed and written (the gather engine here, the
broadcast engine in :mod:`trainer.broadcast`), and ``python -m trainer.infer``'s entry point on
each torchrun process (:func:`rank_main`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moment import faults, procs
from moment.contracts.inference import (
    InferenceError,
)
from moment.contracts.plan import read_plan
from moment.errors import MomentError
from moment.fileio import disk_read_bytes, reserve
from moment.options import OptionParser, add_arguments
from moment.outputs import INPUTS, joined
from moment.progress import Progress, Reporter
from trainer import broadcast
from trainer.dist import DistEnv, PeerFailedError, leave, lost_peer, setup
from trainer.featurestore import TieredFeatureStore
from trainer.infer_nodes import (
    Exchange,
    first_stage,
    gather_progress,
    make_arrays,
    note_finished,
)
from trainer.infer_options import RANK_OPTIONS, InferOptions
from trainer.infer_work import (
    WORK,
    Layout,
    Loaded,
    RankProgress,
    chunks,
    default_memory,
    device_for,
    input_row_bytes,
    layer_form,
    load,
    rank_budget,
    rank_range,
    read_inputs,
    resolved_device,
    stages,
)
from trainer.models import Scatter
from trainer.nodes import check_same_inference

Features = Callable[[np.ndarray], torch.Tensor]  # vertex ids -> their feature rows (layer 1's input)


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
        per_node: int = 0,
    ) -> None:
        """``features``: where layer 1 reads its input rows (default: the placed tiers);
        ``engine``, ``memory``: the engine asked for and a broadcast pass's memory budget (this
        node's); ``per_node``: ranks per node (default ``world``: one node)."""
        self.m, self.data, self.layout, self.batch = loaded, data, layout, batch_size
        self.features = features
        self.engine, self.memory = engine, memory
        self.rank, self.world, self.device = rank, world, device
        self.per_node = per_node or world
        self.node = rank // self.per_node
        placed = loaded.placed
        self.indptr, self.indices = placed.array("indptr"), placed.array("indices")
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
        """This rank's chunks of ``stage``: vertex ids bounded by edges for a gathered layer, the
        destination partitions of a broadcast one, old ids for the export (node 0's ranks: its
        --out gets the whole output)."""
        if stage == self.layout.depth:
            if self.node:
                return []
            return chunks(*rank_range(self.layout.num_nodes, self.rank, self.per_node), self.batch)
        lo, hi = rank_range(self.layout.num_nodes, self.rank, self.world)
        if self.form(stage + 1) is not None:
            width, in_width = self.m.widths[stage], self._in_width(stage + 1)
            budget = rank_budget(self.memory, self.per_node)
            return broadcast.partitions(self.indptr, lo, hi, width, in_width, self.batch, budget)
        return chunks(lo, hi, self.batch, self.indptr)

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
        """Rows of layer ``layer``'s input for vertex ids ``src`` (float32, on the device)."""
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
                    memory=rank_budget(self.memory, self.per_node),
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
        """Rows ``[a, b)`` of the exported arrays: the work files' rows (both in dataset ids)."""
        for name, layer in self.layout.sources().items():
            rows = np.asarray(works[layer][a:b])
            arrays[name][a:b] = rows.argmax(axis=1) if name == "predictions" else rows

    def run_stage(
        self,
        stage: int,
        progress: RankProgress,
        update: Callable[[int], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Do this rank's chunks of ``stage`` that ``progress`` does not record as done, then
        ``after`` (several nodes: the layer's rows exchanged, its time the stage's), which runs
        where this rank recorded the stage too (another rank did not), before it is recorded."""
        if progress.stage <= stage:
            self._run_chunks(stage, progress, update)
        elif after is None:
            return
        if after is not None:
            start = time.perf_counter()
            after()
            progress.timing.setdefault(stages(self.layout.depth)[stage], [0, 0.0, 0.0, 0.0])[1] += (
                time.perf_counter() - start
            )
        if progress.stage <= stage:
            progress.stage, progress.chunks = stage + 1, 0
        progress.write(self.data, self.rank)
        if stage < self.layout.depth:  # the layer's relay, if it had one, has served every partition
            for path in self.relay_paths(stage + 1):
                path.unlink(missing_ok=True)

    def _run_chunks(self, stage: int, progress: RankProgress, update: Callable[[int], None] | None) -> None:
        depth = self.layout.depth
        if progress.stage < stage:
            progress.stage, progress.chunks = stage, 0
        todo = self.chunks_of(stage)
        name = stages(depth)[stage]
        if progress.chunks >= len(todo):  # nothing left (a node past 0 exports nothing)
            return
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


def done_before(rank: Rank, state: RankProgress, stage: int) -> int:
    """Vertices of ``stage`` this rank already did (for the progress bar of a resumed run)."""
    if state.stage > stage:
        return sum(b - a for a, b in rank.chunks_of(stage))
    if state.stage < stage:
        return 0
    return sum(b - a for a, b in rank.chunks_of(stage)[: state.chunks])


def stage_bar(progress: Progress | None, name: str, total: int, done: int) -> Callable[[int], None] | None:
    """A stage's progress callback (vertices done so far), reporting ``done`` at once; None without ``progress``."""
    if progress is None:
        return None
    stage, state = f"infer: {name}", [done]
    progress(stage, done, total)

    def step(k: int) -> None:
        state[0] += k
        progress(stage, state[0], total)

    return step


def rank_main(argv: list[str] | None = None) -> int:
    """``python -m trainer.infer`` on every rank: the stages of this rank, gloo barriers between
    (several nodes: the layers' rows exchanged, :mod:`trainer.infer_nodes`); exit status 0, 1
    (one line), or 128 + the signal that stopped it (quietly: the launcher reports it)."""
    ap = OptionParser(prog="python -m trainer.infer")
    add_arguments(ap, InferOptions, only=RANK_OPTIONS)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--work", help="the staging data directory `moment infer` prepared")
    where.add_argument(
        "--finished",
        metavar="OUT",
        help="several nodes, node 0: its OUT already holds this inference; meet the other nodes to say so, and stop",
    )
    args = ap.parse_args(argv)
    env = DistEnv.from_environ()
    try:
        with procs.interruptible():
            procs.guard()  # stops by itself when its launcher is gone
            # OUT.partial is this job's while it runs (node 0 with --finished has none)
            with joined(Path(args.work).parent, "moment infer") if args.work else contextlib.nullcontext():
                _rank(args, env)
        return 0
    except KeyboardInterrupt as exc:  # the launcher stops the job and reports it
        return procs.stopped(getattr(exc, "exit_code", 130), True)
    except (torch.distributed.DistError, RuntimeError) as exc:  # a peer is gone
        if not isinstance(exc, torch.distributed.DistError) and "/gloo/" not in str(exc):
            raise  # not gloo's lost connection (a barrier raises a plain RuntimeError for it): a bug
        if (signum := procs.stopping()) is not None:
            return procs.stopped(128 + signum, True)
        print(f"trainer.infer rank {env.rank}: error: stopped: {lost_peer(exc)}", file=sys.stderr)
        return 1
    except PeerFailedError:  # another rank said why
        return 1
    except (MomentError, OSError) as exc:
        if (signum := procs.stopping()) is not None:
            return procs.stopped(128 + signum, True)
        if isinstance(exc, OSError):  # a full disk, a read-only target: the file and the reason
            exc = MomentError(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
        print(f"trainer.infer rank {env.rank}: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _rank(args: argparse.Namespace, env: DistEnv) -> None:
    plan = read_plan(args.plan) if args.plan else None
    # gloo (barriers, the exchange between nodes) whatever the device; several nodes: global ranks
    # from --node-rank, checked (trainer.dist.setup)
    device = (
        setup(resolved_device(args.device), "gloo", env, plan)[0]
        if env.launched
        else device_for(env, plan, args.device)
    )
    loaded = load(Path(args.data), Path(args.checkpoint), device, placement=env.node_rank == 0)
    data = Path(args.work) if args.work else None
    if data is not None and not (data / WORK / INPUTS).is_file():
        raise InferenceError(f"{data}: not a work directory prepared by `moment infer`")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    shared = {"checkpoint": loaded.checkpoint_sha256, "ranks per node": per_node}
    shared.update({k: getattr(args, k) for k in ("layers", "dtype", "batch_size", "engine")})
    check = check_same_inference(env, loaded.placed, shared, args.finished)
    if check.finished is not None:  # node 0's --out already holds it: every rank of every node stops here
        if data is not None and env.local_rank == 0:
            note_finished(data, check.finished)
    else:
        assert data is not None  # only node 0 is given --finished, and then every node stops
        _stages(args, env, loaded, data, device, per_node)
    if env.world_size > 1:
        leave()  # every rank done with the group first (gloo#155)


def _stages(
    args: argparse.Namespace,
    env: DistEnv,
    loaded: Loaded,
    data: Path,
    device: torch.device,
    per_node: int,
) -> None:
    """This rank's chunks of every stage, the barriers and (several nodes) the exchanges between."""
    import torch.distributed as dist

    layout = Layout(loaded.placed.num_nodes, tuple(loaded.widths), args.dtype, args.layers)
    memory = int(read_inputs(data).get("memory") or default_memory(loaded.placed))
    state = RankProgress.read(data, env.rank)
    nodes = Exchange(env, per_node, layout, data) if env.nodes > 1 else None
    if nodes:
        make_arrays(env, layout, data)  # a node past 0: before first_stage's collective, which every rank awaits
    first = first_stage(state) if nodes else 0
    worker = Rank(
        loaded, data, layout, args.batch_size, env.rank, env.world_size, device, None, args.engine, memory, per_node
    )
    report = Reporter().__enter__() if env.rank == 0 else None
    try:
        for s, name in enumerate(stages(layout.depth)):
            if s < first:  # every rank recorded it
                continue
            total = sum(b - a for a, b in worker.chunks_of(s))
            update = stage_bar(report, f"{name} (rank 0)", total, done_before(worker, state, s))
            after = functools.partial(nodes.layer, s + 1) if nodes and s < layout.depth else None
            worker.run_stage(s, state, update, after)
            if env.world_size > 1:
                dist.barrier()
        if nodes:
            gather_progress(env, per_node, state, data)
    finally:
        worker.close()
        if report is not None:
            report.__exit__()
