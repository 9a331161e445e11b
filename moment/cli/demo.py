"""``moment demo``: the whole pipeline (profile, plan, place, train) on a bundled profile and a
generated dataset, in a work directory of its own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moment.cli.args import positive
from moment.cli.infer import print_inference
from moment.cli.output import err, out
from moment.cli.plan import plan_picture
from moment.cli.profile import write_picture
from moment.contracts.metrics import MetricsDoc
from moment.errors import MomentError
from moment.progress import Reporter


def add_demo(sub: argparse._SubParsersAction) -> None:
    what = "run the pipeline on a bundled profile and a generated dataset (what the README's first command does)"
    p = sub.add_parser("demo", help=what, description=what)
    p.add_argument("--profile", default="moment-machine-b", help="bundled profile to use (default: moment-machine-b)")
    p.add_argument("--workdir", default="moment-demo", help="where the demo writes its files (default: ./moment-demo)")
    p.add_argument("--nodes", type=int, default=100_000, help="vertices of the generated graph (default 100000)")
    p.add_argument("--epochs", type=positive, default=2, help="training epochs (default 2)")
    p.add_argument("--nproc", type=positive, default=None, help="training ranks (default: 2 CPU ranks without CUDA)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from moment.planner.plan import default_counts, plan
    from moment.planner.planfile import save_plan
    from moment.planner.report import print_layout, print_prediction, ranking_table
    from moment.planner.workload import load_workload
    from moment.topology import profiler
    from moment.topology.profile_io import resolve_profile, save_profile
    from moment.topology.render import print_inspect, print_summary

    work = Path(args.workdir)
    _claim_workdir(work)
    out.rule(f"[bold]1. topology profile: {args.profile} (bundled)")
    machine = resolve_profile(args.profile)
    print_inspect(out, machine)
    write_picture(machine, str(work / f"{args.profile}.svg"))
    out.rule("[bold]   and a live profile of this machine")
    try:  # only informative: the demo plans the bundled profile, so a sandbox without sources goes on
        live, warnings = profiler.build_profile(profiler.capture_live(), "this-machine")
    except MomentError as exc:
        out.print(f"[yellow]note:[/] no live profile of this machine ({exc}); the demo goes on without it")
    else:
        for w in warnings:
            out.print(f"[yellow]note:[/] {w}")
        print_summary(out, live)
        save_profile(live, work / "this-machine.yaml")
    out.rule(f"[bold]2. plan: where the GPUs and SSDs of {args.profile} should go")
    # The profile's (paper-sized) workload, sampled as the demo trains: place pre-samples with the
    # plan's fan-outs and batch size, and the trainer takes the placement's.
    workload = load_workload(machine.workload, fanouts=DEMO_FANOUTS, batch_size=DEMO_BATCH)
    out.print(f"workload: {workload.describe()}")
    outcome = plan(machine, workload, *default_counts(machine))
    print_layout(out, outcome.best)
    print_prediction(out, outcome.best, workload)
    best_s = outcome.best.prop.iteration_s
    out.print(ranking_table("the paper's classic layouts, scored", list(outcome.classic.values()), best_s))
    save_plan(machine, workload, outcome, work / "plan.json")
    plan_picture(outcome.best, str(work / "plan.svg"))

    from placement.place import PlaceOptions, place
    from placement.placed import verify
    from placement.report import print_placement
    from placement.synth import synthesize

    out.rule("[bold]3. place: a generated power-law graph into the planned GPU caches, CPU caches and SSD bins")
    data = work / "dataset"
    placed_dir = work / "placed"
    with Reporter(err) as bars:
        synthesize(
            data,
            nodes=args.nodes,
            avg_degree=10,
            dim=64,
            dtype="float16",
            seed=0,
            train_fraction=0.05,
            replace=True,
            progress=bars,
        )
        manifest = place(
            work / "plan.json",
            data,
            placed_dir,
            PlaceOptions(gpu_cache="2%", cpu_cache="2%", epochs=2),
            progress=bars,
            log=out.print,
        )
    print_placement(out, manifest)
    checked = verify(placed_dir, sample=5000)
    out.print(
        f"verified: {checked['files']} files match their checksums; {checked['sampled']:,} sampled features equal the source"
    )
    out.rule("[bold]4. train: GraphSAGE, one DDP rank per GPU of the plan (CPU ranks with gloo here)")
    from trainer import launch, preflight
    from trainer.config import TrainConfig

    metrics, checkpoints = work / "metrics.json", work / "checkpoints"
    nproc = launch.default_nproc(work / "plan.json") if args.nproc is None else args.nproc
    # Sampling: the placement's (DEMO_FANOUTS, DEMO_BATCH). A demo run starts over: its own
    # earlier checkpoint is replaced, as the earlier run's files are.
    cfg = TrainConfig(
        data=str(placed_dir),
        plan=str(work / "plan.json"),
        hidden=128,
        epochs=args.epochs,
        metrics_json=str(metrics),
        checkpoint_dir=str(checkpoints),
        overwrite=True,
    )
    for note in preflight.preflight(cfg, nproc).warnings:
        out.print(f"[yellow]note:[/] {note}")
    preflight.start_over(checkpoints)
    cmd = launch.build_torchrun_command(cfg, nproc=nproc)
    out.print(f"running: {launch.format_command(cmd)}")
    code = launch.run(cmd, shm_dir=cfg.shm_dir)
    if code != 0:
        raise MomentError(f"training failed with exit code {code}")
    m = MetricsDoc.read(metrics)
    last = m.epochs[-1]
    out.print(
        f"trained {len(m.epochs)} epoch(s): loss {last.loss:.3f}, validation accuracy {_pct(last.val_acc)}, "
        f"test accuracy {_pct(m.test_acc)} (chance {1 / 16:.1%})"
    )
    out.rule("[bold]5. infer: embeddings and predictions for every vertex (layer by layer, full neighbourhood)")
    from trainer import infer

    opts = infer.InferOptions(data=placed_dir, checkpoint=checkpoints, out=work / "inference", plan=work / "plan.json")
    with Reporter(err) as bars:
        inferred = infer.infer(opts, progress=bars, log=out.print)
    assert inferred is not None  # one node: its output
    print_inference(work / "inference", inferred)
    out.print(
        f"\nwrote {work}/: {DEMO_MARKER}, {args.profile}.svg, this-machine.yaml, plan.json, plan.svg, dataset/, placed/, "
        f"checkpoints/, metrics.json, inference/ ({', '.join(e.path for e in inferred.arrays.values())}, "
        f"inference.json)"
    )
    return 0


def _pct(share: float | None) -> str:
    return "—" if share is None else f"{share:.1%}"


DEMO_MARKER = "moment-demo.json"
DEMO_FANOUTS, DEMO_BATCH = [10, 5], 1024  # small enough for a 2-core machine to train in seconds


def _claim_workdir(work: Path) -> None:
    """The demo writes only into a directory that is new, empty, or an earlier demo's (its marker
    file says so); inside it, each stage refuses what it did not write."""
    from moment.fileio import atomic_write_text

    if work.is_symlink() or (work.exists() and not work.is_dir()):
        raise MomentError(f"{work}: not a directory: choose another --workdir")
    if work.exists() and any(work.iterdir()) and not (work / DEMO_MARKER).is_file():
        raise MomentError(
            f"{work}: exists, is not empty and is not a moment demo directory (no {DEMO_MARKER}): "
            f"choose another --workdir"
        )
    atomic_write_text(work / DEMO_MARKER, json.dumps({"format": "moment.demo/1"}) + "\n")
