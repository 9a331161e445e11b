"""Inference benchmark: `moment infer` (layer-wise, full neighbourhood) with its two engines and a
memory-mapped baseline, on the same checkpoint, one process each, in the same run:

* ``broadcast``: the broadcast engine (``trainer.broadcast``: each layer's input streamed once per
  destination partition in placed order, messages scattered into the destinations), layer-1 rows
  from the tiers (``TieredFeatureStore``: cache bins in memory, SSD bins as coalesced reads);
* ``gather``: the gather engine (chunks of destinations gather their in-neighbours' rows), layer-1
  rows from the tiers (sorted, coalesced O_DIRECT preadv of the SSD bins);
* ``base``: the broadcast engine of another checkout (``--compare DIR``), e.g. main before a change;
* ``mmap``: the gather engine with layer-1 rows from the source dataset's features.npy,
  memory-mapped (``np.load(mmap_mode="r")[ids]``: page cache, 4 KiB faults), what a user without
  moment would do.

Out of core: each run happens in a memory cgroup (``--mem-limit``, cgroup v1 or v2, as in
scripts/bench_train.py); file pages of the inputs are dropped before each run. Reported per run
and per layer: vertices/s, bytes read from disk (/proc/self/io read_bytes, sampled when a stage
starts) ÷ the layer's input bytes (N × its input width × 4), and the run's wall seconds and peak
memory; then the broadcast engine's speed-up over each other run and whether the outputs agree
(rtol 1e-4). Run:
    python scripts/bench_infer.py --work /tmp/bench-infer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CODE = "MOMENT_BENCH_CODE"  # a worker's environment: the checkout whose moment it imports (the base run)
sys.path.insert(0, os.environ.get(CODE) or str(ROOT))
import moment  # noqa: E402, F401 - the measured checkout's, before bench_train puts this one first
from bench_train import disk_read_bytes, make_cgroup, parse_size  # noqa: E402 - after the path

sys.path.insert(0, os.environ.get(CODE) or str(ROOT))  # trainer and placement: the measured checkout's too
from moment.fileio import drop_cached  # noqa: E402

RUNS = ("broadcast", "gather", "mmap", "base")  # base: the broadcast engine of the --compare checkout


def worker(args: argparse.Namespace) -> dict:
    import torch

    from trainer import infer

    torch.set_num_threads(args.threads)
    opts = infer.InferOptions(
        data=Path(args.data),
        checkpoint=Path(args.checkpoint),
        out=Path(args.out),
        batch_size=args.batch_size,
        layers="all",
        device="cpu",
        engine="broadcast" if args.worker in ("broadcast", "base") else "gather",
        memory=args.memory,
    )
    features = None
    if args.worker == "mmap":
        source = np.load(Path(args.dataset) / "features.npy", mmap_mode="r")

        def features(ids: np.ndarray) -> torch.Tensor:
            order = np.argsort(ids)  # ascending offsets in the file, as a careful user would read
            rows = np.empty((ids.size, source.shape[1]), dtype=source.dtype)
            rows[order] = source[ids[order]]
            return torch.from_numpy(rows)

    marks: dict[str, int] = {}  # stage -> read_bytes when it started

    def progress(stage: str, done: int, total: int) -> None:
        marks.setdefault(stage.removeprefix("infer: "), disk_read_bytes())

    before = disk_read_bytes()
    start = time.perf_counter()
    p = infer.prepare(opts)
    infer.run_in_process(p, opts, progress=progress, features=features)
    marks["end"] = disk_read_bytes()
    m = infer.finish(p, opts)
    names = list(marks)
    widths = [p.loaded.placed.feature_dim, *p.loaded.widths]
    layers = {
        name: {
            "disk_read_bytes": marks[names[i + 1]] - marks[name],
            "input_bytes": p.layout.num_nodes * widths[i] * 4,
        }
        for i, name in enumerate(names[:-1])
        if name.startswith("layer")
    }
    return {
        "wall_s": time.perf_counter() - start,
        "disk_read_bytes": disk_read_bytes() - before,
        "layers": layers,
        "memory": m.memory,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "throughput": [t.model_dump() for t in m.throughput],
        "accuracy": m.accuracy,
        "embeddings_sha256": m.arrays["embeddings"].sha256,
        "code": str(Path(infer.__file__).parent.parent),
    }


def agree(work: Path, a: str, b: str) -> bool:
    """Whether two runs' logits and embeddings agree (rtol 1e-4, atol 1e-5), read in slices."""
    for name in ("embeddings.npy", "logits.npy"):
        x, y = np.load(work / f"out-{a}" / name, mmap_mode="r"), np.load(work / f"out-{b}" / name, mmap_mode="r")
        for i in range(0, x.shape[0], 1 << 18):
            if not np.allclose(x[i : i + (1 << 18)], y[i : i + (1 << 18)], rtol=1e-4, atol=1e-5):
                return False
    return True


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path]:
    from moment.planner.plan import plan
    from moment.planner.planfile import save_plan
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize
    from trainer import loop

    ds = work / f"ds-{args.nodes}-{args.dim}"
    if not ds.exists():
        t = time.perf_counter()
        synthesize(
            ds,
            nodes=args.nodes,
            avg_degree=args.degree,
            dim=args.dim,
            dtype="float32",
            seed=0,
            train_fraction=0.01,
            val_fraction=0.01,
            test_fraction=0.01,
        )
        print(f"synthesised {ds} in {time.perf_counter() - t:.0f} s", flush=True)
    plan_path = work / "plan.json"
    if not plan_path.exists():
        machine = resolve_profile("moment-machine-b")
        workload = load_workload(machine.workload, fanouts=[5, 3], batch_size=1024)
        save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), plan_path)
    placed = work / "placed"
    if not placed.exists():
        t = time.perf_counter()
        place(plan_path, ds, placed, PlaceOptions(gpu_cache=args.gpu_cache, cpu_cache=args.cpu_cache, epochs=1))
        print(f"placed in {time.perf_counter() - t:.0f} s", flush=True)
    ck = work / "checkpoint"
    if not (ck / "checkpoint.pt").exists():
        code = loop.main(
            [
                "--data",
                str(placed),
                "--hidden",
                str(args.hidden),
                "--fanouts",
                "5,3",
                "--batch-size",
                "512",
                "--epochs",
                "1",
                "--max-batches-per-epoch",
                "20",
                "--device",
                "cpu",
                "--checkpoint-dir",
                str(ck),
            ]
        )
        if code:
            raise SystemExit("training the checkpoint failed")
    return ds, placed, ck


