"""Progress in a log file: plain lines at a steady interval with done/total, rate and ETA (a live
bar would print nothing until it stops), and live bars only on a terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

import logged
from moment.errors import UsageError
from moment.progress import INTERVAL_ENV, Reporter, duration, interval_s


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def plain(interval: float = 10.0) -> tuple[Reporter, io.StringIO, Clock]:
    buf, clock = io.StringIO(), Clock()
    console = Console(file=buf, force_terminal=False, width=80)
    return Reporter(console, interval=interval, clock=clock), buf, clock


def test_plain_lines_at_start_every_interval_every_5_percent_and_at_the_end() -> None:
    report, buf, clock = plain(interval=10.0)
    with report:
        report("edges", 0, 1000)
        clock.t += 0.5
        report("edges", 10, 1000)  # 1 %, half a second: nothing
        clock.t += 0.5
        report("edges", 60, 1000)  # 6 %, a second (a tenth of the interval): a line
        clock.t += 0.2
        report("edges", 120, 1000)  # 12 % but only 0.2 s later: held back
        clock.t += 9.9
        report("edges", 121, 1000)  # 10 s since the last line: a line, whatever the share
        clock.t += 1.0
        report("edges", 1000, 1000)  # the end
        report("edges", 1000, 1000)  # reported twice: one end line
    lines = buf.getvalue().splitlines()
    assert lines == [
        "edges: 0/1,000 (0%)",
        "edges: 60/1,000 (6%), 60/s, ETA 16s",
        "edges: 121/1,000 (12%), 11/s, ETA 1m21s",
        "edges: 1,000/1,000 (100%), 83/s, done in 12s",
    ]


def test_a_resumed_stage_rates_only_its_own_work_and_unknown_totals_print_counts() -> None:
    report, buf, clock = plain(interval=1.0)
    report("layer 1", 500, 1000)
    clock.t += 2.0
    report("layer 1", 700, 1000)
    report("scan", 0, 0)
    clock.t += 1.0
    report("scan", 42, 0)
    assert buf.getvalue().splitlines() == [
        "layer 1: 500/1,000 (50%)",
        "layer 1: 700/1,000 (70%), 100/s, ETA 3.0s",
        "scan: 0",
        "scan: 42, 42/s",
    ]


def test_a_stage_run_again_with_another_total_starts_over() -> None:
    """The CSR build reports "fill" twice (once per pass, each with its own total)."""
    report, buf, clock = plain(interval=1.0)
    report("fill", 0, 10)
    report("fill", 10, 10)
    clock.t += 1.0
    report("fill", 0, 4)
    clock.t += 1.0
    report("fill", 4, 4)
    assert buf.getvalue().splitlines() == [
        "fill: 0/10 (0%)",
        "fill: 10/10 (100%), done in 0.0s",
        "fill: 0/4 (0%)",
        "fill: 4/4 (100%), 4/s, done in 1.0s",
    ]


def test_live_bars_only_on_a_terminal() -> None:
    assert not Reporter(Console(file=io.StringIO(), force_terminal=False)).live
    assert Reporter(Console(file=io.StringIO(), force_terminal=True)).live


def test_interval_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert interval_s() == 10.0
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert interval_s() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        with pytest.raises(UsageError, match=INTERVAL_ENV):
            interval_s()


def test_durations() -> None:
    assert [duration(x) for x in (0.42, 42, 185, 7620)] == ["0.4s", "42s", "3m05s", "2h07m"]


def test_a_step_writes_progress_lines_to_its_log_file_while_it_runs(tmp_path: Path) -> None:
    """`moment plan` sweeping with stderr to a file: progress lines are in the file before the
    process ends (a rich bar on a non-terminal writes nothing until it stops)."""
    log = tmp_path / "plan.log"
    proc = logged.start(["plan", "--profile", "moment-machine-b", "--gpus", "1..4", "--ssds", "4..12"], log)
    try:
        early = logged.seen_while_running(proc, log, "plan sweep: ")
    finally:
        rc = proc.wait(timeout=300)
    assert rc == 0, log.read_text()
    assert early, f"no progress line before the end: {log.read_text()!r}"
    final = [ln for ln in log.read_text().splitlines() if ln.startswith("plan sweep: ")]
    assert final[-1].startswith("plan sweep: 36/36 (100%)") and "done in" in final[-1]
    assert "\x1b[" not in log.read_text()  # no terminal codes in a log


def test_training_epochs_go_through_the_reporter_on_rank_0(monkeypatch) -> None:
    """Rank 0's epoch bar: in a log (a non-terminal console), plain lines with done/total."""
    from prediction_fixture import prediction
    from trainer.config import TrainConfig
    from trainer.metrics import Metrics

    monkeypatch.setenv(INTERVAL_ENV, "0")
    buf = io.StringIO()
    cfg = TrainConfig(data="d", epochs=3, fanouts=(10, 5), batch_size=512, device="cpu")
    metrics = Metrics(cfg, prediction({"gpu-cache": 0.2, "nvme0": 0.7}), [], enabled=True, console=Console(file=buf))
    with metrics.progress(1, 4) as step:
        for _ in range(4):
            step()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "epoch 2/3: 0/4 (0%)"
    assert lines[-1].startswith("epoch 2/3: 4/4 (100%)") and "done in" in lines[-1]
    assert len(lines) == 5


@pytest.mark.slow
def test_every_step_of_the_demo_writes_progress_lines_to_its_log(tmp_path: Path) -> None:
    """The demo (synth, place, train with 2 ranks, infer) with stdout and stderr to one file: each
    long step's plain progress lines are there, and the first shows before the demo ends."""
    log = tmp_path / "demo.log"
    argv = ["demo", "--workdir", str(tmp_path / "d"), "--nodes", "20000", "--epochs", "1"]
    proc = logged.start(argv, log, both=True)
    try:
        early = logged.seen_while_running(proc, log, "features: ")
    finally:
        rc = proc.wait(timeout=900)
    text = log.read_text()
    assert rc == 0, text
    assert early, text
    for step in ("features: ", "writing bins: ", "epoch 1/1: ", "infer: "):
        done = [ln for ln in text.splitlines() if ln.startswith(step) and "(100%)" in ln and "done in" in ln]
        assert done, f"no finished progress line for {step!r} in {text}"
    assert "\x1b[" not in text
