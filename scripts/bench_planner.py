"""Planner benchmark: search time and candidate counts vs brute force, on the bundled machines.

Brute force evaluates every concrete choice of GPU slots and SSD slots with the same LP. Where the
full space is too large to run here, it is timed on a sample and its time projected from the
measured time per layout (said so in the output). Run:
    python scripts/bench_planner.py            # Machine A, B (4 GPUs, 8 SSDs), the 8-GPU example
    python scripts/bench_planner.py --quick    # smaller samples
"""

from __future__ import annotations

import argparse
import itertools
import time

from moment.planner import search
from moment.planner.layout import slot_space
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile


def brute_force_time(machine, workload, n_gpus: int, n_ssds: int, sample: int) -> tuple[float, int, bool, float]:
    """(seconds, layouts, complete?, best time found) — evaluates up to ``sample`` layouts."""
    space = slot_space(machine)
    skeleton = search.skeleton_for(machine)
    gpu_slots = [p.id for p in space.gpu_slots()]
    ssd_slots = [p.id for p in space.ssd_slots()]
    devices = space.gpus[:n_gpus] + space.ssds[:n_ssds]
    t0 = time.perf_counter()
    n, best = 0, float("inf")
    for gsel in itertools.combinations(gpu_slots, n_gpus):
        rest = [p for p in ssd_slots if p not in gsel]
        for ssel in itertools.combinations(rest, n_ssds):
            if n >= sample:
                return time.perf_counter() - t0, n, False, best
            placed = dict(zip(gsel + ssel, devices))
            best = min(best, search.evaluate(skeleton, placed, workload).iteration_s)
            n += 1
    return time.perf_counter() - t0, n, True, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sample = 300 if args.quick else 2000
    cases = [
        ("moment-machine-a", 4, 8),
        ("moment-machine-b", 4, 8),
        ("example-8gpu-16ssd", 8, 16),
        ("moment-machine-b", 1, 2),  # small enough for brute force to finish
    ]
    print(
        f"{'profile':22} {'G':>2} {'S':>2} {'method':9} {'raw':>16} {'distinct':>9} {'evaluated':>9} "
        f"{'plan s':>7} {'brute s':>11} {'ratio':>9}  best s/iter"
    )
    for name, g, s in cases:
        machine = resolve_profile(name)
        workload = load_workload(machine.workload)
        for method in ("enumerate", "milp"):
            if method == "enumerate" and search._space_size(machine, g, s) > search.ENUMERATION_LIMIT:
                continue
            t0 = time.perf_counter()
            result = search.plan_search(machine, workload, g, s, keep=10, method=method)
            plan_s = time.perf_counter() - t0
            secs, n, complete, bf_best = brute_force_time(machine, workload, g, s, sample)
            per = secs / max(n, 1)
            brute = secs if complete else per * result.raw
            note = "" if complete else " (projected)"
            best = result.ranked[0].prediction.iteration_s
            check = (
                ""
                if not complete
                else ("  = brute force" if abs(bf_best - best) <= 1e-6 * best else f"  ≠ brute {bf_best:.4f}")
            )
            print(
                f"{name:22} {g:>2} {s:>2} {method:9} {result.raw:>16,} {result.distinct:>9,} {result.evaluated:>9,} "
                f"{plan_s:>7.2f} {brute:>11.1f} {brute / plan_s:>8.0f}×  {best:.4f}{check}{note}"
            )


if __name__ == "__main__":
    main()
