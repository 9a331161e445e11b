"""Feature reads from SSD bins vs the raw random-read rate of the same file (same read size).

The raw rate: ``moment bench``'s reader — random aligned preads of one row, `--threads` in
flight, O_DIRECT — on the largest SSD bin file. The store: ``TieredFeatureStore.get`` of batches
of random vertex ids of that bin (sorted, deduplicated, coalesced, threaded preadv, O_DIRECT).
Both bypass the page cache. The two alternate in ``--rounds`` short rounds (a shared or noisy
disk drifts over seconds), and the ratio is of the totals. ``--device cuda`` returns the rows
in GPU memory (``--io kvikio`` reads them straight there; ``auto`` probes both, as the trainer
does). The reader's configuration and modes are printed (kvikio's compat-mode reads are buffered,
through the page cache, unless its ``auto_direct_io_read`` is on: then the ratio can exceed 1 for
the wrong reason). Run:
    python scripts/bench_features.py PLACED_DIR [--batch 8000] [--seconds 1] [--rounds 8]
                                     [--device cpu|cuda] [--io auto|posix|kvikio] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from moment.topology.measure import random_read
from placement.placed import open_placed
from trainer.featurestore import TieredFeatureStore
from trainer.readers import READERS, make_reader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("placed")
    ap.add_argument("--batch", type=int, default=8_000, help="random ids per get() call")
    ap.add_argument("--seconds", type=float, default=1.0, help="per round and reader")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="where get() returns the rows: cpu or cuda")
    ap.add_argument("--io", choices=("auto", *READERS), default="auto", help="SSD reader (trainer's --io)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here as JSON")
    args = ap.parse_args()
    placed = open_placed(args.placed)
    ssd = max((b for b in placed.bins if b.tier == "ssd"), key=lambda b: b.count)
    rb = placed.row_bytes
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available on this machine")
    try:
        reader = make_reader(
            args.device,
            threads=args.threads,
            direct=True,
            io=args.io,
            probe=[(str(b.path), rb) for b in placed.bins if b.tier == "ssd"],
        )
    except (ValueError, RuntimeError) as exc:
        ap.error(str(exc))
    store = TieredFeatureStore(placed, device=args.device, reader=reader)
    cuda = store.device.type == "cuda"
    rng = np.random.default_rng(0)
    raw_bytes = raw_s = store_bytes = store_s = 0.0
    print(
        f"bin {ssd.name}: {ssd.count:,} rows of {rb} B ({ssd.path}); {args.batch:,} random ids per call; "
        f"{type(reader).__name__} into {store.device}"
    )
    calls, parts = 0, np.zeros(3)  # the store's seconds in get, in its SSD reads, in assembling the batch
    for r in range(args.rounds):
        raw = random_read(str(ssd.path), read_size=rb, queue_depth=args.threads, seconds=args.seconds)
        raw_bytes += raw.gbps * 1e9 * args.seconds  # random_read runs for `seconds`
        raw_s += args.seconds
        rows, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            store.get(torch.from_numpy(rng.integers(ssd.start, ssd.start + ssd.count, args.batch)))
            if cuda:
                torch.cuda.synchronize()
            st = store.stats()
            rows += st["tiers"]["ssd"]["unique_rows"]
            calls += 1
            parts += (st["seconds"], st["tiers"]["ssd"]["seconds"], st["assemble_seconds"])
            store.reset_stats()
        elapsed = time.perf_counter() - t0
        store_bytes += rows * rb
        store_s += elapsed
        print(
            f"  round {r + 1}: raw {raw.gbps:.3f} GB/s ({raw.iops:,.0f} reads/s, direct={raw.direct}), "
            f"store {rows * rb / elapsed / 1e9:.3f} GB/s: {rows * rb / elapsed / 1e9 / raw.gbps:.2f}"
        )
    raw_gbps, store_gbps = raw_bytes / raw_s / 1e9, store_bytes / store_s / 1e9
    print(f"raw random reads  : {raw_gbps:.3f} GB/s ({args.threads} in flight)")
    print(f"feature store get : {store_gbps:.3f} GB/s of distinct rows")
    print(f"ratio             : {store_gbps / raw_gbps:.2f}  (target >= 0.8)")
    per_call = dict(zip(("get_ms", "ssd_read_ms", "assemble_ms"), (1e3 * parts / max(calls, 1)).round(3).tolist()))
    per_call["wall_ms"] = round(1e3 * store_s / max(calls, 1), 3)  # with the id draw and the device sync
    print(
        f"per call          : {per_call['wall_ms']:.2f} ms wall, {per_call['get_ms']:.2f} ms in get: "
        f"{per_call['ssd_read_ms']:.2f} SSD reads, {per_call['assemble_ms']:.2f} assembling, "
        f"{per_call['get_ms'] - per_call['ssd_read_ms'] - per_call['assemble_ms']:.2f} the rest"
    )
    io = store.stats()["io"]
    print(f"reader            : {json.dumps(io)}")
    if args.json:
        doc = {
            "device": str(store.device),
            "io_asked": args.io,
            "raw_gbps": raw_gbps,
            "store_gbps": store_gbps,
            "ratio": store_gbps / raw_gbps,
            "row_bytes": rb,
            "batch": args.batch,
            "per_call": per_call,
            **io,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
