"""The bin pass's CPU per feature byte: ``placement.writer.write_bins`` over a page-cached source.

Why: place's bin pass reads each chunk, groups its rows by bin and copies them into the bins'
write buffers; on a server whose SSDs write tens of GB/s that CPU side, not the disks, may set
the pass's speed (README, "Projection for the real thing"). This measures it alone: a
synthesized float32 source of ``--rows`` × ``--dim`` is read once (page cache warm), then written
into ``--bins`` bins (vertices assigned at random) ``--runs`` times; it prints wall time, the
calling thread's CPU, the whole process's CPU per byte, and the walls of the grouping and the
appending (``WriteTimes``). ``--dir`` on /dev/shm takes the disk out (the bins are then written
with ``pwrite`` into tmpfs, not ``O_DIRECT``). ``--threads`` pins the threads that
group each chunk and copy it into the bins' buffers (default: every usable core); several
values, comma-separated, alternate run by run in the same process (``--runs`` rounds of each, every
other round reversed), after one untimed warm-up run.

    python scripts/bench_bin_pass.py --rows 312500 --dim 1024 --threads 1,2 --dir /tmp/binpass
    python scripts/bench_bin_pass.py --rows 20000000 --dim 16 --threads 1,2 --dir /tmp/binpass

Everything it writes under ``--dir`` is deleted at the end.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from placement.writer import BinFile, group_threads, write_bins  # noqa: E402 - the repository's own code


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _files(out: Path, counts: np.ndarray) -> list[BinFile]:
    out.mkdir()
    return [BinFile(f"b{b}", out / f"b{b}.bin", int(c)) for b, c in enumerate(counts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=312_500)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", default="", help="grouping threads, comma-separated (default: the usable cores)")
    ap.add_argument("--dir", default="/tmp/bench-bin-pass", help="a scratch directory (deleted at the end)")
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=False)
    try:
        source = np.lib.format.open_memmap(
            work / "source.npy", mode="w+", dtype=np.float32, shape=(args.rows, args.dim)
        )
        step = max(1, (64 << 20) // (4 * args.dim))
        for i in range(0, args.rows, step):
            n = min(step, args.rows - i)
            source[i : i + n] = np.random.default_rng(i).random((n, args.dim), dtype=np.float32)
        source.flush()
        float(np.asarray(source).sum())  # every page read once: the pass reads from the page cache
        bin_of = np.random.default_rng(0).integers(0, args.bins, args.rows).astype(np.int8)
        counts = np.bincount(bin_of, minlength=args.bins)
        nbytes = source.nbytes
        pins = [int(t) for t in args.threads.split(",") if t] or [None]
        order = [
            t for r in range(args.runs) for t in (pins if r % 2 == 0 else pins[::-1])
        ]  # ABBA: no side always first
        write_bins(source, bin_of, _files(work / "warm-up", counts), work / "warm-up", "bench")  # untimed
        shutil.rmtree(work / "warm-up")
        for run, threads in enumerate(order):
            out = work / f"run{run}"
            files = _files(out, counts)
            cpu0, main0, wall0 = _cpu(), time.thread_time(), time.perf_counter()
            times = write_bins(source, bin_of, files, out, "bench", threads=threads)
            wall, main_cpu, cpu = time.perf_counter() - wall0, time.thread_time() - main0, _cpu() - cpu0
            print(
                f"run {run + 1}, {threads or group_threads()} grouping threads: {nbytes / 1e9:.2f} GB "
                f"({args.dim * 4} B rows, {args.bins} bins): wall {wall:.2f} s ({nbytes / wall / 1e9:.2f} GB/s), "
                f"calling thread {main_cpu:.2f} CPU-s ({main_cpu / nbytes * 1e9:.2f} ns/byte), "
                f"process {cpu:.2f} CPU-s ({cpu / nbytes * 1e9:.2f} ns/byte), hashing {times.hash:.2f} s busy, "
                f"waited {times.wait:.2f} s; grouping {times.group:.2f} s wall ({times.group / nbytes * 1e9:.2f} ns/byte), "
                f"appending {times.append:.2f} s wall ({times.append / nbytes * 1e9:.2f} ns/byte)",
                flush=True,
            )
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
