"""Several nodes: two torchrun agents on 127.0.0.1, each a "node" with its own placed dataset and
--shm-dir, train as one DDP job and end with the parameters of a one-node run of the same world
size; a node with other data is refused by name; the command line and the rank numbering."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from moment.cli import main
from moment.contracts.metrics import MetricsDoc
from moment.errors import MomentError
from placement.place import PlaceOptions, place
from placement.placed import open_placed
from placement.synth import synthesize
from trainer import checkpoint, launch
from trainer.config import TrainConfig
from trainer.dist import NODE_RANK, DistEnv, check_numbering
from trainer.nodes import NodeData, config_difference, shared_config, source_order

TRAINER = ["--fanouts", "10,5", "--batch-size", "512", "--hidden", "64", "--lr", "0.01", "--device", "cpu"]


def _synth(out: Path, seed: int) -> Path:
    synthesize(out, nodes=6_000, avg_degree=6, dim=16, dtype="float32", seed=seed, classes=4, train_fraction=0.35)
    return out


@pytest.fixture(scope="module")
def nodes(plan_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dataset placed three times (node 0's, node 1's, and one with larger caches: another
    relabelling), and a placement of another dataset."""
    root = tmp_path_factory.mktemp("nodes")
    _synth(root / "ds", 1)
    _synth(root / "other", 2)
    for name, ds, gpu, cpu in (("node0", "ds", "3%", "4%"), ("node1", "ds", "3%", "4%"), ("wide", "ds", "6%", "8%")):
        place(plan_file, root / ds, root / name, PlaceOptions(gpu_cache=gpu, cpu_cache=cpu))
    place(plan_file, root / "other", root / "other-node", PlaceOptions(gpu_cache="3%", cpu_cache="4%"))
    return root


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moment(*args: str) -> list[str]:
    return [sys.executable, "-m", "moment", *args]


