"""Training benchmark: moment's pipeline (DDAK placement, then hash placement) vs a plain PyG
pipeline, on one out-of-core dataset, one CPU process each, same model, fan-outs and batch.

* moment: ``python -m trainer`` on the placed dataset: sampler, tiered feature store (GPU and
  CPU cache bins in memory on a CPU run, SSD bins read with coalesced O_DIRECT preadv), prefetch
  thread. Once on a DDAK placement, once on a hash placement of the same hotness and budgets.
* PyG: ``torch_geometric.loader.NeighborLoader`` over the same CSR (as a SparseTensor ``adj_t``,
  so it samples from exactly the same neighbour lists) and ``x`` a memmap of the source feature
  file (what a PyG user does when features do not fit in memory), the same GraphSAGE convs
  applied to the sampled subgraph, ``num_workers=0``. NeighborLoader needs pyg-lib or
  torch-sparse; the script says which one it found.

Out of core: every run happens in a memory cgroup (``--mem-limit``, default 2 GiB; cgroup v1 or
v2 must be writable, e.g. as root in a container) smaller than the feature file, so neither the
page cache nor the caches can hold all features; file pages are dropped before each run. Each
run trains ``--batches`` steps of one epoch; reported: seconds per step (epoch time / steps),
bytes per tier, and bytes the process read from disk (/proc/self/io). Run:
    python scripts/bench_train.py --work /tmp/bench-train
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moment.contracts.metrics import MetricsDoc  # noqa: E402  (after the path: the repo's own)
from moment.fileio import drop_cached  # noqa: E402
from moment.sizes import parse_bytes  # noqa: E402


def parse_size(text: str) -> int:
    """``--mem-limit``: bytes as every moment size option reads them (``2GiB``, ``512MiB``,
    ``1.4GB``: :mod:`moment.sizes`), 0 for none."""
    return 0 if text.strip() == "0" else parse_bytes(text, "--mem-limit")


# -- memory limit and page cache -------------------------------------------------------------


def make_cgroup(limit: int, name: str = "moment-bench") -> Path:
    """A child memory cgroup of this process's own, limited to ``limit`` bytes (v1 or v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / name
            group.mkdir(exist_ok=True)
            (group / "memory.limit_in_bytes").write_text(str(limit))
            return group
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):  # cgroup v2
            group = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / name
            group.mkdir(exist_ok=True)
            (group / "memory.max").write_text(str(limit))
            return group
    raise OSError("no memory cgroup found")


def disk_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# -- workers (each a fresh process inside the cgroup) ------------------------------------------


def worker_moment(args: argparse.Namespace) -> dict:
    from trainer.loop import main as trainer_main

    metrics = Path(args.out_json).with_suffix(".metrics.json")
    before = disk_read_bytes()
    code = trainer_main(
        [
            "--data",
            args.data,
            "--device",
            "cpu",
            "--epochs",
            "1",
            "--batch-size",
            str(args.batch_size),
            "--fanouts",
            args.fanouts,
            "--max-batches-per-epoch",
            str(args.batches),
            "--metrics-json",
            str(metrics),
            "--prefetch",
            "2",
        ]
    )
    if code:
        raise SystemExit(code)
    e = MetricsDoc.read(metrics).epochs[0]
    bins = json.loads((Path(args.data) / "placed.json").read_text())["bins"]
    targets = {b["name"]: b["target"] for b in bins if b["tier"] == "ssd"}
    got, want = np.array([e.bytes_per_ssd[k] for k in targets], float), np.array(list(targets.values()), float)
    ssd_l1 = float(np.abs(got / got.sum() - want / want.sum()).sum())
    return {
        "step_s": e.iteration_s,
        "epoch_s": e.epoch_s,
        "bytes_per_tier": e.bytes_per_tier,
        "ssd_share_l1": ssd_l1,
        "data_wait_s": e.data_wait_s,
        "hit_rate": e.hit_rate,
        "disk_read_bytes": disk_read_bytes() - before,
        "loss": e.loss,
    }


