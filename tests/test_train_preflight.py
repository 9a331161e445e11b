"""`moment train` checks its inputs before torchrun starts (issue #11 point 7; safety review rows
10, 16, 17, 19, 27, 28): bad trainer arguments, outputs that cannot be written, a train split too
small for the ranks, an existing checkpoint (refused unless --resume or --overwrite), a resume on
other data; each refusal one line, printed once. The ranks keep the checks that guard their own
state as a safety net for a bare torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from moment.cli import main
from moment.contracts.metrics import MetricsDoc
from moment.contracts.placed import PlacedManifest
from placement.digests import file_digest
from placement.place import PlaceOptions, place
from placement.placed import open_placed
from placement.sampler import NeighborSampler
from placement.synth import synthesize
from trainer import checkpoint, loop, metrics, preflight
from trainer.config import TrainConfig

TINY = ["--fanouts", "5,5", "--batch-size", "64", "--hidden", "16", "--max-batches-per-epoch", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("preflight")


def _placed(root: Path, plan_file: Path, name: str, nodes: int, seed: int) -> Path:
    synthesize(
        root / f"{name}-ds",
        nodes=nodes,
        avg_degree=6,
        dim=16,
        dtype="float32",
        seed=seed,
        classes=4,
        train_fraction=0.1,
        val_fraction=0.05,
        test_fraction=0.05,
    )
    place(plan_file, root / f"{name}-ds", root / name, PlaceOptions(gpu_cache="3%", cpu_cache="4%"))
    return root / name


@pytest.fixture(scope="module")
def placed(root: Path, plan_file: Path) -> Path:
    return _placed(root, plan_file, "placed", 3000, seed=1)


@pytest.fixture(scope="module")
def other(root: Path, plan_file: Path) -> Path:
    """Another dataset, same feature width: today's code would resume on it silently."""
    return _placed(root, plan_file, "other", 2500, seed=2)


@pytest.fixture(scope="module")
def ckpt(root: Path, placed: Path) -> Path:
    """A checkpoint of one epoch on ``placed`` (one process, no torchrun: cheap)."""
    d = root / "ckpt"
    assert (
        loop.main(["--data", str(placed), *TINY, "--device", "cpu", "--epochs", "1", "--checkpoint-dir", str(d)]) == 0
    )
    return d


def copy_with_train(placed: Path, dst: Path, train: np.ndarray) -> Path:
    """A copy of ``placed`` whose train split is ``train``, its manifest updated to match (what
    another tool, or an edited placement, could hand to moment train)."""
    shutil.copytree(placed, dst)
    manifest = PlacedManifest.read(dst / "placed.json")
    entry = manifest.files["train"]
    np.save(dst / entry.path, train.astype(np.int64))
    manifest.files["train"] = entry.model_copy(
        update={
            "bytes": (dst / entry.path).stat().st_size,
            "digest": file_digest(dst / entry.path, entry.digest_algorithm),
        }
    )
    manifest.write(dst / "placed.json")
    return dst


