"""Several nodes: two torchrun agents on 127.0.0.1, each a "node" with its own placed dataset and
--shm-dir, train as one DDP job and end with the parameters of a one-node run of the same world
size; a node with other data is refused by name; the command line and the rank numbering. Then
`moment infer` across nodes: node 0's --out holds the bytes of one process, on both engines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moment import faults
from moment.cli import main
from moment.contracts.inference import InferenceManifest
from moment.contracts.metrics import MetricsDoc
from moment.errors import MomentError
from placement.place import PlaceOptions, place
from placement.placed import open_placed
from placement.synth import synthesize
from trainer import broadcast, checkpoint, launch, loop
from trainer.config import TrainConfig
from trainer.dist import NODE_RANK, DistEnv, all_done, check_numbering
from trainer.infer import InferOptions, infer, work_out
from trainer.infer import torchrun_command as infer_torchrun_command
from trainer.nodes import NodeData, config_difference, per_node, shared_config, straggler

TRAINER = ["--fanouts", "10,5", "--batch-size", "512", "--hidden", "64", "--lr", "0.01", "--device", "cpu"]


def _synth(out: Path, seed: int) -> Path:
    synthesize(out, nodes=6_000, avg_degree=6, dim=16, dtype="float32", seed=seed, classes=4, train_fraction=0.35)
    return out


@pytest.fixture(scope="module")
def nodes(plan_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dataset placed three times (node 0's, node 1's, and one with larger caches: another
    row map, the same vertex ids), and a placement of another dataset."""
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


def start_two_nodes(
    plan: Path, data: tuple[Path, Path], work: Path, epochs: int, again: tuple[str, ...], trainer: tuple[str, ...]
) -> list[subprocess.Popen[str]]:
    """`moment train` on two nodes of one CPU rank each (torchrun agents meeting on 127.0.0.1),
    each with its own placed dataset, --shm-dir and --checkpoint-dir; node 0 writes the metrics.
    ``again``: launcher options (``--resume``, ``--max-restarts 1``); ``trainer``: the ranks'.
    Node 1's launcher, then node 0's."""
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
        cmd = _moment(*argv, "--", *TRAINER, *trainer, "--shm-dir", str(shm))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 600) -> list[subprocess.CompletedProcess[str]]:
    """Node 0's and node 1's outcome (within ``timeout`` seconds of now, all together)."""
    done, deadline = [], time.monotonic() + timeout
    for p in reversed(procs):
        out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def two_nodes(
    plan: Path,
    data: tuple[Path, Path],
    work: Path,
    epochs: int = 2,
    again: tuple[str, ...] = (),
    trainer: tuple[str, ...] = (),
) -> tuple[list[subprocess.CompletedProcess[str]], Path]:
    """Both nodes to the end (:func:`start_two_nodes`); and node 0's metrics file."""
    return finish(start_two_nodes(plan, data, work, epochs, again, trainer)), work / "metrics.json"


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
    # Each node's part of every epoch, beside its own placement's prediction.
    assert [(n["node"], n["data"]) for n in two["nodes"]] == [(0, str(nodes / "node0")), (1, str(nodes / "node1"))]
    for e in two["epochs"]:
        assert [n["node"] for n in e["nodes"]] == [0, 1] and sum(n["seeds"] for n in e["nodes"]) == e["seeds"]
        assert all(abs(sum(n["read_share_per_tier"].values()) - 1) < 1e-9 for n in e["nodes"])
    assert "one_node" not in two and one_node.get("nodes") is None and one_node["epochs"][0].get("nodes") is None
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
    # Resumed once more, with nothing left to train: every node still meets the others (node 1
    # cannot see node 0's checkpoint), takes the checkpoint rank 0 reads, trains no epoch, and
    # stops (no node waits for the rendezvous); the parameters and epochs are the finished run's.
    started = time.monotonic()
    (n0, n1), metrics = two_nodes(plan_file, (nodes / "node0", nodes / "node1"), tmp_path, again=("--resume",))
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    assert time.monotonic() - started < 300
    assert "resuming after epoch 2 of 2: nothing left to train" in n0.stdout + n0.stderr
    again = MetricsDoc.read(metrics).model_dump(mode="json")
    assert [e["epoch"] for e in again["epochs"]] == [1, 2] and again["complete"]
    assert again["rank_param_digests"] == one_node["rank_param_digests"]


