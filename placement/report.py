"""A placement for people: per bin, per tier, achieved against predicted (``moment place`` and
``moment demo`` print it; ``--json`` prints the manifest itself)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


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
