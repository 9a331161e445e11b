"""The ``moment`` command: one entry point, one verb per pipeline stage.

Tables and trees for people (rich), ``--json`` for scripts. A user mistake prints one line on
stderr and exits 1 (bad input) or 2 (bad usage); tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from moment import __version__
from moment.errors import MomentError, UsageError

out = Console()
err = Console(stderr=True, soft_wrap=True)  # one message, one line: never wrapped


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        err.print(f"[red]moment: error:[/] {message} (see `{self.prog} --help`)", highlight=False)
        raise SystemExit(2)


def _add_profile_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="build a topology profile of this machine or of saved captures",
        description=(
            "Profile a server's PCIe topology. With --from DIR, read the saved captures found there "
            "(lspci-tv.txt, lspci-vvv.txt or lspci-vvnn.txt, dmidecode.txt, nvidia-smi-topo-m.txt, "
            "nccl-topo.xml); without it, profile this machine (sysfs, lspci, dmidecode as root, nvidia-smi)."
        ),
    )
    p.add_argument("--from", dest="source", metavar="DIR", help="folder of saved captures")
    p.add_argument("--out", metavar="FILE", help="write the YAML profile here (default: print it)")
    p.add_argument("--name", help="profile name (default: the folder name, or the host name)")
    p.add_argument("--picture", metavar="FILE.svg", help="also draw the topology as SVG")
    p.add_argument("--json", action="store_true", help="print the inventory as JSON")
    p.set_defaults(func=cmd_profile)


def _add_inspect_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a profile's inventory and PCIe tree",
        description="Inventory (sockets, switches, slots, GPUs, NVMe, NICs, NVLink) and the PCIe tree of a profile.",
    )
    p.add_argument("profile", help="a bundled profile name (see `moment profiles`) or a YAML file")
    p.add_argument("--json", action="store_true", help="machine-readable inventory")
    p.add_argument("--picture", metavar="FILE.svg", help="draw the topology as SVG")
    p.set_defaults(func=cmd_inspect)


def _add_bench_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure SSD, DRAM and GPU-copy bandwidths; write them into a profile",
        description=(
            "Measure what the planner would otherwise take from tables: random-read GB/s of files on "
            "each SSD at the feature read size, DRAM copy GB/s, host→GPU and GPU↔GPU copy GB/s when CUDA "
            "is present. Read-only: files and devices are opened O_RDONLY, never written."
        ),
    )
    p.add_argument("--profile", help="profile to put the figures into (bundled name or file)")
    p.add_argument("--out", metavar="FILE", help="write the profile with measured figures here")
    p.add_argument("--file", action="append", default=[], metavar="PATH[:DEVICE]",
                   help="a file (or block device) on an SSD to read; :nvme3 names the profile's SSD it sits on")
    p.add_argument("--read-size", type=int, default=4096, help="bytes per read (the feature row size; default 4096)")
    p.add_argument("--queue-depth", type=int, default=32, help="reads in flight (default 32)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (default 2)")
    p.add_argument("--no-dram", action="store_true", help="skip the DRAM copy")
    p.add_argument("--json", action="store_true", help="machine-readable figures")
    p.set_defaults(func=cmd_bench)


def _add_dataset_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dataset", help="make or import a graph dataset (CSR + features on disk)")
    dsub = p.add_subparsers(dest="dataset_verb", metavar="ACTION", parser_class=_Parser, required=True)
    s = dsub.add_parser(
        "synth",
        help="generate a synthetic power-law graph of any size, out of core",
        description=(
            "Generate a Chung-Lu power-law graph with planted communities (labels a GNN can learn), written "
            "block by block: never the whole graph in memory."
        ),
    )
    s.add_argument("--nodes", type=int, required=True, help="vertices")
    s.add_argument("--avg-degree", type=float, default=15.0, help="mean in-degree of the power-law graph (default 15)")
    s.add_argument("--dim", type=int, default=128, help="feature dimension")
    s.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="feature type (default float16)")
    s.add_argument("--classes", type=int, default=16, help="planted communities = label classes (default 16)")
    s.add_argument("--train-fraction", type=float, default=0.01,
                   help="share of vertices in the train split (default 0.01, as the paper's runs)")
    s.add_argument("--seed", type=int, default=0, help="the same seed gives the same dataset (default 0)")
    s.add_argument("--out", required=True, help="dataset directory to create")
    s.set_defaults(func=cmd_dataset_synth)
    from placement.importers import IMPORTERS

    i = dsub.add_parser(
        "import",
        help="import a dataset from disk: plain .npy arrays, IGB, or OGB (papers100M) files",
        description="Read the files users have on disk and write a moment dataset; the CSR is built out of core "
                    "within --memory. Formats: " + "; ".join(f"{k}: {v.help}" for k, v in IMPORTERS.items()) + ".",
        epilog="IGB splits (IGB ships none), over the L labelled vertices, from one torch.randperm(L) seeded with "
               "--seed: mlperf (seed 42): train = first int(0.6 L), val = next int(0.005 L) (MLPerf's "
               "split_seeds.py), test = next int(0.005 L); igb (seed 0): 60/20/20 (int(0.6 L), int(0.2 L), the "
               "rest), shuffled; fraction:F (seed 0): train round(F L), val and test round(F L / 2) each.",
    )
    i.add_argument("--format", choices=tuple(IMPORTERS), default="npy", help="what --root or the files hold "
                   "(default npy)")
    i.add_argument("--root", help="igb: the directory holding <size>/processed; ogb: the one holding raw/ and split/")
    i.add_argument("--size", help="igb: tiny, small, medium, large or full")
    i.add_argument("--classes", type=int, help="igb: 19 (default) or 2983 label classes")
    i.add_argument("--split", help="igb: mlperf, igb (default) or fraction:F; ogb: the split directory "
                   "(default: the only one, e.g. time)")
    i.add_argument("--labelled", type=int, help="igb: only the first N vertices are labelled, the rest is padding "
                   "(default: all; full: IGB's published counts)")
    i.add_argument("--features", help="npy: N×d .npy (float32/float16)")
    i.add_argument("--edges", help="npy: E×2 .npy edge list (src, dst)")
    i.add_argument("--indptr", help="npy: CSR indptr .npy (with --indices)")
    i.add_argument("--indices", help="npy: CSR indices .npy (with --indptr)")
    i.add_argument("--labels", help="npy: N .npy of class ids")
    i.add_argument("--train", help="npy: train vertex ids .npy (default: a random 1%%)")
    i.add_argument("--val", help="npy: validation vertex ids .npy")
    i.add_argument("--test", help="npy: test vertex ids .npy")
    i.add_argument("--feature-dtype", choices=("float32", "float16"), help="convert the features (default: keep)")
    i.add_argument("--undirected", action="store_true", help="add the reverse of every edge (duplicates kept)")
    i.add_argument("--self-loops", action="store_true", help="give every vertex exactly one self-loop")
    i.add_argument("--memory", help="RAM budget of the CSR build, e.g. 4GB (default: half the available memory)")
    i.add_argument("--dry-run", action="store_true", help="print the schema and the RAM and disk needed; write nothing")
    i.add_argument("--seed", type=int, help="seed of the drawn splits (npy: default 0; igb: the convention's)")
    i.add_argument("--out", required=True, help="dataset directory to create")
    i.set_defaults(func=cmd_dataset_import)


def _non_negative(text: str) -> int:
    """argparse type: an integer >= 0 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_place_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "place",
        help="place a dataset's features into GPU caches, CPU caches and SSD bins per a plan",
        description=(
            "Pre-sample hotness with the trainer's sampler, re-solve the plan's flow model for this dataset, its "
            "measured hotness and the cache sizes used, place vertices with DDAK (or the hash baseline) against "
            "those per-bin traffic targets, and write the placed dataset: relabelled topology, cache bins, one bin "
            "per SSD. Crash-safe: a killed run resumes when run again."
        ),
    )
    p.add_argument("--plan", required=True, help="plan.json from `moment plan`")
    p.add_argument("--dataset", required=True, help="dataset directory")
    p.add_argument("--out", required=True, help="placed dataset directory")
    p.add_argument("--policy", choices=("ddak", "hash"), default="ddak",
                   help="ddak: hottest rows to the caches, SSD bins balanced to their targets (default); hash: a "
                        "baseline spreading rows by id")
    p.add_argument("--gpu-cache", metavar="SIZE", help="feature cache of each GPU (every GPU holds the same rows): 2GB, "
                   "512MiB, 1%% (of vertices), 10000rows (default: the plan's gpu_cache_gb, 0 unless set)")
    p.add_argument("--cpu-cache", metavar="SIZE", help="CPU feature cache (one copy in each socket's memory), same units "
                   "(default: the plan's cpu_cache_fraction, 1%%)")
    p.add_argument("--ssd-dir", action="append", default=[], metavar="BIN=DIR",
                   help="directory (mount point) for an SSD bin, e.g. nvme0=/mnt/nvme0 (default: OUT/bins/BIN)")
    p.add_argument("--hotness", metavar="FILE.npy", help="use a saved hotness instead of pre-sampling")
    p.add_argument("--epochs", type=_positive, default=1, help="pre-sampling epochs (default 1)")
    p.add_argument("--pool", type=_positive, default=100, help="DDAK pool size (default 100)")
    p.add_argument("--priority", choices=("projected", "paper"), default="projected",
                   help="DDAK bin priority: projected (default, matches the plan's targets) or the paper's "
                        "(access/target)×(used/capacity)")
    p.add_argument("--profile", help="the plan's profile (bundled name or YAML file) where it is not bundled; "
                                      "a plan made for another profile is refused")
    p.add_argument("--seed", type=int, default=0, help="pre-sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    p.set_defaults(func=cmd_place)
    what = "re-check a placed dataset: checksums, counts, features against the source"
    v = sub.add_parser("verify", help=what, description=what)
    v.add_argument("placed", help="placed dataset directory")
    v.add_argument("--source", help="source dataset (default: the one the manifest names)")
    v.add_argument("--sample", type=_non_negative, default=10_000, help="vertices to compare with the source (default 10000)")
    v.set_defaults(func=cmd_verify)


def _add_train_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train GraphSAGE/GAT with one DDP rank per GPU of the plan (torchrun)",
        description=(
            "Build and run the torchrun command: one rank per GPU of the plan (CPU ranks with gloo when there is "
            "no GPU), features read from the placed dataset's GPU caches, CPU caches and SSD bins. Arguments "
            "after -- go to the trainer unchanged (python -m trainer --help lists them)."
        ),
    )
    p.add_argument("--plan", help="plan.json (rank → GPU mapping, predicted time to compare with)")
    p.add_argument("--data", required=True, help="placed dataset directory (from `moment place`)")
    p.add_argument("--model", choices=("sage", "gat"), default="sage", help="GraphSAGE (default) or GAT")
    p.add_argument("--epochs", type=_positive, default=None, help="total epochs, counting those a resumed checkpoint did (default 3)")
    p.add_argument("--nproc", type=_positive, default=None, help="ranks (default: the plan's GPUs; 2 CPU ranks without CUDA)")
    p.add_argument("--metrics-json", metavar="FILE", help="per-epoch metrics and measured vs predicted, as JSON")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoint every epoch here")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's checkpoint (same data and model)")
    again.add_argument("--overwrite", action="store_true", help="start over, replacing --checkpoint-dir's checkpoint")
    p.add_argument("--max-restarts", type=_non_negative,
                   help="torchrun restarts of a failed worker group (resumes from the checkpoint)")
    p.add_argument("--nnodes", help="multi-node: torchrun --nnodes")
    p.add_argument("--rdzv-endpoint", help="multi-node: torchrun --rdzv-endpoint HOST:PORT")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("--json", action="store_true", help="with --dry-run: the command and the memory budget as JSON")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then trainer arguments (e.g. -- --batch-size 1024)")
    p.set_defaults(func=cmd_train)


