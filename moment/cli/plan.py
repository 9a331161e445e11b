"""Stage 2 verbs: ``moment plan`` (search and rank layouts, write plan.json) and ``moment score``
(predict one layout)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from moment.cli.args import registry_choices
from moment.cli.output import err, out
from moment.errors import UsageError
from moment.fileio import check_file_target
from moment.progress import Reporter, stage_update

if TYPE_CHECKING:
    from moment.planner.nodes import Compute
    from moment.planner.workload import Workload


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", metavar="FILE", help="workload YAML/JSON (default: the profile's, else built-in)")
    p.add_argument("--nvlink", choices=("on", "off"), default="on", help="what-if: drop the profile's NVLink (off)")
    engine = p.add_argument("--engine", default="ortools", help="max-flow engine of the paper model")
    registry_choices(engine, "moment.planner.flow.engines", "MAX_FLOW_ENGINES")


def add_plan(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "--method",
        choices=("auto", "enumerate", "milp"),
        default="auto",
        help="enumerate every distinct layout (bound-pruned), or a MILP per GPU placement (auto: by size)",
    )
    solver = p.add_argument(
        "--milp-solver",
        default="ortools",
        help="the MILP's solver: ortools (SCIP, default) or pulp-cbc (CBC through PuLP)",
    )
    registry_choices(solver, "moment.planner.flow.milp", "MILP_SOLVERS")
    p.add_argument(
        "--nodes",
        metavar="N",
        help="also predict the iteration with N such servers: the longer of the local reads and the compute, "
        "plus the gradient all-reduce over the NIC",
    )
    p.add_argument(
        "--compute-from",
        metavar="metrics.json",
        help="with --nodes: the compute per iteration an earlier run measured (moment train --metrics-json: its "
        "training time not spent waiting for data), instead of the estimate from the model's FLOPs",
    )
    p.add_argument("--out", metavar="plan.json", help="write the plan for `moment place` and the trainer")
    p.add_argument("--picture", metavar="FILE.svg", help="draw the best layout with the flow on every link")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    _add_workload_args(p)
    p.set_defaults(func=cmd_plan)


def add_score(sub: argparse._SubParsersAction) -> None:
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


def _machine_and_workload(args: argparse.Namespace):
    from moment.planner.workload import load_workload
    from moment.topology.profile_io import resolve_profile

    machine = resolve_profile(args.profile)
    if args.nvlink == "off":
        machine = machine.model_copy(update={"nvlinks": []})
    return machine, load_workload(machine.workload, args.workload)


def _workload_shape(workload: Workload):
    """The run the workload describes, as the trainer sizes it, with
    :data:`~moment.planner.nodes.DEFAULT_CLASSES` classes (a workload names none)."""
    from moment.planner.nodes import DEFAULT_CLASSES
    from trainer.memory import shape_of_workload  # torch: only for --nodes

    return shape_of_workload(workload, ranks_per_node=1, sockets=1, classes=DEFAULT_CLASSES)


def workload_parameters(workload: Workload) -> int:
    """Parameters of the workload's model, by the trainer's own count (formulas where the model
    registers them, no PyG import) at its feature width, ``hidden`` and fan-outs."""
    from trainer.memory import model_parameters

    return model_parameters(_workload_shape(workload))


def workload_step_flops(workload: Workload) -> float:
    """FLOPs of one training step (forward and backward) of the workload's model on one batch,
    by the trainer's own count (:mod:`trainer.flops`)."""
    from trainer.flops import step_flops

    return step_flops(_workload_shape(workload))


def _estimated_compute(machine, workload: Workload, scored) -> Compute:
    """The step's FLOPs on the slowest GPU of the layout ``scored``."""
    from moment.planner.nodes import estimated_compute

    kinds = {d.id: d.kind for d in machine.devices()}
    gpus = [d for d in scored.layout.values() if kinds.get(d) == "gpu"]
    return estimated_compute(machine, gpus, workload_step_flops(workload))


