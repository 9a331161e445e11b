"""A placement for people: per bin, per tier, achieved against predicted (``moment place`` and
``moment demo`` print it; ``--json`` prints the manifest itself)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from moment.contracts.placed import PHASES


def print_placement(console: Console, manifest: dict[str, Any]) -> None:
    """Per bin: rows, fill, and access share against its target; per tier: predicted against
    achieved. Shares are also given within the tier: how much a tier serves is set by hotness and
    cache sizes; how it splits over the tier's bins is what DDAK controls."""
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
        table.add_row(
            b["name"],
            b["tier"],
            f"{b['count']:,}",
            f"{b['count'] / max(b['capacity'], 1):.0%}",
            f"{b['target']:.2%}",
            f"{b['achieved']:.2%}",
            f"{b['target'] / t:.1%}" if t else "-",
            f"{b['achieved'] / g:.1%}" if g else "-",
        )
    console.print(table)
    whose = (
        "predicted for this dataset" if pred["source"] == "dataset" else "the plan's prediction, for its own workload"
    )
    console.print(
        f"reads served per tier, achieved vs predicted ({whose}; {pred['iteration_s']:.4g} s per iteration "
        f"on {pred['profile']}, layout {pred['layout']}): "
        + ", ".join(f"{k} {tier_got[k]:.2%} vs {pred['tier_shares'][k]:.2%}" for k in tier_got)
    )
    pack = manifest.get("pack")
    if pack and pack["useful_bytes"]:
        useful = pack["useful_bytes"]
        console.print(
            f"packed for {pack['batches']:,} replayed batches ({pack['epochs']} epoch(s), {pack['ranks']} rank(s), "
            f"seed {pack['seed']}): the SSD pages they read are {pack['packed_bytes'] / useful:.2f}× their feature "
            f"bytes, {pack['unpacked_bytes'] / useful:.2f}× with rows in id order; train with that seed and rank count "
            "(--reuse-samples past those epochs)"
        )
    if pack and pack.get("samples"):
        s, useful = pack["samples"], pack["useful_bytes"]
        console.print(
            f"their samples stored for the trainer to load instead of sampling: {s['bytes'] / 1e9:.3f} GB in the "
            f"placed directory ({s['bytes'] / max(s['batches'], 1) / 2**10:.0f} KiB per batch; "
            f"{s['bytes'] / max(useful, 1):.2f}× the feature bytes those batches read from the SSD bins)"
        )
    if pack and pack.get("chunks"):
        c = pack["chunks"]
        shared = sum(b["shared"]["bytes"] for b in c["bins"].values())
        console.print(
            f"per-batch chunks and shared caches beside the SSD bins: {c['bytes'] / 1e9:.3f} GB of the "
            f"{c['budget'] / 1e9:.3f} GB --pack-budget, {shared / 1e9:.3f} GB of them the shared cache (rows read "
            f"by more than {c['threshold']} replayed batches, in {c['order']} order; the others copied into each "
            "batch's chunk, each chunk from a page)"
        )


def print_timings(console: Console, manifest: dict[str, Any]) -> None:
    """Seconds per phase (placed.json ``timings_s``), with the hotness sample behind the placement."""
    t = manifest.get("timings_s") or {}
    if not t:
        return
    table = Table(title="where the time went (checksums and fsync partly overlap bin writing)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("of total", justify="right")
    for key, what in PHASES.items():
        if key in t:
            table.add_row(what, f"{t[key]:.2f}", f"{t[key] / t['total']:.0%}" if t.get("total") else "-")
    console.print(table)
    hot = manifest["hotness"]
    bound = "not measured" if hot.get("bound") is None else f"{hot['bound']:.4f}"
    until = f"sampled until ≤ {hot['tolerance']}" if hot.get("tolerance") else f"{hot['epochs']} epoch(s) as asked"
    console.print(f"hotness sample: {hot['batches']:,} batches ({until}); split-half gap at the caches {bound}")