def _add_infer_args(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--checkpoint", required=True, metavar="CK",
                   help="checkpoint directory of `moment train` (or its checkpoint.pt)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--nproc", type=_positive, default=1, help="ranks, each taking a contiguous range of vertices "
                   "(torchrun processes when more than 1; default 1)")
    p.add_argument("--layers", choices=("last", "all"), default="last",
                   help="last: embeddings and predictions; all: also logits.npy and every earlier hidden layer")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="of the hidden-layer arrays")
    p.add_argument("--batch-size", type=_positive, default=8192, help="destination vertices per chunk (default 8192)")
    p.set_defaults(func=cmd_infer)


def _add_demo_args(sub: argparse._SubParsersAction) -> None:
    what = "run the pipeline on a bundled profile and a generated dataset (what the README's first command does)"
    p = sub.add_parser("demo", help=what, description=what)
    p.add_argument("--profile", default="moment-machine-b", help="bundled profile to use (default: moment-machine-b)")
    p.add_argument("--workdir", default="moment-demo", help="where the demo writes its files (default: ./moment-demo)")
    p.add_argument("--nodes", type=int, default=100_000, help="vertices of the generated graph (default 100000)")
    p.add_argument("--epochs", type=_positive, default=2, help="training epochs (default 2)")
    p.add_argument("--nproc", type=_positive, default=None, help="training ranks (default: 2 CPU ranks without CUDA)")
    p.set_defaults(func=cmd_demo)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", metavar="FILE", help="workload YAML/JSON (default: the profile's, else built-in)")
    p.add_argument("--nvlink", choices=("on", "off"), default="on", help="what-if: drop the profile's NVLink (off)")
    p.add_argument("--engine", choices=("ortools", "networkx"), default="ortools", help="max-flow engine of the paper model")


def _add_plan_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="rank the ways to put N GPUs and M SSDs into the profile's slots",
        description=(
            "Search every distinct layout of N GPUs and M SSDs, predict each with the proportional-share "
            "flow model (and the paper's max-flow model), and print the best, the ranking and the "
            "profile's named layouts (the paper's classic ones) beside it. Ranges (--gpus 1..4) sweep."
        ),
    )
    p.add_argument("--profile", required=True, help="bundled profile name or YAML file")
    p.add_argument("--gpus", help="how many GPUs, or a range like 1..4 (default: as installed)")
    p.add_argument("--ssds", help="how many SSDs, or a range like 4..12 (default: as installed)")
    p.add_argument("--top", type=int, default=10, help="how many ranked layouts to keep (default 10)")
    p.add_argument("--method", choices=("auto", "enumerate", "milp"), default="auto",
                   help="enumerate every distinct layout (bound-pruned), or a MILP per GPU placement (auto: by size)")
    p.add_argument("--out", metavar="plan.json", help="write the plan for `moment place` and the trainer")
    p.add_argument("--picture", metavar="FILE.svg", help="draw the best layout with the flow on every link")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    _add_workload_args(p)
    p.set_defaults(func=cmd_plan)


