"""``moment place``: a dataset + a plan → a placed dataset (GPU caches, CPU caches, SSD bins).

Steps, each reported: pre-sample hotness with the trainer's sampler (or load a saved one), place
vertices with DDAK (or the hash baseline) against the plan's per-bin traffic targets, relabel,
check free space on every target, write the bins in one sequential pass, rewrite topology,
labels and splits in the new ids, and commit: manifest last, then one rename. Work happens in
``OUT.partial``; a killed run resumes from its last checkpoint when run again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moment.errors import MomentError, UsageError
from moment.planner.planfile import PlanDoc, read_plan
from placement import relabel as rl
from placement.dataset import Dataset, open_dataset
from placement.ddak import BinSpec, Placement, ddak, hash_placement, hotness_order
from placement.hotness import Hotness, presample
from placement.placed import FORMAT, MANIFEST
from placement.writer import BinFile, file_digest, write_bins

Progress = Callable[[str, int], Callable[[int, int], None]]  # stage, total -> update(done, total)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b|%|rows)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_rows(text: str, what: str, num_nodes: int, row_bytes: int) -> int:
    """Cache budget in rows from '2GB', '512MiB', '1%' (of the vertices) or '10000rows'."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"{what} {text!r}: expected a size like 2GB, 512MiB, 1% or 10000rows")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
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
    profile_sha256: str | None = None  # refuse a plan made for another profile


