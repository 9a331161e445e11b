"""``moment plan`` and ``moment score`` as functions: search, score the named layouts, collect."""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from moment.errors import MomentError, UsageError
from moment.planner import search
from moment.planner.layout import DEFAULT_SSD, installed_layout, slot_space
from moment.planner.scoring import Scored, score
from moment.planner.workload import Workload
from moment.progress import Update
from moment.topology.model import Machine
from moment.yamlio import load_yaml, yaml_problem


@dataclass
class PlanOutcome:
    best: Scored
    ranking: list[Scored]
    classic: dict[str, Scored]
    search: dict


def default_counts(machine: Machine) -> tuple[int, int]:
    """GPUs and SSDs as installed (GPUs fixed in place included where a layout picks among them)."""
    space = slot_space(machine)
    return len(space.gpus) or len(space.fixed_gpus), len(space.ssds)


def check_ssd_tier(machine: Machine, workload: Workload, profile: str, n_gpus: int, n_ssds: int) -> None:
    """Refuse, before the search, a plan without SSDs for a workload that reads from them, and
    give the command line that works: SSDs where slots are free (the profile's own model, else
    :data:`~moment.planner.layout.DEFAULT_SSD`), fewer GPUs to make room, or a workload whose CPU
    cache holds every row where the profile has no slot at all."""
    share = workload.tier_shares()["ssd"]
    if n_ssds > 0 or share <= 1e-9:
        return
    space = slot_space(machine)
    ssd_slots = len(space.ssd_slots())
    free = len({p.id for p in space.gpu_slots() + space.ssd_slots()}) - n_gpus
    base = f"moment plan --profile {shlex.quote(profile)}"
    if min(free, ssd_slots) > 0:
        fix = f"`{base} --ssds {min(free, ssd_slots, 4)}`"
    elif ssd_slots and n_gpus > 1:
        k = min(ssd_slots, n_gpus - 1, 2)
        fix = f"`{base} --gpus {n_gpus - k} --ssds {k}` (no slot is free for an SSD)"
    else:
        fix = (
            f"a workload file holding `cpu_cache_fraction: 1.0` (every row in host memory): "
            f"`{base} --workload W.yaml` (the profile has no slot for an SSD)"
        )
    own = "its own SSD model" if space.ssds else DEFAULT_SSD.model
    installs = f"; --ssds installs {own}" if ssd_slots else ""
    raise UsageError(
        f"the workload needs the ssd tier ({share:.1%} of reads) but the layout has no SSDs: try {fix}{installs}"
    )


def plan(
    machine: Machine,
    workload: Workload,
    n_gpus: int,
    n_ssds: int,
    top: int = 10,
    method: str = "auto",
    engine: str = "ortools",
    milp_solver: str = "ortools",
    space: search.Space | None = None,
    progress: Update | None = None,
    ties: int | None = None,
) -> PlanOutcome:
    """The search's best layouts, each scored by every flow model (``engine``: the paper model's max
    flow; ``milp_solver``: the ``milp`` search's solver; ``space``, ``progress``, ``ties``: as
    :func:`~moment.planner.search.plan_search` takes them)."""
    t0 = time.perf_counter()
    result = search.plan_search(
        machine, workload, n_gpus, n_ssds, top, method, milp_solver, space=space, progress=progress, ties=ties
    )
    seconds = time.perf_counter() - t0
    if not result.ranked:
        raise UsageError(f"no layout of {n_gpus} GPUs and {n_ssds} SSDs fits {machine.name}")
    ranking = [
        score(machine, f"#{i}", cand.layout, workload, result.devices, engine=engine)
        for i, cand in enumerate(result.ranked, 1)
    ]
    ranking[0].name = "best"
    slots = space.slots if space is not None else slot_space(machine)
    classic = {}
    if n_gpus == len(slots.gpus) and n_ssds == len(slots.ssds):  # named layouts use the profile's devices
        for name, layout in sorted(machine.layouts.items()):
            classic[name] = score(machine, name, layout, workload, engine=engine)
    return PlanOutcome(
        best=ranking[0],
        ranking=ranking,
        classic=classic,
        search={
            "gpus": n_gpus,
            "ssds": n_ssds,
            "method": result.method,
            "raw_layouts": result.raw,
            "distinct_layouts": result.distinct,
            "evaluated": result.evaluated,
            "seconds": round(seconds, 4),
        },
    )


def resolve_layout(machine: Machine, name_or_file: str) -> tuple[str, dict[str, str]]:
    """A layout by name (``installed`` or one stored in the profile), from a YAML/JSON file
    mapping port id → device id, or a plan.json's chosen layout (its ``layout.slots``)."""
    if name_or_file == "installed":
        return "installed", installed_layout(machine)
    if name_or_file in machine.layouts:
        return name_or_file, dict(machine.layouts[name_or_file])
    path = Path(name_or_file)
    if not path.exists():
        if path.suffix in (".json", ".yaml", ".yml"):  # meant as a file, as profiles are told apart
            raise MomentError(f"{path}: no such layout file")
        names = ", ".join(["installed", *sorted(machine.layouts)])
        raise UsageError(f"unknown layout {name_or_file!r}: not a file, and not a layout of {machine.name} ({names})")
    try:
        data = json.loads(path.read_text()) if path.suffix == ".json" else load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise MomentError(f"{path}: cannot read layout: {yaml_problem(exc)}") from None
    except (OSError, ValueError) as exc:
        raise MomentError(f"{path}: cannot read layout: {str(exc).splitlines()[0]}") from None
    if isinstance(data, dict) and "layout" in data and isinstance(data["layout"], dict):
        data = data["layout"]
        if isinstance(data.get("slots"), list):  # a plan.json: its layout's slots
            data = {s.get("port"): s.get("device") for s in data["slots"] if isinstance(s, dict)}
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise MomentError(f"{path}: a layout file maps slot/port ids to device ids")
    return path.stem, data


def parse_range(text: str, what: str) -> list[int]:
    """'4' → [4]; '1..4' → [1, 2, 3, 4]."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split("..", 1))
            if lo > hi or lo < 0:
                raise ValueError
            return list(range(lo, hi + 1))
        value = int(text)
        if value < 0:
            raise ValueError
        return [value]
    except ValueError:
        raise UsageError(f"--{what} {text!r}: expected a count like 4 or a range like 1..4") from None
