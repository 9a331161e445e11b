"""`moment infer`: layer-wise full-neighbourhood inference equals an in-memory forward pass of the
same model over the whole graph, resumes after a kill to the same bytes, refuses bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moment import faults
from moment.cli import main
from moment.contracts.inference import InferenceManifest
from placement.dataset import open_dataset
from placement.placed import open_placed
from trainer import checkpoint, loop
from trainer.config import TrainConfig
from trainer.infer import InferOptions, infer
from trainer.models import build_model

ROOT = Path(__file__).resolve().parent.parent
# Runs name their device: "auto" would run on a GPU machine's GPU, where the same-bytes checks below
# do not hold (CUDA's scatter sums add in no fixed order) and two torchrun ranks on one GPU are refused.
CPU = ["--device", "cpu"]
TRAIN = [
    "--fanouts",
    "5,3",
    "--batch-size",
    "128",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--epochs",
    "1",
    "--max-batches-per-epoch",
    "2",
    *CPU,
]


@pytest.fixture(scope="module")
def data(plan_file: Path, make_placed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny placed graph (GPU, CPU and SSD bins all used), a SAGE and a GAT checkpoint, and a
    second placement of other data."""
    root = tmp_path_factory.mktemp("infer")
    tiny = dict(avg_degree=6, dim=12, dtype="float16", classes=4, gpu_cache="5%", cpu_cache="5%", epochs=1)
    placed = make_placed(nodes=1500, seed=5, train_fraction=0.2, val_fraction=0.1, test_fraction=0.1, **tiny)
    out = {"placed": placed, "plan": plan_file}
    for model in ("sage", "gat"):
        assert loop.main(["--data", str(placed), "--model", model, *TRAIN, "--checkpoint-dir", str(root / model)]) == 0
        out[model] = root / model
    out["other"] = make_placed(
        nodes=900, avg_degree=5, dim=12, dtype="float16", seed=6, classes=4, gpu_cache="5%", cpu_cache="5%", epochs=1
    )
    return out


def full_forward(placed_dir: Path, ckpt: Path) -> list[np.ndarray]:
    """Every layer's output, in dataset ids: plain PyG convs over the whole edge_index and the
    source dataset's features, model.eval()."""
    placed = open_placed(placed_dir)
    meta = checkpoint.read_meta(ckpt)
    cfg = TrainConfig.from_dict(meta.config)
    body = checkpoint.load(ckpt, cfg, checkpoint.DataIdentity.of(placed.root, placed.manifest))
    model = build_model(cfg, placed.feature_dim, placed.num_classes)
    model.load_state_dict(body["model"])
    model.eval()
    indptr, indices = np.asarray(placed.array("indptr")), np.asarray(placed.array("indices"))
    n = placed.num_nodes
    edge_index = torch.from_numpy(np.stack([indices.astype(np.int64), np.repeat(np.arange(n), np.diff(indptr))]))
    h = torch.from_numpy(np.asarray(open_dataset(placed.manifest.source.path).features()).astype(np.float32))
    outs = []
    with torch.no_grad():
        for i, conv in enumerate(model.convs):
            h = conv(h, edge_index)
            if i < len(model.convs) - 1:
                h = F.relu(h)
            outs.append(h.numpy())
    return outs


