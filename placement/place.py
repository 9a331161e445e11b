"""``moment place``: a dataset + a plan → a placed dataset (GPU caches, CPU caches, SSD bins).

Steps, each reported: pre-sample hotness with the trainer's sampler (or load a saved one),
re-solve the plan's model for this dataset, its measured hotness and the cache sizes used
(``placement.predict``), place vertices with DDAK (or the hash baseline) against those per-bin
traffic targets, relabel, check free space on every target, write the bins in one sequential
pass, rewrite topology, labels and splits in the new ids, and commit: manifest last, then one
rename. Work happens in ``OUT.partial``; a killed run resumes from its last checkpoint when run
again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moment import faults
from moment.contracts.placed import MANIFEST, PlacedError, PlacedManifest, bin_file_name
from moment.contracts.plan import PlanDoc, read_plan
from moment.errors import MomentError, UsageError
from moment.fileio import atomic_write_text
from moment.outputs import Kind, Staging, check_free_space, check_out
from moment.planner.planfile import plan_profile
from moment.progress import Progress, stage_update
from moment.topology.model import Machine
from placement import relabel as rl
from placement.dataset import Dataset, check_dataset, open_dataset
from placement.ddak import BinSpec, Placement, hotness_order
from placement.hotness import Hotness, presample
from placement.placed import open_placed
from placement.policies import get_policy
from placement.predict import measured_workload, plan_prediction, predict, write_workload
from placement.writer import STATE, BinFile, file_digest, write_bins

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b|%|rows)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_rows(text: str, what: str, num_nodes: int, row_bytes: int) -> int:
    """Cache budget in rows from '2GB', '512MiB', '1%' (of the vertices) or '10000rows'."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"{what} {text!r}: expected a size like 2GB, 512MiB, 1% or 10000rows")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
        if value > 100:
            raise UsageError(f"{what} {text!r}: a share of the vertices is at most 100%")
        return int(num_nodes * value / 100)
    if unit == "rows":
        return int(value)
    return int(value * _UNITS[unit] // row_bytes)


@dataclass
class PlaceOptions:
    policy: str = "ddak"
    gpu_cache: str | None = None  # per GPU
    cpu_cache: str | None = None  # all sockets together
    ssd_dirs: dict[str, Path] = field(default_factory=dict)
    hotness: Path | None = None
    epochs: int = 1
    pool: int = 100
    priority: str = "projected"  # DDAK priority: projected (matches targets) or paper
    seed: int = 0
    profile: Machine | None = None  # the plan's profile where not bundled; another profile's plan is refused


def _cache_rows(plan: PlanDoc, ds: Dataset, opts: PlaceOptions) -> tuple[int, int]:
    """Rows of the GPU cache (each GPU) and the CPU cache (each socket), from ``--gpu-cache`` /
    ``--cpu-cache`` or else the plan's workload (``gpu_cache_gb``, ``cpu_cache_fraction``: one
    source of truth), capped by the vertices there are."""
    workload = plan.workload
    rb, n = ds.row_bytes, ds.num_nodes
    if opts.gpu_cache is not None:
        gpu_rows = parse_rows(opts.gpu_cache, "--gpu-cache", n, rb)
    else:
        gpu_rows = int(workload.gpu_cache_gb * 1e9 // rb)
    if opts.cpu_cache is not None:
        cpu_rows = parse_rows(opts.cpu_cache, "--cpu-cache", n, rb)
    else:
        cpu_rows = int(n * workload.cpu_cache_fraction)
    gpu_rows = min(gpu_rows, n)
    return gpu_rows, min(cpu_rows, n - gpu_rows)


def _bins(plan: PlanDoc, ds: Dataset, caches: tuple[int, int], shares: dict[str, float]) -> list[BinSpec]:
    """DDAK bins: the caches of ``caches`` rows, the SSDs as large as their capacity, each with
    its share of reads from ``shares`` (the prediction's)."""
    cap = {"gpu": caches[0], "cpu": caches[1]}
    rb, n = ds.row_bytes, ds.num_nodes
    return [
        BinSpec(
            t.bin,
            t.tier,
            cap[t.tier] if t.tier in cap else min(int((t.capacity_gb or 1e6) * 1e9 // rb), n),
            shares[t.bin],
        )
        for t in plan.bin_targets
    ]


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _save_npy(path: Path, array: np.ndarray) -> None:
    np.save(path, array)


def _validate_placed(root: Path) -> PlacedManifest:
    return PlacedManifest.read(root / MANIFEST)


def _placed_files(root: Path) -> list[Path]:
    """The files of a placed dataset that ``moment place`` wrote and may remove: each listed in
    its validated manifest, with the size the manifest records, bins under the run's own name."""
    m = PlacedManifest.read(root / MANIFEST)
    owned = []
    for b in m.bins:
        path = Path(b.path) if Path(b.path).is_absolute() else root / b.path
        if path.name == bin_file_name(b.name, m.run_id) and _size(path) == b.bytes:
            owned.append(path)
    owned += [root / f.path for f in m.files.values() if _size(root / f.path) == f.bytes]
    return [*owned, root / MANIFEST]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else -1
    except OSError:
        return -1


PLACED = Kind("placed dataset", MANIFEST, "moment place", _validate_placed, _placed_files, PlacedError)
INPUTS = "inputs.json"  # in the staging data dir: the key of the inputs a partial build is for
SCRATCH = (INPUTS, "bin_of.npy", STATE)  # build state, removed before publishing
MIN_BATCHES = 10  # fewer pre-sampled batches than this: the hotness ranking is mostly noise
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


def _ssd_dirs(opts: PlaceOptions, out: Path) -> dict[str, Path]:
    """Absolute SSD directories (a relative one would later be resolved against the placed
    directory), none inside the output (publishing renames it)."""
    dirs = {}
    for name, d in opts.ssd_dirs.items():
        path = Path(d).absolute()
        if path.exists() and not path.is_dir():
            raise UsageError(f"--ssd-dir {name}={d}: not a directory")
        for inner in (out.absolute(), out.absolute().with_name(out.name + ".partial")):
            if path == inner or path.is_relative_to(inner):
                raise UsageError(
                    f"--ssd-dir {name}={d}: inside the output directory {out}; give a directory outside it"
                )
        dirs[name] = path
    return dirs


def _inputs_key(data: Path) -> str | None:
    try:
        return json.loads((data / INPUTS).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _intact(root: Path) -> bool:
    """Every file of a placed dataset present at its recorded size (cheap; no checksums)."""
    try:
        open_placed(root)
        return True
    except MomentError:
        return False


def _finish_bins(m: PlacedManifest, data: Path) -> None:
    """Give every bin its final name (idempotent: a killed run may have renamed some already)."""
    for b in m.bins:
        final = Path(b.path) if Path(b.path).is_absolute() else data / b.path
        partial = final.with_name(final.name + ".partial")
        if partial.exists():
            partial.replace(final)
        elif _size(final) != b.bytes:
            raise PlacedError(f"{final}: missing or truncated while committing; remove {data.parent} and run again")


def _commit(stage: Staging, dirs: dict[str, Path], log: Callable[[str], None]) -> PlacedManifest:
    """Finish a staged placement (manifest written in ``data``): bins renamed, scratch removed,
    published over the old placement. Every step is idempotent, so a killed commit is finished
    by the next run."""
    m = PlacedManifest.read(stage.data / MANIFEST) if stage.data.exists() else None
    if m is not None:
        _finish_bins(m, stage.data)
        faults.point("place:bins-renamed")
        for name in SCRATCH:
            (stage.data / name).unlink(missing_ok=True)
    keep = [Path(b.path) for b in m.bins if Path(b.path).is_absolute()] if m else []
    for note in stage.publish("place", keep=keep, external_dirs=dirs.values()):
        log(f"note: {note}")
    return _validate_placed(stage.out)


def _discard_build(stage: Staging) -> None:
    """Throw away a killed run's partial build made with other inputs: the staging directory is
    this command's (its marker and lock prove it), and outside it only ``.partial`` bins under
    this run's id, in the directories that build recorded."""
    try:
        recorded = json.loads((stage.data / INPUTS).read_text()).get("bin_dirs", [])
    except (OSError, ValueError, AttributeError):
        recorded = []
    for d in recorded:
        for f in Path(d).glob(f"*-{stage.run_id}.bin.partial"):
            f.unlink()
    shutil.rmtree(stage.data)


def place(
    plan_path: str | Path,
    dataset_path: str | Path,
    out: str | Path,
    opts: PlaceOptions,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Place a dataset per a plan; returns the manifest written (``placed.json``)."""
    t_start = time.perf_counter()
    out = Path(out)
    if opts.epochs < 1:
        raise UsageError(f"--epochs {opts.epochs}: pre-sampling needs at least 1 epoch")
    if opts.pool < 1:
        raise UsageError(f"--pool {opts.pool}: must be at least 1")
    place_vertices = get_policy(opts.policy)
    plan = read_plan(plan_path)
    try:
        machine, no_machine = plan_profile(plan, opts.profile)
    except UsageError as exc:
        raise UsageError(f"{plan_path}: {exc}") from None
    unknown = set(opts.ssd_dirs) - {t.bin for t in plan.bin_targets if t.tier == "ssd"}
    if unknown:
        raise UsageError(f"--ssd-dir names {', '.join(sorted(unknown))}, which the plan has no SSD bin for")
    ds = open_dataset(dataset_path)
    dirs = _ssd_dirs(opts, out)
    check_out(out, PLACED)  # absent, empty or a placed dataset: anything else refused before any work
    check_dataset(ds)  # a full scan: a bad id must not wrap around or crash the trainer later
    opts = replace(opts, ssd_dirs=dirs)
    had_output = check_out(out, PLACED)
    caches = _cache_rows(plan, ds, opts)
    fanouts, batch = tuple(plan.workload.fanouts), plan.workload.batch_size
    hot_given = file_digest(opts.hotness) if opts.hotness is not None and opts.hotness.is_file() else None
    key = _key(
        plan.profile.model_dump(),
        plan.workload.model_dump(mode="json"),
        [t.model_dump() for t in plan.bin_targets],
        ds.meta,
        caches,
        machine is not None,
        opts.policy,
        opts.pool,
        opts.priority,
        opts.seed,
        opts.epochs,
        fanouts,
        batch,
        hot_given,
        {k: str(v) for k, v in dirs.items()},
        str(Path(dataset_path).resolve()),
    )

    stage = Staging(out, PLACED)
    if stage.resume():
        if stage.old.exists() or (stage.data / MANIFEST).exists():
            log(f"finishing the commit of an interrupted `moment place` into {out}")
            _commit(stage, dirs, log)
            had_output = True
            stage = Staging(out, PLACED)
        elif stage.data.exists() and _inputs_key(stage.data) != key:
            log(f"{stage.dir}: left by an interrupted run with other inputs: starting over")
            _discard_build(stage)
        elif stage.data.exists():
            log(f"resuming the interrupted `moment place` in {stage.dir}")
    if had_output and not stage.data.exists():
        try:
            current = _validate_placed(out)
        except MomentError:
            current = None
        if current is not None and current.key == key and _intact(out):
            stage.release()
            log(f"{out} already holds this placement (same plan, dataset and options): nothing to do")
            return current.model_dump(mode="json")
    data = stage.data

    # 1. Hotness: the one a killed run already computed, a saved one, or pre-sample now.
    hot_file = data / "hotness.npy"
    if hot_file.exists():
        hot = Hotness.load(hot_file)
    elif opts.hotness is not None:
        hot = Hotness.load(opts.hotness, num_nodes=ds.num_nodes)
    else:
        hot = presample(
            ds,
            fanouts=fanouts,
            batch_size=batch,
            epochs=opts.epochs,
            seed=opts.seed,
            progress=stage_update(progress, "pre-sampling hotness"),
        )
    if hot.counts.shape != (ds.num_nodes,):
        raise UsageError(f"hotness has {hot.counts.shape[0]} vertices, the dataset {ds.num_nodes}")
    log(
        f"hotness: {hot.batches} batches, {hot.mean_unique_per_batch:,.0f} unique vertices per batch; "
        f"top 1% of vertices catch {dict(hot.curve((0.01,)))[0.01]:.1%} of reads"
    )
    if hot.batches < MIN_BATCHES:
        log(
            f"warning: the hotness comes from only {hot.batches} pre-sampled batch(es) (fewer than {MIN_BATCHES}), "
            f"so its ranking of vertices is noisy: raise --epochs"
        )

    # 2. The plan's model re-solved for this dataset and these caches: DDAK's targets.
    workload = measured_workload(plan.workload, ds, hot, *caches)
    if machine is not None:
        prediction = predict(plan, machine, workload)
    else:
        prediction = plan_prediction(plan)
        log(
            f"warning: {no_machine}, so the targets and the prediction recorded are the plan's, made for its own "
            f"workload ({plan.workload.nodes:,} vertices), not re-solved for this dataset"
        )
    specs = _bins(plan, ds, caches, prediction.bin_shares)

    # 3. Placement (deterministic: a resumed run computes the one it saved).
    t0 = time.perf_counter()
    order = hotness_order(hot.counts)
    placed: Placement = place_vertices(hot.counts, specs, order, opts)
    place_s = time.perf_counter() - t0
    r = rl.relabel(placed.bin_of, [s.tier for s in specs])

    # 4. Preflight: every target has room for what goes there; nothing is created before it.
    rb = ds.row_bytes
    needs: dict[Path, int] = {}
    for b, spec in enumerate(specs):
        d = dirs.get(spec.name, out)
        needs[d] = needs.get(d, 0) + int(placed.used[b]) * rb
    needs[out] = (
        needs.get(out, 0) + (ds.num_edges * ds.indices().dtype.itemsize + (ds.num_nodes + 1) * 8) + 4 * ds.num_nodes * 8
    )
    check_free_space(needs)

    stage.create()  # OUT.partial, locked (when resuming it is ours already)
    data.mkdir(exist_ok=True)
    atomic_write_text(data / INPUTS, json.dumps({"key": key, "bin_dirs": sorted({str(d) for d in dirs.values()})}))
    if not hot_file.exists():
        hot.save(hot_file)
    bin_file = data / "bin_of.npy"
    if bin_file.exists() and not np.array_equal(np.load(bin_file), placed.bin_of):
        raise MomentError(
            f"{bin_file}: the resumed placement differs from the saved one (a bug): remove {stage.dir} to start over"
        )
    np.save(bin_file, placed.bin_of)
    faults.point("place:planned")

    # 5. Bins, one sequential pass over the source features (.partial names until the commit).
    def bin_path(spec: BinSpec) -> Path:
        where = dirs.get(spec.name) or (
            data / ("cache" if spec.tier != "ssd" else f"bins/{spec.name.replace(':', '-')}")
        )
        return where / bin_file_name(spec.name, stage.run_id)

    files = [
        BinFile(s.name, bin_path(s).with_name(bin_path(s).name + ".partial"), int(placed.used[b]))
        for b, s in enumerate(specs)
    ]
    t0 = time.perf_counter()
    written = write_bins(
        ds.features(), placed.bin_of, files, data, key, progress=stage_update(progress, "writing bins")
    )
    write_s = time.perf_counter() - t0
    faults.point("place:bins-written")

    # 6. Topology, labels, splits, id maps in the new ids.
    rl.rewrite_csr(
        ds.indptr(),
        ds.indices(),
        r,
        data / "indptr.npy",
        data / "indices.npy",
        progress=stage_update(progress, "rewriting topology"),
    )
    _save_npy(data / "labels.npy", np.asarray(ds.labels())[r.new_to_old])
    for split in ("train", "val", "test"):
        _save_npy(data / f"{split}_idx.npy", np.sort(r.old_to_new[np.asarray(ds.split(split))]))
    _save_npy(data / "old_to_new.npy", r.old_to_new)
    _save_npy(data / "new_to_old.npy", r.new_to_old)
    _save_npy(data / "hotness_new.npy", hot.counts[r.new_to_old])
    write_workload(data / "workload.yaml", workload)
    faults.point("place:arrays-written")

    # 7. Stage the manifest (final bin names, checksums), then commit: rename bins, publish.
    shares = placed.shares()
    bins_meta = []
    for idx in r.order:
        spec, w = specs[idx], written[idx]
        final = bin_path(spec)
        bins_meta.append(
            {
                "name": spec.name,
                "tier": spec.tier,
                "start": int(r.starts[r.order.index(idx)]),
                "count": int(placed.used[idx]),
                "path": str(final.relative_to(data)) if final.is_relative_to(data) else str(final),
                "bytes": w.bytes,
                "digest": w.digest,
                "target": spec.target,
                "achieved": float(shares[idx]),
                "capacity": spec.capacity,
            }
        )
    files_meta = {
        k: {"path": name, "bytes": (data / name).stat().st_size, "digest": file_digest(data / name)}
        for k, name in PLACED_FILES.items()
    }
    manifest = PlacedManifest(
        run_id=stage.run_id,
        key=key,
        source={"path": str(Path(dataset_path).resolve()), "name": ds.meta.get("name")},
        plan={"path": str(Path(plan_path).resolve()), "profile": plan.profile.model_dump(), "layout": plan.layout.name},
        policy=opts.policy,
        pool=opts.pool,
        priority=opts.priority if opts.policy == "ddak" else None,
        num_nodes=ds.num_nodes,
        num_edges=ds.num_edges,
        feature_dim=ds.feature_dim,
        feature_dtype=ds.meta["feature_dtype"],
        num_classes=ds.num_classes,
        hotness={
            "batches": hot.batches,
            "epochs": hot.epochs,
            "fanouts": list(hot.fanouts),
            "batch_size": hot.batch_size,
            "mean_unique_per_batch": hot.mean_unique_per_batch,
            "curve": hot.curve(),
        },
        prediction=prediction,
        bins=bins_meta,
        files=files_meta,
        timings_s={
            "placement": round(place_s, 3),
            "write_bins": round(write_s, 3),
            "total": round(time.perf_counter() - t_start, 3),
        },
    )
    manifest.write(data / MANIFEST)
    faults.point("place:manifest-staged")
    return _commit(stage, dirs, log).model_dump(mode="json")
