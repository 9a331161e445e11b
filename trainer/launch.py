"""Launching training: the torchrun command ``moment train`` runs (or prints, with --dry-run).

One process per GPU of the plan (``plan.json`` "ranks"); each process finds its GPU and socket
from the plan itself (see ``trainer.dist``). ``check_inputs`` opens the plan and the placed
dataset first, so a bad input is one line from the CLI rather than one error per rank plus
torchrun's own report.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from moment.contracts.plan import read_plan
from moment.errors import UsageError
from moment.procs import supervise
from placement.placed import open_placed
from trainer.config import TrainConfig, from_args
from trainer.dist import NODE_RANK
from trainer.models import LAYERS

CPU_PROCESSES = 2  # processes on a machine without CUDA (gloo): enough to exercise DDP


def default_nproc(plan_path: str | Path | None) -> int:
    """GPUs the plan assigns ranks to (capped by the GPUs visible); 2 processes without CUDA."""
    if not torch.cuda.is_available():
        return CPU_PROCESSES
    visible = torch.cuda.device_count()
    if plan_path is None:
        return visible
    return min(len(read_plan(plan_path).ranks), visible) or visible


def check_inputs(plan_path: str | Path | None, placed_dir: str | Path) -> None:
    """Raise the MomentError a rank would hit on a missing or damaged plan or placed dataset."""
    if plan_path is not None:
        read_plan(plan_path)
    open_placed(placed_dir)


SHARE_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
CHECKPOINT_LOCKED = "MOMENT_CHECKPOINT_LOCKED"  # the launcher holds the checkpoint directory's lock
TORCHRUN = "trainer.torchrun"  # torchrun whose stop and failures are one line each (trainer/torchrun.py)


def trainer_argv(
    plan_path: str | Path | None,
    placed_dir: str | Path,
    model: str = "sage",
    epochs: int | None = None,
    metrics_json: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    extra: Sequence[str] = (),
    resume: bool = False,
    overwrite: bool = False,
) -> list[str]:
    """The trainer's own command line (what follows ``-m trainer``); ``extra`` goes last, verbatim."""
    argv = ["--data", str(placed_dir), "--model", model]
    if plan_path is not None:
        argv += ["--plan", str(plan_path)]
    if epochs is not None:
        argv += ["--epochs", str(int(epochs))]
    if metrics_json is not None:
        argv += ["--metrics-json", str(metrics_json)]
    if checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(checkpoint_dir)]
        if resume and "--resume" not in extra:
            argv.append("--resume")
        if overwrite and "--overwrite" not in extra:
            argv.append("--overwrite")
    return argv + list(extra)


def check_command(argv: Sequence[str]) -> TrainConfig:
    """The trainer's config from its command line, parsed as every rank will parse it; a bad
    argument is a UsageError here (one line, exit 2) instead of a usage message per rank."""
    return from_args(list(argv), raising=True)


def build_torchrun_command(
    plan_path: str | Path | None,
    placed_dir: str | Path,
    nproc: int | None = None,
    model: str = "sage",
    epochs: int | None = None,
    metrics_json: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    extra: Sequence[str] = (),
    nnodes: str | int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    python: str = sys.executable,
    node_rank: int | None = None,
) -> list[str]:
    """``python -m trainer.torchrun ... -m trainer ...`` as an argument list (no shell).

    Single node (no ``nnodes``/``rdzv_endpoint``): ``--standalone`` picks a free port. Several
    nodes with ``max_restarts``: run under ``env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; with
    ``node_rank`` under ``env MOMENT_NODE_RANK=R`` (torchrun's c10d rendezvous ignores
    ``--node-rank``; the ranks number themselves from it, :mod:`trainer.dist`). With
    ``max_restarts`` and a ``checkpoint_dir`` the trainer gets ``--resume``, so a restarted
    worker group continues from the last epoch instead of starting over (with ``overwrite`` the
    caller removes the old checkpoint first: :func:`trainer.preflight.start_over`). ``extra`` goes
    to the trainer verbatim (``--fanouts 15,10``, ``--batch-size 1024``, ...).
    """
    if model not in LAYERS:
        raise UsageError(f"--model {model!r}: expected one of {', '.join(LAYERS)}")
    n = default_nproc(plan_path) if nproc is None else int(nproc)
    if n <= 0:
        raise UsageError(f"--nproc {nproc}: expected a positive number of processes")
    cmd = [python, "-m", TORCHRUN, "--nproc-per-node", str(n)]
    if nnodes is None and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        env = [f"{NODE_RANK}={int(node_rank)}"] if node_rank is not None else []
        if max_restarts:
            # A store of its own for each attempt: torchrun would keep its agent's store, whose
            # keys a restarted group cannot tell from the killed group's across nodes (see
            # trainer.dist.attempt_prefix).
            env.insert(0, f"{SHARE_STORE_OFF}=1")
        if env:
            cmd = ["env", *env, *cmd]
        cmd += ["--nnodes", str(nnodes or 1)]
        cmd += ["--rdzv-backend", rdzv_backend or "c10d"]
        if rdzv_endpoint is not None:
            cmd += ["--rdzv-endpoint", rdzv_endpoint]
        if rdzv_id is not None:
            cmd += ["--rdzv-id", rdzv_id]
    if max_restarts is not None:
        cmd += ["--max-restarts", str(int(max_restarts))]
    restarts = bool(max_restarts and checkpoint_dir is not None)
    argv = trainer_argv(
        plan_path,
        placed_dir,
        model,
        epochs,
        metrics_json,
        checkpoint_dir,
        extra,
        resume=resume or restarts,
        overwrite=overwrite and not (resume or restarts),
    )
    return [*cmd, "-m", "trainer", *argv]


def format_command(cmd: Sequence[str]) -> str:
    """The command as one shell-quoted line (what --dry-run prints)."""
    return shlex.join(cmd)


def run(cmd: Sequence[str], checkpoint_locked: bool = False) -> int:
    """Run the command (no shell) with this terminal as a supervised job (:func:`moment.procs.supervise`:
    signals forwarded, no process of it outliving this one); its exit status, or
    :class:`moment.errors.Interrupted` after SIGINT / SIGTERM / SIGHUP. ``checkpoint_locked``: this
    process holds the checkpoint directory's lock for the job (else rank 0 takes it)."""
    return supervise(cmd, env={CHECKPOINT_LOCKED: str(os.getpid())} if checkpoint_locked else None)