@pytest.mark.slow
def test_a_node_with_other_data_is_refused_by_name(plan_file: Path, nodes: Path, tmp_path: Path) -> None:
    """Node 1 placed another dataset: both nodes stop at start with one line naming node 1 and
    its --data (node 0's rank 0 and node 1's local rank 0 say it), exit 1, no traceback."""
    (n0, n1), metrics = two_nodes(plan_file, (nodes / "node0", nodes / "other-node"), tmp_path)
    assert n0.returncode == 1 and n1.returncode == 1
    for run in (n0, n1):
        lines = [line for line in run.stderr.splitlines() if not line.startswith("running:")]
        # A node's torchrun may still be watching its ranks when the other's, the store's host (on
        # one machine, whichever started first), exits: then one more line says so
        # (trainer/torchrun.py), never a traceback.
        if len(lines) == 2 and lines[1].startswith("torchrun: lost the rendezvous store at"):
            lines = lines[:1]
        assert len(lines) == 1, run.stderr[-3000:]
        assert "node 1 (" in lines[0] and str(nodes / "other-node") in lines[0], lines
        assert "holds other data than node 0" in lines[0] and "Traceback" not in run.stderr
    assert not metrics.exists() and not checkpoint.path_in(tmp_path / "ck0").exists()


def test_node_data_is_the_data_not_the_placement(nodes: Path) -> None:
    """Placements of one dataset agree whatever their caches: larger caches give another row map,
    but the vertex ids, splits and labels are the dataset's on every node; another dataset
    differs, named."""
    a, b, wide, other = (NodeData.of(open_placed(nodes / n)) for n in ("node0", "node1", "wide", "other-node"))
    assert a == b == wide
    placed_a, placed_wide = open_placed(nodes / "node0"), open_placed(nodes / "wide")
    assert not np.array_equal(placed_a.array("old_to_new"), placed_wide.array("old_to_new"))
    # position i of the train split is one vertex on both placements: the dataset's file
    assert np.array_equal(placed_a.array("train"), placed_wide.array("train"))
    assert placed_a.file("train").stat().st_ino == placed_wide.file("train").stat().st_ino
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
    store.set("moment/numbering/1", json.dumps([0, 0, "hostB", 2]))
    with pytest.raises(MomentError, match="--node-rank 0 is given to two nodes"):
        check_numbering(store, a, 0, 2)


def test_a_leaving_rank_waits_until_every_rank_is_done_with_the_group() -> None:
    """leave(): no rank closes its sockets while another may still be in its last collective; a
    peer that never comes costs the timeout, not a hang."""
    import threading
    from datetime import timedelta

    store = dist.HashStore()
    result: list[bool] = []
    first = threading.Thread(target=lambda: result.append(all_done(store, 0, 2, timedelta(seconds=20))))
    first.start()
    first.join(0.3)
    assert first.is_alive() and not result  # rank 1 has not marked itself done
    assert all_done(store, 1, 2, timedelta(seconds=20))
    first.join(5)
    assert result == [True]
    started = time.monotonic()
    assert not all_done(dist.HashStore(), 0, 2, timedelta(seconds=0.2))  # rank 1 gone
    assert time.monotonic() - started < 5


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
    rdzv = launch.Rendezvous(nnodes="2", endpoint="h:29400", id="job", max_restarts=1, node_rank=1)
    cmd = launch.build_torchrun_command(TrainConfig(data="d"), nproc=1, rdzv=rdzv)
    assert cmd[:3] == ["env", f"{launch.SHARE_STORE_OFF}=1", f"{NODE_RANK}=1"]
    assert cmd[cmd.index("--rdzv-id") + 1] == "job" and "--node-rank" not in cmd


