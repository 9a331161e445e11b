"""``moment place --pack``: SSD rows laid out for the batches the trainer will read.

After the bins are written, the trainer's batches are replayed over the graph (the dataset's, in
its ids), and their samples stored for the trainer to load instead of sampling
(:mod:`placement.samples`); their vertices are mapped to bin rows through ``old_to_new``. Without
``--pack-budget`` (:mod:`placement.pack`) each SSD bin (written to an unpacked copy first) gets its
slot map and is rewritten in the order the batches first read its rows; with it
(:mod:`placement.chunks`) the bins stay in id order and each gets per-batch chunks and a shared
cache beside it. Either way the prediction is re-solved for the packed reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moment import faults
from moment.contracts.placed import (
    BinChunks,
    PackChunks,
    PackFile,
    PackSummary,
    Prediction,
    SampleFiles,
    bin_file_name,
)
from moment.outputs import Staging
from moment.planner.workload import Workload
from moment.progress import Progress, stage_update
from placement import chunks as ck
from placement import pack as pk
from placement import relabel as rl
from placement import samples as smp
from placement.ddak import BinSpec, Placement
from placement.hotness import Hotness
from placement.place_write import PLACED_FILES, Phases, PlaceRun, bin_path, packed, partial, unpacked_path
from placement.predict import predict, write_workload
from placement.writer import Written, save_npy


def slot_file(name: str) -> str:
    return f"pack_{name.replace(':', '-')}.npy"


def map_file(kind: str, name: str) -> str:
    """A chunk-mode row map's file name (``kind``: chunkrows, chunkoff, sharedrows)."""
    return f"{kind}_{name.replace(':', '-')}.npy"


def pack_file_path(run: PlaceRun, stage: Staging, spec: BinSpec, kind: str) -> Path:
    """Where a bin's ``chunks`` or ``shared`` file goes: beside the bin, under this run's id."""
    return bin_path(run, stage, spec).with_name(bin_file_name(f"{spec.name}-{kind}", stage.run_id))


@dataclass
class Replay:
    """What both packings replay: the SSD bins (plan order), their first new ids, the batches
    (their vertices, read back from the stored samples), and the samples' files."""

    ssd: list[int]
    starts: list[int]
    counts: list[int]
    batches: Callable[[], Iterator[np.ndarray]]
    total: int
    samples: SampleFiles
    sample_pages: int  # bytes of the pages loading every stored batch reads of the sample files


def _replay(
    run: PlaceRun, stage: Staging, hot: Hotness, specs: list[BinSpec], placed: Placement, progress: Progress | None
) -> Replay:
    """Sample the trainer's batches once and store them (:mod:`placement.samples`, dataset ids);
    the packing passes read their vertices back from there, as rows (through ``old_to_new``)."""
    opts = run.opts
    order = rl.bin_order([s.tier for s in specs])
    starts = dict(zip(order, np.cumsum([0] + [int(placed.used[b]) for b in order]).tolist()))
    ssd = [b for b in order if specs[b].tier == "ssd"]
    arrays = {k: np.load(stage.data / PLACED_FILES[k], mmap_mode="r") for k in ("indptr", "indices", "train")}
    ranks, epochs = opts.pack_ranks or 1, opts.pack_epochs
    fanouts, batch = list(hot.fanouts), hot.batch_size
    total = pk.replay_batches(len(arrays["train"]), batch, epochs, ranks)
    drawn = pk.replay_samples(
        arrays["indptr"], arrays["indices"], arrays["train"], fanouts, batch, opts.seed, epochs, ranks
    )
    node_dtype = np.dtype(rl.id_type(run.ds.num_nodes))
    update = stage_update(progress, "sampling the training batches")
    files = smp.record(stage.data, drawn, len(fanouts), node_dtype, update, total)
    faults.point("place:samples-stored")
    stored = smp.StoredSamples.in_dir(stage.data, files)
    pages = sum(int(p.sum()) for p in stored.pages().values())
    rows = np.load(stage.data / PLACED_FILES["old_to_new"], mmap_mode="r")

    def batches() -> Iterator[np.ndarray]:
        return (rows[nodes] for nodes in stored.all_nodes())

    return Replay(ssd, [starts[b] for b in ssd], [int(placed.used[b]) for b in ssd], batches, total, files, pages)


