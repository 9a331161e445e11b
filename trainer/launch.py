"""Launching training: the torchrun command ``moment train`` runs (or prints, with --dry-run).

One process per GPU of the plan (``plan.json`` "ranks"); each process finds its GPU and socket
from the plan itself (see ``trainer.dist``). ``check_inputs`` opens the plan and the placed
dataset first, so a bad input is one line from the CLI rather than one error per rank plus
torchrun's own report.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moment.contracts.plan import read_plan
from moment.errors import UsageError
from moment.options import to_argv
from moment.procs import supervise
from placement.placed import open_placed
from trainer.config import TrainConfig, from_args
from trainer.dist import NODE_RANK
from trainer.shm import remove_job_files

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


def check_command(argv: Sequence[str]) -> TrainConfig:
    """The trainer's config from its command line, parsed as every rank will parse it; a bad
    argument is a UsageError here (one line, exit 2) instead of a usage message per rank."""
    return from_args(list(argv), raising=True)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """How torchrun's agents meet and restart: one node (``--standalone``: a free port) unless
    ``nnodes`` or ``endpoint`` say otherwise."""

    nnodes: str | int | None = None
    backend: str | None = None  # default c10d
    endpoint: str | None = None  # HOST:PORT
    id: str | None = None
    max_restarts: int | None = None  # restarts of a failed worker group
    node_rank: int | None = None  # this node's --node-rank (several nodes)


def torchrun_command(
    module: str, argv: Sequence[str], nproc: int, rdzv: Rendezvous = Rendezvous(), python: str = sys.executable
) -> list[str]:
    """``python -m trainer.torchrun ... -m MODULE ARGV`` as an argument list (no shell): the one
    launcher command of training and inference ranks. Several nodes with restarts: run under
    ``env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; with a node rank under ``env MOMENT_NODE_RANK=R``
    (torchrun's c10d rendezvous ignores ``--node-rank``; the ranks number themselves from it,
    :mod:`trainer.dist`)."""
    if nproc <= 0:
        raise UsageError(f"--nproc {nproc}: expected a positive number of processes")
    cmd = [python, "-m", TORCHRUN, "--nproc-per-node", str(int(nproc))]
    if rdzv.nnodes is None and rdzv.endpoint is None:
        cmd.append("--standalone")
    else:
        env = [f"{NODE_RANK}={int(rdzv.node_rank)}"] if rdzv.node_rank is not None else []
        if rdzv.max_restarts:
            # A store of its own for each attempt: torchrun would keep its agent's store, whose
            # keys a restarted group cannot tell from the killed group's across nodes (see
            # trainer.dist.attempt_prefix).
            env.insert(0, f"{SHARE_STORE_OFF}=1")
        if env:
            cmd = ["env", *env, *cmd]
        cmd += ["--nnodes", str(rdzv.nnodes or 1), "--rdzv-backend", rdzv.backend or "c10d"]
        if rdzv.endpoint is not None:
            cmd += ["--rdzv-endpoint", rdzv.endpoint]
        if rdzv.id is not None:
            cmd += ["--rdzv-id", rdzv.id]
    if rdzv.max_restarts is not None:
        cmd += ["--max-restarts", str(int(rdzv.max_restarts))]
    return [*cmd, "-m", module, *argv]


def check_nodes(args: Any) -> None:
    """The several-node options together: --node-rank and --rdzv-id need --nnodes, a node rank
    needs a fixed number of nodes (it sets the global rank order) and lies below it, and more
    than one node needs the endpoint where they meet. ``args``: ``moment train``'s parsed
    arguments or ``moment infer``'s options (both have ``nnodes``, ``node_rank``, ``rdzv_endpoint``
    and ``rdzv_id``)."""
    if args.nnodes is None:
        for flag, value in (("--node-rank", args.node_rank), ("--rdzv-id", args.rdzv_id)):
            if value is not None:
                raise UsageError(f"{flag} needs --nnodes (several nodes)")
        return
    low, _, high = str(args.nnodes).partition(":")
    if not (low.isdigit() and (high.isdigit() or not high)) or int(low) < 1:
        raise UsageError(f"--nnodes {args.nnodes!r}: expected a number of nodes, N or MIN:MAX")
    if args.node_rank is not None:
        if high and high != low:
            raise UsageError(f"--node-rank needs a fixed --nnodes N, not {args.nnodes} (it orders the ranks)")
        if args.node_rank >= int(low):
            raise UsageError(f"--node-rank {args.node_rank}: expected 0 to {int(low) - 1} for --nnodes {low}")
    if int(high or low) > 1 and not args.rdzv_endpoint:
        raise UsageError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)")


def build_torchrun_command(
    cfg: TrainConfig, nproc: int | None = None, rdzv: Rendezvous = Rendezvous(), python: str = sys.executable
) -> list[str]:
    """The training job: ``nproc`` ranks (default: the plan's GPUs) of ``python -m trainer``,
    each handed ``cfg`` as its command line (:func:`moment.options.to_argv`).

    With restarts and a checkpoint directory the ranks get ``--resume``, so a restarted worker
    group continues from the last epoch instead of starting over (with ``overwrite`` the caller
    removes the old checkpoint first: :func:`trainer.preflight.start_over`)."""
    if rdzv.max_restarts and cfg.checkpoint_dir is not None:
        cfg = dataclasses.replace(cfg, resume=True, overwrite=False)
    n = default_nproc(cfg.plan) if nproc is None else int(nproc)
    return torchrun_command("trainer", to_argv(cfg), n, rdzv, python)


def format_command(cmd: Sequence[str]) -> str:
    """The command as one shell-quoted line (what --dry-run prints)."""
    return shlex.join(cmd)


def run(cmd: Sequence[str], checkpoint_locked: bool = False, shm_dir: str = "") -> int:
    """Run the command (no shell) with this terminal as a supervised job (:func:`moment.procs.supervise`:
    signals forwarded, no process of it outliving this one); its exit status, or
    :class:`moment.errors.Interrupted` after SIGINT / SIGTERM / SIGHUP. ``checkpoint_locked``: this
    process holds the checkpoint directory's lock for the job (else rank 0 takes it). ``shm_dir``:
    the ranks' --shm-dir, where the job's own shared files that a killed rank left are removed once
    it has ended (:func:`trainer.shm.remove_job_files`)."""
    env = {CHECKPOINT_LOCKED: str(os.getpid())} if checkpoint_locked else None
    return supervise(cmd, env=env, cleanup=(lambda token: remove_job_files(shm_dir, token)) if shm_dir else None)
