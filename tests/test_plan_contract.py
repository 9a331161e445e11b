"""plan.json is read through its contract (PlanDoc): a plan from elsewhere that is broken or
hostile is one line naming the file and the field, before anything is written."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from moment.cli import main
from moment.contracts.plan import PlanDoc, read_plan
from moment.errors import MomentError
from moment.planner.plan import plan
from moment.planner.planfile import plan_document
from moment.planner.workload import Workload
from placement.synth import synthesize
from planner_fixtures import one_switch, ssd

Edit = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def good(plan_file: Path) -> dict[str, Any]:
    return json.loads(plan_file.read_text())


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan-contract") / "ds"
    synthesize(out, nodes=2_000, avg_degree=4, dim=8, dtype="float32", seed=0, train_fraction=0.2)
    return out


def tree(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


def evil(tmp_path: Path, good: dict[str, Any], edit: Edit) -> Path:
    doc = copy.deepcopy(good)
    edit(doc)
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(doc))
    return path


def set_key(part: str, index: int, key: str, value: Any) -> Edit:
    return lambda d: d[part][index].__setitem__(key, value)


# (edit, field the error names, what it says): the review's #20 and #21 and the contract's rules.
CASES: dict[str, tuple[Edit, str, str]] = {
    "bin path traversal (#20)": (
        set_key("bin_targets", -1, "bin", "../../victim"),
        "bin_targets.9.bin",
        "is not a bin name",
    ),
    "absolute bin path": (set_key("bin_targets", 0, "bin", "/tmp/x"), "bin_targets.0.bin", "is not a bin name"),
    "duplicate bin (#21)": (
        lambda d: d["bin_targets"].append(dict(d["bin_targets"][0])),
        "bin_targets.10.bin",
        "duplicate bin gpu-cache",
    ),
    "bins sharing a file name": (
        lambda d: d["bin_targets"].append(dict(d["bin_targets"][1], bin="cpu:cache")),
        "bin_targets.10.bin",
        "same file name as bin cpu-cache",
    ),
    "share abc (#21)": (set_key("bin_targets", 0, "share", "abc"), "bin_targets.0.share", "valid number"),
    "share out of range": (set_key("bin_targets", 0, "share", 1.5), "bin_targets.0.share", "less than or equal to 1"),
    "unknown tier": (set_key("bin_targets", 0, "tier", "tape"), "bin_targets.0.tier", "'gpu', 'cpu' or 'ssd'"),
    "batch_size 0 (#21)": (
        lambda d: d["workload"].__setitem__("batch_size", 0),
        "workload.batch_size",
        "greater than 0",
    ),
    "fanouts 0,0 (#21)": (
        lambda d: d["workload"].__setitem__("fanouts", [0, 0]),
        "workload.fanouts.0",
        "must be positive",
    ),
    "no fanouts": (lambda d: d["workload"].__setitem__("fanouts", []), "workload.fanouts", "at least one"),
    "missing key": (lambda d: d.pop("bin_targets"), "bin_targets", "Field required"),
    "unknown key": (
        set_key("bin_targets", 2, "colour", "red"),
        "bin_targets.2.colour",
        "Extra inputs are not permitted",
    ),
    "wrong type": (lambda d: d.__setitem__("ranks", {"0": "gpu0"}), "ranks", "valid list"),
    "ranks out of order": (set_key("ranks", 2, "rank", 5), "ranks.2.rank", "expected 2"),
    "two ranks on one GPU": (set_key("ranks", 3, "gpu", "gpu1"), "ranks.3.gpu", "gpu1 already has rank 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_place_refuses_a_bad_plan_in_one_line(
    case: str, good: dict[str, Any], dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit, field, says = CASES[case]
    path = evil(tmp_path, good, edit)
    before, source = tree(tmp_path), tree(dataset)
    code = main(
        [
            "place",
            "--plan",
            str(path),
            "--dataset",
            str(dataset),
            "--out",
            str(tmp_path / "a" / "b" / "pp"),
            "--gpu-cache",
            "1%",
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert f"{path}: {field}: " in lines[0] and says in lines[0], lines[0]
    assert tree(tmp_path) == before and tree(dataset) == source  # nothing written, in --out or anywhere else


def test_traversal_through_the_cli_writes_nothing(good: dict[str, Any], dataset: Path, tmp_path: Path) -> None:
    """The review's #20 as a user runs it: exit 1, one line, no file outside (or inside) --out."""
    path = evil(tmp_path, good, set_key("bin_targets", -1, "bin", "../../victim"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moment",
            "place",
            "--plan",
            str(path),
            "--dataset",
            str(dataset),
            "--out",
            str(tmp_path / "a" / "b" / "pp"),
            "--gpu-cache",
            "1%",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert f"{path}: bin_targets.9.bin: '../../victim' is not a bin name" in done.stderr
    assert tree(tmp_path) == [path]


def test_train_refuses_a_bad_plan_in_one_line(
    good: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = evil(tmp_path, good, set_key("ranks", 1, "gpu", "gpu0"))
    assert main(["train", "--plan", str(path), "--data", str(tmp_path / "placed"), "--dry-run"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{path}: ranks.1.gpu: gpu0 already has rank 0" in lines[0], lines


def test_a_written_plan_round_trips_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", "moment-machine-b", "--gpus", "4", "--ssds", "8", "--out", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text()
    doc = read_plan(out)
    assert doc.to_json() == text
    assert doc.model_dump(mode="json") == json.loads(text)
    assert [(t.bin, t.tier) for t in doc.bin_targets][:3] == [
        ("gpu-cache", "gpu"),
        ("cpu-cache", "cpu"),
        ("nvme0", "ssd"),
    ]
    assert doc.rank(3) is doc.ranks[3] and doc.rank(4) is None


def test_the_writer_refuses_what_a_reader_would() -> None:
    """An SSD id that cannot name a bin file is refused when planning, not when placing."""
    machine = one_switch()
    data = machine.model_dump()
    data["sockets"][0]["ports"][0]["switch"]["ports"][2]["device"] = ssd(0, 2.0) | {"id": "nvme/0"}
    machine = type(machine).model_validate(data)
    workload = Workload(nodes=1_000_000, feature_dim=64, gpu_cache_gb=0.01, cpu_cache_fraction=0.01)
    outcome = plan(machine, workload, 2, 2, top=1)
    with pytest.raises(
        MomentError, match=r"^one-switch: cannot make a valid plan: bin_targets\.\d\.bin: 'nvme/0' is not"
    ):
        plan_document(machine, workload, outcome)


def test_format_is_checked_first(good: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(good | {"format": "moment.plan/0"}))
    with pytest.raises(MomentError, match=r"old\.json: format: expected 'moment.plan/2', got 'moment.plan/0'"):
        PlanDoc.read(path)


def test_a_cuda_rank_takes_its_plan_entry(plan_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """select_device reads ``ranks[local_rank]`` (GPU by PCI address, socket pinning) from the model;
    CUDA itself is stubbed, so this runs without a GPU."""
    import torch

    from moment import hw
    from trainer import dist
    from trainer.config import TrainConfig

    doc = read_plan(plan_file)
    doc.ranks[1].bdf, doc.ranks[1].socket = "0000:3b:00.0", "cpu1"
    pinned: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(hw, "cuda_index_of", lambda bdf: 2 if bdf == "0000:3b:00.0" else None)
    monkeypatch.setattr(hw, "pin_to_socket", lambda socket: pinned.append(socket) or f"node of {socket}")
    cfg = TrainConfig(data="unused", device="cuda")
    device, why = dist.select_device(cfg.resolved_device(), dist.DistEnv(1, 4, 1, True), doc)
    assert (device.index, pinned) == (2, ["cpu1"])
    assert why == "cuda:2 (plan gpu1 at 0000:3b:00.0), pinned to node of cpu1"
    device, why = dist.select_device(cfg.resolved_device(), dist.DistEnv(7, 8, 7, True), doc)  # past the plan's GPUs
    assert device.index == 3 and why == "cuda:3 (LOCAL_RANK)"
