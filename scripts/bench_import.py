"""Bounded-memory import: a synthetic graph in the IGB layout, imported under ``--memory``.

Writes ``ROOT/<size>/processed/`` as IGB does (``paper/node_feat.npy`` N × dim float32,
``paper/node_label_19.npy`` N float32, ``paper__cites__paper/edge_index.npy`` E × 2 int64; a small
feature dimension: the point is the CSR), then runs ``moment dataset import --format igb`` in a
child process under ``/usr/bin/time -v`` (peak RSS; ``getrusage`` of the child where that is
missing) and compares its rate (input bytes / wall time) with a plain sequential copy (``cp``) of
the same input files. The inputs were just written, so both read them mostly from the page cache.
Not part of the test suite. Everything it writes under ``--dir`` is deleted at the end.
Run:
    python scripts/bench_import.py [--dir /tmp] [--edges 200000000] [--nodes 10000000] [--dim 16]
                                   [--memory 1GB] [--undirected]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BLOCK = 1 << 24  # edges generated at once


def _npy(path: Path, dtype: str, shape: tuple[int, ...]):
    fh = open(path, "wb")  # noqa: SIM115 - the caller closes it
    np.lib.format.write_array_header_2_0(fh, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape})
    return fh


def synthesize(root: Path, size: str, nodes: int, edges: int, dim: int, seed: int = 0) -> int:
    """The IGB files, written block by block; returns their total size in bytes."""
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
    return sum(p.stat().st_size for p in base.rglob("*.npy"))


def run_child(argv: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, output) of a child process; the output ends with its CPU time
    as /usr/bin/time reports it (on a shared machine, CPU time says more than wall time)."""
    timer = ["/usr/bin/time", "-v"] if os.access("/usr/bin/time", os.X_OK) else []
    start = time.perf_counter()
    proc = subprocess.run([*timer, *argv], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    peak = int(found.group(1)) * 1024 if found else resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    cpu = [
        m.group(0)
        for key in ("User time", "System time", "Percent of CPU")
        if (m := re.search(rf"{key}[^:]*: [\d.%]+", proc.stderr))
    ]
    return wall, peak, proc.stdout + ("\n" + "; ".join(cpu) if cpu else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="where the inputs, the dataset and the copy go (deleted after)")
    ap.add_argument("--edges", type=int, default=200_000_000)
    ap.add_argument("--nodes", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--memory", default="1GB", help="the import's --memory")
    ap.add_argument("--undirected", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-import-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        size = "medium" if args.nodes == 10_000_000 else "large"
        nbytes = synthesize(work / "igb", size, args.nodes, args.edges, args.dim)
        print(
            f"inputs: {args.nodes:,} vertices, {args.edges:,} edges, {args.dim}-dim float32: "
            f"{nbytes / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s under {work}"
        )
        cmd = [
            sys.executable,
            "-m",
            "moment",
            "dataset",
            "import",
            "--format",
            "igb",
            "--root",
            str(work / "igb"),
            "--size",
            size,
            "--memory",
            args.memory,
            "--out",
            str(work / "ds"),
            *(["--undirected"] if args.undirected else []),
        ]
        print("$ " + " ".join(cmd))
        wall, peak, printed = run_child(cmd)
        print(" ".join(printed.split())[-500:])
        copy_wall, copy_peak, _ = run_child(["cp", "-r", str(work / "igb"), str(work / "copy")])
        out_bytes = sum(p.stat().st_size for p in (work / "ds").glob("*.npy"))
        print(
            f"import: {wall:.1f} s, {nbytes / wall / 1e6:.0f} MB/s of input ({out_bytes / 1e9:.2f} GB written), "
            f"peak RSS {peak / 2**20:.0f} MiB (--memory {args.memory})"
        )
        print(
            f"cp of the same inputs: {copy_wall:.1f} s, {nbytes / copy_wall / 1e6:.0f} MB/s, "
            f"peak RSS {copy_peak / 2**20:.0f} MiB; import/cp time ratio {wall / copy_wall:.1f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
