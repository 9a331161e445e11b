"""The memory budget (trainer/memory.py): each rank's peak GPU bytes and each node's host bytes,
computed before torchrun starts; a run that does not fit is refused with one line naming what to
shrink (issue #13; GPU review #8, #10, #11)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moment.cli import main
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile
from trainer import memory, preflight
from trainer.launch import check_command

GB = 1e9


@pytest.fixture(scope="module")
def placed(make_placed) -> Path:
    return make_placed(
        nodes=3000,
        avg_degree=6,
        dim=64,
        classes=4,
        train_fraction=0.1,
        val_fraction=0.05,
        test_fraction=0.05,
        gpu_cache="10%",
        cpu_cache="20%",
    )


def test_the_paper_workload_on_machine_b_is_refused_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 8000, fan-outs 25,10, 1024 float32 features, prefetch 2 on an A100 40GB: ~1.8M rows
    per batch (7 GB) held four times, plus SAGE's [2M edges, 1024] messages: it does not fit;
    the line names the knobs, and the batch size it suggests does fit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # capacity from the profile, not this machine
    machine = resolve_profile("moment-machine-b")
    shape = memory.shape_of_workload(load_workload(machine.workload), ranks_per_node=4, sockets=len(machine.sockets))
    b = memory.budget(shape)
    b.gpu_capacity, b.gpu_capacity_source = memory.gpu_capacity(machine)
    assert b.gpu_capacity == 40 * 10**9 and "A100" in b.gpu_capacity_source
    assert abs(b.gpu["batches"] - 4 * b.gpu["staging"]) <= 4 and b.gpu["batches"] > 25 * GB
    assert b.gpu["activations"] > 8 * GB  # at least the first layer's gathered x_j
    line = memory.refusal(b)
    assert line is not None and "\n" not in line
    assert "40.0 GB" in line and "--prefetch 1" in line and "--batch-size" in line
    fit = memory.largest_batch(b.shape, b.gpu_capacity)
    assert fit is not None and 1000 < fit < 8000
    assert memory.budget(b.shape.with_batch(fit)).gpu_bytes_per_rank <= b.gpu_capacity
    assert memory.budget(b.shape.with_batch(fit + 50)).gpu_bytes_per_rank > b.gpu_capacity


def test_parts_follow_the_run_shape(placed: Path, plan_file: Path) -> None:
    """The GPU cache bin once per rank, prefetch + 2 batches, the host caches once per socket,
    pinned staging per rank (one batch's rows and a page, allocated once) rounded up to a power of
    two (torch's pinned allocator does)."""
    from placement.placed import open_placed
    from trainer.config import TrainConfig

    p = open_placed(placed)
    cfg = TrainConfig(data=str(placed), prefetch=3)
    shape = memory.shape_of_placed(p, cfg, ranks_per_node=4, sockets=2)
    b = memory.budget(shape)
    gpu_rows = sum(x.count for x in p.manifest.bins if x.tier == "gpu")
    cpu_rows = sum(x.count for x in p.manifest.bins if x.tier == "cpu")
    assert gpu_rows > 0 and b.gpu["gpu_cache"] == gpu_rows * p.row_bytes
    assert b.gpu["batches"] == int(5 * shape.unique_per_batch * p.row_bytes)
    assert b.host["host_caches"] == 2 * (gpu_rows + cpu_rows) * p.row_bytes
    one = math.ceil(shape.unique_per_batch) * p.row_bytes + 4096
    pow2 = 1 << max(0, math.ceil(math.log2(max(one, 1))))  # the next power of two
    assert b.host["pinned_staging"] == 4 * pow2 and pow2 >= one
    assert b.gpu_bytes_per_rank == sum(b.gpu.values())
    bigger = memory.budget(shape.with_batch(2 * shape.batch_size))
    assert bigger.gpu["batches"] > b.gpu["batches"]
    cpu = memory.budget(shape, cuda=False)
    assert cpu.gpu_bytes_per_rank == 0 and cpu.host["ranks"] > 0


@pytest.mark.parametrize("model", ["sage", "gat"])
@pytest.mark.parametrize(("in_dim", "hidden", "classes", "layers", "heads"), [(128, 256, 19, 2, 8), (7, 5, 3, 3, 2)])
def test_parameter_formulas_match_the_built_models(
    model: str, in_dim: int, hidden: int, classes: int, layers: int, heads: int
) -> None:
    """The registered formulas (what the launcher counts without importing PyG) against the
    models PyG builds; a model registered without one is built on the meta device."""
    from trainer.config import TrainConfig
    from trainer.models import LAYERS, Layer, build_model, count_parameters

    cfg = TrainConfig(data="-", model=model, hidden=hidden, heads=heads, fanouts=tuple([3] * layers))
    built = sum(p.numel() for p in build_model(cfg, in_dim, classes).parameters())
    assert count_parameters(cfg, in_dim, classes) == built
    plain = Layer(LAYERS[model].make, activations=LAYERS[model].activations)  # a plug-in without a formula
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(LAYERS, "plugin", plain)
        other = TrainConfig(data="-", model="plugin", hidden=hidden, heads=heads, fanouts=tuple([3] * layers))
        assert count_parameters(other, in_dim, classes) is None
        shape = memory.RunShape(
            nodes=10, feature_dim=in_dim, row_bytes=4 * in_dim, fanouts=other.fanouts, batch_size=4,
            unique_per_batch=8.0, model="plugin", hidden=hidden, heads=heads, classes=classes,
            gpu_cache_rows=0, host_cache_rows=0, prefetch=1, ranks_per_node=1, sockets=1,
        )  # fmt: skip
        assert memory.model_parameters(shape) == built


def test_the_launcher_budget_imports_no_pyg(placed: Path, plan_file: Path, tmp_path: Path) -> None:
    """``moment train --dry-run`` counts the model's parameters by formula: PyG's import (seconds,
    most of it torch._dynamo) is paid by the ranks only."""
    code = (
        "import sys; from moment.cli import main; "
        f"rc = main(['train', '--plan', {str(plan_file)!r}, '--data', {str(placed)!r}, '--dry-run', '--json']); "
        "print('PYG', 'torch_geometric' in sys.modules, rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.stdout.strip().splitlines()[-1] == "PYG False 0", out.stderr[-2000:]


def test_dry_run_json_prints_the_memory_budget(
    placed: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--plan", str(plan_file), "--data", str(placed), "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"][:3][1:] == ["-m", "trainer.torchrun"]
    mem = doc["memory"]
    assert mem["host_bytes_per_node"] == sum(mem["host"].values()) > 0
    assert mem["gpu_bytes_per_rank"] == sum(mem["gpu"].values())


def test_a_run_that_does_not_fit_is_refused_before_launch(
    placed: Path, plan_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a GPU machine whose GPUs have 512 MiB free, the run is one line, exit 1, no command."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    smi = tmp_path / "nvidia-smi"  # free MiB per GPU, as --query-gpu=memory.free --format=csv,noheader,nounits
    smi.write_text("#!/bin/sh\necho 512\necho 30720\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code = main(["train", "--plan", str(plan_file), "--data", str(placed), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "GPU memory" in err and "nvidia-smi" in err, err
    with pytest.raises(Exception, match="memory: a rank needs"):
        preflight.preflight(check_command(["--data", str(placed), "--plan", str(plan_file)]), 4, ranks_per_node=4)


def test_a_rank_with_too_little_free_memory_after_loading_says_what_to_shrink(placed: Path) -> None:
    from placement.placed import open_placed
    from trainer.config import TrainConfig

    shape = memory.shape_of_placed(open_placed(placed), TrainConfig(data=str(placed)), ranks_per_node=1, sockets=1)
    b = memory.budget(shape)
    need = b.gpu["batches"] + b.gpu["staging"] + b.gpu["activations"]
    assert memory.live_refusal(b, need, "cuda:0") is None
    line = memory.live_refusal(b, need // 2, "cuda:0")
    assert line is not None and "\n" not in line and line.startswith("memory: cuda:0 has") and "--prefetch 1" in line


def test_a_train_split_smaller_than_the_batch_is_budgeted_at_its_real_batches(small_placed: Path) -> None:
    """Pre-sampling with 1,200 train ids and a nominal batch of 8,000 drew batches of 1,200 seeds:
    its mean unique rows are for those, and a 64-seed training batch reads at least its seeds
    (scaled from the nominal batch it was 3.3 rows)."""
    from placement.placed import open_placed
    from trainer.config import TrainConfig

    p = open_placed(small_placed)
    hot = p.manifest.hotness
    train = int(p.array("train").size)
    assert train < hot.batch_size  # the case: every pre-sampled batch was the whole split
    same = memory.shape_of_placed(p, TrainConfig(data=str(small_placed)), ranks_per_node=1, sockets=1)
    assert same.batch_size == train and same.unique_per_batch == pytest.approx(hot.mean_unique_per_batch)
    small = memory.shape_of_placed(p, TrainConfig(data=str(small_placed), batch_size=64), ranks_per_node=1, sockets=1)
    assert small.batch_size == 64 and 64 <= small.unique_per_batch < hot.mean_unique_per_batch
