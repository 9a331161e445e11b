"""Stage 3 verbs: ``moment dataset synth|import`` (a graph on disk), ``moment place`` (features
into GPU caches, CPU caches and SSD bins per a plan) and ``moment verify``."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from rich.markup import escape

from moment.cli.args import Parser, non_negative, positive, registry_choices
from moment.cli.output import err, out
from moment.errors import UsageError
from moment.progress import Reporter
from moment.sizes import parse_bytes


def add_dataset(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dataset", help="make or import a graph dataset (CSR + features on disk)")
    dsub = p.add_subparsers(dest="dataset_verb", metavar="ACTION", parser_class=Parser, required=True)
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
    dtype = s.add_argument("--dtype", default="float16", help="feature type (default float16)")
    registry_choices(dtype, "moment.contracts.dataset", "FEATURE_DTYPES")
    s.add_argument("--classes", type=int, default=16, help="planted communities = label classes (default 16)")
    s.add_argument(
        "--train-fraction",
        type=float,
        default=0.01,
        help="share of vertices in the train split (default 0.01, as the paper's runs)",
    )
    s.add_argument("--seed", type=int, default=0, help="the same seed gives the same dataset (default 0)")
    s.add_argument("--out", required=True, help="dataset directory to create")
    s.set_defaults(func=cmd_dataset_synth)
    from placement.importers import DEFAULT_FORMAT, IMPORTERS

    i = dsub.add_parser(
        "import",
        help="import a dataset from disk: plain .npy arrays, IGB, or OGB (binary or CSV) files",
        description="Read the files users have on disk and write a moment dataset; the CSR is built out of core "
        "within --memory. Formats: " + "; ".join(f"{k}: {v.help}" for k, v in IMPORTERS.items()) + ".",
        epilog="IGB splits (IGB ships none), over the L labelled vertices, from one torch.randperm(L) seeded with "
        "--seed: mlperf (seed 42): train = first int(0.6 L), val = next int(0.005 L) (MLPerf's "
        "split_seeds.py), test = next int(0.005 L); igb (seed 0): 60/20/20 (int(0.6 L), int(0.2 L), the "
        "rest), shuffled; fraction:F (seed 0): train round(F L), val and test round(F L / 2) each.",
    )
    i.add_argument(
        "--format",
        choices=tuple(IMPORTERS),
        default=DEFAULT_FORMAT,
        help=f"what --root or the files hold (default {DEFAULT_FORMAT})",
    )
    i.add_argument("--root", help="igb: the directory holding <size>/processed; ogb: the one holding raw/ and split/")
    i.add_argument("--size", help="igb: tiny, small, medium, large or full")
    i.add_argument("--classes", type=int, help="igb: 19 (default) or 2983 label classes")
    i.add_argument(
        "--split",
        help="igb: mlperf, igb (default) or fraction:F; ogb: the split directory (default: the only one, e.g. time)",
    )
    i.add_argument(
        "--labelled",
        type=int,
        help="igb: only the first N vertices are labelled, the rest is padding "
        "(default: all; full: IGB's published counts)",
    )
    i.add_argument("--features", help="npy: N×d .npy (float32/float16)")
    i.add_argument("--edges", help="npy: E×2 .npy edge list (src, dst)")
    i.add_argument("--indptr", help="npy: CSR indptr .npy (with --indices)")
    i.add_argument("--indices", help="npy: CSR indices .npy (with --indptr)")
    i.add_argument("--labels", help="npy: N .npy of class ids")
    i.add_argument("--train", help="npy: train vertex ids .npy (default: a random 1%%)")
    i.add_argument("--val", help="npy: validation vertex ids .npy")
    i.add_argument("--test", help="npy: test vertex ids .npy")
    convert = i.add_argument("--feature-dtype", help="convert the features (default: keep)")
    registry_choices(convert, "moment.contracts.dataset", "FEATURE_DTYPES")
    i.add_argument(
        "--copy-features",
        action="store_true",
        help="copy the features into the dataset (default: a C-order float32/float16 .npy or IGB raw file is "
        "read in place, its identity recorded and checked on every open)",
    )
    i.add_argument("--undirected", action="store_true", help="add the reverse of every edge (duplicates kept)")
    i.add_argument("--self-loops", action="store_true", help="give every vertex exactly one self-loop")
    i.add_argument("--memory", help="RAM budget of the CSR build, e.g. 4GB (default: half the available memory)")
    i.add_argument("--dry-run", action="store_true", help="print the schema and the RAM and disk needed; write nothing")
    i.add_argument("--seed", type=int, help="seed of the drawn splits (npy: default 0; igb: the convention's)")
    i.add_argument("--out", required=True, help="dataset directory to create")
    for imp in IMPORTERS.values():  # a registered format's own options
        for key, about in imp.option_help.items():
            with contextlib.suppress(argparse.ArgumentError):  # one another format has added already
                i.add_argument("--" + key.replace("_", "-"), help=f"{imp.name}: {about}")
    i.set_defaults(func=cmd_dataset_import)


def add_place(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "place",
        help="place a dataset's features into GPU caches, CPU caches and SSD bins per a plan",
        description=(
            "Pre-sample hotness with the trainer's sampler, re-solve the plan's flow model for this dataset, its "
            "measured hotness and the cache sizes used, place vertices with DDAK (or the hash baseline) against "
            "those per-bin traffic targets, and write the placed dataset: cache bins, one bin per SSD, the row map, "
            "and the dataset's topology, labels and splits as hard links (copies across file systems). Crash-safe: a killed run resumes when run again."
        ),
    )
    p.add_argument("--plan", required=True, help="plan.json from `moment plan`")
    p.add_argument("--dataset", required=True, help="dataset directory")
    p.add_argument("--out", required=True, help="placed dataset directory")
    policy = p.add_argument("--policy", default="ddak", help="placement policy")
    registry_choices(policy, "placement.policies", "POLICIES", about="policy_help")
    p.add_argument(
        "--gpu-cache",
        metavar="SIZE",
        help="feature cache of each GPU (every GPU holds the same rows): 2GB, 512MiB, 1%% (of vertices), "
        "20000rows; a bare number is bytes (default: the plan's workload's, gpu_cache_rows or gpu_cache_gb; "
        "none unless set)",
    )
    p.add_argument(
        "--cpu-cache",
        metavar="SIZE",
        help="CPU feature cache (one copy in each socket's memory), same units "
        "(default: the plan's workload's, cpu_cache_rows or cpu_cache_fraction; 1%%)",
    )
    p.add_argument(
        "--ssd-dir",
        action="append",
        default=[],
        metavar="BIN=DIR",
        help="directory (mount point) for an SSD bin, e.g. nvme0=/mnt/nvme0 (default: OUT/bins/BIN)",
    )
    p.add_argument("--hotness", metavar="FILE.npy", help="use a saved hotness instead of pre-sampling")
    p.add_argument(
        "--epochs",
        type=positive,
        help="pre-sample exactly this many epochs (default: until the hotness estimate converges, see --tolerance, "
        "at most one epoch)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.005,
        help="pre-sampling stops when the caches' read share, ranked on one half of the sample, differs by at most "
        "this between the halves (default 0.005)",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="lay each SSD bin's rows out in the order the trainer's first batches read them (replayed with "
        "--seed, the pre-sampling's fan-outs and batch size, --pack-ranks ranks): rows a batch reads share pages, "
        "so rows smaller than a page move fewer bytes; train with the same --seed, ranks and CPU sampling "
        "(the mode without --pack-budget)",
    )
    p.add_argument(
        "--pack-epochs", type=positive, default=1, help="training epochs --pack replays and packs for (default 1)"
    )
    p.add_argument(
        "--pack-ranks", type=positive, help="training ranks --pack replays (default: the plan's GPUs, one rank each)"
    )
    p.add_argument(
        "--pack-budget",
        metavar="SIZE",
        help="implies --pack: instead of ordering the bins, copy each replayed batch's SSD rows into a chunk of its "
        "own beside the bin (one large read per batch), rows many batches read into a shared page-reordered cache, "
        "all within SIZE of extra disk (e.g. 20GB, or 2x the SSD bins); too small for the shared cache is refused "
        "(default: none, the bins' rows ordered in place, no extra disk); train with --reuse-samples past "
        "--pack-epochs",
    )
    p.add_argument("--pool", type=positive, default=100, help="DDAK pool size (default 100)")
    priority = p.add_argument(
        "--priority",
        default="projected",
        help="DDAK bin priority: projected (default, matches the plan's targets) or the "
        "paper's (access/target)×(used/capacity)",
    )
    registry_choices(priority, "placement.ddak", "PRIORITIES")
    p.add_argument(
        "--profile",
        help="the plan's profile (bundled name or YAML file) where it is not bundled; "
        "a plan made for another profile is refused",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="pre-sampling seed, and the training --seed whose batches --pack replays (default 0)",
    )
    p.add_argument("--json", action="store_true", help="print the manifest")
    p.set_defaults(func=cmd_place)
    what = "re-check a placed dataset: checksums, counts, features against the source"
    v = sub.add_parser("verify", help=what, description=what)
    v.add_argument("placed", help="placed dataset directory")
    v.add_argument("--source", help="source dataset (default: the one the manifest names)")
    v.add_argument(
        "--sample", type=non_negative, default=10_000, help="vertices to compare with the source (default 10000)"
    )
    v.set_defaults(func=cmd_verify)


def cmd_dataset_synth(args: argparse.Namespace) -> int:
    from placement import synth

    need = synth.estimate(args.nodes, args.avg_degree, args.dim, args.dtype, classes=args.classes)
    total = sum(need.values())
    out.print(
        f"generating {args.nodes:,} vertices, ~{args.nodes * args.avg_degree:,.0f} edges, "
        f"{args.dim}-dim {args.dtype} features: ~{total / 1e9:.2f} GB on disk"
    )
    synth.check_free_space(Path(args.out), total)
    with Reporter(err) as progress:
        ds = synth.synthesize(
            args.out,
            nodes=args.nodes,
            avg_degree=args.avg_degree,
            dim=args.dim,
            dtype=args.dtype,
            seed=args.seed,
            classes=args.classes,
            train_fraction=args.train_fraction,
            progress=progress,
        )
    out.print(
        f"dataset written to [bold]{ds.root}[/]: {ds.num_nodes:,} vertices, {ds.num_edges:,} edges, "
        f"{ds.num_classes} classes, {len(ds.split('train')):,} training vertices"
    )
    return 0


def cmd_dataset_import(args: argparse.Namespace) -> int:
    from placement.importers import COMMON, IMPORTERS, all_options, run

    imp = IMPORTERS[args.format]
    given = {key: getattr(args, key, None) for key in (*COMMON, *all_options())}
    if args.memory is not None:
        given["memory"] = parse_bytes(args.memory, "--memory")

    def log(line: str) -> None:
        (err if line.startswith("warning:") else out).print(escape(line))

    with Reporter(err) as progress:
        ds = run(imp.name, args.out, given, progress=None if args.dry_run else progress, log=log)
    if ds is not None:
        out.print(
            f"dataset written to [bold]{ds.root}[/]: {ds.num_nodes:,} vertices, {ds.num_edges:,} edges, "
            f"{ds.num_classes} classes, {len(ds.split('train')):,} training vertices"
        )
    return 0


def cmd_place(args: argparse.Namespace) -> int:
    from placement.place import PlaceOptions, place
    from placement.report import print_placement, print_timings

    dirs = {}
    for spec in args.ssd_dir:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d:
            raise UsageError(f"--ssd-dir {spec!r}: expected BIN=DIR, e.g. nvme0=/mnt/nvme0")
        if name in dirs:
            raise UsageError(f"--ssd-dir {spec!r}: {name} is given a directory twice")
        dirs[name] = Path(d)
    profile = None
    if args.profile:
        from moment.topology.profile_io import resolve_profile

        profile = resolve_profile(args.profile)
    opts = PlaceOptions(
        policy=args.policy,
        gpu_cache=args.gpu_cache,
        cpu_cache=args.cpu_cache,
        ssd_dirs=dirs,
        hotness=Path(args.hotness) if args.hotness else None,
        epochs=args.epochs,
        tolerance=args.tolerance,
        pool=args.pool,
        priority=args.priority,
        seed=args.seed,
        profile=profile,
        pack=args.pack,
        pack_epochs=args.pack_epochs,
        pack_ranks=args.pack_ranks,
        pack_budget=args.pack_budget,
    )
    with Reporter(err) as bars:
        manifest = place(args.plan, args.dataset, args.out, opts, progress=bars, log=err.print)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    print_placement(out, manifest)
    print_timings(out, manifest)
    out.print(
        f"placed dataset written to [bold]{args.out}[/]  (check it with `moment verify {args.out}`; "
        f"re-plan with the measured workload: `moment plan --workload {args.out}/workload.yaml ...`)"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from placement.placed import verify

    result = verify(args.placed, args.source, sample=args.sample)
    out.print(
        f"[green]ok[/]: {result['files']} files match their checksums, {result['rows']:,} rows, "
        f"{result['sampled']:,} sampled features equal the source"
        + (" (--sample 0: the source not read)" if not result["sampled"] else "")
    )
    return 0
