"""`moment plan` with ranges: every count that fits is planned (at the plan's own best time),
the ones that do not are skipped and listed, and the sweep finishes on every bundled profile."""

from __future__ import annotations

import json

import pytest

from moment.cli import main
from moment.cli.plan import _skipped_lines
from moment.topology.profile_io import bundled_profiles


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_counts_that_do_not_fit_are_skipped_and_listed(capsys) -> None:
    """moment-machine-b: 10 GPU-capable slots, 18 in all."""
    argv = ["plan", "--profile", "moment-machine-b", "--gpus", "9..11", "--ssds", "8..10"]
    rc, out, err = cli([*argv, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert [(r["gpus"], r["ssds"]) for r in doc["sweep"]] == [(9, 8), (9, 9), (10, 8)]
    skipped = {(s["gpus"], s["ssds"]): s["reason"] for s in doc["skipped"]}
    assert set(skipped) == {(9, 10), (10, 9), (10, 10), (11, 8), (11, 9), (11, 10)}
    assert skipped[11, 8] == "more GPUs than the profile's 10 GPU-capable slots"
    assert skipped[9, 10] == "more devices than the profile's 18 free or movable slots"
    rc, out, err = cli(argv, capsys)
    assert rc == 0, err
    assert "skipped 6 of 9 counts:" in out
    assert "11 GPUs, 8..10 SSDs: more GPUs than the profile's 10 GPU-capable slots" in out


def test_skipped_counts_are_listed_in_blocks() -> None:
    why = "the workload reads 60.2% of its rows from SSDs"
    full = "more devices than the profile's 18 free or movable slots"
    skipped = [(g, 0, why) for g in (1, 2, 3)] + [(3, 16, full), (4, 15, full), (4, 16, full)]
    assert _skipped_lines(skipped) == [
        f"1..3 GPUs, 0 SSDs: {why}",
        f"3 GPUs, 16 SSDs: {full}",
        f"4 GPUs, 15..16 SSDs: {full}",
    ]


def test_a_sweep_row_has_the_time_of_the_plan_for_its_count(capsys) -> None:
    rc, out, err = cli(["plan", "--profile", "moment-machine-b", "--gpus", "1..2", "--ssds", "3..5", "--json"], capsys)
    assert rc == 0, err
    rows = {(r["gpus"], r["ssds"]): r["predicted_iteration_s"] for r in json.loads(out)["sweep"]}
    assert len(rows) == 6
    for g, s in [(1, 3), (2, 5)]:
        rc, out, err = cli(
            ["plan", "--profile", "moment-machine-b", "--gpus", str(g), "--ssds", str(s), "--top", "1", "--json"],
            capsys,
        )
        assert rc == 0, err
        assert rows[g, s] == pytest.approx(json.loads(out)["best"]["predicted_iteration_s"], rel=1e-6)


def test_the_marginal_columns_compare_neighbours(capsys) -> None:
    rc, out, err = cli(["plan", "--profile", "moment-machine-b", "--gpus", "1..2", "--ssds", "1..2"], capsys)
    assert rc == 0, err
    rc, js, err = cli(["plan", "--profile", "moment-machine-b", "--gpus", "1..2", "--ssds", "1..2", "--json"], capsys)
    t = {(r["gpus"], r["ssds"]): r["predicted_iteration_s"] for r in json.loads(js)["sweep"]}
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()]
    cells = {(int(r[0]), int(r[1])): r[4:6] for r in rows if len(r) == 7 and r[0].isdigit()}
    assert cells[1, 1] == ["-", "-"]
    assert cells[1, 2][0] == f"{t[1, 1] / t[1, 2]:.2f}×"  # one more SSD: the iteration's speed-up
    assert cells[2, 2][1] == f"{(2 / t[2, 2]) / (1 / t[1, 2]):.2f}×"  # one more GPU: the throughput's


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(bundled_profiles()))
def test_the_full_sweep_finishes_on_every_bundled_profile(name: str, capsys) -> None:
    rc, out, err = cli(["plan", "--profile", name, "--gpus", "1..8", "--ssds", "1..16", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert len(doc["sweep"]) + len(doc["skipped"]) == 128
    assert doc["sweep"], doc["skipped"][:3]
