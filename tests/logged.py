"""A command run with its output going to a log file, as a batch job's would, and the log
watched while the command runs (a line seen before the end was flushed there as it happened)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from moment.progress import INTERVAL_ENV


def start(argv: list[str], log: Path, both: bool = False) -> subprocess.Popen:
    """``python -m moment ARGV`` with stderr (``both``: and stdout) to ``log``, a progress line
    at every report (``MOMENT_PROGRESS_INTERVAL=0``)."""
    env = {**os.environ, INTERVAL_ENV: "0"}
    with log.open("w") as f:
        out = f if both else subprocess.DEVNULL
        return subprocess.Popen([sys.executable, "-m", "moment", *argv], stdout=out, stderr=f, env=env)


def seen_while_running(proc: subprocess.Popen, log: Path, needle: str, timeout: float = 300) -> str:
    """The log's text once it holds ``needle`` while ``proc`` still runs, else "" (it ended, or
    ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        text = log.read_text()
        if needle in text and proc.poll() is None:
            return text
        time.sleep(0.05)
    return ""
