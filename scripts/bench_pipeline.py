"""Time to first epoch: import → place → one training epoch, each against a plain copy of its bytes.

Synthesizes an IGB-layout input (``scripts/bench_import.py``'s generator: ``paper/node_feat.npy``,
``paper/node_label_19.npy``, ``paper__cites__paper/edge_index.npy``; a small feature dimension is
fine, the point is the graph and the passes), plans the paper's Machine B, then runs each step
in a child process of this script:

  import  ``moment dataset import --format igb --split fraction:0.01`` (the paper's 1% of seeds)
  place   ``moment place --gpu-cache 1%`` (and its own phase timings: after pre-sampling, too,
          against a copy of the features and a copy of everything it reads: with small feature
          rows the topology is most of what place reads and writes)
  train   one epoch of the trainer on the CPU, capped at ``--batches`` batches

Before each step the same bytes it reads are copied ``--copies`` times (default 3; the median is
the baseline: a virtual disk's speed moves between runs) with a plain sequential copy (read,
write, fsync), page cache dropped for the source first (``posix_fadvise``; no root needed), and
that step's ratio is copy time / step time: 1.0 is copy speed, 0.5 half of it. For every step and
copy the child reports its wall time, peak anonymous memory (``RssAnon``, sampled every 20 ms),
peak total RSS (``VmHWM``) and the bytes it read and wrote (``/proc/self/io``). The machine may be
shared: the ratios, measured side by side, are the figures to quote.

    python scripts/bench_pipeline.py --nodes 20000000 --edges 300000000 --dim 16 --dir /tmp/bench
    python scripts/bench_pipeline.py --child OUT.json -- dataset import ...   (internal: one step)

Everything it writes under ``--dir`` is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_import import synthesize  # noqa: E402 - the IGB-layout generator, one copy of it

COPY_BLOCK = 64 << 20
RSS_POLL_S = 0.02


# -- the child: one step, measured from inside --------------------------------------------------


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (kB there)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _io() -> dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k: int(v) for k, v in (line.split(": ") for line in fh)}


def child(report: Path, argv: list[str]) -> int:
    """Run one step in this process (``copy SRC... DST`` or a moment / trainer command line) and
    write its wall time, memory peaks and I/O to ``report``. The libraries the step uses are
    imported first, so "above start" is the step's own memory, not the interpreter's and torch's."""
    if argv[0] != "copy":
        import numba  # noqa: F401
        import torch  # noqa: F401

        import moment.cli  # noqa: F401
        import placement.place  # noqa: F401
        import trainer.loop  # noqa: F401
    peak, stop = [_status("RssAnon")], threading.Event()
    base_anon = peak[0]

    def watch() -> None:
        while not stop.wait(RSS_POLL_S):
            peak[0] = max(peak[0], _status("RssAnon"))

    threading.Thread(target=watch, daemon=True).start()
    io0, t0, cpu0 = _io(), time.perf_counter(), _cpu()
    if argv[0] == "copy":
        rc = 0
        for src in argv[1:-1]:
            plain_copy(Path(src), Path(argv[-1]) / Path(src).name)
    elif argv[0] == "train":
        from trainer.loop import main as train_main

        rc = train_main(argv[1:])
    else:
        from moment.cli import main as moment_main

        rc = moment_main(argv)
    wall = time.perf_counter() - t0
    stop.set()
    io1 = _io()
    result = {
        "rc": rc,
        "wall_s": wall,
        "cpu_s": _cpu() - cpu0,  # user + system, all threads (and children: torchrun ranks)
        "peak_anon": max(peak[0], _status("RssAnon")),
        "base_anon": base_anon,  # before the step: the interpreter and its imports
        "peak_rss": _status("VmHWM"),
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "rchar": io1["rchar"] - io0["rchar"],
    }
    report.write_text(json.dumps(result))
    return int(rc or 0)


