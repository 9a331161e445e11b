"""Gathering host-tier rows into the staging buffer: numpy's single-threaded ``take`` (the old
gather) vs :func:`trainer.featurestore.gather_rows` (ATen ``index_select``, torch's intra-op
threads), on the same random rows of the same source, alternating in ``--rounds`` rounds; prints
GB/s of each and their ratio (the totals'). Run:
    python scripts/bench_gather.py [--rows 200000] [--row-bytes 4096] [--batch 50000] [--rounds 6] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from trainer.featurestore import _records, gather_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the source tier")
    ap.add_argument("--row-bytes", type=int, default=4096, help="bytes per row (1024 float32: 4096)")
    ap.add_argument("--batch", type=int, default=50_000, help="rows gathered per call")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, (args.rows, args.row_bytes), dtype=np.uint8))
    ids = rng.integers(0, args.rows, args.batch)
    out = torch.empty((args.batch, args.row_bytes), dtype=torch.uint8)

    def old() -> None:
        np.take(_records(src), ids, out=_records(out), mode="clip")

    def new() -> None:
        gather_rows(src, ids, out)

    seconds = {"np.take": 0.0, "gather_rows": 0.0}
    for f in (old, new):
        f()  # touch the pages once
    for _ in range(args.rounds):
        for name, f in (("np.take", old), ("gather_rows", new)):
            t = time.perf_counter()
            f()
            seconds[name] += time.perf_counter() - t
    nbytes = args.rounds * args.batch * args.row_bytes
    rate = {k: nbytes / s / 1e9 for k, s in seconds.items()}
    print(
        f"{args.batch} rows of {args.row_bytes} B from {args.rows} rows, {torch.get_num_threads()} torch threads: "
        f"np.take {rate['np.take']:.2f} GB/s, gather_rows {rate['gather_rows']:.2f} GB/s, "
        f"ratio {rate['gather_rows'] / rate['np.take']:.2f}"
    )


if __name__ == "__main__":
    main()
