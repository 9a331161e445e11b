"""plan.json: what ``moment plan`` hands to ``moment place`` and the trainer.

Versioned (``format``), JSON (no pickle: users exchange it), written atomically, and read only
through its contract, :class:`moment.contracts.plan.PlanDoc` (``read_plan``): every stage gets
typed attributes, and a plan from elsewhere with a missing, mistyped or unknown field, or a bin
name that is not a plain file name, is one line naming the file and the field. Fields:

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
  profile's named layouts scored beside it;
* ``nodes`` (``--nodes N`` only): the iteration with N such servers (``moment.planner.nodes``).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from moment import __version__
from moment.contracts import first_error
from moment.contracts.plan import FORMAT, PlanDoc
from moment.errors import MomentError, UsageError
from moment.planner.workload import Workload
from moment.topology.model import Machine
from moment.topology.profile_io import bundled_profiles, dump_profile, load_profile

if TYPE_CHECKING:
    from moment.planner.plan import PlanOutcome

__all__ = ["plan_document", "plan_profile", "profile_hash", "save_plan", "write_plan"]


def profile_hash(machine: Machine) -> str:
    return hashlib.sha256(dump_profile(machine).encode()).hexdigest()


def plan_profile(doc: PlanDoc, given: Machine | None = None) -> tuple[Machine | None, str]:
    """The profile ``doc`` was made for, to re-solve its model with: ``given`` (``--profile``;
    another profile's is refused) or else the bundled one of that name if it is still the same
    (hash). ``(None, why)`` where there is none: the caller falls back to the plan's figures."""
    name = doc.profile.name
    if given is not None:
        if profile_hash(given) != doc.profile.sha256:
            raise UsageError(
                f"the plan was made for profile {name!r} (another profile's hash than {given.name!r}): "
                f"re-plan for this one"
            )
        return given, ""
    path = bundled_profiles().get(name)
    if path is None:
        return None, f"the plan's profile {name!r} is not bundled (give it with --profile)"
    machine = load_profile(path)
    if profile_hash(machine) != doc.profile.sha256:
        return (
            None,
            f"the bundled profile {name!r} has changed since the plan was made (give the plan's with --profile)",
        )
    return machine, ""


def plan_document(machine: Machine, workload: Workload, outcome: PlanOutcome, nodes: dict | None = None) -> PlanDoc:
    """The plan of ``outcome``'s best layout; validated as a reader would (a profile whose device
    ids cannot be bin names, for instance, is refused here rather than by ``moment place``)."""
    from moment.planner.scoring import bin_targets, links_table  # only a plan's writer scores: readers stay light

    best = outcome.best
    record = best.to_dict()
    ranks = [
        {"rank": i, "gpu": slot["device"], "bdf": slot["bdf"], "socket": slot["socket"], "port": slot["port"]}
        for i, slot in enumerate(s for s in record["slots"] if s["kind"] == "gpu")
    ]
    doc = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "moment_version": __version__,
        "profile": {"name": machine.name, "sha256": profile_hash(machine)},
        "workload": workload.model_dump(mode="json"),
        "demand_gb_per_gpu": best.net.demand_gb,
        "tier_shares": best.net.shares,
        "notes": best.net.notes,
        "layout": {"name": best.name, "slots": record["slots"]},
        "predicted": record,
        "links": links_table(best),
        "bin_targets": bin_targets(best, workload),
        "ranks": ranks,
        "search": outcome.search,
        "ranking": [s.to_dict() for s in outcome.ranking],
        "classic": {name: s.to_dict() for name, s in outcome.classic.items()},
    }
    if nodes is not None:
        doc["nodes"] = nodes
    try:
        return PlanDoc.model_validate(doc)
    except ValidationError as exc:
        raise MomentError(f"{machine.name}: cannot make a valid plan: {first_error(exc)}") from None


def write_plan(doc: PlanDoc, path: str | Path) -> None:
    """Atomically: a reader sees the old plan or the whole new one."""
    doc.write(path)


def save_plan(
    machine: Machine, workload: Workload, outcome: PlanOutcome, path: str | Path, nodes: dict | None = None
) -> PlanDoc:
    """Build the plan of a ``moment.planner.plan.plan`` outcome and write it to ``path``."""
    doc = plan_document(machine, workload, outcome, nodes)
    write_plan(doc, path)
    return doc