def worker_pyg(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    import torch_geometric.typing as pyg_typing
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    from placement.dataset import open_dataset
    from trainer.config import TrainConfig
    from trainer.models import build_model

    backend = "pyg-lib" if pyg_typing.WITH_PYG_LIB else "torch-sparse" if pyg_typing.WITH_TORCH_SPARSE else None
    if backend is None:
        raise SystemExit("NeighborLoader needs pyg-lib or torch-sparse; neither is installed")
    from torch_sparse import SparseTensor

    before = disk_read_bytes()
    ds = open_dataset(args.dataset)
    n = ds.num_nodes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only memmap: PyG only reads it
        x = torch.from_numpy(ds.features())  # the dataset's file, or the import's source read in place
        y = torch.from_numpy(ds.array("labels"))  # as on disk (int8 for few classes): widened per batch
    indptr = torch.from_numpy(np.asarray(ds.indptr()))
    indices = torch.from_numpy(np.asarray(ds.indices()).astype(np.int64))
    adj_t = SparseTensor(rowptr=indptr, col=indices, sparse_sizes=(n, n), is_sorted=True, trust_data=True)
    data = Data(x=x, adj_t=adj_t, y=y, num_nodes=n)
    train = torch.from_numpy(np.asarray(ds.split("train")).astype(np.int64))
    fanouts = [int(f) for f in args.fanouts.split(",")]
    loader = NeighborLoader(
        data, num_neighbors=fanouts, input_nodes=train, batch_size=args.batch_size, shuffle=True, num_workers=0
    )
    cfg = TrainConfig(data="", fanouts=tuple(fanouts))
    model = build_model(cfg, ds.feature_dim, ds.num_classes)  # the same SAGEConv layers
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    torch.manual_seed(0)
    times, losses = [], []
    t = time.perf_counter()
    for step, batch in enumerate(loader):
        h = batch.x.float()
        for i, conv in enumerate(model.convs):
            h = conv(h, batch.adj_t)
            if i < len(model.convs) - 1:
                h = F.dropout(F.relu(h), p=cfg.dropout, training=True)
        loss = F.cross_entropy(h[: batch.batch_size], batch.y[: batch.batch_size].long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        now = time.perf_counter()
        times.append(now - t)
        print(
            f"pyg step {step + 1}: {now - t:.1f} s, disk read {(disk_read_bytes() - before) / 2**30:.1f} GiB so far",
            file=sys.stderr,
            flush=True,
        )
        if step + 1 == args.batches:
            break  # before the loader samples and fetches a batch nobody trains on
        t = now
    return {
        "step_s": float(np.mean(times)),
        "epoch_s": float(np.sum(times)),
        "backend": backend,
        "disk_read_bytes": disk_read_bytes() - before,
        "loss": float(np.mean(losses)),
    }


# -- driver -------------------------------------------------------------------------------------


def run_worker(
    kind: str, cgroup: Path | None, files: list[Path], extra: list[str], out: Path, script: str = __file__
) -> dict:
    """``script --worker KIND`` in a fresh process inside ``cgroup``, ``files``' pages dropped first."""
    drop_cached(files)
    cmd = [sys.executable, script, "--worker", kind, "--out-json", str(out), *extra]
    procs = cgroup / "cgroup.procs" if cgroup else None

    def enter() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))

    done = subprocess.run(cmd, preexec_fn=enter, capture_output=True, text=True, check=False)  # noqa: PLW1509
    if done.returncode:
        raise SystemExit(f"{kind} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Path]]:
    from moment.planner.plan import plan
    from moment.planner.planfile import save_plan
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    ds_dir = work / f"ds-{args.nodes}-{args.dim}"
    if not ds_dir.exists():
        t = time.perf_counter()
        synthesize(
            ds_dir,
            nodes=args.nodes,
            avg_degree=args.degree,
            dim=args.dim,
            dtype="float16",
            seed=0,
            val_fraction=0.0005,
            test_fraction=0.0005,
        )
        print(f"synthesised {ds_dir} in {time.perf_counter() - t:.0f} s", flush=True)
    plan_path = work / "plan.json"
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    outcome = plan(machine, workload, 4, 8, top=1)
    save_plan(machine, workload, outcome, plan_path)
    placed: dict[str, Path] = {}
    hotness = None  # the first placement's (dataset ids, usable as --hotness): the same for hash
    for policy in ("ddak", "hash"):
        out = work / f"placed-{policy}"
        if not out.exists():
            t = time.perf_counter()
            opts = PlaceOptions(policy=policy, gpu_cache=args.gpu_cache, cpu_cache=args.cpu_cache, hotness=hotness)
            place(plan_path, ds_dir, out, opts)
            print(f"placed {policy} in {time.perf_counter() - t:.0f} s", flush=True)
        hotness = hotness or out / "hotness.npy"  # only the policy differs
        placed[policy] = out
    return ds_dir, placed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/bench-train")
    ap.add_argument("--nodes", type=int, default=6_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--degree", type=float, default=10)
    ap.add_argument("--gpu-cache", default="3%", help="per GPU bin (4 GPUs in the plan)")
    ap.add_argument("--cpu-cache", default="8%")
    ap.add_argument("--mem-limit", default="2GiB", help="memory cgroup limit per run; 0: none")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--fanouts", default="25,10")
    ap.add_argument("--runs", default="ddak,hash,pyg", help="which runs, comma-separated (default all three)")
    ap.add_argument("--worker", choices=("moment", "pyg"), help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = (worker_moment if args.worker == "moment" else worker_pyg)(args)
        Path(args.out_json).write_text(json.dumps(result))
        return

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ds_dir, placed = prepare(args, work)
    limit = parse_size(args.mem_limit)
    cgroup = make_cgroup(limit) if limit else None
    feat = ds_dir / "features.npy"
    files = [p for d in (ds_dir, *placed.values()) for p in d.rglob("*") if p.is_file()]
    common = ["--batches", str(args.batches), "--batch-size", str(args.batch_size), "--fanouts", args.fanouts]
    print(
        f"features {feat.stat().st_size / 2**30:.2f} GiB; memory limit per run {limit / 2**30:.2f} GiB"
        if limit
        else "no memory limit",
        flush=True,
    )
    results = {}
    runs = {
        "ddak": ("moment, DDAK placement", "moment", ["--data", str(placed["ddak"])]),
        "hash": ("moment, hash placement", "moment", ["--data", str(placed["hash"])]),
        "pyg": ("PyG NeighborLoader + memmap", "pyg", ["--dataset", str(ds_dir)]),
    }
    for key in args.runs.split(","):
        name, kind, extra = runs[key]
        results[key] = r = run_worker(kind, cgroup, files, [*common, *extra], work / f"{key}.json")
        tiers = ", ".join(f"{t} {b / 2**20:.0f} MiB" for t, b in r.get("bytes_per_tier", {}).items())
        print(
            f"{name:28}: {r['step_s']:.3f} s/step  ({args.batches} steps {r['epoch_s']:.1f} s), "
            f"disk read {r['disk_read_bytes'] / 2**30:.2f} GiB"
            + (f"; {tiers}" if tiers else "")
            + (f"; SSD bytes vs the plan's per-SSD targets: L1 {r['ssd_share_l1']:.3f}" if "ssd_share_l1" in r else "")
            + (f"; waited for data {r['data_wait_s']:.1f} s" if "data_wait_s" in r else "")
            + (f"; sampler backend {r['backend']}" if "backend" in r else ""),
            flush=True,
        )
    if {"ddak", "pyg"} <= results.keys():
        print(f"moment (DDAK) vs PyG: {results['pyg']['step_s'] / results['ddak']['step_s']:.2f}x faster per step")
    if {"ddak", "hash"} <= results.keys():
        ddak, hashed = results["ddak"], results["hash"]
        print(
            f"DDAK vs hash placement: {hashed['step_s'] / ddak['step_s']:.2f}x faster per step, SSD bytes "
            f"{ddak['bytes_per_tier']['ssd'] / max(hashed['bytes_per_tier']['ssd'], 1):.2f} of hash's"
        )


if __name__ == "__main__":
    main()
