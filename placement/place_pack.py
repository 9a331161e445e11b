"""``moment place --pack``: SSD rows laid out in the order the trainer's first batches read them.

After the bins are written (SSD bins to an unpacked copy), the trainer's batches are replayed
over the relabelled graph (:mod:`placement.pack`), each SSD bin gets its slot map and is
rewritten packed from its copy, and the prediction is re-solved for the packed reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moment import faults
from moment.contracts.placed import PackSummary, Prediction
from moment.outputs import Staging
from moment.planner.workload import Workload
from moment.progress import Progress, stage_update
from placement import pack as pk
from placement import relabel as rl
from placement.ddak import BinSpec, Placement
from placement.hotness import Hotness
from placement.place_write import PLACED_FILES, Phases, PlaceRun, bin_path, packed, partial, unpacked_path
from placement.predict import predict, write_workload
from placement.writer import Written, save_npy


def slot_file(name: str) -> str:
    return f"pack_{name.replace(':', '-')}.npy"


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
    """Replay the trainer's first batches over the relabelled graph, save each SSD bin's slot
    map, write the packed bins from their unpacked copies, and record that all of it is done."""
    data, opts = stage.data, run.opts
    with phases("pack"):
        order = rl.bin_order([s.tier for s in specs])
        starts = dict(zip(order, np.cumsum([0] + [int(placed.used[b]) for b in order]).tolist()))
        ssd = [b for b in order if specs[b].tier == "ssd"]
        arrays = {k: np.load(data / PLACED_FILES[k], mmap_mode="r") for k in ("indptr", "indices", "train")}
        ranks, epochs = opts.pack_ranks or 1, opts.pack_epochs
        fanouts, batch = list(hot.fanouts), hot.batch_size
        plan = pk.plan_pack(
            lambda: pk.replay(
                arrays["indptr"], arrays["indices"], arrays["train"], fanouts, batch, opts.seed, epochs, ranks
            ),
            [starts[b] for b in ssd],
            [int(placed.used[b]) for b in ssd],
            run.ds.row_bytes,
            stage_update(progress, "replaying the training batches"),
            pk.replay_batches(len(arrays["train"]), batch, epochs, ranks),
        )
        slots = {}
        for b, slot in zip(ssd, plan.slots):
            save_npy(data / slot_file(specs[b].name), slot, rl.id_type(max(slot.size, 1))).close()
            slots[specs[b].name] = slot_file(specs[b].name).removesuffix(".npy")
        faults.point("place:pack-planned")
        summary = PackSummary(
            epochs=epochs,
            ranks=ranks,
            seed=opts.seed,
            batch_size=batch,
            fanouts=fanouts,
            batches=plan.batches,
            slots=slots,
            useful_bytes=plan.useful_bytes,
            unpacked_bytes=plan.unpacked_bytes,
            packed_bytes=plan.packed_bytes,
            reads=plan.reads,
        )
        done = list(written)
        for b, slot in zip(ssd, plan.slots):
            final = partial(bin_path(run, stage, specs[b]))
            done[b] = pk.write_packed(written[b].path, final, specs[b].name, slot, run.ds.row_bytes)
        pk.save_state(data, run.key, done, summary)
    faults.point("place:packed")
    return done, summary


def remove_unpacked(run: PlaceRun, stage: Staging, specs: list[BinSpec]) -> None:
    """The unpacked copies, once the packed bins and the state recording them are on disk."""
    for s in specs:
        if packed(run, s):
            unpacked_path(run, stage, s).unlink(missing_ok=True)


def packed_prediction(
    run: PlaceRun, workload: Workload, prediction: Prediction, summary: PackSummary, data: Path
) -> Prediction:
    """The prediction for the packed layout: the workload's SSD reads are the replay's (mean
    bytes moved per read, pages per feature byte), the model re-solved with them for the
    iteration time. DDAK's targets (``bin_shares``) stay those it placed by: packing comes after."""
    amp = summary.amplification
    if amp is None or summary.reads == 0:  # the replayed batches read no SSD row: nothing to pack for
        return prediction
    packed = workload.model_copy(
        update={"ssd_pack_bytes": max(1, round(summary.packed_bytes / summary.reads)), "ssd_pack_amplification": amp}
    )
    write_workload(data / PLACED_FILES["workload"], packed)
    update: dict[str, Any] = {"ssd_amplification": amp}
    if run.machine is not None:
        update["iteration_s"] = predict(run.plan, run.machine, packed).iteration_s
    return prediction.model_copy(update=update)