def _add_score_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="predict one given layout",
        description="Predict one layout: a name stored in the profile (classic-a … classic-d, or 'installed') or a YAML/JSON file mapping port ids to device ids.",
    )
    p.add_argument("--profile", required=True, help="bundled profile name or YAML file")
    p.add_argument("--layout", default="installed", help="layout name or file (default: installed)")
    p.add_argument("--picture", metavar="FILE.svg", help="draw the layout with the flow on every link")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    _add_workload_args(p)
    p.set_defaults(func=cmd_score)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moment",
        description=(
            "Out-of-core GNN training planned around a server's PCIe topology: "
            "profile → plan → place → train."
        ),
    )
    parser.add_argument("--version", action="version", version=f"moment {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    _add_profile_args(sub)
    _add_inspect_args(sub)
    _add_plan_args(sub)
    _add_score_args(sub)
    _add_bench_args(sub)
    _add_dataset_args(sub)
    _add_place_args(sub)
    _add_train_args(sub)
    _add_infer_args(sub)
    _add_demo_args(sub)
    what = "list the bundled topology profiles"
    sub.add_parser("profiles", help=what, description=what).set_defaults(func=cmd_profiles)
    return parser


# --- verbs ---------------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    from moment.topology import profiler
    from moment.topology.profile_io import dump_profile, save_profile

    if args.source:
        caps = profiler.read_capture_dir(args.source)
        name = args.name or Path(args.source).resolve().name
    else:
        import socket

        caps = profiler.capture_live()
        name = args.name or socket.gethostname()
    machine, warnings = profiler.build_profile(caps, name)
    for w in warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    if args.picture:
        _write_picture(machine, args.picture)
    if args.out:
        save_profile(machine, args.out)
    if args.json:
        from moment.topology.inventory import inventory

        print(json.dumps(inventory(machine), indent=2))
    elif args.out:
        from moment.topology.render import print_summary

        print_summary(out, machine)
        out.print(f"profile written to [bold]{args.out}[/]")
    else:
        sys.stdout.write(dump_profile(machine))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from moment.topology.inventory import inventory
    from moment.topology.profile_io import resolve_profile
    from moment.topology.render import print_inspect

    machine = resolve_profile(args.profile)
    if args.picture:
        _write_picture(machine, args.picture)
    if args.json:
        print(json.dumps(inventory(machine), indent=2))
    else:
        print_inspect(out, machine)
    return 0


def _machine_and_workload(args: argparse.Namespace):
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile

    machine = resolve_profile(args.profile)
    if args.nvlink == "off":
        machine = machine.model_copy(update={"nvlinks": []})
    return machine, load_workload(machine.workload, args.workload)


def cmd_plan(args: argparse.Namespace) -> int:
    from moment.planner.plan import check_ssd_tier, default_counts, parse_range, plan

    machine, workload = _machine_and_workload(args)
    have_gpus, have_ssds = default_counts(machine)
    gpus = parse_range(args.gpus, "gpus") if args.gpus else [have_gpus]
    ssds = parse_range(args.ssds, "ssds") if args.ssds else [have_ssds]
    if args.top < 1:
        raise UsageError("--top must be at least 1")
    check_ssd_tier(machine, workload, args.profile, max(gpus), min(ssds))
    if len(gpus) > 1 or len(ssds) > 1:
        return _sweep(machine, workload, gpus, ssds, args)
    outcome = plan(machine, workload, gpus[0], ssds[0], top=args.top, method=args.method, engine=args.engine)
    if args.out:
        from moment.planner.planfile import save_plan

        save_plan(machine, workload, outcome, args.out)
    if args.picture:
        _plan_picture(outcome.best, args.picture)
    if args.json:
        print(json.dumps({
            "profile": machine.name,
            "workload": workload.describe(),
            "tier_shares": outcome.best.net.shares,
            "search": outcome.search,
            "best": outcome.best.to_dict(),
            "ranking": [s.to_dict() for s in outcome.ranking],
            "classic": {k: v.to_dict() for k, v in outcome.classic.items()},
        }, indent=2))
        return 0
    from moment.planner.report import busiest_links_table, print_layout, print_prediction, ranking_table

    srch = outcome.search
    out.print(f"[bold]{machine.name}[/]: {srch['gpus']} GPUs, {srch['ssds']} SSDs")
    out.print(f"workload: {workload.describe()}")
    shares = outcome.best.net.shares
    out.print(f"reads served by: GPU caches {shares['gpu']:.1%}, CPU cache {shares['cpu']:.1%}, SSDs {shares['ssd']:.1%}")
    if srch["method"] == "milp":
        out.print(
            f"search: {srch['raw_layouts']:,} raw layouts; {srch['distinct_layouts']:,} distinct GPU placements, "
            f"each with a MILP choosing the SSD slots; {srch['seconds']:.2f} s"
        )
    else:
        out.print(
            f"search: {srch['raw_layouts']:,} raw layouts, {srch['distinct_layouts']:,} distinct after collapsing "
            f"interchangeable slots and mirror subtrees, {srch['evaluated']:,} evaluated (bounds pruned the rest), "
            f"{srch['seconds']:.2f} s"
        )
    print_layout(out, outcome.best)
    print_prediction(out, outcome.best, workload)
    out.print(busiest_links_table(outcome.best))
    best_s = outcome.best.prop.iteration_s
    out.print(ranking_table("top layouts", outcome.ranking, best_s))
    if outcome.classic:
        out.print(ranking_table("the profile's named layouts, scored", list(outcome.classic.values()), best_s))
    for note in outcome.best.net.notes:
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    if args.out:
        out.print(f"plan written to [bold]{args.out}[/]")
    return 0


def _sweep(machine, workload, gpus: list[int], ssds: list[int], args: argparse.Namespace) -> int:
    from rich.table import Table

    from moment.planner.plan import plan

    if args.out or args.picture:
        raise UsageError("--out/--picture need one GPU count and one SSD count, not a range")
    rows = []
    for g in gpus:
        for s in ssds:
            best = plan(machine, workload, g, s, top=1, method=args.method, engine=args.engine).best
            rows.append({"gpus": g, "ssds": s, **best.to_dict()})
    if args.json:
        print(json.dumps({"profile": machine.name, "sweep": rows}, indent=2))
        return 0
    table = Table(title=f"{machine.name}: best layout per GPU and SSD count")
    for col in ("GPUs", "SSDs", "iteration s", "GB/s per GPU", "vs previous", "bottleneck"):
        table.add_column(col, justify="right" if col != "bottleneck" else "left")
    prev = None
    for r in rows:
        gain = f"{prev / r['predicted_iteration_s']:.2f}×" if prev else "-"
        table.add_row(str(r["gpus"]), str(r["ssds"]), f"{r['predicted_iteration_s']:.4f}",
                      f"{min(r['gbps_per_gpu']):.3g}", gain, (r["bottleneck"] or ["-"])[0])
        prev = r["predicted_iteration_s"]
    out.print(table)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from moment.planner.plan import resolve_layout
    from moment.planner.report import busiest_links_table, print_layout, print_prediction
    from moment.planner.scoring import bin_targets, links_table, score

    machine, workload = _machine_and_workload(args)
    name, layout = resolve_layout(machine, args.layout)
    scored = score(machine, name, layout, workload, engine=args.engine)
    if args.picture:
        _plan_picture(scored, args.picture)
    if args.json:
        print(json.dumps({"profile": machine.name, "tier_shares": scored.net.shares, **scored.to_dict(),
                          "bin_targets": bin_targets(scored, workload), "links": links_table(scored)}, indent=2))
        return 0
    out.print(f"workload: {workload.describe()}")
    print_layout(out, scored)
    print_prediction(out, scored, workload)
    out.print(busiest_links_table(scored))
    return 0


def _plan_picture(scored, path: str) -> None:
    from moment.planner.report import edge_notes
    from moment.topology.picture import render_svg
    from moment.fileio import atomic_write_text

    if not path.endswith(".svg"):
        raise UsageError(f"--picture {path}: only .svg pictures are written")
    notes, hot = edge_notes(scored)
    title = f"{scored.machine.name} — layout {scored.name}: {scored.prop.iteration_s:.4f} s per iteration (bottleneck in red)"
    atomic_write_text(Path(path), render_svg(scored.machine, notes, hot, title))
    err.print(f"picture written to {path}", highlight=False)


def cmd_bench(args: argparse.Namespace) -> int:
    from moment import bench
    from moment.topology.profile_io import resolve_profile, save_profile

    if args.out and not args.profile:
        raise UsageError("--out needs --profile (the profile to put the figures into)")
    if args.read_size < 512 or args.read_size % 512:
        raise UsageError("--read-size must be a multiple of 512 bytes")
    if args.queue_depth < 1 or args.seconds <= 0:
        raise UsageError("--queue-depth and --seconds must be positive")
    machine = resolve_profile(args.profile) if args.profile else None
    ssd, rows = {}, []
    for path, dev in [bench.file_spec(spec, machine) for spec in args.file]:  # all checked before any is read
        res = bench.random_read(path, args.read_size, args.queue_depth, args.seconds)
        rows.append({"what": f"random read {path}", "gbps": res.gbps, "iops": res.iops, "direct": res.direct, "device": dev or None})
        if dev:
            ssd[dev] = res
    dram = None if args.no_dram else bench.dram_copy_gbps()
    if dram:
        rows.append({"what": "DRAM copy", "gbps": dram})
    h2d_idx, peer_idx = bench.gpu_copies()
    bus = bench.cuda_bus_ids()
    gpu_of = {}
    if machine is not None:
        by_bdf = {d.bdf: d.id for d in machine.devices() if d.kind == "gpu" and d.bdf}
        gpu_of = {i: by_bdf[b] for i, b in enumerate(bus) if b in by_bdf}
    for i, gbps in h2d_idx.items():
        rows.append({"what": f"host→cuda:{i} ({bus[i] if i < len(bus) else '?'})", "gbps": gbps, "device": gpu_of.get(i)})
    for (i, j), gbps in peer_idx.items():
        rows.append({"what": f"cuda:{i}→cuda:{j}", "gbps": gbps})
    if not h2d_idx:
        rows.append({"what": "GPU copies", "gbps": None, "note": "skipped: no CUDA device"})
    if machine is not None and args.out:
        h2d = {gpu_of[i]: v for i, v in h2d_idx.items() if i in gpu_of}
        peer = {(gpu_of[i], gpu_of[j]): v for (i, j), v in peer_idx.items() if i in gpu_of and j in gpu_of}
        save_profile(bench.apply_measurements(machine, ssd, dram, h2d, peer), args.out)
    if args.json:
        print(json.dumps({"measurements": rows, "profile_out": args.out}, indent=2))
        return 0
    from rich.table import Table

    table = Table(title="moment bench (GB/s per direction)")
    for col in ("measurement", "GB/s", "IOPS", "profile device", "note"):
        table.add_column(col)
    for r in rows:
        note = r.get("note") or ("" if r.get("direct", True) else "page cache not bypassed (no O_DIRECT here)")
        table.add_row(r["what"], f"{r['gbps']:.3f}" if r.get("gbps") else "-", f"{r['iops']:,.0f}" if r.get("iops") else "",
                      r.get("device") or "", note)
    out.print(table)
    if args.out:
        out.print(f"profile with measured figures written to [bold]{args.out}[/]")
    return 0


class RichProgress:
    """``progress(stage, total)`` → ``update(done, total)``: one rich bar per stage."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             console=console, transient=False)

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def __call__(self, stage: str, total: int):
        task = self.bars.add_task(stage, total=total or None)

        def update(done: int, total_now: int) -> None:
            self.bars.update(task, completed=done, total=total_now or None)

        return update


def cmd_dataset_synth(args: argparse.Namespace) -> int:
    from placement import synth

    need = synth.estimate(args.nodes, args.avg_degree, args.dim, args.dtype)
    total = sum(need.values())
    out.print(f"generating {args.nodes:,} vertices, ~{args.nodes * args.avg_degree:,.0f} edges, "
              f"{args.dim}-dim {args.dtype} features: ~{total / 1e9:.2f} GB on disk")
    synth.check_free_space(Path(args.out), total)
    with RichProgress(err) as bars:
        def progress(stage: str, done: int, of: int, _bars={}) -> None:  # noqa: B006 - one bar per stage
            if stage not in _bars:
                _bars[stage] = bars(stage, of)
            _bars[stage](done, of)

        ds = synth.synthesize(args.out, nodes=args.nodes, avg_degree=args.avg_degree, dim=args.dim, dtype=args.dtype,
                              seed=args.seed, classes=args.classes, train_fraction=args.train_fraction, progress=progress)
    out.print(f"dataset written to [bold]{ds.root}[/]: {ds.num_nodes:,} vertices, {ds.num_edges:,} edges, "
              f"{ds.num_classes} classes, {len(ds.split('train')):,} training vertices")
    return 0


def cmd_dataset_import(args: argparse.Namespace) -> int:
    from placement.importers import COMMON, IMPORTERS, csr, run

    imp = IMPORTERS[args.format]
    given = {key: getattr(args, key) for key in (*COMMON, "features", "edges", "indptr", "indices", "labels", "train",
                                                 "val", "test", "seed", "root", "size", "classes", "split", "labelled")}
    if args.memory is not None:
        try:
            given["memory"] = csr.parse_memory(args.memory)
        except ValueError as exc:
            raise UsageError(f"--memory: {exc}") from None
    if args.format == "npy" and (bool(args.edges) == bool(args.indptr or args.indices)
                                 or bool(args.indptr) != bool(args.indices)):
        raise UsageError("give either --edges, or --indptr with --indices")

    def log(line: str) -> None:
        (err if line.startswith("warning:") else out).print(escape(line), highlight=False)

    with RichProgress(err) as bars:
        def progress(stage: str, done: int, of: int, _bars={}) -> None:  # noqa: B006 - one bar per stage
            if stage not in _bars:
                _bars[stage] = bars(stage, of)
            _bars[stage](done, of)

        ds = run(imp.name, args.out, given, progress=None if args.dry_run else progress, log=log)
    if ds is not None:
        out.print(f"dataset written to [bold]{ds.root}[/]: {ds.num_nodes:,} vertices, {ds.num_edges:,} edges, "
                  f"{ds.num_classes} classes, {len(ds.split('train')):,} training vertices")
    return 0


def cmd_place(args: argparse.Namespace) -> int:
    from placement.place import PlaceOptions, place

    dirs = {}
    for spec in args.ssd_dir:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d:
            raise UsageError(f"--ssd-dir {spec!r}: expected BIN=DIR, e.g. nvme0=/mnt/nvme0")
        dirs[name] = Path(d)
    profile = None
    if args.profile:
        from moment.topology.profile_io import resolve_profile

        profile = resolve_profile(args.profile)
    opts = PlaceOptions(policy=args.policy, gpu_cache=args.gpu_cache, cpu_cache=args.cpu_cache, ssd_dirs=dirs,
                        hotness=Path(args.hotness) if args.hotness else None, epochs=args.epochs, pool=args.pool, priority=args.priority,
                        seed=args.seed, profile=profile)
    with RichProgress(err) as bars:
        manifest = place(args.plan, args.dataset, args.out, opts, progress=bars,
                         log=lambda msg: err.print(msg, highlight=False))
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    print_placement(manifest)
    out.print(f"placed dataset written to [bold]{args.out}[/]  (check it with `moment verify {args.out}`; "
              f"re-plan with the measured workload: `moment plan --workload {args.out}/workload.yaml ...`)")
    return 0


def print_placement(manifest: dict) -> None:
    """Per bin: rows, fill, and access share against its target; per tier: predicted against
    achieved. Shares are also given within the tier: how much a tier serves is set by hotness and
    cache sizes; how it splits over the tier's bins is what DDAK controls."""
    from rich.table import Table

    pred = manifest["prediction"]
    tier_target: dict[str, float] = {}
    tier_got: dict[str, float] = {}
    for b in manifest["bins"]:
        tier_target[b["tier"]] = tier_target.get(b["tier"], 0.0) + b["target"]
        tier_got[b["tier"]] = tier_got.get(b["tier"], 0.0) + b["achieved"]
    table = Table(title=f"placement ({manifest['policy']}): per bin")
    for col in ("bin", "tier", "rows", "fill", "target", "achieved", "in tier: target", "achieved"):
        table.add_column(col, justify="left" if col in ("bin", "tier") else "right")
    for b in manifest["bins"]:
        t, g = tier_target[b["tier"]], tier_got[b["tier"]]
        table.add_row(b["name"], b["tier"], f"{b['count']:,}", f"{b['count'] / max(b['capacity'], 1):.0%}",
                      f"{b['target']:.2%}", f"{b['achieved']:.2%}",
                      f"{b['target'] / t:.1%}" if t else "-", f"{b['achieved'] / g:.1%}" if g else "-")
    out.print(table)
    whose = ("predicted for this dataset" if pred["source"] == "dataset"
             else "the plan's prediction, for its own workload")
    out.print(f"reads served per tier, achieved vs predicted ({whose}; {pred['iteration_s']:.4g} s per iteration on "
              f"{pred['profile']}, layout {pred['layout']}): "
              + ", ".join(f"{k} {tier_got[k]:.2%} vs {pred['tier_shares'][k]:.2%}" for k in tier_got))


def cmd_verify(args: argparse.Namespace) -> int:
    from placement.placed import verify

    result = verify(args.placed, args.source, sample=args.sample)
    out.print(f"[green]ok[/]: {result['files']} files match their checksums, {result['rows']:,} rows, "
              f"{result['sampled']:,} sampled features equal the source")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from trainer import launch

    from trainer import preflight

    extra = [a for a in args.trainer_args if a != "--"]
    if (args.resume or args.overwrite) and not args.checkpoint_dir:
        raise UsageError(f"--{'resume' if args.resume else 'overwrite'} needs --checkpoint-dir")
    # Everything the ranks would refuse, refused here once: trainer arguments, plan, placed data,
    # train split, output paths, an existing checkpoint (#27, #19, #16, #17, #10).
    nproc = launch.default_nproc(args.plan) if args.nproc is None else args.nproc
    argv = launch.trainer_argv(args.plan, args.data, args.model, args.epochs, args.metrics_json, args.checkpoint_dir,
                               extra, resume=args.resume, overwrite=args.overwrite)
    checked = preflight.preflight(argv, preflight.world_size(nproc, args.nnodes), ranks_per_node=nproc,
                                  resume=args.resume or "--resume" in extra, overwrite=args.overwrite or "--overwrite" in extra)
    for warning in checked.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    cmd = launch.build_torchrun_command(args.plan, args.data, nproc=nproc, model=args.model, epochs=args.epochs,
                                        metrics_json=args.metrics_json, checkpoint_dir=args.checkpoint_dir, extra=extra,
                                        nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
                                        resume=args.resume, overwrite=args.overwrite)
    if args.dry_run and args.json:
        print(json.dumps({"command": cmd, "memory": checked.memory.to_dict() if checked.memory else None}, indent=2))
        return 0
    if args.dry_run:
        print(launch.format_command(cmd))
        return 0
    if args.overwrite or "--overwrite" in extra:
        preflight.start_over(checked.cfg.checkpoint_dir)
    err.print(f"running: {launch.format_command(cmd)}", highlight=False)
    return launch.run(cmd)


def cmd_infer(args: argparse.Namespace) -> int:
    from trainer import infer, launch

    opts = infer.InferOptions(data=Path(args.data), checkpoint=Path(args.checkpoint), out=Path(args.out),
                              plan=Path(args.plan) if args.plan else None, nproc=args.nproc, layers=args.layers,
                              dtype=args.dtype, batch_size=args.batch_size)

    def run_ranks(cmd: list[str]) -> int:
        err.print(f"running: {launch.format_command(cmd)}", highlight=False)
        return launch.run(cmd)

    with RichProgress(err) as bars:
        manifest = infer.infer(opts, progress=bars, log=lambda msg: err.print(msg, highlight=False), launch=run_ranks)
    print_inference(args.out, manifest)
    return 0


def print_inference(out_dir: str | Path, manifest) -> None:
    from trainer.infer import summary

    for line in summary(manifest):
        out.print(line, highlight=False)
    files = ", ".join(f"{e.path} {'×'.join(map(str, e.shape))} {e.dtype}" for e in manifest.arrays.values())
    out.print(f"inference written to [bold]{out_dir}[/]: {files}, inference.json (original vertex ids)")


def cmd_profiles(args: argparse.Namespace) -> int:
    from rich.table import Table

    from moment.topology.inventory import counts
    from moment.topology.profile_io import bundled_profiles, load_profile

    keys = ("sockets", "switches", "slots", "gpus", "nvme", "nics", "nvlinks")
    table = Table(title="bundled topology profiles (moment inspect NAME for details)")
    table.add_column("name", no_wrap=True)
    for key in keys:
        table.add_column(key, justify="right")
    for name, path in sorted(bundled_profiles().items()):
        c = counts(load_profile(path))
        table.add_row(name, *(str(c[k]) for k in keys))
    out.print(table)
    return 0


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
    _write_picture(machine, str(work / f"{args.profile}.svg"))
    out.rule("[bold]   and a live profile of this machine")
    live, warnings = profiler.build_profile(profiler.capture_live(), "this-machine")
    for w in warnings:
        out.print(f"[yellow]note:[/] {w}", highlight=False)
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
    _plan_picture(outcome.best, str(work / "plan.svg"))

    from placement.place import PlaceOptions, place
    from placement.placed import verify
    from placement.synth import synthesize

    out.rule("[bold]3. place: a generated power-law graph into the planned GPU caches, CPU caches and SSD bins")
    data = work / "dataset"
    synthesize(data, nodes=args.nodes, avg_degree=10, dim=64, dtype="float16", seed=0, train_fraction=0.05, replace=True)
    placed_dir = work / "placed"
    with RichProgress(err) as bars:
        manifest = place(work / "plan.json", data, placed_dir, PlaceOptions(gpu_cache="2%", cpu_cache="2%", epochs=2),
                         progress=bars, log=lambda msg: out.print(msg, highlight=False))
    print_placement(manifest)
    checked = verify(placed_dir, sample=5000)
    out.print(f"verified: {checked['files']} files match their checksums; {checked['sampled']:,} sampled features equal the source")
    out.rule("[bold]4. train: GraphSAGE, one DDP rank per GPU of the plan (CPU ranks with gloo here)")
    from trainer import launch

    from trainer import preflight

    metrics, checkpoints = work / "metrics.json", work / "checkpoints"
    nproc = launch.default_nproc(work / "plan.json") if args.nproc is None else args.nproc
    extra = ["--hidden", "128"]  # sampling: the placement's (DEMO_FANOUTS, DEMO_BATCH)
    # A demo run starts over: its own earlier checkpoint is replaced, as the earlier run's files are.
    argv = launch.trainer_argv(work / "plan.json", placed_dir, "sage", args.epochs, metrics, checkpoints, extra, overwrite=True)
    for note in preflight.preflight(argv, nproc, overwrite=True).warnings:
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    preflight.start_over(checkpoints)
    cmd = launch.build_torchrun_command(work / "plan.json", placed_dir, nproc=nproc, model="sage", epochs=args.epochs,
                                        metrics_json=metrics, checkpoint_dir=checkpoints, extra=extra, overwrite=True)
    out.print(f"running: {launch.format_command(cmd)}", highlight=False)
    code = launch.run(cmd)
    if code != 0:
        raise MomentError(f"training failed with exit code {code}")
    m = json.loads(metrics.read_text())
    last = m["epochs"][-1]
    out.print(f"trained {len(m['epochs'])} epoch(s): loss {last['loss']:.3f}, validation accuracy {last['val_acc']:.1%}, "
              f"test accuracy {m.get('test_acc', float('nan')):.1%} (chance {1 / 16:.1%})")
    out.rule("[bold]5. infer: embeddings and predictions for every vertex (layer by layer, full neighbourhood)")
    from trainer import infer

    opts = infer.InferOptions(data=placed_dir, checkpoint=checkpoints, out=work / "inference", plan=work / "plan.json")
    with RichProgress(err) as bars:
        inferred = infer.infer(opts, progress=bars, log=lambda msg: out.print(msg, highlight=False))
    print_inference(work / "inference", inferred)
    out.print(f"\nwrote {work}/: {DEMO_MARKER}, {args.profile}.svg, this-machine.yaml, plan.json, plan.svg, dataset/, placed/, "
              f"checkpoints/, metrics.json, inference/ ({', '.join(e.path for e in inferred.arrays.values())}, "
              f"inference.json)")
    return 0


DEMO_MARKER = "moment-demo.json"
DEMO_FANOUTS, DEMO_BATCH = [10, 5], 1024  # small enough for a 2-core machine to train in seconds


def _claim_workdir(work: Path) -> None:
    """The demo writes only into a directory that is new, empty, or an earlier demo's (its marker
    file says so); inside it, each stage refuses what it did not write."""
    from moment.fileio import atomic_write_text

    if work.is_symlink() or (work.exists() and not work.is_dir()):
        raise MomentError(f"{work}: not a directory: choose another --workdir")
    if work.exists() and any(work.iterdir()) and not (work / DEMO_MARKER).is_file():
        raise MomentError(f"{work}: exists, is not empty and is not a moment demo directory (no {DEMO_MARKER}): "
                          f"choose another --workdir")
    atomic_write_text(work / DEMO_MARKER, json.dumps({"format": "moment.demo/1"}) + "\n")


def _write_picture(machine, path: str) -> None:
    from moment.topology.picture import render_svg
    from moment.fileio import atomic_write_text

    if not path.endswith(".svg"):
        raise UsageError(f"--picture {path}: only .svg pictures are written")
    atomic_write_text(Path(path), render_svg(machine))
    err.print(f"picture written to {path}", highlight=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args)
    except MomentError as exc:
        err.print(f"[red]moment {args.verb}: error:[/] {escape(str(exc))}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # read-only file system, disk full, a directory where a file should be ...
        where = f"{exc.filename}: " if exc.filename else ""
        err.print(f"[red]moment {args.verb}: error:[/] {escape(where + str(exc.strerror or exc))}", highlight=False)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
