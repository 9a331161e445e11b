"""``moment infer``: a trained checkpoint over every vertex, layer by layer, out of core
(``trainer.infer`` does the work; one or several ranks)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moment.cli.output import err, out
from moment.options import add_arguments, values
from moment.progress import Reporter
from trainer.infer_options import InferOptions


def add_infer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="embeddings and predictions for every vertex: layer-wise, full-neighbourhood, out of core",
        description=(
            "Run a trained checkpoint over the full in-neighbourhood of every vertex, one layer at a time: each "
            "layer's output for all vertices goes to disk and is read back as the next layer's input, features come "
            "from the placed dataset's tiers. Writes embeddings.npy, predictions.npy (the dataset's vertex ids) and "
            "inference.json; a killed run continues from its last finished chunk when run again. Several nodes "
            "(--nnodes, --node-rank, --rdzv-endpoint, --rdzv-id: the same command on each, with its own --node-rank): "
            "the ranks of all nodes split the vertices, each node reads its own --data and --checkpoint (the same "
            "data and checkpoint on every node, checked at start; a placement numbering the vertices otherwise works "
            "in node 0's ids) and keeps its work files beside its own --out; the layers' rows cross the network, so nothing needs shared storage; node 0 writes --out "
            "and inference.json."
        ),
    )
    add_arguments(p, InferOptions)
    p.set_defaults(func=cmd_infer)


def cmd_infer(args: argparse.Namespace) -> int:
    from trainer import infer, launch

    opts = InferOptions(**values(InferOptions, args), rates=plan_rates(args.plan) if args.plan else None)
    if opts.dry_run:
        for line in infer.dry_run(opts):
            out.print(line)
        return 0

    def run_ranks(cmd: list[str]) -> int:
        err.print(f"running: {launch.format_command(cmd)}")
        return launch.run(cmd)

    with Reporter(err) as bars:
        manifest = infer.infer(opts, progress=bars, log=err.print, launch=run_ranks)
    if manifest is None:  # a node past 0 (it said what it did): node 0 holds the output
        return 0
    print_inference(args.out, manifest)
    return 0


def plan_rates(path: Path):  # -> trainer.infer_predict.Rates | None
    """The sequential read rates of the plan's machine (its profile, bundled and unchanged since
    the plan was made): each SSD's ``read_gbps`` and the sockets' memory; None (said) where the
    profile is not at hand or gives no SSD rate."""
    from moment.contracts.plan import read_plan
    from moment.planner.planfile import plan_profile
    from trainer.infer_predict import Rates

    machine, why = plan_profile(read_plan(path))
    if machine is None:
        err.print(f"note: {why}: no predicted inference time")
        return None
    ssd = {d.id: float(d.read_gbps) for d in machine.devices() if d.kind == "nvme" and d.read_gbps}
    if not ssd:
        err.print(
            f"note: profile {machine.name!r} gives no SSD read rate (moment bench measures them): no predicted time"
        )
        return None
    dram = [float(s.dram_gbps) for s in machine.sockets if s.dram_gbps]
    return Rates(machine.name, ssd, min(dram) if dram else None)


def print_inference(out_dir: str | Path, manifest) -> None:
    """What ``moment infer`` (and the demo) wrote: the summary lines, then the files."""
    from trainer.infer import summary

    for line in summary(manifest):
        out.print(line)
    files = ", ".join(f"{e.path} {'×'.join(map(str, e.shape))} {e.dtype}" for e in manifest.arrays.values())
    out.print(f"inference written to [bold]{out_dir}[/]: {files}, inference.json (the dataset's vertex ids)")