def cmd_plan(args: argparse.Namespace) -> int:
    from moment.planner.nodes import check_nodes, measured_compute, nodes_prediction
    from moment.planner.plan import check_ssd_tier, default_counts, parse_range, plan

    machine, workload = _machine_and_workload(args)
    have_gpus, have_ssds = default_counts(machine)
    gpus = parse_range(args.gpus, "gpus") if args.gpus else [have_gpus]
    ssds = parse_range(args.ssds, "ssds") if args.ssds else [have_ssds]
    if args.top < 1:
        raise UsageError("--top must be at least 1")
    nodes = None if args.nodes is None else check_nodes(args.nodes)
    if args.compute_from and nodes is None:
        raise UsageError("--compute-from needs --nodes N (it is the compute of the several-server prediction)")
    if len(gpus) > 1 or len(ssds) > 1:
        if nodes is not None:
            raise UsageError("--nodes needs one GPU count and one SSD count, not a range")
        return _sweep(machine, workload, gpus, ssds, args)
    for target in (args.out, args.picture):
        if target:
            check_file_target(target)
    check_ssd_tier(machine, workload, args.profile, gpus[0], ssds[0])
    # a bad metrics file is refused before the search, and nothing is written
    measured = measured_compute(args.compute_from) if args.compute_from else None
    with Reporter(err) as report:
        outcome = plan(
            machine,
            workload,
            gpus[0],
            ssds[0],
            top=args.top,
            method=args.method,
            engine=args.engine,
            milp_solver=args.milp_solver,
            progress=stage_update(report, "plan search"),
        )
    several = None
    if nodes is not None:
        compute = measured or _estimated_compute(machine, workload, outcome.best)
        several = nodes_prediction(
            machine, workload_parameters(workload), outcome.best.prop.iteration_s, nodes, compute
        )
    if args.out:
        from moment.planner.planfile import save_plan

        save_plan(machine, workload, outcome, args.out, several)
    if args.picture:
        plan_picture(outcome.best, args.picture)
    if args.json:
        print(
            json.dumps(
                {
                    "profile": machine.name,
                    "workload": workload.describe(),
                    "tier_shares": outcome.best.net.shares,
                    "search": outcome.search,
                    "best": outcome.best.to_dict(),
                    "ranking": [s.to_dict() for s in outcome.ranking],
                    "classic": {k: v.to_dict() for k, v in outcome.classic.items()},
                    **({"nodes": several} if several is not None else {}),
                },
                indent=2,
            )
        )
        return 0
    from moment.planner.report import busiest_links_table, nodes_line, print_layout, print_prediction, ranking_table

    srch = outcome.search
    out.print(f"[bold]{machine.name}[/]: {srch['gpus']} GPUs, {srch['ssds']} SSDs")
    out.print(f"workload: {workload.describe()}")
    shares = outcome.best.net.shares
    out.print(
        f"reads served by: GPU caches {shares['gpu']:.1%}, CPU cache {shares['cpu']:.1%}, SSDs {shares['ssd']:.1%}"
    )
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
    if several is not None:
        out.print(nodes_line(several))
    out.print(busiest_links_table(outcome.best))
    best_s = outcome.best.prop.iteration_s
    out.print(ranking_table("top layouts", outcome.ranking, best_s))
    if outcome.classic:
        out.print(ranking_table("the profile's named layouts, scored", list(outcome.classic.values()), best_s))
    for note in outcome.best.net.notes:
        out.print(f"[yellow]note:[/] {note}")
    if args.out:
        out.print(f"plan written to [bold]{args.out}[/]")
    return 0


def _sweep(machine, workload, gpus: list[int], ssds: list[int], args: argparse.Namespace) -> int:
    """The best time of every GPU and SSD count in the ranges; counts that do not fit the slots
    (or leave an SSD-reading workload without SSDs) are skipped and listed, even all of them (the
    list is the sweep's answer then, as a table is otherwise). Each count is one
    search on the machine's shared :class:`~moment.planner.search.Space`, and ties are not broken
    on headroom (the time is the plan's; ``moment plan`` for one count picks among equals)."""
    from moment.planner.plan import check_ssd_tier, plan
    from moment.planner.search import Space

    if args.out or args.picture:
        raise UsageError("--out/--picture need one GPU count and one SSD count, not a range")
    space = Space.of(machine)
    todo: list[tuple[int, int, str | None]] = []
    skipped: list[tuple[int, int, str | None]] = []
    for g in gpus:
        for s in ssds:
            why = space.misfit(g, s)
            if why is None:
                try:
                    check_ssd_tier(machine, workload, args.profile, g, s)
                except UsageError:
                    why = f"the workload reads {workload.tier_shares()['ssd']:.1%} of its rows from SSDs"
            (todo if why is None else skipped).append((g, s, why))
    rows = []
    with Reporter(err) as report:
        if todo:
            report("plan sweep", 0, len(todo))
        for i, (g, s, _) in enumerate(todo, 1):
            outcome = plan(
                machine,
                workload,
                g,
                s,
                top=1,
                method=args.method,
                engine=args.engine,
                milp_solver=args.milp_solver,
                space=space,
                ties=0,
            )
            rows.append({"gpus": g, "ssds": s, **outcome.best.to_dict()})
            report("plan sweep", i, len(todo))
    if args.json:
        gone = [{"gpus": g, "ssds": s, "reason": why} for g, s, why in skipped]
        print(json.dumps({"profile": machine.name, "sweep": rows, "skipped": gone}, indent=2))
        return 0
    if rows:
        out.print(sweep_table(machine.name, rows))
    else:
        out.print(f"no GPU and SSD count of the sweep fits {machine.name}")
    if skipped:
        out.print(f"skipped {len(skipped)} of {len(skipped) + len(todo)} counts:")
        for line in _skipped_lines(skipped):
            out.print(f"  {line}", soft_wrap=True)
    return 0


