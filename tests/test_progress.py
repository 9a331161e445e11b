"""Progress in a log file: plain lines at a steady interval with done/total, rate and ETA (a live
bar would print nothing until it stops), and live bars only on a terminal."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

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
    env = {**os.environ, INTERVAL_ENV: "0"}
    argv = [
        sys.executable,
        "-m",
        "moment",
        "plan",
        "--profile",
        "moment-machine-b",
        "--gpus",
        "1..4",
        "--ssds",
        "4..12",
    ]
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=f, env=env)
    seen_while_running = []
    try:
        while proc.poll() is None:
            text = log.read_text()
            if proc.poll() is None and "plan sweep: " in text:
                seen_while_running = [ln for ln in text.splitlines() if ln.startswith("plan sweep: ")]
                break
            time.sleep(0.05)
    finally:
        rc = proc.wait(timeout=120)
    assert rc == 0, log.read_text()
    assert seen_while_running, f"no progress line before the end: {log.read_text()!r}"
    final = [ln for ln in log.read_text().splitlines() if ln.startswith("plan sweep: ")]
    assert final[-1].startswith("plan sweep: 36/36 (100%)") and "done in" in final[-1]
    assert "\x1b[" not in log.read_text()  # no terminal codes in a log