def _descendants(pid: int) -> list[int]:
    kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return kids + [d for k in kids for d in _descendants(k)]


def _rank_of(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
    return env.get("LOCAL_RANK")


@pytest.mark.slow
def test_a_killed_node_rank_is_restarted_and_the_run_ends_as_if_never_killed(
    plan_file: Path, nodes: Path, tmp_path: Path
) -> None:
    """--max-restarts 1 on both nodes: node 1's rank is killed (SIGKILL) after the first
    checkpoint; node 0's rank loses its peer, both worker groups restart, resume from node 0's
    checkpoint (node 1's directory has none) and end with the parameters and losses of a
    two-node run never killed (every rank's RNG comes back: dropout draws differ per rank)."""
    data, epochs = (nodes / "node0", nodes / "node1"), 4
    trainer = ("--dropout", "0.3", "--deterministic", "--eval-every", "4")
    (s0, s1), straight = two_nodes(plan_file, data, tmp_path / "straight", epochs, trainer=trainer)
    assert s0.returncode == 0 and s1.returncode == 0, s0.stderr[-3000:] + s1.stderr[-3000:]
    work = tmp_path / "killed"
    procs = start_two_nodes(plan_file, data, work, epochs, ("--max-restarts", "1"), trainer)
    ckpt, deadline = checkpoint.path_in(work / "ck0"), time.monotonic() + 300
    while not ckpt.exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.02)
    victim = next(p for p in _descendants(procs[0].pid) if _rank_of(p) == "0")  # node 1's launcher came first
    done_at_kill = torch.load(ckpt, weights_only=True)["epoch"]
    os.kill(victim, signal.SIGKILL)
    n0, n1 = finish(procs)
    assert done_at_kill < epochs
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    assert "exitcode: -9" in n1.stderr  # node 1's torchrun saw the kill and restarted its group
    a, b = (MetricsDoc.read(p).model_dump(mode="json") for p in (straight, work / "metrics.json"))
    assert [e["epoch"] for e in b["epochs"]] == list(range(1, epochs + 1))
    assert [e["loss"] for e in b["epochs"]] == [e["loss"] for e in a["epochs"]]
    assert b["rank_param_digests"] == a["rank_param_digests"] and b["test_acc"] == a["test_acc"]
    assert not checkpoint.path_in(work / "ck1").exists()


def _stats(rows: dict[str, int]) -> dict:
    tiers = {t: {"rows": n, "bytes": n * 64, "seconds": 0.0} for t, n in rows.items()}
    return {
        "asked": sum(rows.values()),
        "seconds": 0.1,
        "tiers": tiers,
        "ssd_bins": {},
        "bin_rows": {"gpu0": rows["gpu"]},
    }


def test_each_nodes_part_of_an_epoch_and_its_straggler() -> None:
    """Ranks grouped by node: seeds summed, data wait averaged, read shares from the node's own
    stats; the node whose ranks waited for data far longer than the others' is named."""
    timing = [(0, "a", 10.0, 1000, 0.5), (0, "a", 10.0, 1000, 0.7), (1, "b", 10.0, 1000, 4.0), (1, "b", 9.0, 1000, 5.0)]
    stats = [_stats({"gpu": 30, "cpu": 50, "ssd": 20})] * 2 + [_stats({"gpu": 10, "cpu": 10, "ssd": 80})] * 2
    got = per_node(timing, stats, 10.0)
    a, b = got["nodes"]
    assert (a["node"], a["ranks"], a["seeds"], a["seeds_per_s"]) == (0, 2, 2000, 200.0)
    assert a["data_wait_s"] == pytest.approx(0.6) and b["data_wait_s"] == pytest.approx(4.5)
    assert a["read_share_per_tier"] == {"gpu": 0.3, "cpu": 0.5, "ssd": 0.2} and b["read_share_per_tier"]["ssd"] == 0.8
    assert got["straggler"] is not None and got["straggler"].startswith("node 1 (b)")
    # Waits alike, or a difference too small for the epoch: nobody named.
    even = [dict(a, data_wait_s=1.0), dict(b, data_wait_s=1.1)]
    assert straggler(even, 10.0) is None
    assert straggler([dict(a, data_wait_s=0.01), dict(b, data_wait_s=0.05)], 10.0) is None


