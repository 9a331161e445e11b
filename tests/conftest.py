"""Fixtures shared by the placement and trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile


@pytest.fixture(scope="session")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """plan.json of the paper's Machine B (4 GPUs, 8 SSDs), as `moment plan --out` writes it."""
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    outcome = plan(machine, workload, 4, 8, top=1)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(machine, workload, outcome, path)
    return path
