"""Packed vs unpacked SSD bins on rows smaller than a page (issue #25): what the SSD bins move
per feature byte, and seeds/s, against the placement's prediction, in one run.

One synthetic dataset (``--dim`` float32 rows: 128 → 512 B, eight to a 4 KiB page) placed twice
with the same hotness and caches: (a) ``moment place`` as today, SSD rows in id order; (b)
``moment place --pack``, SSD rows in the order the trainer's first epoch reads them (one CPU
rank, seed 0: the batches it replays are the ones trained). Each is trained for one epoch by a
fresh process in a memory cgroup smaller than the features (``--mem-limit``; 0: none), file
pages dropped before. Reported per run: the feature bytes read from the SSD bins (useful), the
pages the readers' reads touched (what the SSDs move, ``metrics.json read_bytes_per_ssd``) and
the bytes the process read from disk (/proc/self/io: the kernel's count, readahead included;
on a page-cache-only or virtual disk it is what that layer reads), each over the useful bytes;
the placement's predicted amplification; seconds per step and seeds/s. And the placement's
time: the packing phase against writing the bins (a plain copy's speed: scripts/bench_place.py).
Run:
    python scripts/bench_pack.py --work /tmp/bench-pack
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import disk_read_bytes, make_cgroup, parse_size, run_worker  # noqa: E402  (after the path)
from moment.contracts.metrics import MetricsDoc  # noqa: E402


def worker(args: argparse.Namespace) -> dict:
    """One epoch on one CPU rank; what it read."""
    from trainer.loop import main as trainer_main

    metrics = Path(args.out_json).with_suffix(".metrics.json")
    before = disk_read_bytes()
    code = trainer_main(
        ["--data", args.data, "--device", "cpu", "--epochs", "1", "--hidden", "64", "--eval-every", "100"]
        + ["--metrics-json", str(metrics), "--io", "posix"]
    )
    if code:
        raise SystemExit(code)
    doc = MetricsDoc.read(metrics)
    e = doc.epochs[0]
    return {
        "useful": sum(e.bytes_per_ssd.values()),
        "pages": sum(e.read_bytes_per_ssd.values()),
        "disk": disk_read_bytes() - before,
        "predicted": doc.prediction.ssd_amplification,
        "step_s": e.iteration_s,
        "seeds_per_s": e.seeds_per_s,
        "steps": e.iterations,
    }


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, dict]]:
    """The dataset, a plan, and the two placements (the second with the first's hotness)."""
    from moment.planner.plan import plan
    from moment.planner.planfile import save_plan
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    work.mkdir(parents=True, exist_ok=True)
    ds = work / f"ds-{args.nodes}-{args.dim}"
    synthesize(ds, nodes=args.nodes, avg_degree=args.degree, dim=args.dim, dtype="float32", seed=0)
    machine = resolve_profile("moment-machine-b")
    fanouts = [int(f) for f in args.fanouts.split(",")]
    workload = load_workload(machine.workload, fanouts=fanouts, batch_size=args.batch_size)
    save_plan(machine, workload, plan(machine, workload, 1, 8, top=1), work / "plan.json")
    placed = {}
    for name, pack in (("unpacked", False), ("packed", True)):
        out = work / f"placed-{name}"
        hot = work / "placed-unpacked" / "hotness.npy"
        opts = PlaceOptions(
            gpu_cache="0rows",
            cpu_cache=args.cpu_cache,
            epochs=1,
            hotness=hot if pack else None,
            pack=pack,
            pack_ranks=1,
        )
        placed[name] = {"dir": out, "manifest": place(work / "plan.json", ds, out, opts)}
    return ds, placed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/bench-pack")
    ap.add_argument("--nodes", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=128, help="float32 features per row (128: 512 B rows)")
    ap.add_argument("--degree", type=float, default=10)
    ap.add_argument("--cpu-cache", default="2%")
    ap.add_argument("--fanouts", default="10,5")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--mem-limit", default="512M", help="memory cgroup limit per training run; 0: none")
    ap.add_argument("--worker", choices=("moment",), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.out_json).write_text(json.dumps(worker(args)))
        return
    work = Path(args.work)
    ds, placed = prepare(args, work)
    limit = parse_size(args.mem_limit)
    try:
        cgroup = make_cgroup(limit, name="moment-bench-pack") if limit else None
    except OSError as exc:
        print(f"no memory cgroup ({exc}): running without a limit", flush=True)
        cgroup = None
    feat = ds / "features.npy"
    print(
        f"features {feat.stat().st_size / 2**20:.0f} MiB ({args.dim * 4} B rows); "
        + (f"memory limit {limit / 2**20:.0f} MiB" if cgroup else "no memory limit"),
        flush=True,
    )
    results = {}
    for name, p in placed.items():
        files = [f for f in (ds, p["dir"]) for f in f.rglob("*") if f.is_file()]
        files += [Path(b["path"]) for b in p["manifest"]["bins"] if Path(b["path"]).is_absolute()]
        extra = ["--data", str(p["dir"])]
        results[name] = r = run_worker("moment", cgroup, files, extra, work / f"{name}.json", script=__file__)
        t = p["manifest"]["timings_s"]
        print(
            f"{name:9}: SSD pages {r['pages'] / r['useful']:.2f}x the feature bytes (predicted "
            f"{r['predicted']:.2f}x), disk reads {r['disk'] / r['useful']:.2f}x; {r['useful'] / 2**20:.0f} MiB useful; "
            f"{r['step_s'] * 1e3:.1f} ms/step, {r['seeds_per_s']:,.0f} seeds/s over {r['steps']} steps; place: "
            f"{t['total']:.1f} s, of which writing the bins {t['write_bins']:.1f} s"
            + (f", packing {t['pack']:.1f} s" if "pack" in t else ""),
            flush=True,
        )
    a, b = results["unpacked"], results["packed"]
    print(
        f"packed vs unpacked: SSD pages per feature byte {b['pages'] / b['useful'] / (a['pages'] / a['useful']):.3f}x, "
        f"disk reads {b['disk'] / max(a['disk'], 1):.3f}x, seeds/s {b['seeds_per_s'] / a['seeds_per_s']:.2f}x; "
        f"packed measured/predicted amplification {b['pages'] / b['useful'] / b['predicted']:.3f}"
    )


if __name__ == "__main__":
    main()
