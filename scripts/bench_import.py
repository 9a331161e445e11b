"""Import at disk speed? A synthetic graph in the IGB layout, imported, against a plain ``cp``.

Writes ``ROOT/<size>/processed/`` as IGB does (``paper/node_feat.npy`` N × dim float32,
``paper/node_label_19.npy`` N float32, ``paper__cites__paper/edge_index.npy`` E × 2 int64), then
for each thread count runs ``moment dataset import --format igb`` in a child process and a plain
``cp`` of the same input files, the page cache of every input dropped before each run
(``posix_fadvise(DONTNEED)`` on the files: only ours, the machine is shared; ``--drop-caches``
drops the whole cache instead, which needs root). The child measures itself: wall time, peak
anonymous memory (RssAnon sampled every 20 ms: the budget ``--memory`` bounds, not the page cache)
and peak total RSS (VmHWM), bytes read and written from ``/proc/self/io``. Ratios are against the
``cp`` of the same run. Not part of the test suite; everything under ``--dir`` is deleted at the end.

Run:
    python scripts/bench_import.py [--dir /tmp] [--nodes 3000000] [--edges 45000000] [--dim 128]
                                   [--memory 1GB] [--threads 1,2] [--undirected] [--copy-features]
                                   [--compare /path/to/an/older/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BLOCK = 1 << 24  # values generated at once
MARK = "BENCH "
REPO = Path(__file__).resolve().parent.parent
PHASES = "import phases: "  # the line `moment dataset import` prints at the end: "csr 1.20 s (CPU 1.90 s), ..."
GRAPH_STEPS = ("csr", "labels", "splits")  # the steps measured against cp of the edge and label files


def _npy(path: Path, dtype: str, shape: tuple[int, ...]):
    fh = open(path, "wb")  # noqa: SIM115 - the caller closes it
    np.lib.format.write_array_header_2_0(fh, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape})
    return fh


def synthesize(root: Path, size: str, nodes: int, edges: int, dim: int, seed: int = 0) -> list[Path]:
    """The IGB files, written block by block; returns their paths."""
    base = root / size / "processed"
    (base / "paper").mkdir(parents=True)
    (base / "paper__cites__paper").mkdir()
    rng = np.random.default_rng(seed)
    with _npy(base / "paper__cites__paper" / "edge_index.npy", "<i8", (edges, 2)) as fh:
        for a in range(0, edges, BLOCK):
            m = min(BLOCK, edges - a)
            src = rng.integers(0, nodes, m)
            dst = (rng.pareto(1.2, m) * nodes / 50).astype(np.int64) % nodes  # skewed in-degrees
            fh.write(np.column_stack([src, dst]).data)
    rows = max(1, BLOCK // dim)
    with _npy(base / "paper" / "node_feat.npy", "<f4", (nodes, dim)) as fh:
        for a in range(0, nodes, rows):
            fh.write(rng.standard_normal((min(rows, nodes - a), dim), dtype=np.float32).data)
    with _npy(base / "paper" / "node_label_19.npy", "<f4", (nodes,)) as fh:
        fh.write(rng.integers(0, 19, nodes).astype(np.float32).data)
    return sorted(base.rglob("*.npy"))


def drop_cache(paths: list[Path], everything: bool) -> None:
    """Evict the files' pages (written back first), or the whole page cache with ``everything``."""
    if str(REPO) not in sys.path:  # here, not at the top: a --compare child must import the other checkout
        sys.path.insert(0, str(REPO))
    from moment.fileio import drop_cached

    os.sync()
    if everything:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return
    drop_cached(paths)


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _io() -> dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k: int(v) for k, v in (line.split(": ") for line in fh)}


def child(argv: list[str]) -> None:
    """Run ``argv`` (a command, or ``moment ...`` in this process) and print what it cost."""
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _status("RssAnon"))

    threading.Thread(target=sample, daemon=True).start()
    before = _io()
    start = time.perf_counter()
    if argv[0] == "moment":
        from moment.cli import main

        rc = main(argv[1:])
    else:
        rc = subprocess.run(argv, check=False).returncode  # cp: its I/O is ours once reaped
    wall = time.perf_counter() - start
    stop.set()
    after = _io()
    peak[0] = max(peak[0], _status("RssAnon"))
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    report = {
        "rc": rc,
        "wall": wall,
        "cpu": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
        "anon": peak[0],
        "hwm": _status("VmHWM"),
        "read": after["read_bytes"] - before["read_bytes"],
        "written": after["write_bytes"] - before["write_bytes"],
    }
    print(MARK + json.dumps(report), flush=True)


