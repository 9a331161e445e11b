"""Flow models are a registry: a model added to FLOW_MODELS reaches scoring, the reports and
plan.json without other edits, and plan.json refuses figures of no model."""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import replace

import pytest
from rich.console import Console

from moment.contracts.plan import LayoutRecord, PlanDoc
from moment.planner import flow
from moment.planner.flow import FlowModel, Prediction
from moment.planner.network import Network
from moment.planner.plan import plan
from moment.planner.planfile import plan_document
from moment.planner.report import print_prediction, ranking_table
from planner_fixtures import SSD_ONLY, one_switch


def _twice_as_fast(net: Network, engine: str, known: Mapping[str, Prediction]) -> Prediction:
    first = known["proportional"]
    return replace(
        first, model="half", iteration_s=first.iteration_s / 2, per_gpu_s={g: t / 2 for g, t in first.per_gpu_s.items()}
    )


def _explain(net: Network, own: Prediction, primary: Prediction) -> str:
    return f"half says {own.iteration_s:.3f} s"


def test_a_registered_model_reaches_scores_reports_and_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(flow.FLOW_MODELS, "half", FlowModel("half", "twice as fast", _twice_as_fast, _explain))
    machine = one_switch()
    outcome = plan(machine, SSD_ONLY, 2, 2, top=2)
    best = outcome.best
    assert list(best.predictions) == ["proportional", "paper", "half"]
    t = best.prop.iteration_s
    assert best.predictions["half"].iteration_s == pytest.approx(t / 2)

    record = best.to_dict()
    assert record["half_iteration_s"] == pytest.approx(t / 2)
    assert record["half_bottleneck"] == record["bottleneck"]
    assert record["models_differ"] == f"half says {t / 2:.3f} s"
    doc = plan_document(machine, SSD_ONLY, outcome)
    assert doc.predicted.model_extra == {
        k: record[k] for k in ("half_iteration_s", "half_gbps_per_gpu", "half_bottleneck")
    }
    assert PlanDoc.model_validate(doc.model_dump(mode="json")) == doc  # reads back equal

    out = io.StringIO()
    print_prediction(Console(file=out, width=200), best, SSD_ONLY)
    assert f"{t:.4f} s (proportional share), " in out.getvalue() and f"{t / 2:.4f} s (twice as fast)" in out.getvalue()
    table = ranking_table("ranking", outcome.ranking, t)
    headers = ["layout", "GPUs", "SSDs", "s/iter", "vs best", "paper", "half", "bottleneck"]
    assert [c.header for c in table.columns] == headers
    assert list(table.columns[6].cells) == [f"{s.prop.iteration_s / 2:.4f}" for s in outcome.ranking]


def test_the_default_registry_writes_the_plan_2_record() -> None:
    """Proportional first (unprefixed), then the paper's: exactly LayoutRecord's declared fields."""
    assert list(flow.FLOW_MODELS) == [flow.PRIMARY, "paper"]
    outcome = plan(one_switch(), SSD_ONLY, 2, 2, top=1)
    assert list(outcome.best.to_dict()) == list(LayoutRecord.model_fields)


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("colour", "red", "unknown field 'colour'"),
        ("Half_iteration_s", 0.1, "unknown field 'Half_iteration_s'"),
        ("half_iteration_s", "fast", "half_iteration_s: Input should be a valid number"),
        ("half_bottleneck", [1], "half_bottleneck: 0: Input should be a valid string"),
    ],
)
def test_a_layout_record_refuses_what_no_model_writes(key: str, value: object, why: str) -> None:
    outcome = plan(one_switch(), SSD_ONLY, 2, 2, top=1)
    record = {**outcome.best.to_dict(), key: value}
    with pytest.raises(ValueError, match="predicted") as info:
        PlanDoc.model_validate(
            {**plan_document(one_switch(), SSD_ONLY, outcome).model_dump(mode="json"), "predicted": record}
        )
    assert why in str(info.value)
