"""Feature reads from SSD bins vs the raw random-read rate of the same file (same read size).

The raw rate: ``moment bench``'s reader — random aligned preads of one row, `--threads` in
flight, O_DIRECT — on the largest SSD bin file. The store: ``TieredFeatureStore.get`` of batches
of random vertex ids of that bin (sorted, deduplicated, coalesced, threaded preadv, O_DIRECT).
Both bypass the page cache, both run here, one after the other. Run:
    python scripts/bench_features.py PLACED_DIR [--batch 50000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from moment.bench import random_read
from placement.placed import open_placed
from trainer.featurestore import TieredFeatureStore
from trainer.readers import FileReader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("placed")
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    placed = open_placed(args.placed)
    ssd = max((b for b in placed.bins if b.tier == "ssd"), key=lambda b: b.count)
    rb = placed.row_bytes
    raw = random_read(str(ssd.path), read_size=rb, queue_depth=args.threads, seconds=args.seconds)
    store = TieredFeatureStore(args.placed, reader=FileReader(threads=args.threads, direct=True))
    rng = np.random.default_rng(0)
    rows = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        ids = torch.from_numpy(rng.integers(ssd.start, ssd.start + ssd.count, args.batch))
        store.get(ids)
        rows += store.stats()["tiers"]["ssd"]["unique_rows"]
        store.reset_stats()
    elapsed = time.perf_counter() - t0
    gbps = rows * rb / elapsed / 1e9
    print(f"bin {ssd.name}: {ssd.count:,} rows of {rb} B ({ssd.path})")
    print(f"raw random reads  : {raw.gbps:.3f} GB/s ({raw.iops:,.0f} reads/s, {args.threads} in flight, direct={raw.direct})")
    print(f"feature store get : {gbps:.3f} GB/s of distinct rows ({args.batch:,} random ids per call)")
    print(f"ratio             : {gbps / raw.gbps:.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