def sweep_table(name: str, rows: list[dict]):
    """One row per count: the best time, and the marginal value of one more SSD (the iteration's
    speed-up over one SSD fewer) and of one more GPU (the throughput, GPUs per iteration time,
    over one GPU fewer with as many SSDs), where the sweep has that neighbour."""
    from rich.table import Table

    from moment.planner.report import seconds

    table = Table(title=f"{name}: best layout per GPU and SSD count")
    for col in ("GPUs", "SSDs", "iteration s", "GB/s per GPU", "+1 SSD", "+1 GPU", "bottleneck"):
        table.add_column(col, justify="right" if col != "bottleneck" else "left")
    t = {(r["gpus"], r["ssds"]): r["predicted_iteration_s"] for r in rows}
    for r in rows:
        g, s, here = r["gpus"], r["ssds"], r["predicted_iteration_s"]
        ssd = f"{t[g, s - 1] / here:.2f}×" if (g, s - 1) in t else "-"
        gpu = f"{(g / here) / ((g - 1) / t[g - 1, s]):.2f}×" if g > 1 and (g - 1, s) in t else "-"
        table.add_row(
            str(g),
            str(s),
            seconds(here),
            f"{min(r['gbps_per_gpu']):.3g}",
            ssd,
            gpu,
            (r["bottleneck"] or ["-"])[0],
        )
    return table


def _skipped_lines(skipped: list[tuple[int, int, str | None]]) -> list[str]:
    """Skipped counts, one line per block of GPU and SSD counts that fail the same way:
    ``5..8 GPUs, 13..16 SSDs: why``."""
    runs: list[list] = []  # [g, s_lo, s_hi, why]: consecutive SSD counts of one GPU count
    for g, s, why in skipped:
        if runs and runs[-1][0] == g and runs[-1][2] == s - 1 and runs[-1][3] == why:
            runs[-1][2] = s
        else:
            runs.append([g, s, s, why])
    blocks: list[list] = []  # [g_lo, g_hi, s_lo, s_hi, why]
    for g, lo, hi, why in runs:
        same = [b for b in blocks if b[1] == g - 1 and b[2:] == [lo, hi, why]]
        if same:
            same[0][1] = g
        else:
            blocks.append([g, g, lo, hi, why])

    def span(lo: int, hi: int, what: str) -> str:
        return f"{lo} {what}{'' if lo == hi == 1 else 's'}" if lo == hi else f"{lo}..{hi} {what}s"

    return [f"{span(g0, g1, 'GPU')}, {span(s0, s1, 'SSD')}: {why}" for g0, g1, s0, s1, why in blocks]


def cmd_score(args: argparse.Namespace) -> int:
    from moment.planner.plan import resolve_layout
    from moment.planner.report import busiest_links_table, print_layout, print_prediction
    from moment.planner.scoring import bin_targets, links_table, score

    machine, workload = _machine_and_workload(args)
    name, layout = resolve_layout(machine, args.layout)
    scored = score(machine, name, layout, workload, engine=args.engine)
    if args.picture:
        plan_picture(scored, args.picture)
    if args.json:
        print(
            json.dumps(
                {
                    "profile": machine.name,
                    "tier_shares": scored.net.shares,
                    **scored.to_dict(),
                    "bin_targets": bin_targets(scored, workload),
                    "links": links_table(scored),
                },
                indent=2,
            )
        )
        return 0
    out.print(f"workload: {workload.describe()}")
    print_layout(out, scored)
    print_prediction(out, scored, workload)
    out.print(busiest_links_table(scored))
    for note in scored.net.notes:  # what the figures rest on (pages moved, IOPS-bound SSDs), as plan says
        out.print(f"[yellow]note:[/] {note}")
    return 0


def plan_picture(scored, path: str) -> None:
    """A layout with the flow on every link as SVG at ``path`` (``--picture``), bottleneck in red."""
    from moment.fileio import atomic_write_text
    from moment.planner.report import edge_notes, seconds
    from moment.topology.picture import render_svg

    if not path.endswith(".svg"):
        raise UsageError(f"--picture {path}: only .svg pictures are written")
    notes, hot = edge_notes(scored)
    title = f"{scored.machine.name} — layout {scored.name}: {seconds(scored.prop.iteration_s)} s per iteration (bottleneck in red)"
    atomic_write_text(Path(path), render_svg(scored.machine, notes, hot, title))
    err.print(f"picture written to {path}")
