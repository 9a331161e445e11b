"""Random row reads: the file reader's engines vs plain C.

Reads ``--reads`` random rows (one read each: no two rows adjacent) of a scratch file with each
engine of ``FileReader`` that runs here — ``python`` (one ``os.preadv`` per row), ``pread`` (the
compiled loop of moment/preads.py, GIL released, one read in flight per thread) and ``io_uring``
(a ring per thread, moment/uring.py) — and, where a C compiler is found, a plain C program doing
the same blocking preads from the same number of pthreads. By default the file is in the page cache, so the figures are the CPU cost per read —
what limits a rank that SSDs can feed faster than Python can ask (finding 18 of the GPU review);
``--direct`` reads with O_DIRECT from the disk instead. Best of ``--rounds`` per cell; the bytes
read are checked against the file. The scratch folder is made with mkdtemp under ``--dir`` and
removed at the end. Run:
    python scripts/bench_readers.py [--dir /tmp] [--size-mb 1024] [--reads 100000]
                                    [--row-bytes 4096] [--threads 1,2,4,16] [--direct]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from trainer.readers import READ_ENGINES, FileReader, engine_refusal

C_PROGRAM = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { int fd; const int64_t *off; int64_t n; size_t size; char *buf; } job_t;

static void *run(void *p) {
    job_t *j = p;
    for (int64_t i = 0; i < j->n; i++)
        if (pread(j->fd, j->buf + i * j->size, j->size, j->off[i]) != (ssize_t)j->size) { perror("pread"); exit(1); }
    return NULL;
}

int main(int argc, char **argv) {  /* file offsets-file reads row-bytes threads direct rounds */
    if (argc != 8) return 2;
    int64_t n = atoll(argv[3]); size_t size = atoll(argv[4]); int threads = atoi(argv[5]), rounds = atoi(argv[7]);
    int fd = open(argv[1], O_RDONLY | (atoi(argv[6]) ? O_DIRECT : 0));
    FILE *f = fopen(argv[2], "rb");
    int64_t *off = malloc(n * sizeof *off);
    char *buf;
    if (fd < 0 || !f || fread(off, sizeof *off, n, f) != (size_t)n || posix_memalign((void **)&buf, 4096, n * size)) return 3;
    memset(buf, 1, n * size);
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        pthread_t t[256]; job_t j[256]; struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int k = 0; k < threads; k++) {
            int64_t lo = n * k / threads, hi = n * (k + 1) / threads;
            j[k] = (job_t){fd, off + lo, hi - lo, size, buf + lo * size};
            pthread_create(&t[k], NULL, run, &j[k]);
        }
        for (int k = 0; k < threads; k++) pthread_join(t[k], NULL);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
        if (s < best) best = s;
    }
    printf("%.9f\n", best);
    return 0;
}
"""


def build_c(work: Path) -> Path | None:
    """The C baseline, compiled; None without a compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    (work / "preads.c").write_text(C_PROGRAM)
    exe = work / "preads_c"
    subprocess.run([cc, "-O2", "-pthread", "-o", str(exe), str(work / "preads.c")], check=True)
    return exe


def write_file(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for lo in range(0, size, 64 << 20):
            f.write(rng.integers(0, 256, min(64 << 20, size - lo), dtype=np.uint8).tobytes())


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def time_reader(path: Path, rows: np.ndarray, out: np.ndarray, threads: int, engine: str, direct: bool, rounds: int):
    best = float("inf")
    with FileReader(threads=threads, direct=direct, engine=engine) as reader:
        for _ in range(rounds):
            if direct:
                drop_cache(path)
            start = time.perf_counter()
            reader.read(path, rows, out)
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--reads", type=int, default=100_000)
    ap.add_argument("--row-bytes", type=int, default=4096)
    ap.add_argument("--threads", default="1,2,4,16", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--direct", action="store_true", help="O_DIRECT reads from the disk, not the page cache")
    args = ap.parse_args()
    rb = args.row_bytes
    nrows = args.size_mb * (1 << 20) // rb
    if args.reads * 2 > nrows:
        ap.error(f"--reads {args.reads}: the file has {nrows} rows; at most {nrows // 2} reads fit without adjacency")
    engines = [e for e in READ_ENGINES if engine_refusal(e) is None]
    for e in READ_ENGINES:
        if e not in engines:
            print(f"{e}: not measured: {engine_refusal(e)}")
    work = Path(tempfile.mkdtemp(prefix="moment-bench-readers-", dir=args.dir))
    try:
        path = work / "rows.bin"
        write_file(path, nrows * rb)
        rng = np.random.default_rng(1)
        rows = np.sort(rng.choice(nrows // 2, args.reads, replace=False)) * 2  # never adjacent: one pread per row
        (rows * rb).astype(np.int64).tofile(work / "offsets.bin")
        exe = build_c(work)
        out = np.frombuffer(mmap.mmap(-1, rows.size * rb), dtype=np.uint8).reshape(rows.size, rb)  # page-aligned
        out.fill(1)  # touched: page faults are not measured
        print(
            f"{args.reads} random {rb}-byte reads of a {args.size_mb} MiB file, "
            f"{'O_DIRECT from disk' if args.direct else 'page-cached'}; best of {args.rounds}; M reads/s"
        )
        names = [*engines, "C"]
        print(f"{'threads':>7}  " + "  ".join(f"{n:>8}" for n in names) + "   (vs python)")
        check = np.fromfile(path, dtype=np.uint8).reshape(-1, rb)[rows]
        for threads in (int(t) for t in args.threads.split(",")):
            seconds = {}
            for engine in engines:
                out.fill(0)
                seconds[engine] = time_reader(path, rows, out, threads, engine, args.direct, args.rounds)
                if not np.array_equal(out, check):
                    raise SystemExit(f"bench_readers: the {engine} engine read wrong bytes")
            seconds["C"] = float("nan")
            if exe is not None:
                if args.direct:
                    drop_cache(path)
                argv = [str(exe), str(path), str(work / "offsets.bin"), str(rows.size), str(rb), str(threads),
                        str(int(args.direct)), str(args.rounds)]  # fmt: skip
                seconds["C"] = float(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
            rate = {n: rows.size / s / 1e6 for n, s in seconds.items()}
            ratios = "  ".join(f"{n} {rate[n] / rate['python']:.2f}×" for n in names if n != "python")
            print(f"{threads:>7}  " + "  ".join(f"{rate[n]:>8.3f}" for n in names) + f"   {ratios}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
