"""The trainer: DDP over gloo learns, keeps replicas equal, uses each seed once, resumes exactly."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from moment import hw
from moment.contracts.metrics import MetricsDoc
from moment.contracts.plan import read_plan
from placement.placed import PlacedError, open_placed
from placement.sampler import NeighborSampler
from trainer import checkpoint, launch, loop, prefetch, shm
from trainer.config import TrainConfig, from_args
from trainer.dist import DistEnv
from trainer.featurestore import TieredFeatureStore
from trainer.metrics import param_digest
from trainer.models import LAYERS, build_model

CLASSES = 8
CHANCE = 1 / CLASSES
SMALL = ["--fanouts", "10,5", "--batch-size", "512", "--hidden", "64", "--lr", "0.01"]
# Tests of gloo ranks and exact equalities say so: on a machine with CUDA, "auto" would make them nccl
# runs (on one GPU, two ranks on one device: NCCL refuses) and depend on CUDA kernels' determinism.
CPU = ["--device", "cpu"]


@pytest.fixture(scope="module")
def placed(make_placed) -> Path:
    return make_placed(nodes=20_000, dim=32, classes=CLASSES, train_fraction=0.2, val_fraction=0.05, test_fraction=0.05)


def identity(placed: Path) -> checkpoint.DataIdentity:
    return checkpoint.DataIdentity.of(placed, open_placed(placed).manifest)


def _cfg(placed: Path | str, plan: Path | None, *argv: object) -> TrainConfig:
    """The trainer's options as ``moment train`` parses them and hands them to the ranks."""
    return launch.check_command(["--data", str(placed), *(["--plan", str(plan)] if plan else []), *map(str, argv)])


def read_json(path: Path) -> dict:
    """A metrics file, read through its contract (as JSON types)."""
    return MetricsDoc.read(path).model_dump(mode="json")


def test_two_gloo_ranks_learn_and_stay_in_step(plan_file: Path, placed: Path, tmp_path: Path) -> None:
    """torchrun with two CPU processes, as `moment train` launches it."""
    metrics, ckpt, shm = tmp_path / "metrics.json", tmp_path / "ckpt", tmp_path / "shm"
    shm.mkdir()
    cmd = launch.build_torchrun_command(
        _cfg(
            placed,
            plan_file,
            "--epochs",
            3,
            "--metrics-json",
            metrics,
            "--checkpoint-dir",
            ckpt,
            *SMALL,
            *CPU,
            "--shm-dir",
            shm,
        ),
        nproc=2,
    )
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = read_json(metrics)
    assert doc["complete"] and doc["world_size"] == 2
    # One copy of the host-memory bins per socket: both ranks' GPUs are on one socket in the
    # plan, so both mapped the file rank 0 wrote, gone since.
    assert all("one copy per socket" in line for line in doc["ranks"]), doc["ranks"]
    assert list(shm.iterdir()) == []
    assert [e["epoch"] for e in doc["epochs"]] == [1, 2, 3]  # numbered as the console numbers them
    for e in doc["epochs"]:
        assert e["epoch_s"] > 0 and e["seeds_per_s"] > 0 and np.isfinite(e["loss"])
        assert set(e["bytes_per_tier"]) == {"gpu", "cpu", "ssd"} and sum(e["bytes_per_tier"].values()) > 0
        assert (
            set(e["gbps_per_ssd"])
            == set(e["bytes_per_ssd"])
            == {b.name for b in open_placed(placed).bins if b.tier == "ssd"}
        )
        assert sum(e["bytes_per_ssd"].values()) == e["bytes_per_tier"]["ssd"] > 0
        assert 0 < e["hit_rate"]["gpu"] < 1
        # Both ranks take 4000 // 2 // 512 → 4 steps, 2000 seeds each: all 4000 training ids.
        assert e["iterations"] == 4 and e["seeds"] == 4000
    assert doc["epochs"][-1]["loss"] < doc["epochs"][0]["loss"]
    assert doc["epochs"][-1]["val_acc"] > 5 * CHANCE and doc["test_acc"] > 5 * CHANCE  # reaches ~0.93
    assert doc["measured_iteration_s"] > 0
    assert (
        doc["predicted_iteration_s"] == open_placed(placed).manifest.prediction.iteration_s
    )  # the placement's, not the plan's
    # DDP kept the replicas identical, and the checkpoint holds them.
    a, b = doc["rank_param_digests"]
    assert a == b
    body = checkpoint.load(ckpt, TrainConfig.from_dict(doc["config"]), identity(placed))
    assert body is not None and body["epoch"] == 3 and len(body["history"]) == 3
    model = build_model(TrainConfig.from_dict(body["config"]), 32, CLASSES)
    model.load_state_dict(body["model"])
    assert param_digest(model) == a
    assert "Traceback" not in done.stderr


