"""``moment place``'s outputs: the bins in one sequential pass, the topology, labels, splits and
id maps rewritten in the new ids, and placed.json built from what was written (sizes and
checksums taken on the way), with the seconds each phase took."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moment import faults
from moment.contracts.placed import MANIFEST, PHASES, PackSummary, PlacedManifest, Prediction, bin_file_name
from moment.contracts.plan import PlanDoc
from moment.outputs import Staging
from moment.planner.workload import Workload
from moment.progress import Progress, stage_update
from moment.topology.model import Machine
from placement import relabel as rl
from placement.dataset import Dataset, label_type
from placement.ddak import BinSpec, Placement
from placement.digests import PLACED_DIGEST, file_digest
from placement.hotness import Hotness
from placement.policies import get_policy
from placement.predict import write_workload
from placement.samples import FILES as SAMPLE_FILES
from placement.writer import BinFile, NpyWriter, Written, save_npy, write_bins

if TYPE_CHECKING:
    from placement.place import PlaceOptions

# Files of a placed directory besides the bins (manifest key -> name). hotness_new.npy: counts
# in new ids; hotness.npy + .json: the same in original ids, usable as `moment place --hotness`.
PLACED_FILES = {
    "indptr": "indptr.npy",
    "indices": "indices.npy",
    "labels": "labels.npy",
    "train": "train_idx.npy",
    "val": "val_idx.npy",
    "test": "test_idx.npy",
    "old_to_new": "old_to_new.npy",
    "new_to_old": "new_to_old.npy",
    "hotness": "hotness_new.npy",
    "hotness_counts": "hotness.npy",
    "hotness_meta": "hotness.json",
    "workload": "workload.yaml",
}


@dataclass
class PlaceRun:
    """One ``moment place``: its validated inputs and the key naming them."""

    plan_path: Path
    dataset_path: Path
    out: Path
    opts: PlaceOptions
    plan: PlanDoc
    machine: Machine | None
    no_machine: str | None
    ds: Dataset
    dirs: dict[str, Path]
    caches: tuple[int, int]
    key: str
    had_output: bool


class Phases:
    """Seconds per phase of a run (placed.json ``timings_s``, keys of ``PHASES``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def written(self, files: list[NpyWriter], phase: str, wall: float) -> None:
        """``wall`` seconds spent writing ``files`` in ``phase``, less what it waited for their
        hashing and fsync; those ran in threads beside it and are their own phases (busy time)."""
        self.add(phase, wall - sum(f.wait_s for f in files))
        self.add("checksums", sum(f.hash_s for f in files))
        self.add("fsync", sum(f.fsync_s for f in files))

    def rounded(self) -> dict[str, float]:
        """The seconds in ``PHASES`` order, with the total so far."""
        seconds = {**self.seconds, "total": time.perf_counter() - self.start}
        return {k: round(seconds[k], 3) for k in PHASES if k in seconds}


def bin_path(run: PlaceRun, stage: Staging, spec: BinSpec) -> Path:
    """Where a bin's file goes: its --ssd-dir, else inside the placed directory."""
    where = run.dirs.get(spec.name) or (
        stage.data / ("cache" if spec.tier != "ssd" else f"bins/{spec.name.replace(':', '-')}")
    )
    return where / bin_file_name(spec.name, stage.run_id)


def packed(run: PlaceRun, spec: BinSpec) -> bool:
    """Whether ``spec``'s bin is packed (``--pack`` without ``--pack-budget``: SSD bins), i.e.
    first written unpacked."""
    return run.opts.pack and run.opts.pack_budget is None and spec.tier == "ssd"


def partial(final: Path) -> Path:
    """A bin's name until the commit."""
    return final.with_name(final.name + ".partial")


def unpacked_path(run: PlaceRun, stage: Staging, spec: BinSpec) -> Path:
    """Where the bin writer puts a bin that is then packed (beside it, under this run's id, so
    that a run with other inputs finds and removes it: ``discard_build``)."""
    return partial(bin_path(run, stage, spec).with_name(bin_file_name(f"{spec.name}-unpacked", stage.run_id)))


def write_placed_bins(
    run: PlaceRun, stage: Staging, specs: list[BinSpec], placed: Placement, phases: Phases, progress: Progress | None
) -> list[Written]:
    """The bins, one sequential pass over the source features (.partial names until the commit)."""
    files = []
    for b, s in enumerate(specs):
        path = unpacked_path(run, stage, s) if packed(run, s) else partial(bin_path(run, stage, s))
        files.append(BinFile(s.name, path, int(placed.used[b])))
    t0 = time.perf_counter()
    result = write_bins(
        run.ds.features(), placed.bin_of, files, stage.data, run.key, progress=stage_update(progress, "writing bins")
    )
    phases.add("write_bins", time.perf_counter() - t0 - result.wait)
    phases.add("checksums", result.hash)
    phases.add("fsync", result.fsync)
    faults.point("place:bins-written")
    return result.files


def write_arrays(
    run: PlaceRun,
    data: Path,
    hot: Hotness,
    placed: Placement,
    specs: list[BinSpec],
    workload: Workload,
    phases: Phases,
    progress: Progress | None,
) -> dict[str, NpyWriter]:
    """Topology, labels, splits, id maps and hotness in the new ids, each written front to back
    and checksummed on the way; returns them by manifest key. Ids and counts are int32 where
    they fit (``relabel.id_type``), labels the narrowest type holding the classes
    (``dataset.label_type``): fewer bytes to write and hash; readers take any of them."""
    ds = run.ds
    t0 = time.perf_counter()
    r = rl.relabel(placed.bin_of, [s.tier for s in specs])
    n = ds.num_nodes
    files = {
        "indptr": NpyWriter(data / PLACED_FILES["indptr"], np.int64, (n + 1,)),
        "indices": NpyWriter(data / PLACED_FILES["indices"], ds.indices().dtype, (ds.num_edges,)),
    }
    rl.rewrite_csr(
        ds.indptr(),
        ds.indices(),
        r,
        files["indptr"],
        files["indices"],
        progress=stage_update(progress, "rewriting topology"),
    )
    for f in files.values():
        f.finish()  # its last hashing and fsync go on beside the next files
    counts_type, labels_type = rl.id_type(int(np.max(hot.counts, initial=0))), label_type(ds.num_classes)
    for key, values, dtype in (("labels", ds.labels(), labels_type), ("hotness", hot.counts, counts_type)):
        files[key] = NpyWriter(data / PLACED_FILES[key], dtype, (n,))
        rl.permute(values, r.new_to_old, files[key])
        files[key].finish()
    for split in ("train", "val", "test"):
        ids = r.old_to_new[np.asarray(ds.split(split))]
        ids.sort()
        files[split] = save_npy(data / PLACED_FILES[split], ids, wait=False)
    files["old_to_new"] = save_npy(data / PLACED_FILES["old_to_new"], r.old_to_new, wait=False)
    files["new_to_old"] = save_npy(data / PLACED_FILES["new_to_old"], r.new_to_old, wait=False)
    for f in files.values():
        f.close()  # every file hashed and on disk before the manifest names it
    write_workload(data / PLACED_FILES["workload"], workload)
    phases.written(list(files.values()), "relabel", time.perf_counter() - t0)
    faults.point("place:arrays-written")
    return files


def build_manifest(
    run: PlaceRun,
    stage: Staging,
    hot: Hotness,
    prediction: Prediction,
    specs: list[BinSpec],
    placed: Placement,
    written: list[Written],
    files: dict[str, NpyWriter],
    phases: Phases,
    pack: PackSummary | None = None,
) -> PlacedManifest:
    """placed.json: final bin names, sizes and checksums (taken while writing), the prediction."""
    data, ds, opts = stage.data, run.ds, run.opts
    r_order = rl.bin_order([s.tier for s in specs])
    starts = np.concatenate(([0], np.cumsum([int(placed.used[b]) for b in r_order])))
    shares = placed.shares()
    bins_meta = []
    for i, idx in enumerate(r_order):
        spec, w, final = specs[idx], written[idx], bin_path(run, stage, specs[idx])
        bins_meta.append(
            {
                "name": spec.name,
                "tier": spec.tier,
                "start": int(starts[i]),
                "count": int(placed.used[idx]),
                "path": str(final.relative_to(data)) if final.is_relative_to(data) else str(final),
                "bytes": w.bytes,
                "digest": w.digest,
                "digest_algorithm": w.algorithm,
                "target": spec.target,
                "achieved": float(shares[idx]),
                "capacity": spec.capacity,
            }
        )
    entries = {
        k: {"path": PLACED_FILES[k], "bytes": f.bytes, "digest": f.digest, "digest_algorithm": f.algorithm}
        for k, f in files.items()
    }
    written_apart = {k: PLACED_FILES[k] for k in ("hotness_counts", "hotness_meta", "workload")}  # by their modules
    written_apart.update({key: f"{key}.npy" for key in (pack.map_keys if pack else ())})  # row maps
    written_apart.update({key: SAMPLE_FILES[key] for key in (pack.samples.keys if pack and pack.samples else ())})
    for k, name in written_apart.items():
        path = data / name
        digest = file_digest(path, PLACED_DIGEST)
        entries[k] = {"path": name, "bytes": path.stat().st_size, "digest": digest, "digest_algorithm": PLACED_DIGEST}
    doc = {
        "format": PlacedManifest.FORMAT,
        "run_id": stage.run_id,
        "key": run.key,
        "source": {"path": str(run.dataset_path.resolve()), "name": ds.meta.get("name")},
        "plan": {
            "path": str(run.plan_path.resolve()),
            "profile": run.plan.profile.model_dump(),
            "layout": run.plan.layout.name,
        },
        "policy": opts.policy,
        "pool": opts.pool,
        "priority": opts.priority if "priority" in get_policy(opts.policy).reads else None,
        "num_nodes": ds.num_nodes,
        "num_edges": ds.num_edges,
        "feature_dim": ds.feature_dim,
        "feature_dtype": ds.meta["feature_dtype"],
        "num_classes": ds.num_classes,
        "hotness": {
            "batches": hot.batches,
            "epochs": hot.epochs,
            "fanouts": list(hot.fanouts),
            "batch_size": hot.batch_size,
            "mean_unique_per_batch": hot.mean_unique_per_batch,
            "curve": hot.curve(),
            "bound": hot.bound,
            "tolerance": hot.tolerance,
        },
        "prediction": prediction.model_dump(),
        "bins": bins_meta,
        "files": entries,
        "timings_s": phases.rounded(),
        "pack": pack.model_dump() if pack else None,
    }
    return PlacedManifest.parse(doc, data / MANIFEST)  # a bug here is one line naming the field, not a traceback
