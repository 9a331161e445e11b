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
    assert all(s["reason"] for s in doc["skipped"])
    if not doc["sweep"]:  # dgx-like-8xa100: no slot takes an SSD, and the sweep asks for 1..16
        assert {s["reason"] for s in doc["skipped"]} == {"more SSDs than the profile's 0 slots an SSD fits"}


def test_a_profile_with_every_gpu_fixed_plans_subsets_of_them(tmp_path, capsys) -> None:
    """dgx-like-8xa100: eight SXM GPUs, no slot. `--gpus 4` picks four of the installed GPUs (the
    plan's ranks name them), 9 does not fit, and SSDs have nowhere to go."""
    from moment.contracts.plan import read_plan

    w = tmp_path / "w.yaml"
    w.write_text("cpu_cache_fraction: 1.0\n")
    out = tmp_path / "plan.json"
    base = ["plan", "--profile", "dgx-like-8xa100", "--workload", str(w)]
    rc, stdout, err = cli([*base, "--gpus", "4", "--top", "3", "--out", str(out), "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc["search"]["gpus"] == 4
    ranks = read_plan(out).ranks
    assert len(ranks) == 4 and len({r.gpu for r in ranks}) == 4
    assert {r.socket for r in ranks} == {"cpu0", "cpu1"}  # both sockets' memory serves the CPU cache
    rc, stdout, err = cli([*base, "--top", "1", "--json"], capsys)  # as installed: all eight
    assert rc == 0, err
    assert json.loads(stdout)["search"]["gpus"] == 8 and len(json.loads(stdout)["best"]["slots"]) == 8
    rc, stdout, err = cli(["score", "--profile", "dgx-like-8xa100", "--workload", str(w), "--layout", str(out)], capsys)
    assert rc == 0, err
    rc, stdout, err = cli([*base, "--gpus", "9"], capsys)
    assert rc == 2 and "fixed in place" in err
    rc, stdout, err = cli(
        ["plan", "--profile", "dgx-like-8xa100", "--gpus", "1..8", "--ssds", "1..16", "--json"], capsys
    )
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc["sweep"] == [] and {s["reason"] for s in doc["skipped"]} == {
        "more SSDs than the profile's 0 slots an SSD fits"
    }
    rc, stdout, err = cli([*base, "--gpus", "1..8", "--ssds", "0", "--json"], capsys)
    assert rc == 0, err
    times = [r["predicted_iteration_s"] for r in json.loads(stdout)["sweep"]]
    assert len(times) == 8 and all(t > 0 for t in times)


def test_profiles_prints_whole_headers_into_a_pipe() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "moment", "profiles"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "name" in line)
    assert [h.strip() for h in header.strip("┃ ").split("┃")] == [
        "name",
        "sockets",
        "switches",
        "slots",
        "gpus",
        "nvme",
        "nics",
        "nvlinks",
    ]


def test_score_prints_four_significant_digits(tmp_path, capsys) -> None:
    """A fast layout's time is not rounded away (0.000186 s, not 0.0002 s)."""
    w = tmp_path / "w.yaml"
    w.write_text("nodes: 100000\nfeature_dim: 32\nbatch_size: 64\n")
    rc, out, err = cli(["score", "--profile", "moment-machine-b", "--workload", str(w), "--json"], capsys)
    assert rc == 0, err
    t = json.loads(out)["predicted_iteration_s"]
    assert t < 0.01
    rc, out, err = cli(["score", "--profile", "moment-machine-b", "--workload", str(w)], capsys)
    assert f"predicted iteration {t:#.4g} s" in " ".join(out.split())  # 0.002011 s, not 0.0020 s
