"""Placement benchmark: bin writing vs a plain sequential copy of the same bytes; DDAK vs hash.

Makes (or reuses) a synthetic dataset, plans the paper's Machine B, and times
  * a plain sequential copy of the feature file (read + write + fsync, same disk): the baseline;
  * ``moment place``'s bin writing (one pass over the source, appends to every bin, checksums,
    fsync), from the placement's own timing;
and prints how far each bin's achieved share lands from the plan's target, for DDAK and hash.
The source file's pages are dropped from the page cache before each timed pass. Run:
    python scripts/bench_place.py --nodes 4000000 --dim 128 --work /tmp/bench-place
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile
from placement.dataset import open_dataset
from placement.place import PlaceOptions, place
from placement.synth import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import drop_cache  # noqa: E402 - one copy of it


def plain_copy(src: Path, dst: Path) -> float:
    drop_cache([src])
    t0 = time.perf_counter()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, length=64 << 20)
        fo.flush()
        os.fsync(fo.fileno())
    return time.perf_counter() - t0


def tier_error(manifest: dict, tier: str) -> float:
    """L1 distance between achieved and target shares inside a tier (each normalised to 1)."""
    bins = [b for b in manifest["bins"] if b["tier"] == tier]
    t = np.array([b["target"] for b in bins])
    a = np.array([b["achieved"] for b in bins])
    if t.sum() == 0 or a.sum() == 0:
        return float("nan")
    return float(np.abs(a / a.sum() - t / t.sum()).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--work", default="/tmp/bench-place")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ds_dir = work / f"ds-{args.nodes}-{args.dim}"
    if not ds_dir.exists():
        t0 = time.perf_counter()
        synthesize(ds_dir, nodes=args.nodes, avg_degree=15, dim=args.dim, dtype="float16", seed=0)
        print(f"synthesised {ds_dir} in {time.perf_counter() - t0:.1f} s")
    ds = open_dataset(ds_dir)
    feat = ds.path("features")
    size = feat.stat().st_size
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    outcome = plan(machine, workload, 4, 8, top=1)
    plan_path = work / "plan.json"
    save_plan(machine, workload, outcome, plan_path)

    copy_s = plain_copy(feat, work / "copy.bin")
    (work / "copy.bin").unlink()
    print(f"features: {size / 1e9:.2f} GB; plain sequential copy {copy_s:.2f} s = {size / copy_s / 1e9:.2f} GB/s")
    hotness = None
    for policy in ("ddak", "hash"):
        drop_cache([feat])
        out = work / f"placed-{policy}"
        opts = PlaceOptions(policy=policy, gpu_cache="2%", cpu_cache="1%", epochs=args.epochs, hotness=hotness)
        m = place(plan_path, ds_dir, out, opts)
        t = m["timings_s"]
        print(
            f"{policy:5}: write bins {t['write_bins']:.2f} s = {size / t['write_bins'] / 1e9:.2f} GB/s "
            f"({copy_s / t['write_bins']:.2f} of the plain copy's speed); DDAK {t['ddak']:.2f} s, row map and links {t['arrays']:.2f} s; "
            f"total {t['total']:.1f} s; SSD-tier L1 error vs targets {tier_error(m, 'ssd'):.4f}, "
            f"GPU-tier {tier_error(m, 'gpu'):.4f}"
        )
        hotness = hotness or out / "hotness.npy"  # the same hotness for hash, so only the policy differs


if __name__ == "__main__":
    main()