def plain_copy(src: Path, dst: Path) -> None:
    """Read ``src`` front to back and write it to ``dst`` (fsync'ed): the baseline."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, length=COPY_BLOCK)
        fo.flush()
        os.fsync(fo.fileno())


# -- the parent ---------------------------------------------------------------------------------


def drop_cache(paths: list[Path]) -> None:
    """Evict files from the page cache (written pages are flushed first), so a step reads the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(work: Path, name: str, argv: list[str], inputs: list[Path], timeout: float) -> dict:
    """One step in a child process of this script, its inputs evicted from the page cache first."""
    drop_cache(inputs)
    report = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", str(report), "--", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not report.exists():
        sys.exit(f"{name} failed ({proc.returncode}): {' '.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (work / f"{name}.out").write_text(proc.stdout)
    (work / f"{name}.err").write_text(proc.stderr)
    return json.loads(report.read_text())


def copy_of(work: Path, name: str, files: list[Path], timeout: float, copies: int = 1) -> dict:
    """The plain copy of ``files`` (the bytes a step reads), into a scratch directory removed after;
    made ``copies`` times, the median run returned (``walls_s``: every run's wall time), because a
    virtual disk's speed moves between runs (2.5x seen here) and one copy makes a noisy baseline."""
    runs = []
    for _ in range(copies):
        dst = work / f"copy-{name}"
        dst.mkdir()
        try:
            runs.append(measure(work, f"copy-{name}", ["copy", *map(str, files), str(dst)], files, timeout))
        finally:
            shutil.rmtree(dst)
    runs.sort(key=lambda r: r["wall_s"])
    return {**runs[len(runs) // 2], "walls_s": [r["wall_s"] for r in runs]}


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def row(step: str, m: dict, copy: dict, nbytes: int) -> str:
    mib = 2**20
    return (
        f"| {step} | {m['wall_s']:.1f} s | {m.get('cpu_s', 0):.1f} s | {copy['wall_s']:.1f} s "
        f"| {copy['wall_s'] / m['wall_s']:.2f}x "
        f"| {(m['peak_anon'] - m['base_anon']) / mib:,.0f} MiB | {m['peak_rss'] / mib:,.0f} MiB "
        f"| {m['read_bytes'] / 1e9:.2f} GB | {m['write_bytes'] / 1e9:.2f} GB | {nbytes / 1e9:.2f} GB |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=20_000_000)
    ap.add_argument("--edges", type=int, default=300_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--memory", default="1GB", help="the import's --memory")
    ap.add_argument("--batches", type=int, default=20, help="training batches (one epoch, capped)")
    ap.add_argument("--dir", default="/tmp", help="where inputs, outputs and copies go")
    ap.add_argument("--keep", action="store_true", help="keep what it wrote")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds any one step may take")
    ap.add_argument("--copies", type=int, default=3, help="plain copies per step; the median is the baseline")
    ap.add_argument("--child", metavar="REPORT", help=argparse.SUPPRESS)
    ap.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(Path(args.child), [a for a in args.argv if a != "--"] if args.argv[:1] == ["--"] else args.argv)

    from moment.planner.plan import plan
    from moment.planner.planfile import save_plan
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile

    work = Path(args.dir) / f"bench-pipeline-{args.nodes}-{args.edges}-{args.dim}"
    work.mkdir(parents=True, exist_ok=False)
    try:
        t0 = time.perf_counter()
        size = "large"
        inputs = synthesize(work / "igb", size, args.nodes, args.edges, args.dim)
        nbytes = sum(f.stat().st_size for f in inputs)
        print(
            f"input: {args.nodes:,} vertices, {args.edges:,} edges, {args.dim}-dim float32, IGB layout: "
            f"{nbytes / 1e9:.2f} GB, synthesized in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        machine = resolve_profile("moment-machine-b")
        workload = load_workload(machine.workload)
        save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), work / "plan.json")
        ds, placed = work / "ds", work / "placed"
        results = []

        m = measure(
            work,
            "import",
            ["dataset", "import", "--format", "igb", "--root", str(work / "igb"), "--size", size]
            + ["--memory", args.memory, "--split", "fraction:0.01", "--out", str(ds)],
            inputs,
            args.timeout,
        )
        results.append(("import", m, copy_of(work, "import", inputs, args.timeout, args.copies), nbytes))
        print(row(*results[-1]), flush=True)

        from placement.dataset import open_dataset

        dataset = open_dataset(ds)
        ds_files = sorted({*files_under(ds), *(dataset.path(k) for k in dataset.meta["files"])})
        m = measure(
            work,
            "place",
            ["place", "--plan", str(work / "plan.json"), "--dataset", str(ds), "--out", str(placed)]
            + ["--gpu-cache", "1%", "--json"],
            ds_files,
            args.timeout,
        )
        feature_files = [dataset.path("features")]  # in the dataset, or the source it refers to
        place_copy = copy_of(work, "place", feature_files, args.timeout, args.copies)
        place_bytes = sum(f.stat().st_size for f in feature_files)
        results.append(("place", m, place_copy, place_bytes))
        print(row(*results[-1]), flush=True)
        inputs_copy = copy_of(work, "place-inputs", sorted({*feature_files, *ds_files}), args.timeout, args.copies)
        manifest = json.loads((work / "place.out").read_text())
        t = manifest["timings_s"]
        after = t["total"] - t.get("check", 0) - t.get("presample", 0)
        print(
            f"place phases (s): {json.dumps(t)}; after pre-sampling {after:.1f} s = "
            f"{place_copy['wall_s'] / after:.2f}x a plain copy of the features ({place_copy['wall_s']:.1f} s; "
            f"copies {', '.join(f'{w:.1f}' for w in place_copy['walls_s'])} s), "
            f"{inputs_copy['wall_s'] / after:.2f}x a plain copy of everything place reads: features, topology, "
            f"labels, splits ({inputs_copy['wall_s']:.1f} s); hotness: "
            f"{manifest['hotness']['batches']} batches, split-half gap {manifest['hotness'].get('bound')}",
            flush=True,
        )

        placed_files = files_under(placed)
        m = measure(
            work,
            "train",
            ["train", "--data", str(placed), "--plan", str(work / "plan.json"), "--device", "cpu", "--epochs", "1"]
            + ["--max-batches-per-epoch", str(args.batches), "--hidden", "16"],
            placed_files,
            args.timeout,
        )
        train_bytes = sum(p.stat().st_size for p in placed_files)  # what it opens; a capped epoch reads part
        results.append(("train", m, copy_of(work, "train", placed_files, args.timeout, args.copies), train_bytes))
        print(row(*results[-1]), flush=True)

        print(
            f"\n{args.nodes:,} vertices, {args.edges:,} edges, {args.dim}-dim float32 "
            f"({nbytes / 1e9:.2f} GB of IGB input); ratio = copy time / step time\n"
        )
        print(
            "| step | wall | CPU | plain copy of its bytes | ratio | peak anon (above start) | peak RSS "
            "| read | written | bytes copied |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            print(row(*r))
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
