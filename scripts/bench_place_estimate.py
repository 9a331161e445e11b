"""How close ``moment place``'s announced time comes to the time it then takes.

    python scripts/bench_place_estimate.py --plan PLAN --dataset DS --out OUT [--cold] [--rounds N] [-- place options]

Runs ``moment place --json`` (``--cold``: the dataset's pages, and its features', dropped from
the page cache first; files it may write are fsynced before), reads the ``expected: about X s``
line it prints before writing and the ``timings_s`` it records, and prints both with their
ratio: the actual time being the run's total less what came before the estimate (check,
pre-sampling, predict, DDAK). OUT must not exist: what place wrote there is removed after each
round, and nothing else is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

BEFORE = ("check", "presample", "predict", "ddak")  # phases done when the estimate is printed


def drop_cache(dataset: Path) -> None:
    meta = json.loads((dataset / "dataset.json").read_text())
    files = list(dataset.glob("*.npy"))
    source = (meta.get("features_at") or {}).get("path")
    files += [Path(source)] if source else []
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.access(path, os.W_OK):
                os.fdatasync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one(plan: str, dataset: Path, out: Path, cold: bool, extra: list[str]) -> None:
    """One place into ``out`` (absent before: so all it holds after is this run's), then removed."""
    if cold:
        drop_cache(dataset)
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "moment", "place", "--plan", plan, "--dataset", str(dataset), "--out", str(out)]
    done = subprocess.run([*cmd, "--json", *extra], capture_output=True, text=True, check=False)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0:
        sys.exit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"place exited {done.returncode}")
    timings = json.loads(done.stdout)["timings_s"]
    line = next(x for x in done.stderr.splitlines() if "expected: about" in x)
    found = re.search(r"expected: about ([\d,.]+) s", line)
    assert found is not None, line
    estimate = float(found.group(1).replace(",", ""))
    actual = timings["total"] - sum(timings.get(k, 0.0) for k in BEFORE)
    print(
        f"{'cold' if cold else 'warm'}: estimate {estimate:.1f} s, actual {actual:.1f} s "
        f"(actual/estimate {actual / estimate:.2f}), load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(f"    {line.strip()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    args, extra = ap.parse_known_args()
    if args.out.exists():
        sys.exit(f"{args.out}: exists; give a path that does not (it is removed after each round)")
    for _ in range(args.rounds):
        one(args.plan, args.dataset, args.out, args.cold, [x for x in extra if x != "--"])


if __name__ == "__main__":
    main()