def pack_bins(
    run: PlaceRun,
    stage: Staging,
    hot: Hotness,
    specs: list[BinSpec],
    placed: Placement,
    written: list[Written],
    phases: Phases,
    progress: Progress | None,
) -> tuple[list[Written], PackSummary]:
    """Replay the trainer's first batches over the graph and pack the SSD bins for
    them: ordered in place, or within ``--pack-budget`` into per-batch chunks and shared caches
    (:func:`chunk_bins`); record that all of it is done."""
    if run.opts.pack_budget is not None:
        return chunk_bins(run, stage, hot, specs, placed, written, phases, progress)
    data = stage.data
    with phases("pack"):
        r = _replay(run, stage, hot, specs, placed, progress)
        plan = pk.plan_pack(
            r.batches,
            r.starts,
            r.counts,
            run.ds.row_bytes,
            stage_update(progress, "replaying the training batches"),
            r.total,
        )
        slots = {}
        for b, slot in zip(r.ssd, plan.slots):
            save_npy(data / slot_file(specs[b].name), slot, rl.id_type(max(slot.size, 1))).close()
            slots[specs[b].name] = slot_file(specs[b].name).removesuffix(".npy")
        faults.point("place:pack-planned")
        summary = _summary(run, hot, plan, slots, r.samples, r.sample_pages)  # slot maps: in memory, read once
        done = list(written)
        for b, slot in zip(r.ssd, plan.slots):
            final = partial(bin_path(run, stage, specs[b]))
            done[b] = pk.write_packed(written[b].path, final, specs[b].name, slot, run.ds.row_bytes)
        pk.save_state(data, run.key, done, summary)
    faults.point("place:packed")
    return done, summary


def _summary(
    run: PlaceRun,
    hot: Hotness,
    plan: pk.PackPlan | ck.ChunkPlan,
    slots: dict[str, str],
    samples: SampleFiles,
    placed_bytes: int,
) -> PackSummary:
    opts = run.opts
    return PackSummary(
        epochs=opts.pack_epochs,
        ranks=opts.pack_ranks or 1,
        seed=opts.seed,
        batch_size=hot.batch_size,
        fanouts=list(hot.fanouts),
        batches=plan.batches,
        slots=slots,
        useful_bytes=plan.useful_bytes,
        unpacked_bytes=plan.unpacked_bytes,
        packed_bytes=plan.packed_bytes,
        reads=plan.reads,
        placed_bytes=placed_bytes,
        samples=samples,
    )