def _arrays(out: Path) -> dict[str, np.ndarray]:
    m = InferenceManifest.read(out / "inference.json")
    return {k: np.load(out / e.path) for k, e in m.arrays.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model", ["sage", "gat"])
def test_infer_equals_a_full_graph_forward_pass(data: dict[str, Path], tmp_path: Path, model: str, device: str) -> None:
    out = tmp_path / "out"
    # small chunks and two ranks: many chunk borders, neighbours inside and outside each chunk
    opts = InferOptions(
        data=data["placed"], checkpoint=data[model], out=out, nproc=2, layers="all", batch_size=200, device=device
    )
    m = infer(opts)
    got = _arrays(out)
    want = full_forward(data["placed"], data[model])
    hidden, logits = want[0], want[1]
    np.testing.assert_allclose(got["embeddings"], hidden, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-5)
    assert np.array_equal(got["predictions"], logits.argmax(axis=1)) and got["predictions"].dtype == np.int64
    assert set(got) == {"embeddings", "predictions", "logits"} and not out.with_name("out.partial").exists()
    # the manifest: checksums of what is on disk, accuracy of these predictions on the test split
    for entry in m.arrays.values():
        assert checkpoint_sha(out / entry.path) == entry.sha256
    placed = open_placed(data["placed"])
    test, labels = np.asarray(placed.array("test")), np.asarray(open_dataset(placed.manifest.source.path).labels())
    assert m.accuracy["test"] == pytest.approx(float((got["predictions"][test] == labels[test]).mean()))
    assert m.data.placed_sha256 == checkpoint.DataIdentity.of(placed.root, placed.manifest).placed_sha256
    assert [t.stage for t in m.throughput] == ["layer 1", "layer 2", "export"]
    assert all(t.vertices == placed.num_nodes for t in m.throughput)


def checkpoint_sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_float16_and_last_layer_only(data: dict[str, Path], tmp_path: Path) -> None:
    infer(InferOptions(data=data["placed"], checkpoint=data["sage"], out=tmp_path / "o", dtype="float16", device="cpu"))
    got = _arrays(tmp_path / "o")
    assert set(got) == {"embeddings", "predictions"} and got["embeddings"].dtype == np.float16
    want = full_forward(data["placed"], data["sage"])[0]
    np.testing.assert_allclose(got["embeddings"].astype(np.float32), want, rtol=2e-3, atol=2e-3)


def _run_cli(args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
    return subprocess.run(
        [sys.executable, "-m", "moment", "infer", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("point", ["infer:layer2:chunk3", pytest.param("infer:manifest", marks=pytest.mark.slow)])
def test_a_killed_infer_resumes_to_the_same_bytes(data: dict[str, Path], tmp_path: Path, point: str) -> None:
    args = ["--data", str(data["placed"]), "--checkpoint", str(data["gat"]), "--batch-size", "256", "--layers", "all"]
    args += CPU
    straight = tmp_path / "straight"
    infer(
        InferOptions(
            data=data["placed"], checkpoint=data["gat"], out=straight, batch_size=256, layers="all", device="cpu"
        )
    )
    out = tmp_path / "killed"
    killed = _run_cli([*args, "--out", str(out)], fault=point)
    assert killed.returncode == faults.FAULT_EXIT, killed.stderr
    assert not out.exists() and out.with_name("killed.partial").exists()
    if point.startswith("infer:layer"):
        progress = json.loads((out.with_name("killed.partial") / "data/work/progress-0.json").read_text())
        assert (progress["stage"], progress["chunks"]) == (1, 3)  # layer 1 and 3 chunks of layer 2 recorded
    logged: list[str] = []
    infer(
        InferOptions(data=data["placed"], checkpoint=data["gat"], out=out, batch_size=256, layers="all", device="cpu"),
        log=logged.append,
    )
    assert any("interrupted" in line for line in logged), logged
    a, b = _arrays(straight), _arrays(out)
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert not out.with_name("killed.partial").exists()
    # the same command once more: nothing to do
    logged.clear()
    infer(
        InferOptions(data=data["placed"], checkpoint=data["gat"], out=out, batch_size=256, layers="all", device="cpu"),
        log=logged.append,
    )
    assert any("nothing to do" in line for line in logged), logged


@pytest.mark.slow
def test_two_torchrun_ranks_write_what_one_process_writes(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "infer",
        "--data",
        str(data["placed"]),
        "--checkpoint",
        str(data["sage"]),
        "--batch-size",
        "300",
        "--plan",
        str(data["plan"]),
        *CPU,
    ]
    assert main([*args, "--out", str(tmp_path / "ranks"), "--nproc", "2"]) == 0
    assert "trainer.torchrun" in capsys.readouterr().err
    loop_out = tmp_path / "loop"
    infer(
        InferOptions(data=data["placed"], checkpoint=data["sage"], out=loop_out, nproc=2, batch_size=300, device="cpu")
    )
    a, b = _arrays(tmp_path / "ranks"), _arrays(tmp_path / "loop")
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_inputs_are_one_line(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["infer", "--data", str(data["placed"]), "--out", str(tmp_path / "o")]
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        assert main([*base, "--checkpoint", str(data["sage"]), "--device", "cuda"]) == 2
        assert "--device cuda: CUDA is not available" in _one_line(capsys.readouterr().err)
    assert main([*base, "--checkpoint", str(tmp_path / "nowhere")]) == 1
    assert "nowhere: missing" in _one_line(capsys.readouterr().err)
    assert (
        main(["infer", "--data", str(data["other"]), "--out", str(tmp_path / "o"), "--checkpoint", str(data["sage"])])
        == 1
    )
    assert "trained on other data" in _one_line(capsys.readouterr().err)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "checkpoint.pt").write_bytes(b"junk")
    assert main([*base, "--checkpoint", str(tmp_path / "junk")]) == 1
    assert "unreadable checkpoint" in _one_line(capsys.readouterr().err)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("mine")
    assert main(["infer", "--data", str(data["placed"]), "--checkpoint", str(data["sage"]), "--out", str(docs)]) == 1
    assert "is not a directory of inference outputs" in _one_line(capsys.readouterr().err)
    assert (docs / "notes.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_the_launcher_times_each_layer_on_the_device_it_names(
    data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher loads the model on the CPU and times the ranks' device (the first GPU run
    failed there: "mat2 is on cpu"). Every tensor the timed layer form holds is on that device,
    and the launcher's own model stays where it was. (SAGE: the layers GAT's gather engine runs
    are not timed.)"""
    from trainer import infer as infer_mod
    from trainer.infer_predict import Compute

    device = torch.device("meta")  # a device other than the CPU that a CPU machine has
    seen: list[set[torch.device]] = []

    def spy(form, in_width, width, block, dev, rows, num_nodes):  # noqa: ANN001, ANN202
        held = [c.cell_contents for f in (form.message, form.root, form.finish) for c in (f.__closure__ or ())]
        tensors = [t for t in held if isinstance(t, torch.Tensor)]
        tensors += [p for m in held if isinstance(m, torch.nn.Module) for p in m.parameters()]
        assert dev == device and tensors
        seen.append({t.device for t in tensors})
        return Compute(1e-9, 1e-9)

    monkeypatch.setattr(infer_mod, "device_for", lambda **_: device)
    monkeypatch.setattr(infer_mod.infer_predict, "calibrate", spy)
    opts = InferOptions(data=data["placed"], checkpoint=data["sage"], out=tmp_path / "out", layers="all", device="cpu")
    p = infer_mod.prepare(opts)
    p.stage.release()
    assert seen and all(s == {device} for s in seen)
    assert {t.device.type for t in p.loaded.model.parameters()} == {"cpu"}
