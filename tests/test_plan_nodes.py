"""`moment plan --nodes N`: the iteration with N servers, local reads plus the gradient ring
all-reduce over each node's NIC (moment/planner/nodes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moment.cli.plan import workload_parameters
from moment.contracts.plan import read_plan
from moment.planner.nodes import DEFAULT_NIC_GBPS, nodes_prediction, ring_allreduce_s
from moment.planner.workload import Workload
from moment.topology.profile_io import resolve_profile, save_profile

PROFILE = ("--profile", "moment-machine-b", "--gpus", "2", "--ssds", "4", "--top", "1")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moment", *args], capture_output=True, text=True, timeout=600)


def sage_parameters(in_dim: int, hidden: int, classes: int) -> int:
    """Two SAGEConv layers by hand: a weight on the neighbours' mean and one on the root, one bias."""
    return (2 * in_dim * hidden + hidden) + (2 * hidden * classes + classes)


@pytest.mark.parametrize(("nodes", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5)])
def test_ring_allreduce_by_hand(nodes: int, factor: float) -> None:
    # 2(N-1)/N × 4 MB over 10 GB/s: 0, 0.4 ms, 0.6 ms
    assert ring_allreduce_s(4e6, nodes, 10.0) == pytest.approx(factor * 4e6 / 10e9)


@pytest.mark.parametrize("nodes", [2, 4])
def test_prediction_adds_the_allreduce_of_the_models_gradients(nodes: int) -> None:
    machine = resolve_profile("moment-machine-b").model_copy(update={"nic_gbps": 12.5})
    workload = Workload(feature_dim=100, hidden=64, fanouts=[10, 5], model="graphsage")
    params = sage_parameters(100, 64, 19)  # 15,315
    assert workload_parameters(workload) == params == 15_315
    got = nodes_prediction(machine, params, 0.25, nodes)
    allreduce = 2 * (nodes - 1) / nodes * params * 4 / 12.5e9  # float32 gradients
    assert got["parameters"] == params
    assert got["nic_gbps"] == 12.5 and "profile" in got["nic_source"]
    assert got["allreduce_s"] == pytest.approx(allreduce)
    assert got["iteration_s"] == pytest.approx(0.25 + allreduce)
    default = nodes_prediction(resolve_profile("moment-machine-b"), params, 0.25, nodes)
    assert default["nic_gbps"] == DEFAULT_NIC_GBPS == 25.0
    assert default["allreduce_s"] == pytest.approx(allreduce / 2)  # twice the bandwidth


def test_nodes_1_is_todays_prediction_and_the_plan_records_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = run("plan", *PROFILE, "--nodes", "1", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    today = data["best"]["predicted_iteration_s"]
    assert data["nodes"]["allreduce_s"] == 0.0 and data["nodes"]["iteration_s"] == today
    doc = read_plan(out)
    assert doc.nodes is not None and doc.nodes.iteration_s == today == doc.predicted.predicted_iteration_s
    old = json.loads(out.read_text())
    del old["nodes"]  # a plan written before --nodes existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert read_plan(tmp_path / "old.json").nodes is None


def test_nodes_from_a_profiles_nic(tmp_path: Path) -> None:
    profile = tmp_path / "b.yaml"
    save_profile(resolve_profile("moment-machine-b").model_copy(update={"nic_gbps": 5.0}), profile)
    done = run("plan", *PROFILE[2:], "--profile", str(profile), "--nodes", "4")
    assert done.returncode == 0, done.stderr
    one = " ".join(done.stdout.split())
    assert "with 4 such servers:" in one and "ring over 5 GB/s NICs" in one


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_bad_nodes_is_one_line_exit_2(value: str) -> None:
    done = run("plan", *PROFILE, f"--nodes={value}")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--nodes {value!r}" in lines[0], done.stderr


def test_nodes_with_a_sweep_is_refused() -> None:
    done = run("plan", "--profile", "moment-machine-b", "--gpus", "1..2", "--nodes", "2")
    assert done.returncode == 2 and "--nodes needs one GPU count" in done.stderr