def chunk_bins(
    run: PlaceRun,
    stage: Staging,
    hot: Hotness,
    specs: list[BinSpec],
    placed: Placement,
    written: list[Written],
    phases: Phases,
    progress: Progress | None,
) -> tuple[list[Written], PackSummary]:
    """``--pack-budget``: each SSD bin's per-batch chunks and shared cache (:mod:`placement.chunks`),
    their row maps in the placed directory, both files written in one pass over the bin."""
    data, opts, rb = stage.data, run.opts, run.ds.row_bytes
    assert opts.pack_budget is not None
    with phases("pack"):
        r = _replay(run, stage, hot, specs, placed, progress)
        budget = ck.parse_budget(opts.pack_budget, sum(c * rb for c in r.counts))
        plan = ck.plan_chunks(
            r.batches,
            r.starts,
            r.counts,
            rb,
            budget,
            f"--pack-budget {opts.pack_budget}",
            stage_update(progress, "replaying the training batches"),
            r.total,
            opts.seed,
        )
        maps: dict[str, dict[str, str]] = {}
        for i, b in enumerate(r.ssd):
            name, maps[specs[b].name] = specs[b].name, {}
            for kind, rows in (
                ("chunkrows", plan.chunk_rows[i]),
                ("chunkoff", plan.chunk_offsets[i]),
                ("sharedrows", plan.shared_rows[i]),
            ):
                dtype = np.int64 if kind == "chunkoff" else rl.id_type(max(r.counts[i], 1))
                save_npy(data / map_file(kind, name), rows, dtype).close()
                maps[name][kind] = map_file(kind, name).removesuffix(".npy")
        faults.point("place:pack-planned")
        files = {}
        for i, b in enumerate(r.ssd):
            path = {kind: partial(pack_file_path(run, stage, specs[b], kind)) for kind in ("chunks", "shared")}
            outputs = [
                ck.chunk_file("chunks", path["chunks"], plan.chunk_rows[i], plan.chunk_offsets[i], rb, plan.align),
                ck.Gathered("shared", path["shared"], plan.shared_rows[i]),
            ]
            step = stage_update(progress, f"packing {specs[b].name}")
            for w in ck.write_gathered(written[b].path, r.counts[i], rb, outputs, step):
                final = w.path.with_name(w.path.name.removesuffix(".partial"))
                where = str(final.relative_to(data)) if final.is_relative_to(data) else str(final)
                files[specs[b].name, w.name] = PackFile(
                    path=where, bytes=w.bytes, digest=w.digest, digest_algorithm=w.algorithm
                )
        bins = {
            specs[b].name: BinChunks(
                chunks=files[specs[b].name, "chunks"],
                shared=files[specs[b].name, "shared"],
                chunk_rows=maps[specs[b].name]["chunkrows"],
                chunk_offsets=maps[specs[b].name]["chunkoff"],
                shared_rows=maps[specs[b].name]["sharedrows"],
            )
            for b in r.ssd
        }
        maps_read = sum(
            ck.row_map_pages(data / map_file("chunkrows", specs[b].name), plan.chunk_offsets[i])
            for i, b in enumerate(r.ssd)
        )
        summary = _summary(run, hot, plan, {}, r.samples, r.sample_pages + maps_read).model_copy(
            update={
                "chunks": PackChunks(
                    budget=budget,
                    bytes=plan.bytes,
                    threshold=plan.threshold,
                    bins=bins,
                    align=plan.align,
                    order=plan.order,
                )
            }
        )
        pk.save_state(data, run.key, written, summary)
    faults.point("place:packed")
    return written, summary


def remove_unpacked(run: PlaceRun, stage: Staging, specs: list[BinSpec]) -> None:
    """The unpacked copies, once the packed bins and the state recording them are on disk."""
    for s in specs:
        if packed(run, s):
            unpacked_path(run, stage, s).unlink(missing_ok=True)


def packed_prediction(
    run: PlaceRun, workload: Workload, prediction: Prediction, summary: PackSummary, data: Path
) -> Prediction:
    """The prediction for the packed layout: the workload's SSD reads are the replay's (mean
    bytes moved per read, pages per feature byte: the SSD pages and those of the stored samples
    and chunk row maps, every byte a batch reads from disk, charged to the SSDs), the model
    re-solved with them for the iteration time. DDAK's targets (``bin_shares``) stay those it
    placed by: packing comes after."""
    amp, disk = summary.amplification, summary.disk_amplification
    if amp is None or summary.reads == 0:  # the replayed batches read no SSD row: nothing to pack for
        return prediction
    packed = workload.model_copy(
        update={
            "ssd_pack_bytes": max(1, round(summary.packed_bytes / summary.reads)),
            "ssd_pack_amplification": disk or amp,
        }
    )
    write_workload(data / PLACED_FILES["workload"], packed)
    update: dict[str, Any] = {"ssd_amplification": amp, "disk_amplification": disk}
    if run.machine is not None:
        update["iteration_s"] = predict(run.plan, run.machine, packed).iteration_s
    return prediction.model_copy(update=update)
