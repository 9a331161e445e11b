"""`moment plan --nodes N`: the iteration with N servers, the longer of the local reads and the
compute plus the gradient ring all-reduce over each node's NIC (moment/planner/nodes.py). The
compute is the step's FLOPs (trainer/flops.py) at the plan's GPUs' sustained rate
(moment/topology/gpu_flops.py), or what an earlier run measured (``--compute-from metrics.json``)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from moment.cli.plan import workload_parameters, workload_step_flops
from moment.contracts.plan import read_plan
from moment.planner.nodes import DEFAULT_NIC_GBPS, Compute, measured_compute, nodes_prediction, ring_allreduce_s
from moment.planner.workload import Workload
from moment.topology.gpu_flops import DERATE, gpu_tflops
from moment.topology.model import Device
from moment.topology.profile_io import resolve_profile, save_profile
from prediction_fixture import prediction
from trainer.config import TrainConfig
from trainer.metrics import Metrics, epoch_record

PROFILE = ("--profile", "moment-machine-b", "--gpus", "2", "--ssds", "4", "--top", "1")
NO_READS = {"asked": 0, "seconds": 0.0, "tiers": {}, "ssd_bins": {}, "bin_rows": {}}
ANY = Compute(0.0, "none")  # a compute below any data time: the data time bounds


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
    got = nodes_prediction(machine, params, 0.25, nodes, ANY)
    allreduce = 2 * (nodes - 1) / nodes * params * 4 / 12.5e9  # float32 gradients
    assert got["parameters"] == params
    assert got["nic_gbps"] == 12.5 and "profile" in got["nic_source"]
    assert got["allreduce_s"] == pytest.approx(allreduce)
    assert got["iteration_s"] == pytest.approx(0.25 + allreduce)
    default = nodes_prediction(resolve_profile("moment-machine-b"), params, 0.25, nodes, ANY)
    assert default["nic_gbps"] == DEFAULT_NIC_GBPS == 25.0
    assert default["allreduce_s"] == pytest.approx(allreduce / 2)  # twice the bandwidth


def test_nodes_1_is_the_longer_of_todays_prediction_and_the_compute(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = run("plan", *PROFILE, "--nodes", "1", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    plain = run("plan", *PROFILE, "--json")  # without --nodes: today's plan, no nodes record
    assert plain.returncode == 0, plain.stderr
    today = json.loads(plain.stdout)["best"]["predicted_iteration_s"]
    assert "nodes" not in json.loads(plain.stdout) and data["best"]["predicted_iteration_s"] == today
    n = data["nodes"]
    assert n["allreduce_s"] == 0.0 and n["data_iteration_s"] == today
    assert n["iteration_s"] == max(today, n["compute_s"]) and n["compute_source"].startswith("estimated:")
    doc = read_plan(out)
    assert doc.nodes is not None and doc.nodes.iteration_s == n["iteration_s"] and doc.nodes.bound == n["bound"]
    assert doc.predicted.predicted_iteration_s == today
    old = json.loads(out.read_text())
    for key in ("compute_s", "compute_source", "step_flops", "gpu_tflops", "bound"):
        del old["nodes"][key]  # a plan written before the compute term
    (tmp_path / "before.json").write_text(json.dumps(old))
    assert read_plan(tmp_path / "before.json").nodes.compute_s is None  # type: ignore[union-attr]
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


# -- the compute term -------------------------------------------------------------------------


def metrics_file(path: Path, epochs: list[tuple[float, float, int]]) -> Path:
    """A metrics.json as ``moment train --metrics-json`` writes it: one (epoch_s, data_wait_s,
    iterations) per epoch."""
    cfg = TrainConfig(data="d", fanouts=(10, 5), batch_size=512, device="cpu", metrics_json=str(path))
    m = Metrics(cfg, prediction({"nvme0": 1.0}), [], enabled=True, console=Console(file=io.StringIO()))
    for i, (epoch_s, wait, iterations) in enumerate(epochs, 1):
        m.add_epoch(
            epoch_record(
                i,
                train_s=epoch_s,
                iterations=iterations,
                seeds=iterations,
                loss=1.0,
                val_acc=None,
                data_wait_s=wait,
                stats=[NO_READS],
            )
        )
    assert path.exists()
    return path


@pytest.mark.parametrize(
    ("model", "flops"),
    [
        # batch 10, fan-outs 10,5, 660 rows: hops of 10, 110 and 660 vertices; 100 features, 64
        # hidden, 19 classes. SAGE: layer 1 (110 targets, 550 edges) 550·100 adds + 4·110·100·64;
        # layer 2 (10 targets, 100 edges) 100·64 + 4·10·64·19: 2,926,040 forward, × 3.
        ("graphsage", 3 * (550 * 100 + 4 * 110 * 100 * 64 + 100 * 64 + 4 * 10 * 64 * 19)),
        # GAT, 8 heads of 64: layer 1 projects 660 sources to 512 (2·660·100·512), scores
        # 2·770·512, 660 edges with self loops × 8 heads × (4 + 128); layer 2 (one head of 19, 512
        # in): 2·110·512·19 + 2·120·19 + 110·(4 + 38). 71,218,780 forward, × 3.
        (
            "gat",
            3 * (2 * 660 * 100 * 512 + 2 * 770 * 512 + 660 * 8 * 132 + 2 * 110 * 512 * 19 + 2 * 120 * 19 + 110 * 42),
        ),
    ],
)
def test_step_flops_by_hand(model: str, flops: int) -> None:
    workload = Workload(feature_dim=100, hidden=64, fanouts=[10, 5], batch_size=10, unique_per_batch=660, model=model)
    assert workload_step_flops(workload) == pytest.approx(flops)


def test_gpu_rates_from_the_table_the_profile_or_a_stand_in() -> None:
    a100 = Device(id="gpu0", kind="gpu", model="NVIDIA A100 40GB PCIe")
    rate, source = gpu_tflops(a100)
    assert rate == pytest.approx(19.5 * DERATE) and "A100 datasheet" in source and "memory-bound" in source
    rtx = Device(id="gpu1", kind="gpu", model="NVIDIA GPU 10de:2204", vendor_id="10de", device_id="2204")
    assert gpu_tflops(rtx)[0] == pytest.approx(35.6 * DERATE)
    measured = a100.model_copy(update={"tflops": 3.0})
    assert gpu_tflops(measured) == (3.0, "gpu0: the profile's tflops")
    unknown = Device(id="gpu2", kind="gpu", model="Some Accelerator")
    rate, source = gpu_tflops(unknown)
    assert rate == pytest.approx(19.5 * DERATE) and "not in the table" in source


@pytest.mark.parametrize(
    ("data_s", "compute_s", "bound", "iteration"),
    [(0.25, 0.1, "data", 0.25), (0.25, 0.4, "compute", 0.4), (0.25, 0.25, "data", 0.25)],
)
def test_the_longer_of_data_and_compute_bounds(data_s: float, compute_s: float, bound: str, iteration: float) -> None:
    machine = resolve_profile("moment-machine-b").model_copy(update={"nic_gbps": 10.0})
    got = nodes_prediction(machine, 1_000_000, data_s, 4, Compute(compute_s, "by hand"))
    allreduce = 1.5 * 4e6 / 10e9  # 2(N-1)/N of 4 MB of float32 gradients over 10 GB/s: 0.6 ms
    assert got["bound"] == bound and got["compute_s"] == compute_s and got["compute_source"] == "by hand"
    assert got["iteration_s"] == pytest.approx(iteration + allreduce)


def test_a_measured_compute_is_the_time_not_waiting_for_data(tmp_path: Path) -> None:
    # (10 - 4) + (12 - 2) seconds over 200 iterations: 0.08 s
    path = metrics_file(tmp_path / "m.json", [(10.0, 4.0, 100), (12.0, 2.0, 100)])
    got = measured_compute(path)
    assert got.seconds == pytest.approx(0.08) and got.step_flops is None
    assert got.source.startswith(f"measured: {path}") and "200 iterations" in got.source


def test_compute_from_overrides_the_estimate_and_can_bound(tmp_path: Path) -> None:
    """A measured 5 s an iteration (compute-bound: the reads take well under a second) replaces
    the FLOPs estimate in the prediction, the plan and the line."""
    path = metrics_file(tmp_path / "m.json", [(510.0, 10.0, 100)])
    out = tmp_path / "plan.json"
    done = run("plan", *PROFILE, "--nodes", "2", "--compute-from", str(path), "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    n = json.loads(done.stdout)["nodes"]
    assert n["compute_s"] == pytest.approx(5.0) and n["bound"] == "compute" and n["data_iteration_s"] < 5.0
    assert n["iteration_s"] == pytest.approx(5.0 + n["allreduce_s"]) and n["step_flops"] is None
    assert n["compute_source"].startswith(f"measured: {path}")
    assert read_plan(out).nodes.bound == "compute"  # type: ignore[union-attr]
    estimate = json.loads(run("plan", *PROFILE, "--nodes", "2", "--json").stdout)["nodes"]
    assert estimate["compute_s"] != n["compute_s"] and estimate["compute_source"].startswith("estimated:")
    line = " ".join(run("plan", *PROFILE, "--nodes", "2", "--compute-from", str(path)).stdout.split())
    assert "bound by compute" in line and f"compute measured: {path}" in line


def test_a_slow_gpu_in_the_profile_makes_the_estimate_compute_bound(tmp_path: Path) -> None:
    """The profile's tflops, 0.001 on every GPU: the paper workload's ~660 GFLOP a step take
    minutes, far above its reads."""
    machine = resolve_profile("moment-machine-b")
    for port, _ in machine.iter_ports():
        if port.device is not None and port.device.kind == "gpu":
            port.device.tflops = 0.001
    profile = tmp_path / "slow.yaml"
    save_profile(machine, profile)
    done = run("plan", *PROFILE[2:], "--profile", str(profile), "--nodes", "4", "--json")
    assert done.returncode == 0, done.stderr
    n = json.loads(done.stdout)["nodes"]
    assert n["gpu_tflops"] == 0.001 and n["bound"] == "compute"
    assert n["compute_s"] == pytest.approx(n["step_flops"] / 1e9) and "the profile's tflops" in n["compute_source"]
    assert n["iteration_s"] == pytest.approx(n["compute_s"] + n["allreduce_s"])


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "missing"),
        ("{not json", ""),
        (json.dumps({"format": "moment.plan/2"}), "format"),
        ("EMPTY", "no training iteration recorded"),
    ],
)
def test_a_bad_metrics_file_is_one_line_naming_it(tmp_path: Path, content: str | None, why: str) -> None:
    path = tmp_path / "metrics.json"
    if content == "EMPTY":
        metrics_file(path, [(0.0, 0.0, 0)])
    elif content is not None:
        path.write_text(content)
    out = tmp_path / "plan.json"
    done = run("plan", *PROFILE, "--nodes", "2", "--compute-from", str(path), "--out", str(out))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert str(path) in lines[0] and why in lines[0] and "Traceback" not in done.stderr
    assert not out.exists()


def test_compute_from_without_nodes_is_refused() -> None:
    done = run("plan", *PROFILE, "--compute-from", "m.json")
    assert done.returncode == 2 and "--compute-from needs --nodes" in done.stderr
