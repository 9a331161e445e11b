"""Out-of-core, layer-wise, full-neighbourhood inference: embeddings and predictions for every vertex.

A sampled model is run over the *whole* in-neighbourhood of every vertex, one layer at a time
(the ATLAS / PyG ``BasicGNN.inference`` scheme), so nothing needs all vertices' activations in
memory:

* stage ``l`` (layer ``l + 1``) walks the destination vertices in chunks of ``batch_size`` vertex
  ids; for chunk ``D = [a, b)`` it reads the CSR rows of ``D`` (the in-neighbours), makes the
  bipartite graph whose sources are ``D`` itself first (so GAT's self loops and SAGE's root
  weight see the chunk's own rows) followed by its outside neighbours, gathers their rows of the
  previous layer — layer 0: the tiered feature store (GPU/CPU caches, SSD bins); later layers:
  the previous stage's memory-mapped ``.npy`` on disk — and writes the chunk's output rows into
  this stage's ``.npy``. Memory per chunk: its sources' rows, never N × hidden.
* the last stage (``export``) copies into the arrays users get (rows in the dataset's vertex
  ids, as the work files and the placed dataset): ``embeddings.npy`` (the last hidden layer, after its ReLU: what the
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
or, in one process, a loop over the ranks (:func:`run_in_process`). Across nodes
(``--nnodes``) the ranges are over the global ranks, each node works in a directory of its own and
the nodes exchange each layer's rows (:mod:`trainer.infer_nodes`); node 0 exports and publishes.

Crash safety: the work happens in ``OUT.partial/data`` (``moment.outputs.Staging``). After each
chunk the rank flushes its rows and records ``(stage, chunks done)`` in its own progress file;
a re-run with the same inputs continues from there and writes the same bytes (the chunking is
fixed by the inputs, so every chunk is computed the same way; on the CPU, whose kernels are
deterministic: CUDA's scatter sums add in no fixed order, so there the last bits may differ).
``inference.json`` is written last, then the directory is published by one rename.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment import faults
from moment.contracts.inference import (
    MANIFEST,
    ArrayEntry,
    InferenceError,
    InferenceManifest,
    LayerPrediction,
    LayerThroughput,
)
from moment.contracts.plan import read_plan
from moment.errors import UsageError
from moment.options import to_argv
from moment.outputs import Kind, Staging, check_free_space, check_out, write_inputs
from moment.progress import Progress
from placement.digests import file_digest
from trainer import broadcast, infer_predict
from trainer.infer_nodes import node_outcome
from trainer.infer_options import RANK_OPTIONS, InferOptions
from trainer.infer_rank import Features, Rank, done_before, rank_main, stage_bar
from trainer.infer_work import (
    ALREADY,
    WORK,
    Layout,
    Loaded,
    RankProgress,
    default_memory,
    device_for,
    input_row_bytes,
    layer_engines,
    layer_form,
    load,
    rank_budget,
    rank_range,
    read_inputs,
    stages,
)

# -- prediction ---------------------------------------------------------------------------------


def predict(
    loaded: Loaded, layout: Layout, opts: InferOptions, memory: int, device: torch.device
) -> list[LayerPrediction]:
    """Each layer's prediction (:mod:`trainer.infer_predict`): passes, bytes, memory, time on the
    plan's machine (``opts.rates``; compute measured here on ``device``)."""
    placed = loaded.placed
    indptr, index_bytes = placed.array("indptr"), placed.array("indices").dtype.itemsize
    ranges = [rank_range(layout.num_nodes, r, opts.world) for r in range(opts.world)]
    bins = [(b.name, b.tier, b.bytes) for b in sorted(placed.bins, key=lambda b: b.start)]
    out = []
    for k in range(1, layout.depth + 1):
        form = layer_form(loaded, opts.engine, k, device)
        in_width = placed.feature_dim if k == 1 else loaded.widths[k - 2]
        out_row = loaded.widths[k - 1] * np.dtype(layout.work(k)[2]).itemsize
        shape = infer_predict.Shape(
            k, in_width, loaded.widths[k - 1], input_row_bytes(loaded, layout, k), out_row, form
        )
        if form is None:
            out.append(infer_predict.predict_gather(shape, indptr, index_bytes, opts.batch_size))
            continue
        budget = rank_budget(memory, opts.nproc)  # --memory is each node's
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
    loaded = load(opts.data, opts.checkpoint, device, placement=opts.node == 0)
    layout = Layout(loaded.placed.num_nodes, tuple(loaded.widths), opts.dtype, opts.layers)
    memory = opts.memory or default_memory(loaded.placed)
    yield (
        f"{layout.num_nodes:,} vertices, {loaded.placed.num_edges:,} edges, {opts.world} rank"
        f"{'s' if opts.world != 1 else ''}{f' on {opts.nodes} nodes' if opts.nodes > 1 else ''}, "
        f"--memory {memory / 1e9:.3g} GB{' a node' if opts.nodes > 1 else ''}; compute timed on {device}"
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
    if opts.nodes > 1:  # a node's work directory holds its ranges, its progress records
        parts["nodes"] = [opts.nodes, opts.node]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


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
    loaded = load(opts.data, opts.checkpoint, placement=opts.node == 0)
    layout = Layout(loaded.placed.num_nodes, tuple(loaded.widths), opts.dtype, opts.layers)
    if opts.world > layout.num_nodes:
        raise UsageError(f"--nproc {opts.nproc}: more ranks ({opts.world}) than the {layout.num_nodes} vertices")
    key = _key(loaded, opts)
    out = work_out(opts)
    stage = Staging(out, KIND)
    if stage.resume():
        if stage.old.exists() or (stage.data / MANIFEST).exists():
            log(f"finishing the publication of an interrupted `moment infer` into {out}")
            stage.publish("infer")
            stage = Staging(out, KIND)
        elif stage.data.exists() and read_inputs(stage.data).get("key") != key:
            log(f"{stage.dir}: left by an interrupted run with other inputs: starting over")
            shutil.rmtree(stage.data)  # inside our own locked staging directory
        elif stage.data.exists():
            log(f"resuming the interrupted `moment infer` in {stage.dir}")
    if check_out(out, KIND) and not stage.data.exists():
        current = _validate(out)
        if current.key == key:
            stage.release()
            log(f"{out} already holds this inference ({ALREADY}): nothing to do")
            return Prepared(stage, loaded, layout, key, done=current)
    memory = opts.memory or default_memory(loaded.placed)
    fresh = not stage.data.exists()
    if not fresh:  # the partitions (the chunks progress counts) were cut by the first run's budget
        first = int(read_inputs(stage.data).get("memory") or memory)
        if opts.memory and opts.memory != first:
            log(f"keeping the interrupted run's --memory {first / 1e9:.3g} GB (its partitions are half done)")
        memory = first
    plan = read_plan(opts.plan) if opts.plan is not None else None
    predicted = predict(loaded, layout, opts, memory, device_for(plan=plan, requested=opts.device))
    if fresh:
        # Beside the layer arrays, a layer's spilled edges live in scratch files until its passes end.
        scratch = max((layer.spilled_edge_bytes for layer in predicted), default=0)
        check_free_space({out: layout.nbytes(exports=opts.node == 0) + scratch}, InferenceError)
        stage.create()
        if opts.node == 0:
            layout.create(stage.data)
        else:  # its ranks make its arrays once node 0 says there is work (infer_nodes.make_arrays)
            (stage.data / WORK).mkdir(parents=True, exist_ok=True)
        write_inputs(stage.data / WORK, key, memory=memory)
    return Prepared(stage, loaded, layout, key, memory=memory, predicted=predicted)


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
            update = stage_bar(
                progress, name, p.layout.num_nodes, sum(done_before(r, st, s) for r, st in zip(ranks, states))
            )
            for rank, state in zip(ranks, states):
                rank.run_stage(s, state, update)
    finally:
        for rank in ranks:
            rank.close()


def finish(p: Prepared, opts: InferOptions, log: Callable[[str], None] = lambda _: None) -> InferenceManifest:
    """Accuracy, checksums, the manifest; the work files removed; the output published."""
    data, layout, loaded = p.stage.data, p.layout, p.loaded
    states = [RankProgress.read(data, r) for r in range(opts.world)]  # node 0's: every node's ranks
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
        measured: dict[str, Any] = {}
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
            path=path,
            shape=list(shape),
            dtype=dt,
            bytes=(data / path).stat().st_size,
            sha256=file_digest(data / path, "sha256"),
        )
    shutil.rmtree(data / WORK)  # the layers in vertex ids: scratch of this run, inside its locked staging directory
    manifest = InferenceManifest(
        key=p.key,
        model=loaded.cfg.to_dict(),
        checkpoint_sha256=loaded.checkpoint_sha256,
        checkpoint_epoch=loaded.epoch,
        data=loaded.identity,
        dtype=opts.dtype,
        layers=opts.layers,
        nproc=opts.nproc,
        nodes=opts.nodes,
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
    world, layer = opts.world, stage + 1
    in_width = p.loaded.placed.feature_dim if layer == 1 else p.loaded.widths[layer - 2]
    indptr = p.loaded.placed.array("indptr")
    width, budget = p.loaded.widths[stage], rank_budget(p.memory, opts.nproc)
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
) -> InferenceManifest | None:
    """``moment infer``: prepare, run every rank (in this process, or ``launch``-ed under
    torchrun when ``nproc > 1`` or on several nodes, where ``launch`` is required), finish and
    publish. A node past 0 returns None (said in ``log``): node 0 wrote the output, or already
    held it; its own scratch is removed."""
    if opts.nodes > 1 and launch is None:
        raise UsageError(f"--nnodes {opts.nnodes}: several nodes run their ranks under torchrun (give a launcher)")
    p = prepare(opts, log)
    if p.done is not None:
        if opts.nodes > 1:  # the other nodes cannot see it: node 0's ranks meet theirs to say so
            assert launch is not None
            code = launch(torchrun_command(opts, None))
            if code != 0:
                raise InferenceError(
                    f"{opts.out} already holds this inference, but the other nodes could not be told: its ranks "
                    f"failed with exit code {code} (the lines above say why)"
                )
        return p.done
    try:
        if opts.nodes > 1 or (opts.nproc > 1 and launch is not None):
            assert launch is not None
            (p.stage.data / WORK / RANKS_MARKER).touch()
            code = launch(torchrun_command(opts, p.stage.data))
            if code != 0:
                raise InferenceError(
                    f"inference ranks failed with exit code {code} (the lines above say why); run the same command "
                    f"again {'on every node ' if opts.nodes > 1 else ''}to continue from the last finished chunk"
                )
        else:
            run_in_process(p, opts, progress)
        if opts.node > 0:
            said = node_outcome(p.stage.data, opts.node)
            shutil.rmtree(p.stage.data)  # this node's scratch, inside its locked staging directory
            p.stage.release()
            log(said)
            return None
        return finish(p, opts, log)
    except BaseException:
        p.stage.unlock()
        raise