def run_worker(
    kind: str, cgroup: Path | None, files: list[Path], extra: list[str], out: Path, code: Path | None = None
) -> dict:
    """One run in its own process (in ``cgroup``), its inputs evicted from the page cache first;
    ``code``: the checkout whose moment it runs (default: this one)."""
    drop_cached(files)
    cmd = [sys.executable, __file__, "--worker", kind, "--out-json", str(out), *extra]
    procs = cgroup / "cgroup.procs" if cgroup else None

    def enter() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))

    env = {**os.environ, "PYTHONPATH": str(code or ROOT), CODE: str(code or ROOT)}
    done = subprocess.run(cmd, preexec_fn=enter, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise SystemExit(f"{kind} run failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def remove_earlier_output(out: Path) -> None:
    """An earlier run's output, so that this run computes again: removed only when it is a
    complete `moment infer` output (its manifest validated) and only the files that manifest
    lists; anything else there is refused, never deleted."""
    if not out.exists():
        return
    from moment.errors import MomentError
    from trainer.infer import KIND

    try:
        KIND.validate(out)
        files = list(KIND.owned_files(out))
    except MomentError as exc:
        raise SystemExit(
            f"{out}: not an inference output of this benchmark ({exc}); move it or pick another --work"
        ) from None
    for path in files:
        path.unlink()
    try:
        out.rmdir()
    except OSError:
        raise SystemExit(f"{out}: holds files moment infer did not write; they were left in place") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/bench-infer")
    ap.add_argument("--nodes", type=int, default=400_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--degree", type=float, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--gpu-cache", default="1%", help="per GPU bin (4 GPUs in the plan)")
    ap.add_argument("--cpu-cache", default="4%")
    ap.add_argument("--mem-limit", default="1.25GiB", help="memory cgroup limit per run; 0: none")
    ap.add_argument("--batch-size", type=int, default=2048, help="destination vertices per chunk")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads per run (1: on a shared machine, OpenMP threads spin)"
    )
    ap.add_argument("--runs", default="broadcast,gather,mmap", help="which of broadcast, gather, mmap, base, in order")
    ap.add_argument(
        "--compare",
        type=Path,
        help="another checkout (e.g. `git archive main | tar -x -C DIR`): the base run is its broadcast engine",
    )
    ap.add_argument("--memory", type=int, default=None, help="broadcast: --memory in bytes (default: its default)")
    ap.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.out_json).write_text(json.dumps(worker(args)))
        return

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ds, placed, ck = prepare(args, work)
    limit = parse_size(args.mem_limit)
    cgroup = make_cgroup(limit, "moment-bench-infer") if limit else None
    feat = ds / "features.npy"
    files = [p for d in (ds, placed) for p in d.rglob("*") if p.is_file()]
    print(
        f"{args.nodes:,} vertices, features {feat.stat().st_size / 2**30:.2f} GiB; "
        + (f"memory limit per run {limit / 2**30:.2f} GiB ({cgroup})" if limit else "no memory limit"),
        flush=True,
    )
    results = {}
    kinds = args.runs.split(",")
    if unknown := [k for k in kinds if k not in RUNS]:
        raise SystemExit(f"--runs: {', '.join(unknown)}: expected some of {', '.join(RUNS)}")
    if "base" in kinds and (args.compare is None or not (args.compare / "trainer" / "infer.py").is_file()):
        raise SystemExit(f"--compare: {args.compare}: not a moment checkout (needed by the base run)")
    try:
        for kind in kinds:
            out = work / f"out-{kind}"
            remove_earlier_output(out)
            extra = [
                "--data",
                str(placed),
                "--dataset",
                str(ds),
                "--checkpoint",
                str(ck),
                "--out",
                str(out),
                "--batch-size",
                str(args.batch_size),
                "--threads",
                str(args.threads),
                *(["--memory", str(args.memory)] if args.memory else []),
            ]
            code = args.compare.resolve() if kind == "base" else None
            results[kind] = r = run_worker(kind, cgroup, files, extra, work / f"{kind}.json", code)
            stages = ", ".join(f"{t['stage']} {t['vertices_per_s']:,.0f}/s" for t in r["throughput"])
            predicted = {t["stage"]: t.get("predicted") for t in r["throughput"]}
            reads = ", ".join(
                f"{name} {v['disk_read_bytes'] / 2**30:.2f} GiB = {v['disk_read_bytes'] / v['input_bytes']:.2f}× its input"
                + (
                    f" (predicted {p['read_bytes'] / v['input_bytes']:.2f}×)"
                    if (p := predicted.get(name)) and p.get("passes") is not None
                    else ""
                )
                for name, v in r["layers"].items()
            )
            parts = [t.get("partitions") for t in r["throughput"] if t.get("engine") == "broadcast"]
            spilled = [t.get("edges_on_disk") for t in r["throughput"] if t.get("engine") == "broadcast"]
            print(
                f"{kind:9s}: {stages}; wall {r['wall_s']:.1f} s; disk read {r['disk_read_bytes'] / 2**30:.2f} GiB "
                f"({reads}); peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB; "
                + (f"partitions per layer {parts} (--memory {r['memory'] / 1e9:.2f} GB); " if parts else "")
                + (f"of them with edges on disk {spilled}; " if any(x is not None for x in spilled) else "")
                + f"test acc {r['accuracy'].get('test', float('nan')):.4f}"
                + (f"; code {r['code']}" if kind == "base" else ""),
                flush=True,
            )
    finally:
        if cgroup is not None:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    if "broadcast" in results:
        b = results["broadcast"]
        for other in [k for k in results if k != "broadcast"]:
            o = results[other]
            per_layer = ", ".join(
                f"{t['stage']} {t['vertices_per_s'] / u['vertices_per_s']:.1f}x"
                for t, u in zip(b["throughput"], o["throughput"])
                if u["vertices_per_s"] > 0
            )
            print(
                f"broadcast vs {other}: {per_layer}; whole run {o['wall_s'] / b['wall_s']:.1f}x; "
                f"outputs agree (rtol 1e-4): {agree(work, 'broadcast', other)}"
            )
    (work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