@pytest.mark.parametrize("endpoint", [["--rdzv-endpoint", "10.0.0.1:29400"], ["--rdzv_endpoint=10.0.0.1:29400"]])
def test_a_lost_rendezvous_store_is_one_line(
    endpoint: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun raising RendezvousConnectionError (node 0, the store's host, exited while this
    node's torchrun still watched its ranks: the race the two-node refusal test met) is one line
    naming the store, exit 1, no traceback."""
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from trainer import torchrun

    def lost(args: list[str]) -> None:
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(run, "main", lost)
    monkeypatch.setenv("LOGLEVEL", "CRITICAL")  # what main would set: restored after the test
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    assert torchrun.main(["--nnodes", "2", *endpoint, "-m", "trainer"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "torchrun: lost the rendezvous store at 10.0.0.1:29400: the torchrun hosting it (the node at that "
        "address; on one machine, the first to start) has stopped (its log says why)"
    ]


# -- moment infer across nodes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def inferable(nodes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A SAGE checkpoint (the broadcast engine) and a GAT one (the gather engine), trained on node 0's placement."""
    root = tmp_path_factory.mktemp("infer-ck")
    for model in ("sage", "gat"):
        argv = ["--data", str(nodes / "node0"), "--model", model, *INFER_TRAIN, "--checkpoint-dir", str(root / model)]
        assert loop.main(argv) == 0
    return {"sage": root / "sage", "gat": root / "gat"}


INFER_TRAIN = ["--fanouts", "5,3", "--batch-size", "128", "--hidden", "16", "--heads", "2", "--epochs", "1"]
INFER_TRAIN += ["--max-batches-per-epoch", "2", "--device", "cpu"]
BLOCK = 300  # --batch-size of the inference runs: many chunks, partitions and exchange pieces


def start_infer_nodes(
    data: tuple[Path, Path],
    ckpt: Path,
    outs: tuple[Path, Path],
    extra: list[str],
    faults_at: dict[int, str] | None = None,
) -> list[subprocess.Popen[str]]:
    """`moment infer` on two nodes of one CPU rank each (torchrun agents meeting on 127.0.0.1),
    each with its own placed dataset and --out; ``faults_at``: node → a fault point it stops at.
    Node 1's launcher, then node 0's."""
    endpoint, job = f"127.0.0.1:{_port()}", f"infer-{outs[0].name}-{len(extra)}"
    procs = []
    for node in (1, 0):
        argv = ["infer", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", job]
        argv += ["--nproc", "1", "--data", str(data[node]), "--checkpoint", str(ckpt), "--out", str(outs[node])]
        env = {k: v for k, v in os.environ.items() if k != faults.ENV}
        if faults_at and node in faults_at:
            env[faults.ENV] = faults_at[node]
        cmd = _moment(*argv, "--device", "cpu", "--batch-size", str(BLOCK), "--layers", "all", *extra)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return procs


def _inferred(out: Path) -> dict[str, bytes]:
    m = InferenceManifest.read(out / "inference.json")
    return {k: np.load(out / e.path).tobytes() for k, e in m.arrays.items()}


def _memory() -> list[str]:
    """A --memory that cuts a rank's destinations into several broadcast partitions (a relay too)."""
    return ["--memory", str(broadcast.fixed_bytes(BLOCK, 16, 16) + 30_000)]


@pytest.mark.slow
@pytest.mark.parametrize("model, shared", [("sage", True), ("gat", False)])
def test_two_nodes_infer_what_one_process_infers(
    nodes: Path, inferable: dict[str, Path], tmp_path: Path, model: str, shared: bool
) -> None:
    """2 nodes × 1 rank (each its own placement) write node 0's --out with the bytes of one process
    running 2 ranks, on the broadcast engine (SAGE, partitions and relays) and the gather engine
    (GAT); node 1 keeps nothing, whether its --out is node 0's path (shared storage) or its own."""
    extra = _memory() if model == "sage" else []
    outs = (tmp_path / "out", tmp_path / "out") if shared else (tmp_path / "out", tmp_path / "n1" / "out")
    n0, n1 = finish(start_infer_nodes((nodes / "node0", nodes / "node1"), inferable[model], outs, extra))
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    assert "MOMENT_NODE_RANK=1" in n1.stderr and "node 1: its vertex ranges done" in n1.stderr
    written = (tmp_path / "out" / "inference.json").stat().st_mtime_ns
    # The same commands again: only node 0 sees that its --out is complete; its ranks still meet
    # node 1's to say so, and both nodes stop at once (torchrun's rendezvous would hold node 1 for
    # 600 s), exit 0, each saying there is nothing to do. Nothing rewritten, no scratch left.
    started = time.monotonic()
    a0, a1 = finish(start_infer_nodes((nodes / "node0", nodes / "node1"), inferable[model], outs, extra), 300)
    assert a0.returncode == 0 and a1.returncode == 0, a0.stderr[-3000:] + a1.stderr[-3000:]
    assert time.monotonic() - started < 300
    assert f"{tmp_path / 'out'} already holds this inference" in a0.stderr and "nothing to do" in a0.stderr
    said = [line for line in a1.stderr.splitlines() if not line.startswith("running:")]
    assert said == [
        f"node 1: node 0 already holds this inference in {socket.gethostname()}:{tmp_path / 'out'} (same "
        "checkpoint, data and options): nothing to do"
    ], a1.stderr
    assert (tmp_path / "out" / "inference.json").stat().st_mtime_ns == written
    memory = 2 * int(extra[1]) if extra else None  # --memory is a node's: one node of 2 ranks, twice one rank's
    one = infer(
        InferOptions(
            data=nodes / "node0", checkpoint=inferable[model], out=tmp_path / "one", nproc=2, layers="all",
            batch_size=BLOCK, device="cpu", memory=memory,
        )
    )  # fmt: skip
    a, b = _inferred(tmp_path / "out"), _inferred(tmp_path / "one")
    assert set(a) == set(b) == {"embeddings", "predictions", "logits"} and all(a[k] == b[k] for k in a)
    m = InferenceManifest.read(tmp_path / "out" / "inference.json")
    assert [t.vertices for t in m.throughput] == [6_000] * 3 and m.accuracy == one.accuracy
    assert (m.nodes, m.nproc, m.world_size) == (2, 1, 2) and (one.nodes, one.nproc, one.world_size) == (1, 2, 2)
    if model == "sage":
        assert [t.engine for t in m.throughput[:2]] == ["broadcast"] * 2 and m.throughput[0].partitions > 2
        assert [t.partitions for t in m.throughput[:2]] == [t.partitions for t in one.throughput[:2]]
    assert sorted(p.name for p in outs[1].parent.iterdir()) == (["one", "out"] if shared else [])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sage", "gat"])
def test_a_node_placed_otherwise_infers_what_one_process_infers(
    nodes: Path, inferable: dict[str, Path], tmp_path: Path, model: str
) -> None:
    """Node 1's placement has larger caches: the same data and vertex ids, another row map (its
    layer 1 reads its own tiers through it). Node 0's --out holds the bytes of one process on
    node 0's placement, on the broadcast engine (SAGE, partitions and relays; node 1 first
    stopped in layer 2 and the job resumed) and the gather engine (GAT)."""
    rows = [np.asarray(open_placed(nodes / k).array("old_to_new")) for k in ("node0", "wide")]
    assert not np.array_equal(*rows)
    data, ck = (nodes / "node0", nodes / "wide"), inferable[model]
    extra = _memory() if model == "sage" else []
    outs = (tmp_path / "o0", tmp_path / "o1")
    if model == "sage":
        n0, n1 = finish(start_infer_nodes(data, ck, outs, extra, {1: "infer:layer2:chunk0"}))
        assert n1.returncode != 0 and n0.returncode != 0, n0.stderr[-3000:] + n1.stderr[-3000:]
        assert "Traceback" not in n0.stderr + n1.stderr, n0.stderr + n1.stderr
        assert (
            json.loads((tmp_path / "o1.node1.partial" / "data" / "work" / "progress-1.json").read_text())["stage"] == 1
        )
    n0, n1 = finish(start_infer_nodes(data, ck, outs, extra))
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    if model == "sage":
        assert "resuming the interrupted" in n0.stderr and "resuming the interrupted" in n1.stderr
    memory = 2 * int(extra[1]) if extra else None
    one = infer(
        InferOptions(
            data=nodes / "node0", checkpoint=ck, out=tmp_path / "one", nproc=2, layers="all", batch_size=BLOCK,
            device="cpu", memory=memory,
        )
    )  # fmt: skip
    a, b = _inferred(outs[0]), _inferred(tmp_path / "one")
    assert set(a) == set(b) == {"embeddings", "predictions", "logits"} and all(a[k] == b[k] for k in a)
    assert InferenceManifest.read(outs[0] / "inference.json").accuracy == one.accuracy
    assert not (tmp_path / "o1.node1.partial").exists() and not outs[1].exists()


@pytest.mark.slow
def test_a_killed_node_resumes_and_the_output_is_unchanged(
    nodes: Path, inferable: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 stops in layer 2 (a fault point: rows written, not recorded); node 0 loses its peer.
    The same commands again: both continue from their records (layer 1 is not computed again) and
    node 0's --out holds the bytes of a run never killed."""
    data, ck, extra = (nodes / "node0", nodes / "node1"), inferable["sage"], _memory()
    straight = (tmp_path / "s0", tmp_path / "s1")
    n0, n1 = finish(start_infer_nodes(data, ck, straight, extra))
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    outs = (tmp_path / "k0", tmp_path / "k1")
    n0, n1 = finish(start_infer_nodes(data, ck, outs, extra, {1: "infer:layer2:chunk0"}))
    assert n1.returncode != 0 and n0.returncode != 0 and "Traceback" not in n0.stderr + n1.stderr, n0.stderr + n1.stderr
    work1 = tmp_path / "k1.node1.partial" / "data" / "work"
    assert json.loads((work1 / "progress-1.json").read_text())["stage"] == 1  # layer 1 recorded
    n0, n1 = finish(start_infer_nodes(data, ck, outs, extra))
    assert n0.returncode == 0 and n1.returncode == 0, n0.stderr[-3000:] + n1.stderr[-3000:]
    assert "resuming the interrupted" in n0.stderr and "resuming the interrupted" in n1.stderr
    assert _inferred(outs[0]) == _inferred(straight[0])
    assert not (tmp_path / "k1.node1.partial").exists() and not outs[1].exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--node-rank", "1"], "--node-rank needs --nnodes"),
        (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint needs --nnodes"),
        (["--nnodes", "2", "--node-rank", "1"], "needs --rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "--nnodes 2 needs --node-rank"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "expected 0 to 1"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "--nnodes: expected an integer"),
    ],
)
def test_infer_node_options_misused_are_usage_errors(
    nodes: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    argv = ["infer", "--data", str(nodes / "node0"), "--checkpoint", "nowhere", "--out", str(tmp_path / "o")]
    try:
        code = main([*argv, "--device", "cpu", *extra])
    except SystemExit as exc:  # argparse's own refusal (a type), one line too
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


def test_each_node_runs_the_infer_ranks_with_its_node_rank(tmp_path: Path) -> None:
    """Several nodes: torchrun meets the others (no --standalone) with this node's rank in the
    environment; the ranks get none of the node options (they read their place from torchrun's)."""
    opts = InferOptions(
        data=tmp_path, checkpoint=tmp_path, out=tmp_path / "o", nnodes=2, node_rank=1, rdzv_endpoint="h:29400",
        rdzv_id="job",
    )  # fmt: skip
    cmd = infer_torchrun_command(opts, tmp_path / "work")
    assert cmd[:2] == ["env", f"{NODE_RANK}=1"] and "--standalone" not in cmd
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--rdzv-endpoint") + 1] == "h:29400"
    ranks = cmd[cmd.index("trainer.infer") + 1 :]
    assert not any(a.startswith(("--nnodes", "--node-rank", "--rdzv")) for a in ranks)
    assert work_out(opts) == tmp_path / "o.node1" and work_out(InferOptions(tmp_path, tmp_path, tmp_path / "o")) == (
        tmp_path / "o"
    )
    one = infer_torchrun_command(InferOptions(tmp_path, tmp_path, tmp_path / "o", nproc=2), tmp_path)
    assert "--standalone" in one and one[0] != "env"


def test_a_node_placed_otherwise_passes_the_checks_and_other_data_is_refused(
    nodes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 on the larger caches' placement (the same data and ids, another row map) trains and
    infers with nothing to note; a node with other data, or running another checkpoint, is
    refused, by name."""
    from trainer import nodes as node_check

    node0, wide = open_placed(nodes / "node0"), open_placed(nodes / "wide")
    shared = {"checkpoint": "a", "layers": "all"}

    def node0_runs(options: dict[str, object] | None) -> None:
        """all_gather as rank 1 of two sees it: node 0's entry (``options``, else this node's), then its own."""

        def gather(obj: tuple[dict[str, object], NodeData, dict[str, object]]) -> list[object]:
            first = ({"node": 0, "host": "h0", "data": str(node0.root)}, NodeData.of(node0), options or obj[2])
            return [first, obj]

        monkeypatch.setattr(node_check, "all_gather", gather)

    env = DistEnv(1, 2, 0, True, node_rank=1, nodes=2)
    node0_runs(None)
    assert node_check.check_same_data(env, wide, TrainConfig(data="d")).predictions is not None  # no refusal
    assert node_check.check_same_inference(env, wide, shared) == node_check.SameInference()
    assert node_check.check_same_inference(env, node0, shared) == node_check.SameInference()
    with pytest.raises(MomentError, match=r"node 1 \(.*other-node\) holds other data than node 0: "):
        node_check.check_same_inference(env, open_placed(nodes / "other-node"), shared)
    node0_runs(shared)
    with pytest.raises(MomentError, match="runs other options than node 0: checkpoint 'b', node 0 has 'a'"):
        node_check.check_same_inference(env, node0, {**shared, "checkpoint": "b"})


def test_node_0s_finished_output_reaches_every_node(nodes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 alone sees that its --out is complete; the start-up check's collective carries its
    word to node 1 (as HOST:OUT), which has work only when node 0 says nothing; a lone node keeps
    its own word."""
    from trainer import nodes as node_check

    node0 = open_placed(nodes / "node0")
    shared = {"checkpoint": "a", "layers": "all"}
    sent: list[dict[str, object]] = []

    def node0_says(finished: str | None) -> None:
        def gather(obj: tuple[dict[str, object], NodeData, dict[str, object]]) -> list[object]:
            sent.append(obj[0])
            first = {"node": 0, "host": "h0", "data": str(node0.root), "finished": finished}
            return [(first, NodeData.of(node0), shared), obj]

        monkeypatch.setattr(node_check, "all_gather", gather)

    env = DistEnv(1, 2, 0, True, node_rank=1, nodes=2)
    node0_says("/data/emb")
    assert node_check.check_same_inference(env, node0, shared).finished == "h0:/data/emb"
    assert sent[-1]["finished"] is None  # node 1 has no word of its own
    node0_says(None)
    assert node_check.check_same_inference(env, node0, shared).finished is None
    lone = DistEnv(0, 1, 0, False)
    assert node_check.check_same_inference(lone, node0, shared, "/o").finished == "/o"


def test_node_0_with_a_finished_output_still_meets_the_others(tmp_path: Path) -> None:
    """Node 0's ranks get --finished OUT (absolute: node 1 names it) instead of a work directory:
    the same rendezvous, nothing to compute."""
    opts = InferOptions(
        data=tmp_path, checkpoint=tmp_path, out=Path("rel/out"), nnodes=2, node_rank=0, rdzv_endpoint="h:29400",
        rdzv_id="job",
    )  # fmt: skip
    cmd = infer_torchrun_command(opts, None)
    assert "--work" not in cmd and cmd[cmd.index("--finished") + 1] == str(Path("rel/out").absolute())
    assert cmd[cmd.index("--rdzv-id") + 1] == "job" and cmd[:2] == ["env", f"{NODE_RANK}=0"]


def test_a_node_past_0_makes_its_arrays_only_once_there_is_work(
    nodes: Path, inferable: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1's launcher prepares its work directory without the layers' arrays (node 0 may
    already hold the output: then it has nothing to compute); its local rank 0 makes them after
    the start-up check, once; a resumed job keeps what it wrote, one begun by an older launcher
    (which made them itself) too."""
    from trainer.infer import prepare
    from trainer.infer_nodes import make_arrays

    opts = InferOptions(
        data=nodes / "node1", checkpoint=inferable["gat"], out=tmp_path / "o", nnodes=2, node_rank=1,
        rdzv_endpoint="h:29400", rdzv_id="job", device="cpu",
    )  # fmt: skip
    p = prepare(opts)
    work = p.stage.data / "work"
    assert work.is_dir() and not list(work.glob("h*.npy"))
    for env in (DistEnv(2, 4, 1, True, node_rank=1, nodes=2), DistEnv(0, 4, 0, True, node_rank=0, nodes=2)):
        make_arrays(env, p.layout, p.stage.data)  # not node 1's local rank 0: nothing
        assert not list(work.glob("h*.npy"))
    node1 = DistEnv(2, 4, 0, True, node_rank=1, nodes=2)
    make_arrays(node1, p.layout, p.stage.data)
    made = sorted(work.glob("h*.npy"))
    assert [f.name for f in made] == [f"h{k}.npy" for k in range(1, p.layout.depth + 1)]
    rows = p.layout.open(p.stage.data, p.layout.work(1)[0])
    rows[0] = 1.0
    rows.flush()
    make_arrays(node1, p.layout, p.stage.data)  # again (a resumed job): kept
    assert (p.layout.open(p.stage.data, p.layout.work(1)[0])[0] == 1.0).all()
    (work / "arrays-made").unlink()  # a job begun before the ranks made the arrays, with rows recorded
    (work / "progress-2.json").write_text(json.dumps({"stage": 1, "chunks": 0, "timing": {}}))
    make_arrays(node1, p.layout, p.stage.data)
    assert (p.layout.open(p.stage.data, p.layout.work(1)[0])[0] == 1.0).all()
    p.stage.unlock()


def test_inference_json_from_before_nodes_reads_as_one_node(
    nodes: Path, inferable: dict[str, Path], tmp_path: Path
) -> None:
    """inference.json records the nodes (nproc: ranks per node); a file written before it did
    reads as one node."""
    out = tmp_path / "out"
    m = infer(InferOptions(data=nodes / "node0", checkpoint=inferable["gat"], out=out, device="cpu"))
    assert (m.nodes, m.world_size) == (1, 1)
    doc = json.loads((out / "inference.json").read_text())
    assert doc["nodes"] == 1
    del doc["nodes"]
    old = InferenceManifest.parse(doc, "old.json")
    assert (old.nodes, old.nproc, old.world_size) == (1, 1, 1)
    assert InferenceManifest.parse({**doc, "nodes": 3, "nproc": 2}, "n.json").world_size == 6
