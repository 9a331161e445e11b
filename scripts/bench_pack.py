"""Packed vs unpacked SSD bins on rows smaller than a page (issue #25): what the SSD bins move
per feature byte, seconds per step, seeds/s and accuracy, against the prediction and the IO
limit, in one run.

One synthetic dataset (``--dim`` float32 rows: 128 → 512 B, eight to a 4 KiB page) placed four
times with the same hotness: (a) ``moment place`` as today, SSD rows in id order; (b) ``moment
place --pack`` (``--pack-epochs``, one CPU rank, seed 0: the batches it replays are the ones
trained; epochs past them are trained with ``--reuse-samples``); (c) every row in the CPU cache,
the all-in-RAM step. Each trains ``--epochs`` epochs in a fresh process, (a) and (b) in a memory
cgroup smaller than the features (``--mem-limit``; 0: none), file pages dropped before.
Reported per run: the feature bytes read from the SSD bins (useful), the pages the readers'
reads touched (what the SSDs move, ``metrics.json read_bytes_per_ssd``) over them, the bytes the
process read from disk (/proc/self/io: the kernel's count, topology and cache bins included; on a
virtual disk with 512 B blocks it does not see 4 KiB pages), the placement's predicted
amplification, seconds per step, seeds/s, test accuracy, and the placement's time (packing
against writing the bins). Then (b)'s IO limit, as the issue defines it: the larger of (c)'s
step and (b)'s pages per step over the disk's sequential rate (the packed bins read front to
back, pages dropped first). (b) and (d) load the replayed batches' stored samples instead of
sampling them (placement/samples.py); (e) trains (d)'s placement with ``--live-sampling``, so
(d) vs (e) is stored samples vs live sampling, each against the IO limit, whose all-in-RAM step
samples the same way: (c) samples live, (f) trains (c)'s placement (placed with ``--pack`` only to
store its samples) on its stored samples. (d) ``moment place --pack-budget`` (``--pack-budget``, default 1x the SSD
bins): per-batch chunks and a shared cache beside the bins in id order, trained like (b); its
packing time is reported against a plain copy of the same bytes (the chunk and shared files
copied, pages dropped first) and its disk space against the budget. ``--preset high-reuse``: a
graph where many batches read the same rows (100k vertices, 128 B rows, 5% training vertices,
three epochs replayed and trained: 30 batches, each reading about 30% of the vertices), a 2x
budget, no memory limit (the features are smaller than a Python process). ``--curve``: what
(d)'s batches would move at other budgets (the replay's count, no training). Run:
    python scripts/bench_pack.py --work /tmp/packs-bench --epochs 3
    python scripts/bench_pack.py --work /tmp/packs-reuse --preset high-reuse
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import disk_read_bytes, make_cgroup, parse_size, run_worker  # noqa: E402  (after the path)
from moment.contracts.metrics import MetricsDoc  # noqa: E402
from moment.errors import UsageError  # noqa: E402
from moment.fileio import drop_cached  # noqa: E402


def worker(args: argparse.Namespace) -> dict:
    """``--epochs`` epochs on one CPU rank; what they read, how fast, and the test accuracy."""
    from trainer.loop import main as trainer_main

    metrics = Path(args.out_json).with_suffix(".metrics.json")
    before = disk_read_bytes()
    code = trainer_main(
        ["--data", args.data, "--device", "cpu", "--epochs", str(args.epochs), "--hidden", "64"]
        + ["--eval-every", "100", "--metrics-json", str(metrics), "--io", "posix", *args.train_args.split()]
    )
    if code:
        raise SystemExit(code)
    doc = MetricsDoc.read(metrics)
    epochs = doc.epochs
    return {
        "useful": sum(sum(e.bytes_per_ssd.values()) for e in epochs),
        "pages": sum(sum(e.read_bytes_per_ssd.values()) for e in epochs),
        # pages of the placed directory's files the batches read (stored samples, chunk row maps)
        "placed": sum(sum(e.placed_read_bytes.values()) for e in epochs),
        "disk_predicted": doc.prediction.disk_amplification,
        "disk": disk_read_bytes() - before,
        "predicted": doc.prediction.ssd_amplification,
        "step_s": sum(e.epoch_s for e in epochs) / sum(e.iterations for e in epochs),
        # the prefetch thread's feature-store calls per step: wall time, and CPU time on that thread
        "feature_s": sum(e.feature_read_s for e in epochs) / sum(e.iterations for e in epochs),
        "feature_cpu_s": sum((e.feature_cpu_s_per_iteration or 0.0) * e.iterations for e in epochs)
        / sum(e.iterations for e in epochs),
        "data_wait_s": sum(e.data_wait_s for e in epochs) / sum(e.iterations for e in epochs),
        "seeds_per_s": sum(e.seeds for e in epochs) / sum(e.epoch_s for e in epochs),
        "steps": sum(e.iterations for e in epochs),
        "test_acc": doc.test_acc,
    }


def sequential_gbps(paths: list[Path], block: int = 8 << 20) -> float:
    """GB/s of reading ``paths`` front to back in large reads, their pages dropped first: the
    disk's sequential rate, the IO limit's denominator."""
    drop_cached(paths)
    buf, total = bytearray(block), 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                total += got
    return total / (time.perf_counter() - start) / 1e9


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, dict]]:
    """The dataset, a plan, and the three placements, all with the first one's hotness: rows in
    id order, packed, and every row in the CPU cache (the all-in-RAM step)."""
    from moment.planner.plan import plan
    from moment.planner.planfile import save_plan
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    work.mkdir(parents=True, exist_ok=True)
    ds = work / f"ds-{args.nodes}-{args.dim}-{args.train}"
    synthesize(
        ds, nodes=args.nodes, avg_degree=args.degree, dim=args.dim, dtype="float32", seed=0, train_fraction=args.train
    )
    machine = resolve_profile("moment-machine-b")
    fanouts = [int(f) for f in args.fanouts.split(",")]
    workload = load_workload(machine.workload, fanouts=fanouts, batch_size=args.batch_size)
    save_plan(machine, workload, plan(machine, workload, 1, 8, top=1), work / "plan.json")
    placed = {}
    hot = work / "placed-unpacked" / "hotness.npy"
    for name, cache, pack in (
        ("unpacked", args.cpu_cache, False),
        ("packed", args.cpu_cache, True),
        ("ram", "100%", True),  # packed only to store its samples: every row is in the CPU cache
        ("chunks", args.cpu_cache, True),
    ):
        out = work / f"placed-{name}"
        opts = PlaceOptions(
            gpu_cache="0rows",
            cpu_cache=cache,
            epochs=1,
            hotness=hot if name != "unpacked" else None,
            pack=pack,
            pack_epochs=args.pack_epochs,
            pack_ranks=1,
            pack_budget=args.pack_budget if name == "chunks" else None,
        )
        placed[name] = {"dir": out, "manifest": place(work / "plan.json", ds, out, opts)}
    return ds, placed


PRESETS = {
    "high-reuse": {
        "nodes": 100_000,
        "dim": 32,
        "train": 0.05,
        "pack_epochs": 3,
        "epochs": 3,
        "mem_limit": "0",
        "pack_budget": "2x",
    },
}


def plain_copy_s(paths: list[Path], into: Path, block: int = 8 << 20) -> float:
    """Seconds to copy ``paths`` (pages dropped first) into ``into`` and fsync: what writing the
    same bytes costs without packing them."""
    drop_cached(paths)
    into.mkdir(parents=True, exist_ok=True)
    buf = bytearray(block)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f, open(into / path.name, "wb", buffering=0) as out:
            while got := f.readinto(buf):
                out.write(memoryview(buf)[:got])
            os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    for path in paths:
        (into / path.name).unlink()
    return seconds


def budget_curve(root: Path, budgets: list[float]) -> None:
    """What (d)'s replayed batches would move at other budgets (the replay's page count, as its
    prediction; no training): the threshold, the disk used and the pages per feature byte; and the
    pages of each shared-cache order (``placement.chunks.SHARED_ORDERS``: the placement keeps the fewer)."""
    from placement.chunks import plan_chunks
    from placement.placed import open_placed
    from placement.samples import StoredSamples

    placed = open_placed(root)
    stored = StoredSamples.of(placed)
    assert stored is not None, f"{root}: no stored samples"
    nodes, p = list(stored.all_nodes()), placed.manifest.pack
    assert p is not None
    ssd = [b for b in placed.bins if b.tier == "ssd"]
    starts, counts, rb = [b.start for b in ssd], [b.count for b in ssd], placed.row_bytes
    total = sum(counts) * rb
    for x in budgets:
        try:
            c = plan_chunks(lambda: iter(nodes), starts, counts, rb, int(x * total), f"{x}x", seed=p.seed)
        except UsageError as exc:
            print(f"  budget {x}x: {exc}")
            continue
        print(
            f"  budget {x}x: disk {c.bytes / total:.2f}x the SSD bins, shared cache "
            f"{sum(r.size for r in c.shared_rows) * rb / total:.2f}x (rows read by more than {c.threshold} batches), "
            f"SSD pages {c.packed_bytes / c.useful_bytes:.4f}x the feature bytes with the shared cache in {c.order} "
            "order; in each order "
            + ", ".join(
                f"{name} {(c.packed_bytes - c.shared_pages[c.order] + moved) / c.useful_bytes:.4f}x"
                for name, moved in c.shared_pages.items()
            )
        )


def samples_report(m: dict, r: dict[str, dict], gbps: float) -> None:
    """(d) with its stored samples against (e), the same placement sampling every batch: seconds
    per step, each against its IO limit: the larger of the all-in-RAM step sampling the same way
    ((f) stored, (c) live) and the bytes a step moves (its pages; with stored samples the pages of
    them and of the chunk row maps too, as measured) over the disk's sequential rate; and the disk the samples take against the features."""
    pack = m["pack"]
    samples = pack["samples"]["bytes"]
    per_step = samples / max(pack["batches"], 1)
    stored, live = r["stored"], r["live"]
    io_s = stored["pages"] / stored["steps"] / (gbps * 1e9)
    placed_s = stored["placed"] / stored["steps"] / (gbps * 1e9)  # the samples' (and row maps') pages read
    stored_limit = max(r["ram-stored"]["step_s"], io_s + placed_s)
    live_limit = max(r["ram"]["step_s"], live["pages"] / live["steps"] / (gbps * 1e9))
    ssd = sum(x["bytes"] for x in m["bins"] if x["tier"] == "ssd")
    print(
        f"stored samples vs live sampling (placement (d)): {stored['step_s'] * 1e3:.1f} vs {live['step_s'] * 1e3:.1f} "
        f"ms/step ({stored['step_s'] / live['step_s']:.2f}x); all in RAM {r['ram-stored']['step_s'] * 1e3:.1f} ms "
        f"stored, {r['ram']['step_s'] * 1e3:.1f} ms live; IO limit stored {stored_limit * 1e3:.1f} ms (pages "
        f"{io_s * 1e3:.1f} ms + samples' and row maps' {stored['placed'] / stored['steps'] / 2**10:.0f} KiB), "
        f"live {live_limit * 1e3:.1f} ms; "
        f"step / IO limit: stored {stored['step_s'] / stored_limit:.2f}x, live {live['step_s'] / live_limit:.2f}x; "
        f"test accuracy {stored['test_acc']:.4f} vs {live['test_acc']:.4f}\n"
        f"samples on disk: {samples / 2**20:.1f} MiB for {pack['batches']} batches ({per_step / 2**10:.0f} KiB each), "
        f"{samples / ssd:.3f}x the SSD bins' {ssd / 2**20:.1f} MiB, {samples / max(pack['useful_bytes'], 1):.3f}x the "
        f"feature bytes those batches read from them (not counted against --pack-budget: placed directory)"
    )