def _bins(plan: PlanDoc, ds: Dataset, opts: PlaceOptions, out: Path) -> tuple[list[BinSpec], dict[str, Path]]:
    """DDAK bins from the plan's targets, capacities from the cache budgets and the SSDs."""
    workload = plan.workload
    targets = plan.bin_targets
    gpus = [t for t in targets if t.tier == "gpu"]
    cpus = [t for t in targets if t.tier == "cpu"]
    rb, n = ds.row_bytes, ds.num_nodes
    if opts.gpu_cache is not None:
        gpu_rows = parse_rows(opts.gpu_cache, "--gpu-cache", n, rb)
    else:
        per_gpu_gb = workload.gpu_cache_gb or 0.5 * min((t.capacity_gb or 0 for t in gpus), default=0)
        gpu_rows = int(per_gpu_gb * 1e9 // rb)
    if opts.cpu_cache is not None:
        cpu_rows = parse_rows(opts.cpu_cache, "--cpu-cache", n, rb)
    else:
        cpu_rows = int(n * workload.cpu_cache_fraction)
    dirs: dict[str, Path] = {}
    specs = []
    unknown = set(opts.ssd_dirs) - {t.bin for t in targets if t.tier == "ssd"}
    if unknown:
        raise UsageError(f"--ssd-dir names {', '.join(sorted(unknown))}, which the plan has no SSD bin for")
    for t in targets:
        if t.tier == "gpu":
            cap = gpu_rows
        elif t.tier == "cpu":  # the CPU cache goes where the plan wants CPU reads served from
            total = sum(c.share for c in cpus)
            cap = int(cpu_rows * t.share / total) if total > 0 else cpu_rows // max(len(cpus), 1)
        else:
            d = opts.ssd_dirs.get(t.bin, out.with_name(out.name + ".partial") / "bins" / t.bin)
            dirs[t.bin] = d
            cap = int((t.capacity_gb or 1e6) * 1e9 // rb)
        specs.append(BinSpec(t.bin, t.tier, min(cap, n), t.share))
    return specs, dirs


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _preflight(needs: dict[Path, int]) -> None:
    """Enough free space on every target directory, before any byte is written."""
    by_fs: dict[Path, int] = {}
    for d, need in needs.items():
        probe = d
        while not probe.exists():
            probe = probe.parent
        by_fs[probe] = by_fs.get(probe, 0) + need
    for probe, need in by_fs.items():
        free = shutil.disk_usage(probe).free
        if free < need * 1.02 + (64 << 20):
            raise MomentError(f"{probe}: {need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free: not enough space")


def _save_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    np.save(path, array)
    return {"path": path.name, "bytes": path.stat().st_size}


def place(plan_path: str | Path, dataset_path: str | Path, out: str | Path, opts: PlaceOptions,
          progress: Progress | None = None, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Place a dataset per a plan; returns the manifest written (``placed.json``)."""
    t_start = time.perf_counter()
    out = Path(out)
    plan = read_plan(plan_path)
    if opts.profile_sha256 and plan.profile.sha256 != opts.profile_sha256:
        raise UsageError(f"{plan_path}: made for profile {plan.profile.name!r} (another profile's hash): re-plan for this one")
    ds = open_dataset(dataset_path)
    if opts.policy not in ("ddak", "hash"):
        raise UsageError(f"--policy {opts.policy!r}: expected ddak or hash")
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    specs, dirs = _bins(plan, ds, opts, out)
    fanouts, batch = tuple(plan.workload.fanouts), plan.workload.batch_size

    # 1. Hotness: a saved one, the one a killed run already computed, or pre-sample now.
    hot_file = work / "hotness.npy"
    if opts.hotness is not None:
        hot = Hotness.load(opts.hotness)
    elif hot_file.exists():
        hot = Hotness.load(hot_file)
    else:
        hot = presample(ds, fanouts=fanouts, batch_size=batch, epochs=opts.epochs, seed=opts.seed,
                        progress=progress("pre-sampling hotness", 0) if progress else None)
        hot.save(hot_file)
    if hot.counts.shape != (ds.num_nodes,):
        raise UsageError(f"hotness has {hot.counts.shape[0]} vertices, the dataset {ds.num_nodes}")
    log(f"hotness: {hot.batches} batches, {hot.mean_unique_per_batch:,.0f} unique vertices per batch; "
        f"top 1% of vertices catch {dict(hot.curve((0.01,)))[0.01]:.1%} of reads")

    # 2. Placement (deterministic; saved so a resumed run writes the same layout).
    key = _key(plan.profile.model_dump(), [t.model_dump() for t in plan.bin_targets], ds.meta, [s.__dict__ for s in specs],
               opts.policy, opts.pool, opts.priority, hot.counts.sum(), str(dirs))
    bin_file = work / f"bin_of-{key}.npy"
    t0 = time.perf_counter()
    order = hotness_order(hot.counts)
    if opts.policy == "ddak":
        placed: Placement = ddak(hot.counts, specs, pool=opts.pool, order=order, priority=opts.priority)
    else:
        placed = hash_placement(hot.counts, specs, seed=opts.seed, order=order)
    if bin_file.exists():
        saved = np.load(bin_file)
        if not np.array_equal(saved, placed.bin_of):
            raise MomentError(f"{bin_file}: a resumed placement differs from the saved one; remove {work} to start over")
    else:
        np.save(bin_file, placed.bin_of)
    place_s = time.perf_counter() - t0
    r = rl.relabel(placed.bin_of, [s.tier for s in specs])

    # 3. Preflight: every target has room for what goes there.
    rb = ds.row_bytes
    needs: dict[Path, int] = {}
    for b, spec in enumerate(specs):
        d = dirs.get(spec.name, work)
        needs[d] = needs.get(d, 0) + int(placed.used[b]) * rb
    needs[work] = needs.get(work, 0) + (ds.num_edges * ds.indices().dtype.itemsize + (ds.num_nodes + 1) * 8) + 3 * ds.num_nodes * 8
    _preflight(needs)

    # 4. Bins, one sequential pass over the source features.
    pid = key[:8]
    files = [
        BinFile(s.name, dirs.get(s.name, work / "cache") / f"{s.name.replace(':', '-')}-{pid}.bin.partial", int(placed.used[b]))
        for b, s in enumerate(specs)
    ]
    t0 = time.perf_counter()
    written = write_bins(ds.features(), placed.bin_of, files, work, key,
                         progress=progress("writing bins", ds.num_nodes) if progress else None)
    write_s = time.perf_counter() - t0

    # 5. Topology, labels, splits, id maps in the new ids.
    rl.rewrite_csr(ds.indptr(), ds.indices(), r, work / "indptr.npy", work / "indices.npy",
                   progress=progress("rewriting topology", ds.num_nodes) if progress else None)
    files_meta = {"indptr": {"path": "indptr.npy"}, "indices": {"path": "indices.npy"}}
    files_meta["labels"] = _save_npy(work / "labels.npy", np.asarray(ds.labels())[r.new_to_old])
    for split in ("train", "val", "test"):
        files_meta[split] = _save_npy(work / f"{split}_idx.npy", np.sort(r.old_to_new[np.asarray(ds.split(split))]))
    files_meta["old_to_new"] = _save_npy(work / "old_to_new.npy", r.old_to_new)
    files_meta["new_to_old"] = _save_npy(work / "new_to_old.npy", r.new_to_old)
    files_meta["hotness"] = _save_npy(work / "hotness_new.npy", hot.counts[r.new_to_old])

    # 6. Commit: final bin names, checksums, manifest last, one rename.
    shares = placed.shares()
    bins_meta = []
    for idx in r.order:
        spec, w = specs[idx], written[idx]
        final = w.path.with_name(w.path.name.removesuffix(".partial"))
        w.path.replace(final)
        inside = final.is_relative_to(work)
        bins_meta.append({
            "name": spec.name, "tier": spec.tier, "start": int(r.starts[r.order.index(idx)]), "count": int(placed.used[idx]),
            "path": str(final.relative_to(work)) if inside else str(final), "bytes": w.bytes, "digest": w.digest,
            "target": spec.target, "achieved": float(shares[idx]), "capacity": spec.capacity,
        })
    for meta in files_meta.values():
        path = work / meta["path"]
        meta.update({"bytes": path.stat().st_size, "digest": file_digest(path)})
    manifest = {
        "format": FORMAT,
        "complete": True,
        "source": {"path": str(Path(dataset_path).resolve()), "name": ds.meta.get("name")},
        "plan": {"path": str(Path(plan_path).resolve()), "profile": plan.profile.model_dump(), "layout": plan.layout.name},
        "policy": opts.policy,
        "pool": opts.pool,
        "priority": opts.priority if opts.policy == "ddak" else None,
        "num_nodes": ds.num_nodes,
        "num_edges": ds.num_edges,
        "feature_dim": ds.feature_dim,
        "feature_dtype": ds.meta["feature_dtype"],
        "num_classes": ds.num_classes,
        "hotness": {"batches": hot.batches, "epochs": hot.epochs, "fanouts": list(hot.fanouts), "batch_size": hot.batch_size,
                    "mean_unique_per_batch": hot.mean_unique_per_batch, "curve": hot.curve()},
        "bins": bins_meta,
        "files": files_meta,
        "timings_s": {"placement": round(place_s, 3), "write_bins": round(write_s, 3),
                      "total": round(time.perf_counter() - t_start, 3)},
    }
    (work / "write-state.json").unlink(missing_ok=True)
    for stale in work.glob("bin_of-*.npy"):
        stale.unlink()
    hot_file.unlink(missing_ok=True)
    hot_file.with_suffix(".json").unlink(missing_ok=True)
    from moment.fileio import atomic_write_text

    _write_workload(work, ds, hot)
    atomic_write_text(work / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    _commit(work, out)
    return manifest


def _write_workload(work: Path, ds: Dataset, hot: Hotness) -> None:
    """The measured workload as ``moment plan --workload`` reads it: the planner's input from
    pre-sampling (hotness curve and unique vertices per batch), closing the loop."""
    import yaml

    from moment.fileio import atomic_write_text

    body = {
        "dataset": ds.meta.get("name", "dataset"),
        "nodes": ds.num_nodes,
        "edges": ds.num_edges,
        "feature_dim": ds.feature_dim,
        "feature_dtype": ds.meta["feature_dtype"],
        "fanouts": list(hot.fanouts),
        "batch_size": hot.batch_size,
        "unique_per_batch": round(hot.mean_unique_per_batch, 1),
        "hotness": {"curve": [[x, round(y, 6)] for x, y in hot.curve() if 0 < x < 1],
                    "source": f"measured: {hot.epochs} pre-sampled epoch(s), {hot.batches} batches"},
    }
    atomic_write_text(work / "workload.yaml", "# Measured by `moment place` (pre-sampling); use with `moment plan --workload`.\n"
                      + yaml.safe_dump(body, sort_keys=False))


def _commit(work: Path, out: Path) -> None:
    """Swap the finished directory in: the old placement stays whole until the new one is there."""
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.old-{int(time.time())}")
        out.rename(old)
    work.rename(out)
    if old is not None:
        _remove_placement(old)


def _remove_placement(path: Path) -> None:
    """Delete a replaced placement, its SSD bins outside it included."""
    try:
        meta = json.loads((path / MANIFEST).read_text())
        for b in meta.get("bins", []):
            p = Path(b["path"])
            if p.is_absolute():
                p.unlink(missing_ok=True)
    except (OSError, ValueError):
        pass
    shutil.rmtree(path, ignore_errors=True)