def work_out(opts: InferOptions) -> Path:
    """The output a node builds: ``--out`` on node 0; ``OUT.nodeR`` on node R, never published
    (its ``OUT.nodeR.partial`` holds its work files, whether or not --out is shared storage)."""
    out = Path(opts.out)
    return out if opts.node == 0 else out.with_name(f"{out.name}.node{opts.node}")


def torchrun_command(opts: InferOptions, data: Path | None, python: str = sys.executable) -> list[str]:
    """``python -m trainer.torchrun --standalone --nproc-per-node N -m trainer.infer ...`` (several
    nodes: their rendezvous instead of --standalone): the ranks get their options
    (:data:`RANK_OPTIONS`) and the work directory; they read the broadcast budget ``prepare``
    recorded there. ``data`` None: node 0's --out is complete, its ranks only tell the other nodes
    (``--finished OUT``)."""
    from trainer.launch import Rendezvous
    from trainer.launch import torchrun_command as launcher

    where = ["--work", str(data)] if data is not None else ["--finished", str(Path(opts.out).absolute())]
    argv = [*to_argv(opts, only=RANK_OPTIONS), *where]
    rdzv = Rendezvous()
    if opts.nodes > 1:
        rdzv = Rendezvous(nnodes=opts.nodes, endpoint=opts.rdzv_endpoint, id=opts.rdzv_id, node_rank=opts.node)
    return launcher("trainer.infer", argv, opts.nproc, rdzv, python=python)


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


if __name__ == "__main__":
    sys.exit(rank_main())
