"""Two nodes on one machine: seeds/s of 2 nodes × 1 rank against 1 node × 2 ranks (the baseline,
measured in the same run), CPU ranks with gloo.

Both "nodes" are torchrun agents on 127.0.0.1 (``moment train --nnodes 2 --node-rank R``), each
with its own placement of one dataset and its own ``--shm-dir``; the baseline is ``moment train
--nproc 2`` on node 0's placement. Same world size, same seeds: the runs end with the same
parameters, which the script checks. On one machine there is nothing to gain (the same cores,
gradients over loopback TCP either way); what it measures is what the second agent costs.
``--pin`` gives each node one core of its own (``taskset``), as two one-core servers would
have; without it both nodes see every core (and each sizes its threads for all of them). The
runs alternate, ``--repeats`` times; reported: the median over runs of the mean seeds/s of the
epochs after the first, and the ratio to the baseline. Run:
    python scripts/bench_nodes.py --work /tmp/bench-nodes [--pin] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moment.contracts.metrics import MetricsDoc  # noqa: E402  (after the path: the repo's own)

TRAINER = ["--fanouts", "10,5", "--batch-size", "512", "--hidden", "64", "--device", "cpu"]


def prepare(work: Path, vertices: int) -> tuple[Path, Path, Path]:
    """plan.json of the paper's Machine B, a synthetic dataset, and two placements of it."""
    from moment.planner.plan import plan
    from moment.planner.planfile import save_plan
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    plan_path = work / "plan.json"
    if not plan_path.exists():
        machine = resolve_profile("moment-machine-b")
        workload = load_workload(machine.workload)
        save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), plan_path)
    if not (work / "ds").exists():
        synthesize(work / "ds", nodes=vertices, avg_degree=10, dim=64, dtype="float32", seed=1, classes=8)
    for node in ("node0", "node1"):
        if not (work / node).exists():
            place(plan_path, work / "ds", work / node, PlaceOptions(gpu_cache="3%", cpu_cache="10%"))
    return plan_path, work / "node0", work / "node1"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _seeds_per_s(metrics: Path) -> tuple[float, str]:
    doc = MetricsDoc.read(metrics).model_dump(mode="json")
    later = doc["epochs"][1:] or doc["epochs"]
    return statistics.mean(e["seeds_per_s"] for e in later), doc["rank_param_digests"][0]


def one_node(plan: Path, data: Path, out: Path, epochs: int, pin: bool) -> tuple[float, str]:
    shutil.rmtree(out, ignore_errors=True)
    (out / "shm").mkdir(parents=True)
    cmd = [sys.executable, "-m", "moment", "train", "--nproc", "2", "--plan", str(plan), "--data", str(data)]
    cmd += ["--epochs", str(epochs), "--metrics-json", str(out / "m.json"), "--", *TRAINER]
    cmd += ["--shm-dir", str(out / "shm")]
    cores = sorted(os.sched_getaffinity(0))
    if pin:
        cmd = ["taskset", "-c", ",".join(map(str, cores[:2])), *cmd]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return _seeds_per_s(out / "m.json")


def two_nodes(plan: Path, data: tuple[Path, Path], out: Path, epochs: int, pin: bool) -> tuple[float, str]:
    shutil.rmtree(out, ignore_errors=True)
    endpoint, cores = f"127.0.0.1:{_port()}", sorted(os.sched_getaffinity(0))
    procs = []
    for node in (1, 0):
        (out / f"shm{node}").mkdir(parents=True)
        cmd = [sys.executable, "-m", "moment", "train", "--nnodes", "2", "--node-rank", str(node)]
        cmd += ["--rdzv-endpoint", endpoint, "--rdzv-id", out.name, "--nproc", "1", "--plan", str(plan)]
        cmd += ["--data", str(data[node]), "--epochs", str(epochs)]
        if node == 0:
            cmd += ["--metrics-json", str(out / "m.json")]
        cmd += ["--", *TRAINER, "--shm-dir", str(out / f"shm{node}")]
        if pin:
            cmd = ["taskset", "-c", str(cores[node % len(cores)]), *cmd]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"a node failed ({p.returncode}): {err[-2000:]}")
    return _seeds_per_s(out / "m.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--vertices", type=int, default=100_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pin", action="store_true", help="one core per node (taskset), two for the baseline")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    plan, node0, node1 = prepare(args.work, args.vertices)
    base, nodes, digests = [], [], set()
    for i in range(args.repeats):
        rate, digest = one_node(plan, node0, args.work / "one", args.epochs, args.pin)
        base.append(rate)
        digests.add(digest)
        rate, digest = two_nodes(plan, (node0, node1), args.work / "two", args.epochs, args.pin)
        nodes.append(rate)
        digests.add(digest)
        print(f"run {i + 1}: 1 node × 2 ranks {base[-1]:,.0f} seeds/s, 2 nodes × 1 rank {nodes[-1]:,.0f} seeds/s")
    result = {
        "one_node_two_ranks_seeds_per_s": statistics.median(base),
        "two_nodes_one_rank_seeds_per_s": statistics.median(nodes),
        "ratio_two_nodes_over_one": statistics.median(nodes) / statistics.median(base),
        "same_parameters": len(digests) == 1,
        "pinned": args.pin,
        "runs": {"one_node": base, "two_nodes": nodes},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