def two_nodes(
    plan: Path, data: tuple[Path, Path], work: Path, epochs: int = 2, again: tuple[str, ...] = ()
) -> tuple[list[subprocess.CompletedProcess[str]], Path]:
    """`moment train` on two nodes of one CPU rank each (torchrun agents meeting on 127.0.0.1),
    each with its own placed dataset, --shm-dir and --checkpoint-dir; node 0 writes the metrics.
    ``again``: launcher options of a second run in ``work`` (``--resume``)."""
    endpoint, job = f"127.0.0.1:{_port()}", f"test-{work.name}-{len(again)}"
    procs = []
    for node in (1, 0):
        shm = work / f"shm{node}"
        shm.mkdir(parents=True, exist_ok=True)
        argv = ["train", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", job]
        argv += ["--nproc", "1", "--plan", str(plan), "--data", str(data[node]), "--epochs", str(epochs), *again]
        argv += ["--checkpoint-dir", str(work / f"ck{node}")]
        if node == 0:
            argv += ["--metrics-json", str(work / "metrics.json")]
        cmd = _moment(*argv, "--", *TRAINER, "--shm-dir", str(shm))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for p in reversed(procs):  # node 0, node 1
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done, work / "metrics.json"


@pytest.fixture(scope="module")
def one_node(plan_file: Path, nodes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The metrics of 1 node × 2 ranks, 2 epochs, on node 0's placement: what two nodes must match."""
    work = tmp_path_factory.mktemp("one")
    (work / "shm").mkdir()
    argv = ["train", "--nproc", "2", "--plan", str(plan_file), "--data", str(nodes / "node0"), "--epochs", "2"]
    argv += ["--metrics-json", str(work / "metrics.json")]
    run = subprocess.run(
        _moment(*argv, "--", *TRAINER, "--shm-dir", str(work / "shm")), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return MetricsDoc.read(work / "metrics.json").model_dump(mode="json")


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_ranks(plan_file: Path, nodes: Path, one_node: dict, tmp_path: Path) -> None:
    """2 nodes × 1 rank end with the parameters of 1 node × 2 ranks, bit for bit (tolerance 0:
    the same seeds per global rank, the same samples, gloo's sum of two gradients is the same
    sum in either order); node 0 alone writes the checkpoint; each node's --shm-dir is emptied."""
    (n0, n1), metrics = two_nodes(plan_file, (nodes / "node0", nodes / "node1"), tmp_path)
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    assert "MOMENT_NODE_RANK=1" in n1.stderr and "--rdzv-id" in n1.stderr  # the command each printed
    two = MetricsDoc.read(metrics).model_dump(mode="json")
    assert two["world_size"] == 2 and two["complete"]
    assert two["rank_param_digests"] == one_node["rank_param_digests"]
    assert len(set(two["rank_param_digests"])) == 1
    assert [e["seeds"] for e in two["epochs"]] == [e["seeds"] for e in one_node["epochs"]]
    assert [e["loss"] for e in two["epochs"]] == [e["loss"] for e in one_node["epochs"]]
    # Global rank 0 (node 0's local rank 0) wrote the checkpoint, in node 0's directory only.
    assert checkpoint.path_in(tmp_path / "ck0").exists() and not checkpoint.path_in(tmp_path / "ck1").exists()
    assert all(not any((tmp_path / f"shm{n}").iterdir()) for n in (0, 1))


@pytest.mark.slow
def test_two_nodes_resume_from_node_0s_disk(plan_file: Path, nodes: Path, one_node: dict, tmp_path: Path) -> None:
    """One epoch, then all nodes restarted with --resume: node 0's checkpoint (on its own disk:
    node 1's --checkpoint-dir is empty) is what every rank continues, and the run ends where an
    uninterrupted one ends."""
    (n0, n1), _ = two_nodes(plan_file, (nodes / "node0", nodes / "node1"), tmp_path, epochs=1)
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    (n0, n1), metrics = two_nodes(plan_file, (nodes / "node0", nodes / "node1"), tmp_path, again=("--resume",))
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    assert not checkpoint.path_in(tmp_path / "ck1").exists()
    two = MetricsDoc.read(metrics).model_dump(mode="json")
    assert [e["epoch"] for e in two["epochs"]] == [1, 2]  # the first from the checkpoint's history
    assert two["rank_param_digests"] == one_node["rank_param_digests"]


@pytest.mark.slow
def test_a_node_with_other_data_is_refused_by_name(plan_file: Path, nodes: Path, tmp_path: Path) -> None:
    """Node 1 placed another dataset: both nodes stop at start with one line naming node 1 and
    its --data (node 0's rank 0 and node 1's local rank 0 say it), exit 1, no traceback."""
    (n0, n1), metrics = two_nodes(plan_file, (nodes / "node0", nodes / "other-node"), tmp_path)
    assert n0.returncode == 1 and n1.returncode == 1
    for run in (n0, n1):
        lines = [line for line in run.stderr.splitlines() if not line.startswith("running:")]
        assert len(lines) == 1, run.stderr[-3000:]
        assert "node 1 (" in lines[0] and str(nodes / "other-node") in lines[0], lines
        assert "holds other data than node 0" in lines[0] and "Traceback" not in run.stderr
    assert not metrics.exists() and not checkpoint.path_in(tmp_path / "ck0").exists()


def test_node_data_is_the_data_not_the_placement(nodes: Path) -> None:
    """Two placements of one dataset agree whatever their caches (the splits are in the source's
    order), though larger caches relabel the vertices; another dataset differs, named."""
    a, b, wide, other = (NodeData.of(open_placed(nodes / n)) for n in ("node0", "node1", "wide", "other-node"))
    assert a == b
    assert wide.difference(a) is None and wide.relabel != a.relabel  # the "ids agree": not across layouts
    # In the source's order, position i of the train split is one vertex on both placements.
    placed_a, placed_wide = open_placed(nodes / "node0"), open_placed(nodes / "wide")
    source_a, source_wide = (
        np.asarray(p.array("new_to_old"))[source_order(p, p.array("train"))] for p in (placed_a, placed_wide)
    )
    assert np.array_equal(source_a, source_wide) and np.all(np.diff(source_a) > 0)
    why = other.difference(a)
    assert why is not None and ("num_edges" in why or "split" in why or "labels" in why)


def test_options_every_node_must_share() -> None:
    """Epochs, batch size, seed and whether checkpoints are written must agree; each node's own
    files, --shm-dir and readers need not."""
    base = TrainConfig(data="a", checkpoint_dir="/ck", fanouts=(10, 5), batch_size=512)
    mine = TrainConfig(data="b", checkpoint_dir="/other", shm_dir="/x", io="posix", fanouts=(10, 5), batch_size=512)
    assert config_difference(shared_config(mine), shared_config(base)) is None
    later = TrainConfig(data="a", checkpoint_dir="/ck", fanouts=(10, 5), batch_size=512, epochs=9)
    assert "epochs 9" in (config_difference(shared_config(later), shared_config(base)) or "")
    none = TrainConfig(data="a", fanouts=(10, 5), batch_size=512)
    assert "checkpoints False" in (config_difference(shared_config(none), shared_config(base)) or "")


def test_global_rank_follows_node_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's c10d rendezvous orders nodes by host and pid; with --node-rank the ranks number
    themselves node by node, so node 0 holds rank 0 (checkpoints, metrics)."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    for key, value in {**env, "GROUP_WORLD_SIZE": "2", NODE_RANK: "1"}.items():
        monkeypatch.setenv(key, value)
    got = DistEnv.from_environ()
    assert (got.rank, got.node_rank, got.nodes, got.launch_rank) == (3, 1, 2, 0)
    monkeypatch.delenv(NODE_RANK)  # a bare torchrun: its own numbering
    assert DistEnv.from_environ().rank == 0


def test_two_nodes_claiming_one_node_rank_are_refused() -> None:
    """Before any process group: two nodes both given --node-rank 0 would claim the same ranks."""
    store = dist.HashStore()
    a = DistEnv(0, 2, 0, True, node_rank=0, nodes=2)
    store.set(f"moment/numbering/{_attempt()}/1", json.dumps([0, 0, "hostB", 2]))
    with pytest.raises(MomentError, match="--node-rank 0 is given to two nodes"):
        check_numbering(store, a, 0, 2)


def _attempt() -> str:
    from trainer.dist import attempt

    return attempt()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--node-rank", "1"], "--node-rank needs --nnodes"),
        (["--rdzv-id", "j"], "--rdzv-id needs --nnodes"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "expected 0 to 1"),
        (["--nnodes", "1:3", "--node-rank", "0", "--rdzv-endpoint", "h:1"], "needs a fixed --nnodes"),
        (["--nnodes", "2"], "needs --rdzv-endpoint"),
        (["--nnodes", "two", "--rdzv-endpoint", "h:1"], "expected a number of nodes"),
    ],
)
def test_node_options_misused_are_usage_errors(extra: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--data", "nowhere", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_each_node_runs_torchrun_with_its_node_rank() -> None:
    """The node rank reaches the ranks through the environment (torchrun's c10d ignores
    --node-rank); restarts get a store per attempt as before."""
    cmd = launch.build_torchrun_command(
        None, "d", nproc=1, nnodes="2", rdzv_endpoint="h:29400", rdzv_id="job", node_rank=1, max_restarts=1
    )
    assert cmd[:3] == ["env", f"{launch.SHARE_STORE_OFF}=1", f"{NODE_RANK}=1"]
    assert cmd[cmd.index("--rdzv-id") + 1] == "job" and "--node-rank" not in cmd
