"""`moment plan` / `moment score` as a user runs them, and the plan.json they write."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moment.contracts.plan import FORMAT, read_plan


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moment", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def machine_b_plan(tmp_path_factory) -> tuple[dict, Path, Path]:
    d = tmp_path_factory.mktemp("plan")
    out, pic = d / "plan.json", d / "plan.svg"
    done = run(
        "plan",
        "--profile",
        "moment-machine-b",
        "--gpus",
        "4",
        "--ssds",
        "8",
        "--out",
        str(out),
        "--picture",
        str(pic),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), out, pic


def test_plan_json_output(machine_b_plan) -> None:
    data, _, _ = machine_b_plan
    for record in [data["best"], *data["ranking"], *data["classic"].values()]:
        assert isinstance(record["predicted_iteration_s"], float) and record["predicted_iteration_s"] > 0
        assert isinstance(record["gbps_per_gpu"], list) and len(record["gbps_per_gpu"]) == 4
        assert isinstance(record["bottleneck"], list)
    assert set(data["classic"]) == {"classic-a", "classic-b", "classic-c", "classic-d"}
    best = data["best"]["predicted_iteration_s"]
    assert all(c["predicted_iteration_s"] >= best * (1 - 1e-6) for c in data["classic"].values())
    assert data["search"]["raw_layouts"] > data["search"]["distinct_layouts"] >= data["search"]["evaluated"]


def test_plan_file(machine_b_plan) -> None:
    _, path, _ = machine_b_plan
    doc = read_plan(path)
    assert doc.format == FORMAT
    assert doc.profile.name == "moment-machine-b" and len(doc.profile.sha256) == 64
    assert sum(b.share for b in doc.bin_targets) == pytest.approx(1.0, abs=1e-6)
    tiers = {t: sum(b.share for b in doc.bin_targets if b.tier == t) for t in ("gpu", "cpu", "ssd")}
    assert tiers == pytest.approx(doc.tier_shares.model_dump(), abs=1e-6)
    assert [r.rank for r in doc.ranks] == [0, 1, 2, 3]
    assert {r.socket for r in doc.ranks} <= {"cpu0", "cpu1"}
    assert len(doc.layout.slots) == 12
    top = doc.links[0]
    assert top.utilisation == pytest.approx(1.0, abs=1e-3)  # the bottleneck is full


def test_plan_picture_marks_the_bottleneck(machine_b_plan) -> None:
    _, _, pic = machine_b_plan
    root = ET.fromstring(pic.read_text())
    ns = "{http://www.w3.org/2000/svg}"
    assert any(el.get("stroke") == "#d62728" for el in root.iter(f"{ns}line"))
    assert any("GB/s (" in (t.text or "") for t in root.iter(f"{ns}text"))


def test_score_classic_layout() -> None:
    done = run("score", "--profile", "moment-machine-a", "--layout", "classic-a", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["name"] == "classic-a"
    assert data["predicted_iteration_s"] >= data["paper_iteration_s"] * (1 - 1e-6)
    assert len(data["gbps_per_gpu"]) == 4 and data["bottleneck"]


def test_score_layout_file(tmp_path: Path) -> None:
    layout = tmp_path / "mine.yaml"
    layout.write_text(
        "sw0-gpu0: gpu0\nsw0-gpu1: gpu1\nsw1-gpu0: gpu2\nsw1-gpu1: gpu3\n"
        + "".join(f"cpu{i // 4}-bay{i % 4}: nvme{i}\n" for i in range(8))
    )
    done = run("score", "--profile", "moment-machine-a", "--layout", str(layout), "--json")
    assert done.returncode == 0, done.stderr
    same = run("score", "--profile", "moment-machine-a", "--layout", "classic-a", "--json")
    assert json.loads(done.stdout)["predicted_iteration_s"] == pytest.approx(
        json.loads(same.stdout)["predicted_iteration_s"]
    )


def test_sweep_gpus() -> None:
    done = run("plan", "--profile", "moment-machine-b", "--gpus", "1..3", "--ssds", "8", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["sweep"]
    assert [r["gpus"] for r in rows] == [1, 2, 3]
    # More GPUs read more bytes per iteration in total: the iteration never gets shorter.
    times = [r["predicted_iteration_s"] for r in rows]
    assert all(b >= a * (1 - 1e-6) for a, b in zip(times, times[1:])), times  # up to the LP's tolerance


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--profile", "moment-machine-b", "--gpus", "11"], "GPU-capable slots"),
        (["plan", "--profile", "no-such-machine"], "unknown profile"),
        (["plan", "--profile", "moment-machine-b", "--gpus", "two"], "--gpus 'two'"),
        (["score", "--profile", "moment-machine-a", "--layout", "classic-z"], "unknown layout 'classic-z'"),
    ],
)
def test_bad_input_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    done = run(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert needle in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_layout_naming_a_missing_slot(tmp_path: Path) -> None:
    layout = tmp_path / "bad.json"
    layout.write_text(json.dumps({"sw9-gpu0": "gpu0"}))
    done = run("score", "--profile", "moment-machine-a", "--layout", str(layout))
    assert done.returncode == 1  # the file's content is wrong: bad input
    assert "sw9-gpu0" in done.stderr and "Traceback" not in done.stderr


def test_gpu_in_an_ssd_bay_is_refused(tmp_path: Path) -> None:
    layout = tmp_path / "bad.json"
    layout.write_text(json.dumps({"cpu0-bay0": "gpu0"}))
    done = run("score", "--profile", "moment-machine-a", "--layout", str(layout))
    assert done.returncode == 1
    assert "does not fit" in done.stderr


def test_plan_takes_either_milp_solver() -> None:
    """--milp-solver pulp-cbc (CBC) finds the time ortools' SCIP finds; an unknown solver is refused."""
    times = {}
    for solver in ("ortools", "pulp-cbc"):
        done = run(
            "plan",
            "--profile",
            "moment-machine-b",
            "--gpus",
            "2",
            "--ssds",
            "4",
            "--method",
            "milp",
            "--milp-solver",
            solver,
            "--top",
            "1",
            "--json",
        )
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        assert data["search"]["method"] == "milp"
        times[solver] = data["best"]["predicted_iteration_s"]
    assert times["pulp-cbc"] == pytest.approx(times["ortools"], rel=1e-6)
    done = run("plan", "--profile", "moment-machine-b", "--method", "milp", "--milp-solver", "glpk")
    assert done.returncode == 2 and "--milp-solver" in done.stderr and "pulp-cbc" in done.stderr