def measure(argv: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(  # COLUMNS: rich does not wrap the phase line
        [sys.executable, __file__, "--child", *argv],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "10000"},
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    phases = {}  # name: (wall, CPU) seconds
    for line in proc.stdout.splitlines():
        if line.startswith(PHASES):
            for name, wall, cpu in re.findall(r"(\w+) ([\d.]+) s \(CPU ([\d.]+) s\)", line):
                phases[name] = (float(wall), float(cpu))
    if proc.returncode or not lines or json.loads(lines[-1][len(MARK) :])["rc"]:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len(MARK) :]), "phases": phases}


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="where the inputs, the dataset and the copy go (deleted after)")
    ap.add_argument("--nodes", type=int, default=3_000_000)
    ap.add_argument("--edges", type=int, default=45_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--memory", default="1GB", help="the import's --memory")
    ap.add_argument("--threads", default="1,2", help="NUMBA_NUM_THREADS of each import run (default 1,2)")
    ap.add_argument("--undirected", action="store_true")
    ap.add_argument("--copy-features", action="store_true", help="pass --copy-features (the old behaviour)")
    ap.add_argument("--drop-caches", action="store_true", help="drop the whole page cache (root) before each run")
    ap.add_argument(
        "--compare",
        metavar="CHECKOUT",
        help="also run the import of another checkout of moment (e.g. the main branch before a change) in the "
        "same run, with PYTHONPATH=CHECKOUT: the before/after on the same machine, minutes apart",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-import-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        inputs = synthesize(work / "igb", "small", args.nodes, args.edges, args.dim)
        sizes = {p.name: p.stat().st_size for p in inputs}
        total = sum(sizes.values())
        graph = total - sizes["node_feat.npy"]
        print(
            f"inputs: {args.nodes:,} vertices, {args.edges:,} edges, {args.dim}-dim float32: {_gb(total)} "
            f"({_gb(graph)} edges and labels) written in {time.perf_counter() - t0:.0f} s under {work}"
        )
        print(f"machine: {os.cpu_count()} CPUs, shared with other work; page cache dropped before each run")
        cmd = [
            "moment",
            "dataset",
            "import",
            "--format",
            "igb",
            "--root",
            str(work / "igb"),
            "--size",
            "small",
            "--memory",
            args.memory,
            *(["--undirected"] if args.undirected else []),
            *(["--copy-features"] if args.copy_features else []),
        ]
        print("$ " + " ".join([*cmd, "--out", "DS"]))
        drop_cache(inputs, args.drop_caches)
        cp = measure(["cp", "-r", str(work / "igb"), str(work / "copy")], dict(os.environ))
        shutil.rmtree(work / "copy")
        graph_files = [p for p in inputs if p.name != "node_feat.npy"]
        (work / "copy").mkdir()
        drop_cache(inputs, args.drop_caches)
        cpg = measure(["cp", *map(str, graph_files), str(work / "copy")], dict(os.environ))
        shutil.rmtree(work / "copy")
        print(
            f"cp -r of the inputs: {cp['wall']:.2f} s, {total / cp['wall'] / 1e6:.0f} MB/s, "
            f"read {_gb(cp['read'])}, written {_gb(cp['written'])}; cp of the edge and label files alone: "
            f"{cpg['wall']:.2f} s, {graph / cpg['wall'] / 1e6:.0f} MB/s"
        )
        print(
            "code | threads | import s | CPU s | vs cp (all inputs) | graph steps vs cp of their bytes | peak anon | "
            "peak RSS | read | written"
        )
        runs = [("this", int(t)) for t in args.threads.split(",")]
        if args.compare:
            runs.insert(0, (args.compare, 1))
        for code, threads in runs:
            drop_cache(inputs, args.drop_caches)
            env = {**os.environ, "NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
            argv = [*cmd, "--out", str(work / "ds")]
            if code != "this":
                env["PYTHONPATH"] = code
                argv = [a for a in argv if a != "--copy-features"]  # the old code always copied
            r = measure(argv, env)
            out_files = [p for p in (work / "ds").iterdir() if p.is_file()]
            written = sum(p.stat().st_size for p in out_files)
            shutil.rmtree(work / "ds")
            steps = sum(r["phases"].get(k, (0.0, 0.0))[0] for k in GRAPH_STEPS)
            phases = ", ".join(f"{k} {w:.2f} s (CPU {c:.2f} s)" for k, (w, c) in r["phases"].items())
            ratio = f"{cpg['wall'] / steps:.2f}× ({steps:.2f} s)" if steps else "n/a (no phase line)"
            print(
                f"{code} | {threads} | {r['wall']:.2f} | {r['cpu']:.2f} | {cp['wall'] / r['wall']:.2f}× | "
                f"{ratio} | {r['anon'] / 2**20:.0f} MiB | {r['hwm'] / 2**20:.0f} MiB | "
                f"{_gb(r['read'])} | {_gb(r['written'])} (dataset {_gb(written)})"
            )
            print(f"    phases: {phases or 'not printed'}; load average {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
