"""``moment infer``: a trained checkpoint over every vertex, layer by layer, out of core
(``trainer.infer`` does the work; one or several ranks)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moment.cli.args import positive, registry_choices
from moment.cli.output import err, out
from moment.progress import Reporter


def add_infer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="embeddings and predictions for every vertex: layer-wise, full-neighbourhood, out of core",
        description=(
            "Run a trained checkpoint over the full in-neighbourhood of every vertex, one layer at a time: each "
            "layer's output for all vertices goes to disk and is read back as the next layer's input, features come "
            "from the placed dataset's tiers. Writes embeddings.npy, predictions.npy (original vertex ids) and "
            "inference.json; a killed run continues from its last finished chunk when run again."
        ),
    )
    p.add_argument("--plan", help="plan.json (checked; the rank count defaults to 1)")
    p.add_argument("--data", required=True, help="placed dataset directory (the one the checkpoint was trained on)")
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="CK",
        help="checkpoint directory of `moment train` (or its checkpoint.pt)",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (required unless --dry-run)")
    p.add_argument(
        "--nproc",
        type=positive,
        default=1,
        help="ranks, each taking a contiguous range of vertices (torchrun processes when more than 1; default 1)",
    )
    layers = p.add_argument(
        "--layers",
        default="last",
        help="last: embeddings and predictions; all: also logits.npy and every earlier hidden layer",
    )
    registry_choices(layers, "trainer.infer", "LAYER_CHOICES")
    dtype = p.add_argument("--dtype", default="float32", help="of the hidden-layer arrays")
    registry_choices(dtype, "trainer.infer", "DTYPES")
    p.add_argument("--batch-size", type=positive, default=8192, help="destination vertices per chunk (default 8192)")
    device = p.add_argument(
        "--device",
        default="auto",
        help="where the ranks run: cpu, cuda (each rank on the GPU the plan gives it) or auto (default: cuda "
        "where there is CUDA, else cpu)",
    )
    registry_choices(device, "trainer.infer", "DEVICES")
    engine = p.add_argument(
        "--engine",
        default="broadcast",
        help="broadcast (default): each layer's input streamed once in placed order, messages scattered into "
        "the destinations (layers with a scatter form: sage; others run on gather); gather: each chunk of "
        "destinations gathers its in-neighbours' rows (the reference)",
    )
    registry_choices(engine, "trainer.infer", "ENGINES")
    p.add_argument(
        "--memory",
        help="memory the broadcast passes may hold, e.g. 4GB, shared by the ranks: the destinations' partial sums and "
        "edges; when they do not "
        "fit, the destinations are cut into partitions, each streaming the input once (default: three quarters of the "
        "memory available, within its memory cgroup)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="write nothing: print per layer the engine, passes over its input, bytes read, memory and the "
        "predicted time (reads at the sequential rates of the plan's machine, compute timed here)",
    )
    p.set_defaults(func=cmd_infer)


def cmd_infer(args: argparse.Namespace) -> int:
    from moment.errors import UsageError
    from placement.importers.csr import parse_memory
    from trainer import infer, launch

    try:
        memory = parse_memory(args.memory) if args.memory is not None else None
    except ValueError as exc:
        raise UsageError(f"--memory: {exc}") from None
    if args.out is None and not args.dry_run:
        raise UsageError("--out: required (the output directory), unless --dry-run")
    opts = infer.InferOptions(
        data=Path(args.data),
        checkpoint=Path(args.checkpoint),
        out=Path(args.out or "."),
        plan=Path(args.plan) if args.plan else None,
        nproc=args.nproc,
        layers=args.layers,
        dtype=args.dtype,
        batch_size=args.batch_size,
        device=args.device,
        engine=args.engine,
        memory=memory,
        rates=plan_rates(Path(args.plan)) if args.plan else None,
    )
    if args.dry_run:
        for line in infer.dry_run(opts):
            out.print(line)
        return 0

    def run_ranks(cmd: list[str]) -> int:
        err.print(f"running: {launch.format_command(cmd)}")
        return launch.run(cmd)

    with Reporter(err) as bars:
        manifest = infer.infer(opts, progress=bars, log=err.print, launch=run_ranks)
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
    out.print(f"inference written to [bold]{out_dir}[/]: {files}, inference.json (original vertex ids)")
