"""`moment infer` on two nodes on one machine: vertices/s of 2 nodes × 1 rank against 1 node × 2
ranks (the baseline, measured in the same run), CPU ranks with gloo.

Both "nodes" are torchrun agents on 127.0.0.1 (``moment infer --nnodes 2 --node-rank R``), each
with its own placement of one dataset (``scripts/bench_nodes.py``'s) and its own --out; the
baseline is ``moment infer --nproc 2`` on node 0's placement. The same ranges per global rank:
the outputs are the same bytes, which the script checks. On one machine there is nothing to
gain (the same cores); what it measures is what the second agent and the exchange of every
layer's rows over loopback TCP cost. ``--pin`` gives each node one core of its own
(``taskset``), two for the baseline. The runs alternate, ``--repeats`` times; reported: the
median over runs of the whole run's vertices/s (vertices × layers over the layers' seconds,
inference.json) and of the wall time, and the ratios to the baseline; then the wall time of both
commands run once more on their complete outputs (nothing to do: node 0 tells node 1).
``--other-layout`` adds a third run to each round: node 1 on a placement with larger caches (the
same data and vertex ids, another row map: ``trainer/infer_nodes.py``), its ratio to the two
nodes placed alike, and the same bytes checked. Run:
    python scripts/bench_infer_nodes.py --work /tmp/bench-infer-nodes [--pin] [--repeats 3] [--other-layout]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_nodes import _port, prepare  # noqa: E402  (scripts/: the dataset and placements of bench_nodes)
from moment.contracts.inference import InferenceManifest  # noqa: E402

TRAIN = ["--fanouts", "10,5", "--batch-size", "512", "--hidden", "64", "--epochs", "1"]
TRAIN += ["--max-batches-per-epoch", "4", "--device", "cpu"]


def checkpoint(work: Path, data: Path) -> Path:
    """A GraphSAGE checkpoint of node 0's placement (a few batches: inference's cost is the same)."""
    ck = work / "ck"
    if not (ck / "checkpoint.pt").exists():
        cmd = [sys.executable, "-m", "trainer", "--data", str(data), "--checkpoint-dir", str(ck), *TRAIN]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ck


def _result(out: Path, wall: float) -> tuple[float, float, str]:
    """vertices/s over the layers, the wall time, the arrays' digest."""
    m = InferenceManifest.read(out / "inference.json")
    layers = [t for t in m.throughput if t.stage != "export"]
    rate = sum(t.vertices for t in layers) / sum(t.seconds for t in layers)
    digest = hashlib.sha256("".join(e.sha256 for e in m.arrays.values()).encode()).hexdigest()
    return rate, wall, digest


def _run(cmds: list[list[str]]) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"a run failed ({p.returncode}): {err[-2000:]}")
    return time.perf_counter() - start


def remove_output(out: Path) -> None:
    """Delete ``out`` only where it is an inference output (its ``inference.json``): ``--work`` is
    the user's directory, and a folder of theirs named like ours stays."""
    if not out.exists():
        return
    if not (out / "inference.json").is_file():
        raise SystemExit(f"{out}: exists and is not an inference output; give another --work")
    shutil.rmtree(out)


def one_node(data: Path, ck: Path, out: Path, pin: bool, fresh: bool = True) -> tuple[float, float, str]:
    """``fresh``: remove the last run's output first (else the run has nothing to do)."""
    if fresh:
        remove_output(out)
    cmd = [sys.executable, "-m", "moment", "infer", "--nproc", "2", "--data", str(data), "--checkpoint", str(ck)]
    cmd += ["--out", str(out), "--device", "cpu"]
    if pin:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:2])), *cmd]
    return _result(out, _run([cmd]))


