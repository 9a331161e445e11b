"""plan.json: what ``moment plan`` hands to ``moment place`` and the trainer.

Versioned (``format``), JSON (no pickle: users exchange it), written atomically. Fields:

* ``profile``: name and sha256 of the profile's canonical YAML (stage 3 refuses a plan made for
  another profile);
* ``workload`` and ``tier_shares`` (share of reads the GPU caches / CPU cache / SSDs serve) and
  ``demand_gb_per_gpu``;
* ``layout``: the chosen layout — ``slots`` lists port, slot name, device, kind, PCI address
  (where known) and socket;
* ``predicted``: the layout's figures (``predicted_iteration_s``, ``gbps_per_gpu``,
  ``bottleneck``, the paper model's figures, and why the two differ when they do);
* ``links``: every link's capacity, load and utilisation at the prediction;
* ``bin_targets``: the share of all feature bytes each bin should serve (stage 3's targets);
* ``ranks``: rank → GPU → PCI address → socket, for the trainer;
* ``search``: candidate counts and time; ``ranking``: the top layouts; ``classic``: the
  profile's named layouts scored beside it.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moment import __version__
from moment.errors import MomentError
from moment.planner.report import Scored, bin_targets, links_table
from moment.planner.workload import Workload
from moment.topology.model import Machine
from moment.fileio import atomic_write_text, read_json
from moment.topology.profile_io import dump_profile

FORMAT = "moment.plan/1"


def profile_hash(machine: Machine) -> str:
    return hashlib.sha256(dump_profile(machine).encode()).hexdigest()


def plan_document(machine: Machine, workload: Workload, best: Scored, search: dict[str, Any],
                  ranking: list[Scored], classic: dict[str, Scored]) -> dict[str, Any]:
    ranks = [
        {"rank": i, "gpu": slot["device"], "bdf": slot["bdf"], "socket": slot["socket"], "port": slot["port"]}
        for i, slot in enumerate(s for s in best.to_dict()["slots"] if s["kind"] == "gpu")
    ]
    return {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "moment_version": __version__,
        "profile": {"name": machine.name, "sha256": profile_hash(machine)},
        "workload": workload.model_dump(mode="json"),
        "demand_gb_per_gpu": best.net.demand_gb,
        "tier_shares": best.net.shares,
        "notes": best.net.notes,
        "layout": {"name": best.name, "slots": best.to_dict()["slots"]},
        "predicted": best.to_dict(),
        "links": links_table(best),
        "bin_targets": bin_targets(best),
        "ranks": ranks,
        "search": search,
        "ranking": [s.to_dict() for s in ranking],
        "classic": {name: s.to_dict() for name, s in classic.items()},
    }


def write_plan(doc: dict[str, Any], path: str | Path) -> None:
    atomic_write_text(Path(path), json.dumps(doc, indent=2) + "\n")


def read_plan(path: str | Path) -> dict[str, Any]:
    """Load a plan.json; a clear one-line error for a missing, broken or foreign file."""
    p = Path(path)
    doc = read_json(p, FORMAT, "plan file")
    for key in ("profile", "layout", "bin_targets", "ranks"):
        if key not in doc:
            raise MomentError(f"{p}: {key}: missing")
    return doc
