"""Plan sweeps: wall time of ``moment plan --gpus 1..8 --ssds 1..16`` on bundled profiles, this
checkout against a baseline checkout (an older commit), one after the other in child processes.

The baseline is another source tree of moment (``git worktree add /tmp/old ddd7a47``); each run
imports its own tree through PYTHONPATH with this interpreter, so both use the same packages.
Runs alternate (this, baseline, this) so a machine whose load changes shows it. Not part of the
test suite. Run:
    python scripts/bench_plan_sweep.py --baseline /tmp/old [--profiles example-8gpu-16ssd ...]
        [--gpus 1..8] [--ssds 1..16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def sweep(src: Path, profile: str, gpus: str, ssds: str, timeout: float) -> tuple[float, int]:
    """(seconds, exit status) of one sweep run from the source tree ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    argv = [sys.executable, "-m", "moment", "plan", "--profile", profile, "--gpus", gpus, "--ssds", ssds]
    t0 = time.perf_counter()
    try:
        # run from the tree itself: ``python -m`` puts the working directory first on sys.path
        rc = subprocess.run(argv, env=env, cwd=src, capture_output=True, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return time.perf_counter() - t0, rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="source tree of the moment to compare with")
    ap.add_argument("--profiles", nargs="+", default=["example-8gpu-16ssd"])
    ap.add_argument("--gpus", default="1..8")
    ap.add_argument("--ssds", default="1..16")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (rc 124 past it)")
    args = ap.parse_args()
    runs = [("this", HERE)]
    if args.baseline:
        runs = [("this", HERE), ("baseline", args.baseline), ("this", HERE)]
    print(f"moment plan --gpus {args.gpus} --ssds {args.ssds}; load average {os.getloadavg()[0]:.1f} at start")
    for profile in args.profiles:
        took = {}
        for who, src in runs:
            secs, rc = sweep(src, profile, args.gpus, args.ssds, args.timeout)
            took.setdefault(who, []).append(secs)
            print(f"{profile}: {who}: {secs:.1f} s (rc {rc}, load {os.getloadavg()[0]:.1f})", flush=True)
        if "baseline" in took:
            mean = sum(took["this"]) / len(took["this"])
            print(f"{profile}: baseline / this = {took['baseline'][0] / mean:.1f}×")


if __name__ == "__main__":
    main()
