"""The plan's prediction, re-solved for the dataset being placed.

A plan's bin targets are for the workload it was made with (usually the profile's default: a
paper-sized graph and a Zipf-like hotness guess). ``moment place`` knows better once it has
pre-sampled: the dataset's size and row width, the measured hotness curve and unique rows per
batch, and the cache sizes it is about to fill. :func:`measured_workload` puts these into the
planner's :class:`Workload` (the caches as the rows placed: ``gpu_cache_rows``,
``cpu_cache_rows``), and :func:`predict` re-solves the
proportional model for the plan's layout on the plan's profile: those bin shares are DDAK's
targets, and the tier shares what the achieved ones are compared with. The shares are of
feature rows; ``ssd_amplification`` is apart: the bytes the SSDs move per feature byte read from
them (whole pages, :mod:`moment.ssd_reads`), which the trainer's page count (metrics.json
``ssd_read_amplification``) is compared with. ``workload.yaml`` holds
that workload, so ``moment score --profile P --layout plan.json --workload OUT/workload.yaml``
reproduces the prediction.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from moment.contracts.placed import PredictedWorkload, Prediction
from moment.contracts.plan import PlanDoc, TierShares
from moment.errors import MomentError
from moment.fileio import atomic_write_text
from moment.planner.scoring import rescore
from moment.planner.workload import CACHE_UNITS, Workload
from moment.topology.model import Machine
from placement.dataset import Dataset
from placement.hotness import CURVE_POINTS, Hotness, access_curve


def measured_workload(base: Workload, ds: Dataset, hot: Hotness, gpu_rows: int, cpu_rows: int) -> Workload:
    """``base`` (the plan's workload) with what placing ``ds`` measured and uses: its size, the
    pre-sampling's fan-outs, batch size and unique rows per batch, the measured hotness curve
    (also at the cache boundaries, so the tier shares it gives are the placement's), and the
    caches placed, ``gpu_rows`` (each GPU) and ``cpu_rows`` (each socket), as rows."""
    n = ds.num_nodes
    bounds = {gpu_rows / n, (gpu_rows + cpu_rows) / n}
    points = sorted(x for x in {*CURVE_POINTS, *bounds} if 0 < x < 1)
    w = Workload.model_validate(
        {
            **base.model_dump(exclude={*CACHE_UNITS, *CACHE_UNITS.values()}),
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
            "gpu_cache_rows": gpu_rows,
            "cpu_cache_rows": cpu_rows,
        }
    )
    if w.row_bytes != ds.row_bytes or w.cache_rows() != (gpu_rows, cpu_rows):
        raise MomentError(
            f"the planner counts {w.row_bytes} bytes per row and caches of {w.cache_rows()} rows, the placement "
            f"{ds.row_bytes} and {(gpu_rows, cpu_rows)} (a bug)"
        )
    return w


def predict(plan: PlanDoc, machine: Machine, workload: Workload) -> Prediction:
    """The proportional model re-solved for ``workload`` on the plan's layout of ``machine``
    (the profile the plan was made for)."""
    scored = rescore(plan, machine, workload)
    shares = scored.bin_shares()
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
        workload=_brief(workload, caches=False),
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
        workload=_brief(plan.workload, caches=True),
    )


def _brief(w: Workload, caches: bool) -> PredictedWorkload:
    """The workload in brief; its caches only where they are not the placement's (``caches``: a
    plan's own prediction): the bins' capacity records the placement's, once."""
    gpu, cpu = w.cache_rows() if caches else (None, None)
    return PredictedWorkload(
        fanouts=list(w.fanouts),
        batch_size=w.batch_size,
        unique_per_batch=w.vertices_per_batch(),
        gpu_cache_rows=gpu,
        cpu_cache_rows=cpu,
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