@contextlib.contextmanager
def _torchrun(cmd: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """torchrun, killed with its workers if still running at the end (a failed or timed-out
    test leaves no orphans: the workers run in sessions of their own)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            for pid in _children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.communicate()


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


@pytest.mark.slow
@pytest.mark.parametrize("shared_store", [True, False], ids=["agent-store", "store-per-attempt"])
def test_a_killed_rank_is_restarted_from_the_checkpoint_and_ends_as_if_never_killed(
    plan_file: Path, placed: Path, tmp_path: Path, shared_store: bool
) -> None:
    """torchrun --max-restarts: rank 1 is killed (SIGKILL) after the first checkpoint; the restarted
    ranks resume from it and finish with the parameters and losses of a run never killed (every
    rank's RNG comes back: dropout draws differ per rank). With torchrun's default, one store
    kept across restarts (the trainer scopes its keys to the attempt), and with a store per
    attempt (what ``moment train`` asks for across nodes)."""
    env = {**os.environ, launch.SHARE_STORE_OFF: "0" if shared_store else "1"}
    epochs, shm = 4, tmp_path / "shm"
    shm.mkdir()
    extra = [*SMALL, *CPU, "--dropout", "0.3", "--deterministic", "--eval-every", "4", "--shm-dir", str(shm)]

    def command(name: str, **kw: launch.Rendezvous) -> list[str]:
        argv = [
            "--epochs",
            epochs,
            *extra,
            "--metrics-json",
            tmp_path / f"{name}.json",
            "--checkpoint-dir",
            tmp_path / name,
        ]
        return launch.build_torchrun_command(_cfg(placed, plan_file, *argv), nproc=2, **kw)

    with _torchrun(command("straight"), env) as straight:
        _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    with _torchrun(command("killed", rdzv=launch.Rendezvous(max_restarts=1)), env) as proc:
        ckpt, deadline = checkpoint.path_in(tmp_path / "killed"), time.monotonic() + 240
        while not ckpt.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.02)
        victim = next(p for p in _children(proc.pid) if _environ(p).get("LOCAL_RANK") == "1")
        done_at_kill = torch.load(ckpt, weights_only=True)["epoch"]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    assert done_at_kill < epochs
    assert proc.returncode == 0, err[-3000:]
    assert "exitcode: -9) local_rank: 1" in err  # torchrun saw the kill, restarted the group, and it finished
    a, b = read_json(tmp_path / "straight.json"), read_json(tmp_path / "killed.json")
    assert [e["epoch"] for e in b["epochs"]] == list(range(1, epochs + 1))
    assert [e["loss"] for e in b["epochs"]] == [e["loss"] for e in a["epochs"]]
    assert b["rank_param_digests"] == a["rank_param_digests"]
    assert b["test_acc"] == a["test_acc"]
    assert list(shm.iterdir()) == []


def test_each_training_id_is_a_seed_at_most_once_per_epoch(placed: Path) -> None:
    p = open_placed(placed)
    train = np.asarray(p.array("train"))
    cfg = TrainConfig(data=str(placed), batch_size=300)
    sampler = NeighborSampler(p.array("indptr"), p.array("indices"), (10, 5))
    world = 3
    for epoch in range(2):
        per_rank = [torch.cat(list(loop.epoch_batches(sampler, train, cfg, epoch, r, world))) for r in range(world)]
        steps = [len(list(loop.epoch_batches(sampler, train, cfg, epoch, r, world))) for r in range(world)]
        assert len(set(steps)) == 1  # every rank runs the same number of steps
        seen = torch.cat(per_rank)
        assert seen.unique().numel() == seen.numel()  # no id twice, across ranks
        assert set(seen.tolist()) <= set(train.tolist())
        assert seen.numel() == len(train) - len(train) % world  # all but the uneven remainder


def test_evaluation_batches_are_training_sized_whatever_the_split_order(placed: Path) -> None:
    """A split stored in degree order (as ids often are) evaluated in that order put all the
    high-degree seeds in one batch, the step's memory peak. Evaluation takes each id once across
    ranks, in one fixed shuffled order: every batch about as large a sample as any other."""
    p = open_placed(placed)
    indptr = np.asarray(p.array("indptr"))
    degree = np.diff(indptr)
    ids = np.argsort(-degree, kind="stable")[:1200].astype(np.int64)  # the split stored by degree, highest first
    cfg = TrainConfig(data=str(placed), batch_size=300)
    sampler = NeighborSampler(p.array("indptr"), p.array("indices"), (10, 5))
    world = 2
    per_rank = [list(loop.eval_batches(sampler, ids, cfg, r, world)) for r in range(world)]
    seen = torch.cat([b for batches in per_rank for b in batches])
    assert sorted(seen.tolist()) == sorted(ids.tolist())  # every id once, across ranks
    again = [list(loop.eval_batches(sampler, ids, cfg, r, world)) for r in range(world)]
    assert all(torch.equal(a, b) for x, y in zip(per_rank, again) for a, b in zip(x, y))  # the same every pass
    means = [float(degree[b.numpy()].mean()) for batches in per_rank for b in batches]
    assert max(means) < 1.5 * min(means), means  # stored order: the first batch's mean degree is far above the last's


def run_main(args: list[str]) -> int:
    return loop.main(args)


def test_resumed_run_ends_where_an_uninterrupted_run_ends(placed: Path, tmp_path: Path) -> None:
    common = [
        "--data",
        str(placed),
        *SMALL,
        *CPU,
        "--dropout",
        "0.3",
        "--max-batches-per-epoch",
        "3",
        "--deterministic",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_main([*common, "--epochs", "2", "--checkpoint-dir", str(straight)]) == 0
    assert run_main([*common, "--epochs", "1", "--checkpoint-dir", str(split)]) == 0
    metrics = tmp_path / "resumed.json"
    assert (
        run_main([*common, "--epochs", "2", "--checkpoint-dir", str(split), "--resume", "--metrics-json", str(metrics)])
        == 0
    )
    cfg = TrainConfig(data=str(placed), fanouts=(10, 5), hidden=64)
    a, b = checkpoint.load(straight, cfg, identity(placed)), checkpoint.load(split, cfg, identity(placed))
    assert a["epoch"] == b["epoch"] == 2
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=1e-6, atol=1e-7)
    assert [e["epoch"] for e in read_json(metrics)["epochs"]] == [1, 2]
    assert read_json(metrics)["epochs"][1]["loss"] == pytest.approx(a["history"][1]["loss"], rel=1e-6)


def test_checkpoint_of_another_model_or_damaged_is_refused(
    placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--data",
        str(placed),
        *SMALL,
        *CPU,
        "--epochs",
        "1",
        "--max-batches-per-epoch",
        "1",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    assert run_main(args) == 0
    with pytest.raises(checkpoint.CheckpointError, match="hidden=64"):
        checkpoint.load(tmp_path, from_args([*args, "--hidden", "32"]), identity(placed))
    checkpoint.path_in(tmp_path).write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert run_main([*args, "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreadable checkpoint" in err


def test_metrics_without_plan_carry_the_placements_prediction(placed: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "m.json"
    args = [
        "--data",
        str(placed),
        *SMALL,
        *CPU,
        "--epochs",
        "2",
        "--eval-every",
        "2",
        "--max-batches-per-epoch",
        "2",
        "--metrics-json",
        str(metrics),
    ]
    assert run_main(args) == 0
    doc = read_json(metrics)
    # Measured peaks, for the memory budget: an in-process run's RSS holds at least torch itself.
    mem = doc["memory"]
    assert mem["gpu_peak_allocated_bytes"] is None and mem["host_peak_rss_bytes"] > 100 << 20
    # The base (torch up, before the data) is part of the peak: a run of this size adds little to it.
    assert 100 << 20 < mem["host_base_rss_bytes"] <= mem["host_peak_rss_bytes"]
    pred = doc["prediction"]
    assert doc["predicted_iteration_s"] == pred["iteration_s"] == open_placed(placed).manifest.prediction.iteration_s
    assert "fanouts [25, 10] (this run [10, 5])" in pred["note"] and "read shares will differ" in pred["note"]
    assert doc["epochs"][0]["val_acc"] is None and doc["epochs"][1]["val_acc"] is not None
    assert doc["measured_iteration_s"] == pytest.approx(sum(e["epoch_s"] for e in doc["epochs"]) / 4)


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_damaged_bin_is_one_line_and_exit_1(
    placed: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "placed"
    shutil.copytree(placed, copy)
    ssd = next(b for b in open_placed(copy).bins if b.tier == "ssd")
    if damage == "truncate":
        ssd.path.write_bytes(ssd.path.read_bytes()[:-64])
    else:
        ssd.path.unlink()
    capsys.readouterr()
    assert run_main(["--data", str(copy), *SMALL, "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and ssd.path.name in err
    assert ("truncated" if damage == "truncate" else "missing") in err
    with pytest.raises(PlacedError):
        launch.check_inputs(None, copy)


def test_an_ssd_read_failing_mid_run_is_one_line_and_the_reader_is_closed_once(
    placed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An SSD that fails reads while training (EIO, raised in the prefetch thread) ends the run
    with one line naming the bin, exit 1; the reader, whose files are cuFile handles with kvikio,
    is closed once when training ends, as it is after a run that succeeds."""
    from trainer import file_reader, readers

    ssd = next(b for b in open_placed(placed).bins if b.tier == "ssd")
    real_preadv, real_close = os.preadv, readers.FileReader.close
    closes: list[int] = []

    def failing_preadv(fd: int, buffers: list, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(ssd.path.name):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, buffers, offset)

    def counted_close(self: readers.FileReader) -> None:
        closes.append(1)
        real_close(self)

    monkeypatch.setattr(readers.FileReader, "close", counted_close)
    # EIO is injected through os.preadv, which the python engine calls for every read; the
    # compiled engines hand a failing read to that same code (tests/test_preads.py).
    monkeypatch.setattr(file_reader, "pick_engine", lambda engine: "python")  # FileReader's engine
    args = ["--data", str(placed), *SMALL, *CPU, "--epochs", "1", "--max-batches-per-epoch", "1"]
    assert run_main(args) == 0 and len(closes) == 1
    monkeypatch.setattr(os, "preadv", failing_preadv)
    capsys.readouterr()
    assert run_main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {ssd.path}: Input/output error"), err
    assert len(closes) == 2


def test_input_errors_are_reported_by_rank_0_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank reads the same inputs: rank 0 speaks for all, the others exit 1 quietly."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert run_main(["--data", str(tmp_path / "nope")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == lines and "Traceback" not in err
        assert lines == 0 or "placed.json missing" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fanouts", "10,x"], "--fanouts"),
        (["--batch-size", "0"], "--batch-size"),
        (["--model", "gcn"], "--model"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--dropout", "1.5"], "--dropout"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        from_args(["--data", "d", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "cuda, local_world, argv, message",
    [
        (False, 1, ["--io", "kvikio"], "--io kvikio reads into GPU memory: it needs CUDA"),
        (False, 1, ["--io", "nvme"], "--io: invalid choice"),
        (True, 1, ["--io", "kvikio", "--device", "cuda"], "kvikio is not installed"),
        (True, 2, ["--device", "cuda:1"], "every rank of the node would use that one GPU"),
    ],
)
def test_device_and_io_mistakes_exit_2(
    cuda: bool,
    local_world: int,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Checked before any rank starts: what this machine has (CUDA, kvikio) and what torchrun
    starts (LOCAL_WORLD_SIZE ranks sharing one --device cuda:N)."""
    if "kvikio is not installed" in message and importlib.util.find_spec("kvikio") is not None:
        pytest.skip("kvikio is installed here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    with pytest.raises(SystemExit) as exc:
        from_args(["--data", "d", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    if not cuda:
        return
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank may name its GPU
    assert from_args(["--data", "d", "--device", "cuda:1"]).device == "cuda:1"


def test_config_defaults_and_round_trip() -> None:
    sage = from_args(["--data", "d"])
    assert (sage.hidden, sage.fanouts, sage.batch_size, sage.lr) == (256, None, None, 3e-3)  # sampling: the placement's
    with pytest.raises(ValueError, match="not resolved"):
        _ = sage.layers
    placed = sage.with_sampling((25, 10), 8000)
    assert (placed.fanouts, placed.batch_size, placed.layers) == ((25, 10), 8000, 2)
    mine = from_args(["--data", "d", "--fanouts", "5", "--batch-size", "64"]).with_sampling((25, 10), 8000)
    assert (mine.fanouts, mine.batch_size) == ((5,), 64)  # flags win
    gat = from_args(["--data", "d", "--model", "gat", "--fanouts", "15,10,5"])
    assert (gat.hidden, gat.heads, gat.layers) == (64, 8, 3)
    assert TrainConfig.from_dict(json.loads(json.dumps(gat.to_dict()))) == gat
    assert sage.resolved_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_models_consume_one_block_per_layer(placed: Path) -> None:
    p = open_placed(placed)
    sampler = NeighborSampler(p.array("indptr"), p.array("indices"), (6, 4, 3), seed=3)
    batch = sampler.sample(torch.arange(0, 2000, 10))
    with TieredFeatureStore(p) as store:
        x = store.get(batch.nodes).float()
    for model in ("sage", "gat"):
        net = build_model(TrainConfig(data="d", model=model, hidden=16, heads=2, fanouts=(6, 4, 3)), 32, CLASSES)
        assert net(x, batch.blocks).shape == (200, CLASSES)
    with pytest.raises(ValueError, match="blocks"):
        net(x, batch.blocks[1:])


def test_any_bipartite_pyg_conv_plugs_in(monkeypatch: pytest.MonkeyPatch, placed: Path) -> None:
    from torch_geometric.nn import GraphConv

    monkeypatch.setitem(LAYERS, "graphconv", lambda cfg, i, o, last: (GraphConv(i, o), o))
    p = open_placed(placed)
    batch = NeighborSampler(p.array("indptr"), p.array("indices"), (5, 5)).sample(torch.arange(50))
    net = build_model(TrainConfig(data="d", model="graphconv", hidden=8, fanouts=(5, 5)), 32, CLASSES)
    assert net(torch.randn(batch.nodes.numel(), 32), batch.blocks).shape == (50, CLASSES)


def test_prefetcher_raises_worker_errors_and_stops_early() -> None:
    def prepare(seeds: torch.Tensor) -> prefetch.Prepared:
        if int(seeds[0]) == 3:
            raise RuntimeError("boom")
        return prefetch.Prepared(None, seeds.float(), seeds)  # type: ignore[arg-type]

    pf = prefetch.Prefetcher(iter(torch.arange(10).split(1)), prepare, 2, torch.device("cpu"))
    got = []
    with pytest.raises(RuntimeError, match="boom"):
        for item in pf:
            got.append(int(item.y))
    assert got == [0, 1, 2]
    pf.close()
    endless = (torch.tensor([0]) for _ in iter(int, 1))
    pf = prefetch.Prefetcher(endless, prepare, 2, torch.device("cpu"))
    assert int(next(iter(pf)).y) == 0
    pf.close()  # returns although the producer is blocked on a full queue


def test_torchrun_command(plan_file: Path, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, plan_file, "--epochs", 2, "--metrics-json", "m.json", "--seed", 3)
    cmd = launch.build_torchrun_command(cfg)
    n = str(launch.default_nproc(plan_file))
    assert cmd[:6] == [sys.executable, "-m", "trainer.torchrun", "--nproc-per-node", n, "--standalone"]
    assert cmd[6:8] == ["-m", "trainer"]
    assert from_args(cmd[8:]) == cfg  # the ranks parse back what the launcher parsed, option for option
    assert cmd[8:] == ["--data", str(tmp_path), "--plan", str(plan_file), "--hidden", "256", "--epochs", "2"] + [
        "--seed",
        "3",
        "--metrics-json",
        "m.json",
    ]  # the options that differ from their defaults, in TrainConfig's order
    assert n == str(min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 2)  # the plan's 4 GPUs, as seen
    multi = launch.build_torchrun_command(
        _cfg("d", None, "--model", "gat", "--checkpoint-dir", "ck"),
        nproc=4,
        rdzv=launch.Rendezvous(nnodes="2", endpoint="host:29400", max_restarts=3),
    )
    assert multi[:2] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]  # a fresh store per attempt, on every node
    assert multi[5:15] == [
        "--nproc-per-node",
        "4",
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "host:29400",
        "--max-restarts",
        "3",
    ]
    assert from_args(multi[17:]).resume  # a restarted group continues
    assert shlex.split(launch.format_command(cmd)) == cmd


def test_plan_rank_gpu_helpers(placed: Path, plan_file: Path) -> None:
    assert hw.parse_bdf("0000:1b:00.0") == (0, 0x1B, 0) and hw.parse_bdf("3b:02.1") == (0, 0x3B, 2)
    assert hw.parse_bdf("gpu0") is None
    doc = read_plan(plan_file)
    p = open_placed(placed)
    assert p.num_nodes > 0
    # Host-memory tiers: one copy per socket, written by the socket's first local rank.
    ranks = [r.model_copy(update={"socket": s}) for r, s in zip(doc.ranks, ["cpu0", "cpu1", "cpu0", "cpu1"])]
    two = doc.model_copy(update={"ranks": ranks})
    assert [shm.socket_of(two, r) for r in range(5)] == ["cpu0", "cpu1", "cpu0", "cpu1", "node"]
    assert [shm.socket_writer(two, DistEnv(r, 4, r, True)) for r in range(4)] == [True, True, False, False]
    assert shm.socket_of(None, 0) == "node" and shm.socket_writer(None, DistEnv(1, 2, 1, True)) is False
    assert hw.pin_to_socket("cpu999") is None  # no such NUMA node: nothing done, no error


@pytest.fixture
def restored_affinity() -> Iterator[None]:
    """A CUDA run pins this process to its GPU's socket: the rest of the session gets its CPUs back."""
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


@pytest.mark.gpu
def test_single_gpu_run(placed: Path, plan_file: Path, tmp_path: Path, restored_affinity: None) -> None:
    metrics = tmp_path / "m.json"
    assert (
        run_main(
            [
                "--data",
                str(placed),
                "--plan",
                str(plan_file),
                *SMALL,
                "--epochs",
                "2",
                "--device",
                "cuda",
                "--metrics-json",
                str(metrics),
            ]
        )
        == 0
    )
    doc = read_json(metrics)
    assert doc["ranks"][0].startswith("cuda:")
    assert doc["sampling"]["where"] == "gpu"  # this graph's CSR fits the GPU many times over
    assert doc["test_acc"] > 4 * CHANCE
    mem = doc["memory"]  # the CSR alone is on the GPU: the peak holds at least it
    assert mem["gpu_peak_reserved_bytes"] >= mem["gpu_peak_allocated_bytes"] > 0


@pytest.mark.slow
def test_missing_shm_dir_falls_back_to_private_copies(placed: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.json"
    argv = ["--epochs", 1, "--metrics-json", metrics, *SMALL, *CPU, "--max-batches-per-epoch", 1]
    cmd = launch.build_torchrun_command(_cfg(placed, None, *argv, "--shm-dir", tmp_path / "nope"), nproc=2)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--shm-dir {tmp_path / 'nope'}: no such directory" in done.stderr
    assert all(line.endswith("a private copy") for line in read_json(metrics)["ranks"])


def test_cpu_tests_stay_gloo_where_cuda_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi-rank tests above pass CPU: on a GPU machine they still run gloo on CPU ranks,
    while the same arguments without it would become nccl."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert from_args(["--data", "d", *SMALL]).resolved_backend() == "nccl"
    cfg = from_args(["--data", "d", *SMALL, *CPU])
    assert cfg.resolved_device() == "cpu" and cfg.resolved_backend() == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_train(placed: Path, tmp_path: Path) -> None:
    """Two ranks on two GPUs with nccl (the gloo test above, on the GPU path)."""
    metrics = tmp_path / "metrics.json"
    argv = ["--epochs", 1, "--metrics-json", metrics, *SMALL, "--device", "cuda", "--max-batches-per-epoch", 2]
    cmd = launch.build_torchrun_command(_cfg(placed, None, *argv), nproc=2)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = read_json(metrics)
    assert doc["world_size"] == 2 and len(set(doc["ranks"])) == 2
    assert doc["rank_param_digests"][0] == doc["rank_param_digests"][1]


def test_feature_read_time_is_compared_only_on_the_plans_gpus(
    placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CPU run is not on the profile's machine: its data time is reported, not set against the
    prediction. The same record from ranks on the plan's GPUs is compared, with the ratio."""
    from rich.console import Console

    from trainer.metrics import Metrics

    out = tmp_path / "m.json"
    args = ["--data", str(placed), *SMALL, *CPU, "--epochs", "1", "--max-batches-per-epoch", "2"]
    assert run_main([*args, "--metrics-json", str(out)]) == 0
    doc = read_json(out)
    epochs = doc["epochs"]
    iterations = sum(e["iterations"] for e in epochs)
    assert doc["on_plan_gpus"] is False
    assert doc["measured_feature_read_s"] == pytest.approx(sum(e["feature_read_s"] for e in epochs) / iterations)
    assert epochs[0]["feature_read_s_per_iteration"] == pytest.approx(epochs[0]["feature_read_s"] / iterations)
    # the store's CPU on its thread: some, and no more than its wall time (a thread runs on one core)
    assert 0 < epochs[0]["feature_cpu_s_per_iteration"] <= epochs[0]["feature_read_s_per_iteration"] * 1.01 + 1e-3
    printed = " ".join(capsys.readouterr().out.split())  # the table wraps at the terminal's width
    assert "not compared: ranks are not on the plan's GPUs" in printed, printed

    console = Console(record=True, width=200)
    manifest = open_placed(placed).manifest
    metrics = Metrics(TrainConfig(data=str(placed)), manifest.prediction, epochs, enabled=True, console=console)
    metrics.print_config(["cuda:0 (plan gpu0 at 0000:3b:00.0)"], on_plan_gpus=True)
    final = metrics.finish(test_acc=0.5, rank_param_digests=["x"])
    assert final["on_plan_gpus"] is True
    ratio = final["measured_feature_read_s"] / manifest.prediction.iteration_s
    assert f"predicted ({ratio:.2f}×), on the plan's GPUs" in console.export_text()
