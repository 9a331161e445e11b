"""What a plan says about one layout, for people: rich tables and one-line summaries of a
:class:`~moment.planner.scoring.Scored` (the records themselves are in :mod:`moment.planner.scoring`)."""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

from moment.planner.flow import FLOW_MODELS, PRIMARY
from moment.planner.network import down_edge, edge_kind, edge_target, up_edge
from moment.planner.scoring import Scored, links_table
from moment.planner.workload import Workload


def busiest_links_table(s: Scored, limit: int = 8) -> Table:
    """The links closest to full at the prediction (per-link utilisation)."""
    table = Table(title=f"busiest links of {s.name} (of {sum(1 for r in links_table(s))})")
    for col in ("link", "capacity GB/s", "GB/iter", "utilisation"):
        table.add_column(col, justify="left" if col == "link" else "right")
    for row in links_table(s)[:limit]:
        style = "red" if row["edge"] in s.prop.bottleneck else ""
        table.add_row(
            short_label(row["label"]),
            f"{row['capacity_gbps']:.3g}",
            f"{row['load_gb']:.3g}",
            f"[{style}]{row['utilisation']:.0%}[/]" if style else f"{row['utilisation']:.0%}",
        )
    return table


def edge_notes(s: Scored) -> tuple[dict[str, str], set[str]]:
    """Per-port flow labels and the bottleneck ports, for the plan picture."""
    notes: dict[str, str] = {}
    hot: set[str] = set()
    T = s.prop.iteration_s
    port_of = {p.device.id: p.id for p, _ in s.machine.iter_ports() if p.device is not None}
    for key, load in s.prop.edge_load_gb.items():
        kind, ident = edge_kind(key), edge_target(key)
        if kind in ("up", "down"):
            target = ident
        elif kind == "upi":
            target = "upi"
        elif kind == "read" and key in s.prop.bottleneck and ident in port_of:
            target = port_of[ident]  # a saturated SSD: drawn on its own link
            notes[target] = f"{notes[target]}\nreads 100%" if target in notes else "reads 100%"
            hot.add(target)
            continue
        else:
            continue
        rate = load / T if T > 0 else 0.0
        util = s.prop.utilisation.get(key, 0.0)
        text = f"{'↑' if kind == 'up' else '↓' if kind == 'down' else ''}{rate:.3g} GB/s ({util:.0%})"
        notes[target] = f"{notes[target]}\n{text}" if target in notes else text
        if key in s.prop.bottleneck:
            hot.add(target)
    return notes, hot


def print_layout(console: Console, s: Scored) -> None:
    table = Table(title=f"layout {s.name}: which device goes in which slot")
    for col in ("device", "slot", "port", "socket", "link GB/s"):
        table.add_column(col)
    for row in s.to_dict()["slots"]:
        key = down_edge(row["port"]) if row["kind"] == "gpu" else up_edge(row["port"])  # the way its data flows
        cap = s.net.edges.get(key, (None, None, None))[2]
        table.add_row(row["device"], row["slot"] or "-", row["port"], row["socket"], f"{cap:.3g}" if cap else "-")
    console.print(table)


def seconds(x: float) -> str:
    """A predicted time with four significant digits, trailing zeros kept (0.5000, 0.0001860):
    fixed decimals would show a fast layout's 0.000186 s as 0.0002."""
    return f"{x:#.4g}".rstrip(".")


def print_prediction(console: Console, s: Scored, workload: Workload) -> None:
    d = s.to_dict()
    times = ", ".join(f"{seconds(p.iteration_s)} s ({FLOW_MODELS[m].title})" for m, p in s.predictions.items())
    console.print(
        f"[bold]{s.name}[/]: predicted iteration {times}; "
        f"per GPU {', '.join(f'{x:.3g}' for x in d['gbps_per_gpu'])} GB/s; imbalance {d['imbalance']:.3f}"
    )
    if d["bottleneck"]:
        console.print(f"  bottleneck: [red]{bottleneck_summary(s, limit=6)}[/]")
    if d["models_differ"]:
        console.print(f"  [yellow]{d['models_differ']}[/]")


def nodes_line(n: dict) -> str:
    """``moment plan --nodes N``'s prediction in one line (the plan's ``nodes`` record): the two
    terms, the one that bounds the iteration, and where the compute figure came from."""
    one = max(n["data_iteration_s"], n["compute_s"])  # one server's iteration, no network
    speed = n["nodes"] * one / n["iteration_s"] if n["iteration_s"] > 0 else float(n["nodes"])
    return (
        f"with {n['nodes']} such servers: {seconds(n['iteration_s'])} s per iteration = max(local reads "
        f"{seconds(n['data_iteration_s'])} s, compute {seconds(n['compute_s'])} s) + gradient all-reduce "
        f"{seconds(n['allreduce_s'])} s, bound by {n['bound']}; compute {n['compute_source']}; "
        f"{n['parameters']:,} parameters, ring over {n['nic_gbps']:.3g} GB/s NICs, {n['nic_source']}: "
        f"{speed:.2f}× one server's seeds/s"
    )


_LINK = re.compile(r"^(link|uplink) of (\S+) \(.*\) (up|down)$")


def short_label(label: str) -> str:
    """'link of gpu2 (switch 0 slot (bus 3b)) up' → 'gpu2 link ↑'."""
    m = _LINK.match(label)
    if m:
        return f"{m.group(2)} {m.group(1)} {'↑' if m.group(3) == 'up' else '↓'}"
    return label


def bottleneck_summary(s: Scored, limit: int = 3) -> str:
    """The tight links in a few words: SSD reads grouped, the rest by short name."""
    labels = [s.net.labels[e] for e in s.prop.bottleneck]
    ssd = [x for x in labels if x.endswith(" reads")]
    rest = [short_label(x) for x in labels if not x.endswith(" reads")]
    n_ssd = len(s.net.tier_bins("ssd"))
    parts = ([f"SSD reads ({len(ssd)}/{n_ssd})"] if ssd else []) + rest
    more = len(parts) - limit
    return ", ".join(parts[:limit]) + (f" +{more}" if more > 0 else "") if parts else "-"


def ranking_table(title: str, rows: list[Scored], best_s: float) -> Table:
    table = Table(title=title)
    others = [m for m in FLOW_MODELS if m != PRIMARY]  # a column of times per other flow model
    for col in ("layout", "GPUs", "SSDs", "s/iter", "vs best", *others, "bottleneck"):
        table.add_column(col, justify="right" if col in ("s/iter", "vs best", *others) else "left")
    for s in rows:
        table.add_row(
            s.name,
            _spread(s, "gpu"),
            _spread(s, "nvme"),
            seconds(s.prop.iteration_s),
            f"{s.prop.iteration_s / best_s:.2f}×",
            *(seconds(s.predictions[m].iteration_s) for m in others),
            bottleneck_summary(s),
        )
    return table


def _spread(s: Scored, kind: str) -> str:
    """e.g. 'sw0:2 sw1:2' — devices counted by the switch (or socket) they hang off."""
    counts: dict[str, int] = {}
    parents = {p.id: sw.id for sw in s.machine.switches() for p in sw.ports}
    for port, socket in s.machine.iter_ports():
        if port.device is not None and port.device.kind == kind and port.id in s.layout:
            key = parents.get(port.id, socket.id)
            counts[key] = counts.get(key, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"
