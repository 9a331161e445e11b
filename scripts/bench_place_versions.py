"""`moment place` of this checkout against another one, on the same IGB-layout input, alternately.

Synthesizes an IGB-layout input (``scripts/bench_import.py``'s generator), imports it with each
checkout (IGB's default 60/20/20 split: one pre-sampled epoch is many batches) and plans the
paper's Machine B with each, then runs ``moment place --gpu-cache 1%`` of each checkout in turn,
``--rounds`` times, the page cache of the dataset files and the source features dropped before
every run. Prints each run's wall time (the whole command: start-up included) and its phases.
Not part of the test suite; everything under ``--dir`` is deleted at the end unless ``--keep``.

    git archive ddd7a47 | tar -x -C /tmp/old
    python scripts/bench_place_versions.py --other /tmp/old --nodes 3000000 --edges 45000000 --dim 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_import import synthesize  # noqa: E402 - the IGB-layout generator, one copy of it

sys.path.insert(0, str(REPO))
from moment.fileio import drop_cached  # noqa: E402

PLAN = (
    "from moment.planner.plan import plan; from moment.planner.planfile import save_plan; "
    "from moment.planner.workload import load_workload; from moment.topology.profile_io import resolve_profile; "
    "import sys; m = resolve_profile('moment-machine-b'); w = load_workload(m.workload); "
    "save_plan(m, w, plan(m, w, 4, 8, top=1), sys.argv[1])"
)


def moment(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m moment ARGS`` from ``tree`` (``-m`` puts the working directory first on sys.path)."""
    return subprocess.run([sys.executable, "-m", "moment", *args], cwd=tree, capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, type=Path, help="the other checkout (e.g. git archive REV | tar -x)")
    ap.add_argument("--nodes", type=int, default=3_000_000)
    ap.add_argument("--edges", type=int, default=45_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if not args.dir.is_dir():
        ap.error(f"--dir {args.dir}: not a directory")
    work = Path(tempfile.mkdtemp(prefix="bench-place-versions-", dir=args.dir))
    trees = {"other": args.other.resolve(), "this": REPO}
    try:
        source = synthesize(work / "igb", "large", args.nodes, args.edges, args.dim)
        for name, tree in trees.items():
            done = moment(*(tree, "dataset", "import", "--format", "igb", "--root", str(work / "igb")),
                          *("--size", "large", "--out", str(work / f"ds-{name}")))  # fmt: skip
            if done.returncode:
                print(f"{name}: import failed: {done.stderr[-2000:]}")
                return 1
            subprocess.run([sys.executable, "-c", PLAN, str(work / f"plan-{name}.json")], cwd=tree, check=True)
        print(f"{args.nodes:,} vertices, {args.edges:,} edges, {args.dim}-dim float32; other = {trees['other']}")
        for rnd in range(args.rounds):
            for name, tree in trees.items():
                ds, out = work / f"ds-{name}", work / f"placed-{name}"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                drop_cached([*ds.glob("*.npy"), *source])
                t0 = time.perf_counter()
                done = moment(*(tree, "place", "--plan", str(work / f"plan-{name}.json"), "--dataset", str(ds)),
                              *("--out", str(out), "--gpu-cache", "1%"))  # fmt: skip
                wall = time.perf_counter() - t0
                if done.returncode:
                    print(f"round {rnd} {name}: place failed: {done.stderr[-2000:]}")
                    return 1
                placed = json.loads((out / "placed.json").read_text())
                print(
                    f"round {rnd} {name}: wall {wall:.1f} s; hotness {placed['hotness']['batches']} batches; "
                    f"phases {placed.get('timings_s', {})}",
                    flush=True,
                )
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
