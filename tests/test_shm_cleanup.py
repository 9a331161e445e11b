"""Node-shared host-memory files (``--shm-dir``) do not outlive an interrupted job: a rank killed
between the writer's publish and the second barrier left ``moment-host-*`` in /dev/shm (found
after a CI run), the socket's whole host cache held in memory until someone deleted it. Its
launcher removes its own job's files once the job has ended; a writer that unwinds removes the
file it made; nobody removes another job's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moment import faults, procs
from moment.errors import Interrupted
from trainer import launch, shm
from trainer.config import from_args

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--batch-size", "64", "--hidden", "16", "--max-batches-per-epoch", "2", "--device", "cpu"]
KEY = "0123456789abcdef"


def _env(**more: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **more}
    env.pop(procs.JOB_ENV, None)
    if faults.ENV not in more:
        env.pop(faults.ENV, None)
    return env


def _others(shm_dir: Path) -> set[str]:
    """Files of other jobs in ``shm_dir``: without a token (a bare torchrun's), another launcher's
    (and its temporary), a file of this test's name but no job's pattern."""
    names = {
        f"moment-host-{KEY}",
        f"moment-host-{KEY}-{'f' * 16}",
        f".moment-csr-{KEY}-{'e' * 16}.x1y2.tmp",
        "moment-notes",
    }
    for name in names:
        (shm_dir / name).write_bytes(b"x" * 64)
    return names


def _train(placed: Path, plan: Path, shm_dir: Path, *more: str) -> list[str]:
    return ["train", "--plan", str(plan), "--data", str(placed), "--nproc", "2", "--shm-dir", str(shm_dir)] + [
        *more,
        "--",
        *TINY,
    ]


def test_the_name_carries_the_job_token_under_a_launcher(small_placed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from placement.placed import open_placed

    placed = open_placed(small_placed)
    monkeypatch.delenv(procs.JOB_ENV, raising=False)
    bare = shm.shm_path("/x", placed, "node")
    assert bare.name.startswith("moment-host-") and len(bare.name) == len("moment-host-") + 16
    monkeypatch.setenv(procs.JOB_ENV, f"12:345:{'a' * 16}")
    assert shm.shm_path("/x", placed, "node", "csr").name.endswith(f"-{'a' * 16}-0")
    assert shm.shm_path("/x", placed, "node").name == f"{bare.name}-{'a' * 16}-0"
    monkeypatch.setenv(procs.JOB_ENV, "12:345:not-a-token")  # not one the launcher made: no token
    assert shm.shm_path("/x", placed, "node") == bare


def test_remove_job_files_removes_only_the_jobs_own(tmp_path: Path) -> None:
    token = "0a" * 8
    others = _others(tmp_path)
    ours = {f"moment-host-{KEY}-{token}-0", f"moment-csr-{KEY}-{token}-0", f".moment-host-{KEY}-{token}-0.k3j_x.tmp"}
    later = {f"moment-host-{'1' * 16}-{token}-2", f".moment-csr-{KEY}-{token}-1.k3j_x.tmp"}
    for name in ours | later:
        (tmp_path / name).write_bytes(b"y")
    (tmp_path / f"moment-host-{'1' * 16}-{token}-0.d").mkdir()  # not a file the job makes
    assert {p.name for p in shm.remove_job_files(tmp_path, token, before=1)} == ours  # a restart's sweep
    assert {p.name for p in tmp_path.iterdir()} == others | later | {f"moment-host-{'1' * 16}-{token}-0.d"}
    assert {p.name for p in shm.remove_job_files(tmp_path, token)} == later  # the launcher's, at the end
    assert {p.name for p in tmp_path.iterdir()} == others | {f"moment-host-{'1' * 16}-{token}-0.d"}
    assert shm.remove_job_files(tmp_path, "") == [] and shm.remove_job_files(tmp_path, ".*") == []
    assert shm.remove_job_files(tmp_path / "gone", token) == []


def test_a_writer_killed_before_all_mapped_leaves_no_file_of_its_job(
    small_placed: Path, plan_file: Path, tmp_path: Path
) -> None:
    """``moment train``'s writer killed outright (no ``finally``: what kill -9 leaves) once it has
    published the socket's file, before the others mapped it: the launcher removes the file once
    torchrun has ended (a failure: exit 77); the files of other jobs in the same --shm-dir stay."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    others = _others(shm_dir)
    done = subprocess.run(
        [sys.executable, "-m", "moment", *_train(small_placed, plan_file, shm_dir, "--epochs", "1")],
        env=_env(**{faults.ENV: "shm:host:published"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == faults.FAULT_EXIT, done.stderr[-3000:]
    assert {p.name for p in shm_dir.iterdir()} == others


def test_a_writer_whose_peer_died_removes_its_file_without_a_launcher(
    small_placed: Path, plan_file: Path, tmp_path: Path
) -> None:
    """A bare torchrun (no launcher, no token): the reader dies after mapping; the writer, at the
    second barrier, unwinds (its peer gone, or torchrun's SIGTERM) and removes the file it made."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    others = _others(shm_dir)
    cfg = from_args(["--data", str(small_placed), "--plan", str(plan_file), *TINY, "--shm-dir", str(shm_dir)])
    cmd = launch.build_torchrun_command(cfg, nproc=2)
    done = subprocess.run(
        cmd, env=_env(**{faults.ENV: "shm:host:mapped:reader"}), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == faults.FAULT_EXIT, done.stderr[-3000:]
    assert {p.name for p in shm_dir.iterdir()} == others


def test_a_signalled_launcher_removes_what_its_killed_ranks_left(tmp_path: Path) -> None:
    """The launcher's signal path: a "rank" publishes its job's file, signals the launcher
    (SIGTERM, as a supervisor would), and dies of the forwarded SIGTERM without unwinding (no
    handler: what a rank killed outright leaves). ``Interrupted``, and the file is gone; the
    other jobs' files stay."""
    others = _others(tmp_path)
    rank = (
        "import os, signal, sys, time; from moment.procs import job_token; "
        f"open(os.path.join(sys.argv[1], 'moment-host-{KEY}-' + job_token() + '-0'), 'wb').write(b'z' * 64); "
        "os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)"
    )
    with pytest.raises(Interrupted) as info:
        launch.run([sys.executable, "-c", rank, str(tmp_path)], shm_dir=str(tmp_path))
    assert info.value.signum == signal.SIGTERM
    assert {p.name for p in tmp_path.iterdir()} == others


def test_a_restarted_writer_removes_its_jobs_files_of_earlier_attempts(
    small_placed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's second attempt (restart count 1) of a job whose first attempt's writer was killed
    after publishing: the new writer removes that file before writing its own, keeps another
    job's, and unlinks its own once all have mapped it (a group of one here)."""
    import torch.distributed as dist

    from placement.placed import open_placed
    from trainer.dist import DistEnv

    token = "0b" * 8
    monkeypatch.setenv(procs.JOB_ENV, f"12:345:{token}")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    others = _others(shm_dir)
    stale = shm_dir / f"moment-host-{KEY}-{token}-0"
    stale.write_bytes(b"s" * 64)
    seen: list[set[str]] = []

    def open_store(path: Path | None) -> str:
        assert path is not None and path.name.endswith(f"-{token}-1")
        seen.append({p.name for p in shm_dir.iterdir()})
        path.write_bytes(b"n")
        return "store"

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = shm.per_socket(open_store, str(shm_dir), open_placed(small_placed), None, DistEnv(0, 1, 0, True))
    finally:
        dist.destroy_process_group()
    assert got == "store" and seen == [others]
    assert {p.name for p in shm_dir.iterdir()} == others