def train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``moment train ARGS``: exit status (a usage error's SystemExit too), stdout, stderr."""
    capsys.readouterr()
    try:
        code = main(["train", *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- #27: trainer arguments and --epochs, before torchrun -------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--", "--fanouts=abc"], "--fanouts: expected positive integers"),
        (["--", "--epochs", "0"], "--epochs: expected a positive integer"),
        (["--", "--batch-size", "-3"], "--batch-size"),
        (["--", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--epochs", "0"], "--epochs: expected a positive integer, got '0'"),
        (["--epochs", "-1"], "--epochs: expected a positive integer, got '-1'"),
        (["--fanouts", "5,x"], "--fanouts: expected positive integers"),  # a trainer option, given to moment train
    ],
)
def test_bad_trainer_arguments_are_one_usage_line_before_torchrun(
    plan_file: Path, placed: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = train(capsys, "--plan", str(plan_file), "--data", str(placed), "--dry-run", *argv)
    assert code == 2 and out == ""  # --dry-run printed no command
    assert message in one_line(err)


def test_bad_trainer_argument_without_dry_run_starts_no_torchrun(plan_file: Path, placed: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moment",
            "train",
            "--plan",
            str(plan_file),
            "--data",
            str(placed),
            "--epochs",
            "1",
            "--",
            "--device",
            "cpu",
            "--fanouts=abc",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--fanouts" in one_line(done.stderr) and "running:" not in done.stderr


# -- #19: outputs that cannot be written, found before torchrun ---------------------------------


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody here may write in (root ignores modes: then /sys, read-only for it)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    for candidate in (d, Path("/sys")):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            yield candidate
            break
        os.close(fd)
        os.unlink(probe)
    else:
        pytest.skip("no read-only directory here")
    d.chmod(0o755)


@pytest.mark.parametrize("flag, path", [("--metrics-json", "sub/m.json"), ("--checkpoint-dir", "ck")])
def test_unwritable_outputs_are_refused_before_torchrun(
    plan_file: Path, placed: Path, read_only: Path, capsys: pytest.CaptureFixture[str], flag: str, path: str
) -> None:
    before = sorted(os.listdir(read_only))
    target = read_only / path
    code, out, err = train(capsys, "--plan", str(plan_file), "--data", str(placed), flag, str(target), "--dry-run")
    assert code == 1 and out == ""
    assert f"{flag} {target}: {read_only} is not writable" in one_line(err)
    assert sorted(os.listdir(read_only)) == before  # no probe file, no directory left


def test_outputs_in_new_directories_are_probed_without_creating_them(
    plan_file: Path, placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = train(
        capsys,
        "--plan",
        str(plan_file),
        "--data",
        str(placed),
        "--metrics-json",
        str(tmp_path / "a" / "b" / "m.json"),
        "--checkpoint-dir",
        str(tmp_path / "c" / "d"),
        "--dry-run",
    )
    assert code == 0 and list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    code, _, err = train(
        capsys, "--plan", str(plan_file), "--data", str(placed), "--metrics-json", str(tmp_path), "--dry-run"
    )
    assert code == 1 and "a directory, expected a file name" in one_line(err)
    code, _, err = train(capsys, "--data", str(placed), "--checkpoint-dir", str(tmp_path / "file"), "--dry-run")
    assert code == 1 and "not a directory" in one_line(err)


# -- #17: an existing checkpoint: --resume or --overwrite ---------------------------------------


def test_existing_checkpoint_needs_resume_or_overwrite(
    placed: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--data", str(placed), "--checkpoint-dir", str(ckpt), "--dry-run", "--", *TINY]
    code, _, err = train(capsys, *base)
    assert code == 1 and "--resume" in one_line(err) and "--overwrite" in err
    code, _, err = train(capsys, "--max-restarts", "1", *base)  # restarts resume, but not an earlier run's file
    assert code == 1 and "holds a checkpoint" in one_line(err)
    code, out, _ = train(capsys, "--resume", *base)
    assert code == 0 and " --resume" in out
    code, out, _ = train(capsys, "--overwrite", *base)
    assert code == 0 and " --overwrite" in out and checkpoint.path_in(ckpt).exists()  # a dry run removes nothing
    code, _, err = train(capsys, "--resume", "--overwrite", *base)
    assert code == 2 and "--resume and --overwrite exclude each other" in one_line(err)
    code, _, err = train(capsys, "--data", str(placed), "--resume", "--dry-run")
    assert code == 2 and "--resume needs --checkpoint-dir" in one_line(err)


def test_overwrite_removes_only_a_moment_checkpoint(tmp_path: Path) -> None:
    """--overwrite deletes checkpoint.pt only when it reads as a moment checkpoint."""
    foreign = tmp_path / "ck"
    foreign.mkdir()
    checkpoint.path_in(foreign).write_bytes(b"a file of someone else's")
    with pytest.raises(checkpoint.CheckpointError):
        preflight.start_over(foreign)
    assert checkpoint.path_in(foreign).read_bytes() == b"a file of someone else's"
    preflight.start_over(tmp_path / "empty")  # nothing there: nothing to do


def test_rank_refuses_to_overwrite_a_checkpoint_too(
    placed: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bare `torchrun -m trainer` (no launcher) gets the same refusal, from rank 0."""
    capsys.readouterr()
    assert loop.main(["--data", str(placed), *TINY, "--checkpoint-dir", str(ckpt)]) == 1
    assert "--resume to continue it or --overwrite" in one_line(capsys.readouterr().err)


@pytest.mark.slow
def test_overwrite_starts_over_and_metrics_count_epochs_from_1(
    plan_file: Path, placed: Path, ckpt: Path, tmp_path: Path
) -> None:
    """Through torchrun (two gloo ranks): the old checkpoint is replaced by the new run's."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpt, ck)
    m = tmp_path / "m.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moment",
            "train",
            "--plan",
            str(plan_file),
            "--data",
            str(placed),
            "--nproc",
            "2",
            "--epochs",
            "2",
            "--checkpoint-dir",
            str(ck),
            "--overwrite",
            "--metrics-json",
            str(m),
            "--",
            *TINY,
            "--device",
            "cpu",  # gloo ranks: on a machine with one GPU, two nccl ranks would be refused
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = MetricsDoc.read(m).model_dump(mode="json")
    assert doc["format"] == "moment.metrics/2" and [e["epoch"] for e in doc["epochs"]] == [1, 2]
    meta = checkpoint.read_meta(ck)
    assert meta is not None and meta.epoch == 2 and len(meta.history) == 2
    assert meta.data == checkpoint.DataIdentity.of(placed, open_placed(placed).manifest)
    assert meta.data.num_nodes == 3000 and meta.data.feature_dim == 16


# -- #16: a checkpoint records its data; a resume on other data is refused ---------------------


def test_checkpoint_records_the_data_it_trained_on(placed: Path, ckpt: Path) -> None:
    meta = checkpoint.read_meta(ckpt)
    manifest = open_placed(placed).manifest
    assert meta is not None and meta.format == "moment.checkpoint/3" and meta.epoch == 1
    d = meta.data
    assert (d.num_nodes, d.num_edges, d.feature_dim, d.feature_dtype, d.num_classes) == (
        manifest.num_nodes,
        manifest.num_edges,
        manifest.feature_dim,
        manifest.feature_dtype,
        manifest.num_classes,
    )
    assert len(d.placed_sha256) == 64
    body = torch.load(checkpoint.path_in(ckpt), weights_only=True)  # tensors and primitives only
    assert body["data"] == d.model_dump()


def test_resume_on_other_data_is_refused_before_torchrun_and_in_the_rank(
    placed: Path, other: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = train(
        capsys, "--data", str(other), "--checkpoint-dir", str(ckpt), "--resume", "--dry-run", "--", *TINY
    )
    assert code == 1 and out == ""
    assert "cannot resume: trained on other data: num_nodes 3000 (checkpoint) vs 2500 (--data)" in one_line(err)
    assert loop.main(["--data", str(other), *TINY, "--checkpoint-dir", str(ckpt), "--resume"]) == 1
    assert "trained on other data: num_nodes" in one_line(capsys.readouterr().err)
    with pytest.raises(checkpoint.CheckpointError, match="trained on other data"):
        checkpoint.load(
            ckpt,
            TrainConfig(data=str(other), fanouts=(5, 5), hidden=16),
            checkpoint.DataIdentity.of(other, open_placed(other).manifest),
        )


def test_resume_on_another_placement_of_equal_shape_is_refused(
    placed: Path, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same counts and width, other ids (e.g. 150 other training vertices): only the digest tells."""
    train_ids = np.asarray(open_placed(placed).array("train"))
    copy = copy_with_train(placed, tmp_path / "copy", train_ids[::-1].copy())
    code, _, err = train(
        capsys, "--data", str(copy), "--checkpoint-dir", str(ckpt), "--resume", "--dry-run", "--", *TINY
    )
    assert code == 1 and "placed.json sha256" in one_line(err) and "another placement" in err


def test_old_or_damaged_checkpoint_metadata_is_one_line(
    tmp_path: Path, placed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"format": "moment.checkpoint/2", "epoch": 1, "config": {}, "history": []}, checkpoint.path_in(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match="format: expected 'moment.checkpoint/3'"):
        checkpoint.read_meta(tmp_path)
    code, _, err = train(capsys, "--data", str(placed), "--checkpoint-dir", str(tmp_path), "--resume", "--dry-run")
    assert code == 1 and "format: expected 'moment.checkpoint/3'" in one_line(err)


# -- #10: a train split too small for the ranks -------------------------------------------------


def test_empty_train_split_is_refused(placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = copy_with_train(placed, tmp_path / "empty", np.zeros(0, np.int64))
    code, _, err = train(capsys, "--data", str(empty), "--nproc", "1", "--dry-run")
    assert code == 1 and "train split is empty" in one_line(err)
    assert loop.main(["--data", str(empty), *TINY]) == 1  # the rank's safety net
    assert "train split is empty" in one_line(capsys.readouterr().err)


def test_fewer_training_ids_than_ranks_is_refused(
    placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = copy_with_train(placed, tmp_path / "one", np.array([7]))
    code, _, err = train(capsys, "--data", str(one), "--nproc", "2", "--dry-run")
    assert code == 1 and "fewer than the 2 ranks" in one_line(err)
    code, _, _ = train(capsys, "--data", str(one), "--nproc", "1", "--dry-run")
    assert code == 0


def test_nccl_ranks_on_the_cpu_are_one_line(placed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch's init_process_group raises in every rank (device_id must be an accelerator)."""
    code, _, err = train(
        capsys, "--data", str(placed), "--nproc", "2", "--dry-run", "--", "--device", "cpu", "--backend", "nccl"
    )
    assert code == 1 and "--backend nccl needs CUDA ranks, not --device cpu" in one_line(err)


def test_an_empty_share_is_no_batch_and_ranks_run_equal_steps(placed: Path) -> None:
    p = open_placed(placed)
    sampler = NeighborSampler(p.array("indptr"), p.array("indices"), (5, 5))
    ids = np.array([3, 8, 11])
    shares = [list(sampler.batches(ids, 64, rank=r, world_size=2, drop_last_uneven=True)) for r in range(2)]
    assert [len(s) for s in shares] == [1, 1] and all(len(s[0]) == 1 for s in shares)  # 1 id each, the 3rd dropped
    assert shares[0][0].item() != shares[1][0].item()
    # Evaluation shares (no drop): one id for two ranks leaves rank 1 with nothing, not an empty batch.
    assert list(sampler.batches(np.array([5]), 64, shuffle=False, rank=1, world_size=2)) == []


# -- #28: the plan is not the placement's, or is for other data ----------------------------------


def test_plan_of_another_placement_is_warned(
    plan_file: Path, placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads(plan_file.read_text())
    doc["profile"] = {"name": "elsewhere", "sha256": "0" * 64}
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(doc))
    code, out, err = train(capsys, "--plan", str(foreign), "--data", str(placed), "--dry-run")
    assert code == 0 and out.count("\n") == 1
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ")
    assert (
        f"{foreign} (profile elsewhere, layout {doc['layout']['name']}) is not the plan {placed} was placed with"
        in lines[0]
    )
    code, _, err = train(capsys, "--plan", str(plan_file), "--data", str(placed), "--dry-run")
    assert code == 0 and err == ""  # the placement's own plan; its prediction was re-solved for this data


def test_metrics_prediction_is_the_placements(placed: Path) -> None:
    """measured / predicted compares like with like: the prediction is re-solved for the data
    placed; only a plan's prediction kept for other data is marked not comparable."""
    manifest = open_placed(placed).manifest
    cfg = TrainConfig(data=str(placed)).with_sampling(manifest.hotness.fanouts, manifest.hotness.batch_size)
    pred = metrics.prediction(manifest.prediction, cfg)
    assert pred["comparable"] is True and pred["iteration_s"] == manifest.prediction.iteration_s
    assert pred["tier_shares"] == manifest.prediction.tier_shares.model_dump()
    kept = manifest.prediction.model_copy(update={"source": "plan"})
    assert metrics.prediction(kept, cfg)["comparable"] is False


def test_a_checkpoint_whose_history_is_damaged_is_refused_before_the_run(
    tmp_path: Path, placed: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its epoch records are metrics.json's: a record that is not one (here a loss that is text)
    is one line at resume, naming the record and field, not an error at the first epoch's end."""
    meta = checkpoint.read_meta(ckpt)
    body = torch.load(checkpoint.path_in(ckpt), weights_only=True)
    assert meta.history, "the fixture checkpoint has trained at least one epoch"
    body["history"] = [dict(meta.history[0], loss="low")]
    torch.save(body, checkpoint.path_in(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=r"history: .*record 0: loss: Input should be a valid number"):
        checkpoint.read_meta(tmp_path)
    code, _, err = train(capsys, "--data", str(placed), "--checkpoint-dir", str(tmp_path), "--resume", "--dry-run")
    assert code == 1 and "record 0: loss" in one_line(err)