def report(name: str, r: dict, t: dict) -> None:
    amp = (
        f"SSD pages {r['pages'] / r['useful']:.3f}x the feature bytes (predicted {r['predicted']:.3f}x), "
        if r["useful"]
        else ""
    )
    if r["useful"] and (r["placed"] or r["disk_predicted"]):  # stored samples and chunk row maps read too
        predicted = "—" if r["disk_predicted"] is None else f"{r['disk_predicted']:.3f}x"
        amp += f"with the placed directory's pages {(r['pages'] + r['placed']) / r['useful']:.3f}x (predicted {predicted}), "
    print(
        f"{name:9}: {amp}disk reads {r['disk'] / 2**20:.0f} MiB; {r['useful'] / 2**20:.0f} MiB from the SSD bins; "
        f"{r['step_s'] * 1e3:.1f} ms/step (waiting for data {r['data_wait_s'] * 1e3:.1f} ms; features "
        f"{r['feature_s'] * 1e3:.1f} ms, of it CPU {r['feature_cpu_s'] * 1e3:.1f} ms, on the prefetch thread), "
        f"{r['seeds_per_s']:,.0f} seeds/s over {r['steps']} steps; test accuracy "
        f"{r['test_acc']:.4f}; place: {t['total']:.1f} s, of which writing the bins {t['write_bins']:.1f} s"
        + (f", packing {t['pack']:.1f} s" if "pack" in t else ""),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/packs-bench")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a configuration of the options below (see above)")
    ap.add_argument("--nodes", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=128, help="float32 features per row (128: 512 B rows)")
    ap.add_argument("--degree", type=float, default=10)
    ap.add_argument("--train", type=float, default=0.01, help="share of the vertices that are training seeds")
    ap.add_argument("--cpu-cache", default="2%")
    ap.add_argument("--fanouts", default="10,5")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1, help="training epochs of each run (default 1)")
    ap.add_argument(
        "--pack-epochs", type=int, default=1, help="epochs --pack replays; later ones reuse them (--reuse-samples)"
    )
    ap.add_argument("--pack-budget", default="1x", help="(d)'s --pack-budget (default 1x: the SSD bins' size)")
    ap.add_argument("--mem-limit", default="512MiB", help="memory cgroup limit per training run; 0: none")
    ap.add_argument("--curve", default="1,1.5,2,2.5,3", help="other budgets (x the SSD bins) to count (d)'s pages at")
    ap.add_argument("--worker", choices=("moment",), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--train-args", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.out_json).write_text(json.dumps(worker(args)))
        return
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    work = Path(args.work)
    ds, placed = prepare(args, work)
    limit = parse_size(args.mem_limit)
    try:
        # a cgroup of its own: runs side by side (other worktrees) share no limit
        cgroup = make_cgroup(limit, name=f"moment-bench-pack-{os.getpid()}") if limit else None
    except OSError as exc:
        print(f"no memory cgroup ({exc}): running without a limit", flush=True)
        cgroup = None
    feat = ds / "features.npy"
    print(
        f"features {feat.stat().st_size / 2**20:.0f} MiB ({args.dim * 4} B rows, {args.nodes:,} vertices, "
        f"{args.train:.0%} training); "
        + (f"memory limit {limit / 2**20:.0f} MiB" if cgroup else "no memory limit")
        + f" (the all-in-RAM run: none); {args.epochs} epoch(s), {args.pack_epochs} replayed",
        flush=True,
    )
    reuse = "--reuse-samples" if args.epochs > args.pack_epochs else ""
    runs = {
        "unpacked": (cgroup, ""),
        "packed": (cgroup, reuse),
        "ram": (None, f"--shm-dir= {reuse} --live-sampling"),
        "chunks": (cgroup, reuse),
        "live": (cgroup, f"{reuse} --live-sampling"),
        "ram-stored": (None, f"--shm-dir= {reuse}"),
    }
    results = {}
    for name, (group, train_args) in runs.items():
        p = placed[{"live": "chunks", "ram-stored": "ram"}.get(name, name)]
        files = [f for f in (ds, p["dir"]) for f in f.rglob("*") if f.is_file()]
        files += [Path(b["path"]) for b in p["manifest"]["bins"] if Path(b["path"]).is_absolute()]
        extra = ["--data", str(p["dir"]), "--epochs", str(args.epochs), f"--train-args={train_args}"]
        results[name] = run_worker("moment", group, files, extra, work / f"{name}.json", script=__file__)
        report(f"({'abcdef'[list(runs).index(name)]}) {name}", results[name], p["manifest"]["timings_s"])
    if cgroup is not None:  # ours (named with this pid), empty now that its workers are done
        try:
            cgroup.rmdir()
        except OSError as exc:
            print(f"{cgroup}: not removed ({exc})", flush=True)
    a, b, ram, d, e, f = (results[k] for k in runs)
    root = placed["packed"]["dir"]
    bins = [
        Path(x["path"]) if Path(x["path"]).is_absolute() else root / x["path"]
        for x in placed["packed"]["manifest"]["bins"]
        if x["tier"] == "ssd"
    ]
    gbps = sequential_gbps(bins)
    limit_s = max(f["step_s"], b["pages"] / b["steps"] / (gbps * 1e9))  # (b), (d): stored samples, as (f)
    d_limit_s = max(f["step_s"], d["pages"] / d["steps"] / (gbps * 1e9))
    print(
        f"packed vs unpacked: SSD pages per feature byte {b['pages'] / b['useful'] / (a['pages'] / a['useful']):.3f}x, "
        f"disk reads {b['disk'] / max(a['disk'], 1):.3f}x, seeds/s {b['seeds_per_s'] / a['seeds_per_s']:.2f}x, "
        f"test accuracy {b['test_acc'] - a['test_acc']:+.4f}; packed measured/predicted amplification "
        f"{b['pages'] / b['useful'] / b['predicted']:.3f}\n"
        f"chunks vs unpacked: SSD pages per feature byte {d['pages'] / d['useful'] / (a['pages'] / a['useful']):.3f}x "
        f"(vs packed {d['pages'] / d['useful'] / (b['pages'] / b['useful']):.3f}x), seeds/s "
        f"{d['seeds_per_s'] / a['seeds_per_s']:.2f}x, test accuracy {d['test_acc'] - a['test_acc']:+.4f}; "
        f"measured/predicted amplification {d['pages'] / d['useful'] / d['predicted']:.3f}\n"
        f"IO limit of a step: max(all-in-RAM step on stored samples {f['step_s'] * 1e3:.1f} ms (sampling live "
        f"{ram['step_s'] * 1e3:.1f} ms), its pages / the disk's sequential "
        f"{gbps:.2f} GB/s): packed {limit_s * 1e3:.1f} ms, chunks {d_limit_s * 1e3:.1f} ms; packed step "
        f"{b['step_s'] / limit_s:.2f}x its limit, chunks {d['step_s'] / d_limit_s:.2f}x, unpacked {a['step_s'] / limit_s:.2f}x"
    )
    samples_report(placed["chunks"]["manifest"], {"stored": d, "live": e, "ram": ram, "ram-stored": f}, gbps)
    m = placed["chunks"]["manifest"]
    c, croot = m["pack"]["chunks"], placed["chunks"]["dir"]
    copies = [
        Path(f["path"]) if Path(f["path"]).is_absolute() else croot / f["path"]
        for x in c["bins"].values()
        for f in (x["chunks"], x["shared"])
    ]
    copy_s = plain_copy_s([f for f in copies if f.stat().st_size], work / "copy")
    ssd_bytes = sum(x["bytes"] for x in m["bins"] if x["tier"] == "ssd")
    shared = sum(x["shared"]["bytes"] for x in c["bins"].values())
    print(
        f"chunks on disk: {c['bytes'] / 2**20:.1f} MiB of the {c['budget'] / 2**20:.1f} MiB budget "
        f"({c['bytes'] / ssd_bytes:.2f}x the SSD bins' {ssd_bytes / 2**20:.1f} MiB), of which the shared cache "
        f"{shared / 2**20:.1f} MiB (rows read by more than {c['threshold']} replayed batches); packing {m['timings_s']['pack']:.1f} s (replay and writing) vs "
        f"a plain copy of the same bytes {copy_s:.1f} s, writing the bins {m['timings_s']['write_bins']:.1f} s"
    )
    if args.curve:
        print(
            f"(d) at other budgets (the replay's count; id order {a['pages'] / a['useful']:.2f}x, packed "
            f"{b['pages'] / b['useful']:.2f}x):"
        )
        budget_curve(croot, [float(x) for x in args.curve.split(",")])


if __name__ == "__main__":
    main()
