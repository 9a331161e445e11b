"""The plan's prediction, re-solved for the dataset being placed.

A plan's bin targets are for the workload it was made with (usually the profile's default: a
paper-sized graph and a Zipf-like hotness guess). ``moment place`` knows better once it has
pre-sampled: the dataset's size and row width, the measured hotness curve and unique rows per
batch, and the cache sizes it is about to fill. :func:`measured_workload` puts these into the
planner's :class:`Workload` (caches in its own terms, so that ``gpu_cache_rows()`` and
``cpu_cache_rows()`` give back exactly the rows placed), and :func:`predict` re-solves the
proportional model for the plan's layout on the plan's profile: those bin shares are DDAK's
targets, and the tier shares what the achieved ones are compared with. The shares are of
feature rows; ``ssd_amplification`` is apart: the bytes the SSDs move per feature byte read from
them (whole pages, :mod:`moment.ssd_reads`), which the trainer's page count (metrics.json
``ssd_read_amplification``) is compared with. ``workload.yaml`` holds
that workload, so ``moment score --profile P --layout plan.json --workload OUT/workload.yaml``
reproduces the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import yaml

from moment.contracts.placed import PredictedWorkload, Prediction
from moment.contracts.plan import PlanDoc, TierShares
from moment.errors import MomentError
from moment.fileio import atomic_write_text
from moment.planner.scoring import bin_targets, rescore
from moment.planner.workload import Workload
from moment.topology.model import Machine
from placement.dataset import Dataset
from placement.hotness import CURVE_POINTS, Hotness, access_curve


def measured_workload(base: Workload, ds: Dataset, hot: Hotness, gpu_rows: int, cpu_rows: int) -> Workload:
    """``base`` (the plan's workload) with what placing ``ds`` measured and uses: its size, the
    pre-sampling's fan-outs, batch size and unique rows per batch, the measured hotness curve
    (also at the cache boundaries, so the tier shares it gives are the placement's), and
    ``gpu_rows`` (each GPU) / ``cpu_rows`` (each socket) as ``gpu_cache_gb`` and
    ``cpu_cache_fraction``."""
    n, rb = ds.num_nodes, ds.row_bytes
    bounds = {gpu_rows / n, (gpu_rows + cpu_rows) / n}
    points = sorted(x for x in {*CURVE_POINTS, *bounds} if 0 < x < 1)
    w = Workload.model_validate(
        {
            **base.model_dump(),
            "dataset": ds.meta.get("name") or "dataset",
            "nodes": n,
            "edges": ds.num_edges,
            "feature_dim": ds.feature_dim,
            "feature_dtype": ds.meta["feature_dtype"],
            "fanouts": list(hot.fanouts),
            "batch_size": hot.batch_size,
            "unique_per_batch": hot.mean_unique_per_batch or None,
            "hotness": {
                "curve": access_curve(hot.counts, points),
                "source": f"measured: {hot.epochs} pre-sampled epoch(s), {hot.batches} batches",
            },
            "gpu_cache_gb": gpu_rows * rb / 1e9,
            "cpu_cache_fraction": cpu_rows / n,
        }
    )
    if w.row_bytes != rb:
        raise MomentError(f"the planner counts {w.row_bytes} bytes per row, the dataset {rb} (a bug)")
    gb = _exact(w.gpu_cache_gb, gpu_rows, lambda v: w.model_copy(update={"gpu_cache_gb": v}).gpu_cache_rows())
    w = w.model_copy(update={"gpu_cache_gb": gb})
    frac = _exact(
        w.cpu_cache_fraction, cpu_rows, lambda v: w.model_copy(update={"cpu_cache_fraction": v}).cpu_cache_rows()
    )
    return Workload.model_validate({**w.model_dump(), "cpu_cache_fraction": frac})


def _exact(value: float, rows: int, rows_of: Callable[[float], int]) -> float:
    """The least float from ``value`` up that ``rows_of`` (the workload's own rounding) turns into
    ``rows``: rows × bytes / 1e9 may come back one row short."""
    for _ in range(64):
        if rows_of(value) >= rows:
            break
        value = math.nextafter(value, math.inf)
    if rows_of(value) != rows:
        raise MomentError(
            f"cannot express a cache of {rows} rows in the workload's terms (got {rows_of(value)}; a bug)"
        )
    return value


def predict(plan: PlanDoc, machine: Machine, workload: Workload) -> Prediction:
    """The proportional model re-solved for ``workload`` on the plan's layout of ``machine``
    (the profile the plan was made for)."""
    scored = rescore(plan, machine, workload)
    shares = {t["bin"]: t["share"] for t in bin_targets(scored, workload)}
    if list(shares) != [t.bin for t in plan.bin_targets]:
        raise MomentError(
            f"re-solving the plan gives bins {', '.join(shares)}, the plan has "
            f"{', '.join(t.bin for t in plan.bin_targets)} (a bug)"
        )
    return Prediction(
        source="dataset",
        profile=machine.name,
        layout=plan.layout.name,
        iteration_s=scored.prop.iteration_s,
        tier_shares=TierShares(**scored.net.shares),
        bin_shares=shares,
        ssd_amplification=workload.ssd_amplification(),
        workload=_brief(workload),
    )


def plan_prediction(plan: PlanDoc) -> Prediction:
    """The plan's own prediction (for its workload, not the dataset's): the fallback where the
    plan's profile cannot be found to re-solve it."""
    return Prediction(
        source="plan",
        profile=plan.profile.name,
        layout=plan.layout.name,
        iteration_s=plan.predicted.predicted_iteration_s,
        tier_shares=plan.tier_shares,
        bin_shares={t.bin: t.share for t in plan.bin_targets},
        ssd_amplification=plan.workload.ssd_amplification(),
        workload=_brief(plan.workload),
    )


def _brief(w: Workload) -> PredictedWorkload:
    return PredictedWorkload(
        fanouts=list(w.fanouts),
        batch_size=w.batch_size,
        unique_per_batch=w.vertices_per_batch(),
        gpu_cache_rows=w.gpu_cache_rows(),
        cpu_cache_rows=w.cpu_cache_rows(),
        hotness=w.hotness.source,
    )


def write_workload(path: Path, workload: Workload) -> None:
    """The measured workload, every field, as ``moment plan``/``score --workload`` read it."""
    atomic_write_text(
        path,
        "# Measured by `moment place`. Re-plan with it: moment plan --profile P --workload THIS; "
        "`moment score --profile P --layout plan.json --workload THIS` gives placed.json's prediction.\n"
        + yaml.safe_dump(workload.model_dump(mode="json"), sort_keys=False),
    )
