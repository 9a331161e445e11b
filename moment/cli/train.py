"""Stage 4 verb: ``moment train`` builds the torchrun command (one DDP rank per GPU of the plan),
checks once what every rank would refuse, and runs it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape

from moment.cli.args import non_negative, positive
from moment.cli.output import err
from moment.options import add_arguments, to_argv
from moment.outputs import DirLock
from trainer.config import TrainConfig


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a GNN (GraphSAGE, GAT, ...) with one DDP rank per GPU of the plan (torchrun)",
        description=(
            "Build and run the torchrun command: one rank per GPU of the plan (CPU ranks with gloo when there is "
            "no GPU), features read from the placed dataset's GPU caches, CPU caches and SSD bins. Every trainer "
            "option is an option here (python -m trainer --help lists the same); arguments after -- go to the "
            "trainer too, after these."
        ),
    )
    add_arguments(p, TrainConfig)
    p.add_argument(
        "--nproc", type=positive, default=None, help="ranks (default: the plan's GPUs; 2 CPU ranks without CUDA)"
    )
    p.add_argument(
        "--max-restarts",
        type=non_negative,
        help="torchrun restarts of a failed worker group (resumes from the checkpoint)",
    )
    p.add_argument("--nnodes", help="several nodes: how many (torchrun --nnodes; the same command on each)")
    p.add_argument(
        "--node-rank",
        type=non_negative,
        help="several nodes: this node's number, 0 to --nnodes - 1 (node 0 writes checkpoints and metrics)",
    )
    p.add_argument("--rdzv-endpoint", help="several nodes: HOST:PORT where they meet (on node 0; torchrun's c10d)")
    p.add_argument("--rdzv-id", help="several nodes: a job id, the same on every node, so two jobs never meet")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("--json", action="store_true", help="with --dry-run: the command and the memory budget as JSON")
    p.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="-- then more trainer arguments (e.g. -- --batch-size 1024)"
    )
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from trainer import launch, preflight

    # The options given here and after --, parsed as every rank will parse them; everything the
    # ranks would refuse (trainer arguments, plan, placed data, train split, output paths, an
    # existing checkpoint) refused here once.
    extra = [a for a in args.trainer_args if a != "--"]
    launch.check_nodes(args)
    cfg = launch.check_command(to_argv(args, TrainConfig) + extra)
    nproc = launch.default_nproc(cfg.plan) if args.nproc is None else args.nproc
    checked = preflight.preflight(
        cfg, preflight.world_size(nproc, args.nnodes), ranks_per_node=nproc, node_rank=args.node_rank or 0
    )
    for warning in checked.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}")
    rdzv = launch.Rendezvous(
        nnodes=args.nnodes,
        endpoint=args.rdzv_endpoint,
        id=args.rdzv_id,
        max_restarts=args.max_restarts,
        node_rank=args.node_rank,
    )
    cmd = launch.build_torchrun_command(cfg, nproc=nproc, rdzv=rdzv)
    if args.dry_run and args.json:
        print(json.dumps({"command": cmd, "memory": checked.memory.to_dict() if checked.memory else None}, indent=2))
        return 0
    if args.dry_run:
        print(launch.format_command(cmd))
        return 0
    # One training per checkpoint directory, for the whole job: its ranks register there too, so
    # ranks that outlive a killed launcher keep it theirs until they stop (moment.outputs.DirLock).
    # On several nodes (one launcher each, the directory perhaps shared) rank 0 takes it instead.
    single_node = args.nnodes is None and args.rdzv_endpoint is None
    lock = DirLock(Path(cfg.checkpoint_dir), "moment train") if cfg.checkpoint_dir and single_node else None
    if lock is not None:
        lock.acquire()
    try:
        if cfg.overwrite:
            preflight.start_over(cfg.checkpoint_dir)
        err.print(f"running: {launch.format_command(cmd)}")
        return launch.run(cmd, checkpoint_locked=lock is not None, shm_dir=cfg.shm_dir)
    finally:
        if lock is not None:
            lock.release()