def two_nodes(data: tuple[Path, Path], ck: Path, out: Path, pin: bool, fresh: bool = True) -> tuple[float, float, str]:
    """``fresh``: remove the last run's output first (else node 0 finds it complete)."""
    if fresh:
        remove_output(out)
    endpoint, cores, cmds = f"127.0.0.1:{_port()}", sorted(os.sched_getaffinity(0)), []
    for node in (1, 0):
        cmd = [sys.executable, "-m", "moment", "infer", "--nnodes", "2", "--node-rank", str(node)]
        cmd += ["--rdzv-endpoint", endpoint, "--rdzv-id", f"bench-{endpoint.rsplit(':', 1)[1]}"]
        cmd += ["--nproc", "1", "--data", str(data[node]), "--checkpoint", str(ck), "--out", str(out)]
        cmd += ["--device", "cpu"]
        if pin:
            cmd = ["taskset", "-c", str(cores[node % len(cores)]), *cmd]
        cmds.append(cmd)
    return _result(out, _run(cmds))


def _other_layout(runs: list[tuple[float, float, str]], two: float, two_wall: float) -> dict[str, float]:
    speed, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {
        "other_layout_vertices_per_s": speed,
        "ratio_other_layout_over_two_nodes": speed / two,
        "other_layout_wall_s": wall,
        "ratio_other_layout_wall_over_two_nodes": wall / two_wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--vertices", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pin", action="store_true", help="one core per node (taskset), two for the baseline")
    ap.add_argument("--other-layout", action="store_true", help="also node 1 on a placement with other caches")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    plan_path, node0, node1 = prepare(args.work, args.vertices)
    wide = args.work / "node1-wide"
    if args.other_layout and not wide.exists():
        from placement.place import PlaceOptions, place

        place(plan_path, args.work / "ds", wide, PlaceOptions(gpu_cache="6%", cpu_cache="20%"))
    ck = checkpoint(args.work, node0)
    base, nodes, other, digests = [], [], [], set()
    for i in range(args.repeats):
        base.append(one_node(node0, ck, args.work / "one", args.pin))
        nodes.append(two_nodes((node0, node1), ck, args.work / "two", args.pin))
        digests |= {base[-1][2], nodes[-1][2]}
        line = (
            f"run {i + 1}: 1 node × 2 ranks {base[-1][0]:,.0f} vertices/s ({base[-1][1]:.1f} s), "
            f"2 nodes × 1 rank {nodes[-1][0]:,.0f} vertices/s ({nodes[-1][1]:.1f} s)"
        )
        if args.other_layout:
            other.append(two_nodes((node0, wide), ck, args.work / "other-layout", args.pin))
            digests.add(other[-1][2])
            line += f", node 1 placed otherwise {other[-1][0]:,.0f} vertices/s ({other[-1][1]:.1f} s)"
        print(line)
    # The same commands once more on the complete outputs: nothing to do, every node told so.
    again = {"one": one_node(node0, ck, args.work / "one", args.pin, fresh=False)}
    again["two"] = two_nodes((node0, node1), ck, args.work / "two", args.pin, fresh=False)
    digests |= {again["one"][2], again["two"][2]}
    print(f"again, nothing to do: 1 node × 2 ranks {again['one'][1]:.1f} s, 2 nodes × 1 rank {again['two'][1]:.1f} s")
    med = {k: statistics.median(r[0] for r in runs) for k, runs in (("one", base), ("two", nodes))}
    wall = {k: statistics.median(r[1] for r in runs) for k, runs in (("one", base), ("two", nodes))}
    result = {
        "one_node_two_ranks_vertices_per_s": med["one"],
        "two_nodes_one_rank_vertices_per_s": med["two"],
        "ratio_two_nodes_over_one": med["two"] / med["one"],
        "one_node_wall_s": wall["one"],
        "two_nodes_wall_s": wall["two"],
        "nothing_to_do_one_node_wall_s": again["one"][1],
        "nothing_to_do_two_nodes_wall_s": again["two"][1],
        "same_bytes": len(digests) == 1,
        **(_other_layout(other, med["two"], wall["two"]) if other else {}),
        "pinned": args.pin,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
