"""The one progress-callback type every long-running stage takes, and the one reporter that shows it.

A :class:`Progress` is told ``(stage, done, total)`` whenever a stage advances; the first call
for a stage starts it (``total`` 0: not known yet; ``done`` above 0: a resumed stage). Loops
inside one stage take the narrower :data:`Update`, ``(done, total)``, which
:func:`stage_update` makes from a ``Progress``. Tests pass a plain function.

:class:`Reporter` is the ``Progress`` every command and rank 0 of training and inference use. On
a terminal it draws one live rich bar per stage. Anywhere else (a batch job's log file, a pipe) a
live bar would print nothing until it stops, so it writes plain lines instead, each with done/total,
rate and time left: one when a stage starts, then whenever :data:`INTERVAL_ENV` seconds (default
10) have passed or the stage moved another 5 % (but at most one line per tenth of the interval),
and one when it ends.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

from moment.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress as Bars
    from rich.progress import TaskID

Update = Callable[[int, int], None]  # done, total: one stage's advance

INTERVAL_ENV = "MOMENT_PROGRESS_INTERVAL"  # seconds between plain progress lines (0: every report)
DEFAULT_INTERVAL_S = 10.0
STEP = 0.05  # ... or this share of the stage, whichever comes first


class Progress(Protocol):
    def __call__(self, stage: str, done: int, total: int) -> None: ...


def stage_update(progress: Progress | None, stage: str) -> Update | None:
    """``progress`` narrowed to one ``stage``, or None without one."""
    return None if progress is None else partial(progress, stage)


def interval_s() -> float:
    """Seconds between plain progress lines: ``MOMENT_PROGRESS_INTERVAL``, else 10."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{INTERVAL_ENV}={text!r}: expected seconds between progress lines, like 10")
    return value


@dataclass
class _Stage:
    start: float
    first_done: int
    total: int
    last_t: float  # when its last line was written
    last_step: int  # the STEP share its last line was in
    finished: bool = False


def duration(seconds: float) -> str:
    """``0.4s``, ``42s``, ``3m05s``, ``2h07m``: a time left or taken, as a log line says it."""
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def line(stage: str, done: int, total: int, elapsed: float, rate: float | None) -> str:
    """One plain progress line: ``STAGE: DONE/TOTAL (P%), RATE/s, ETA T`` (the parts known)."""
    parts = [f"{stage}: {done:,}/{total:,} ({done / total:.0%})" if total else f"{stage}: {done:,}"]
    if rate is not None and rate > 0:
        parts.append(f"{rate:,.0f}/s" if rate >= 10 else f"{rate:.3g}/s")
    if total and done >= total:
        parts.append(f"done in {duration(elapsed)}")
    elif total and rate:
        parts.append(f"ETA {duration((total - done) / rate)}")
    return ", ".join(parts)


class Reporter:
    """A :class:`Progress` that draws live bars on a terminal and writes plain lines elsewhere
    (``live`` forces either). Use it as a context manager around the work."""

    def __init__(
        self,
        console: Console | None = None,
        live: bool | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if console is None:
            from rich.console import Console

            console = Console(stderr=True, soft_wrap=True, highlight=False)
        self.console = console
        self.live = console.is_terminal if live is None else live
        self.interval = interval_s() if interval is None else interval
        self.clock = clock
        self.stages: dict[str, _Stage] = {}
        self.bars: Bars | None = None
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> Reporter:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bars

            cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            self.bars = Bars(*cols, console=self.console, transient=False)
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bars is not None:
            if stage not in self.tasks:
                self.tasks[stage] = self.bars.add_task(stage, total=total or None)
            self.bars.update(self.tasks[stage], completed=done, total=total or None)
            return
        now = self.clock()
        st = self.stages.get(stage)
        step = int(done / total / STEP) if total else 0
        if st is None or total != st.total or (st.finished and done < total):  # (re)starts, or resumes at done
            self.stages[stage] = _Stage(now, done, total, now, step, finished=bool(total) and done >= total)
            self._write(line(stage, done, total, 0.0, None))
            return
        if st.finished:
            return
        finished = bool(total) and done >= total
        since = now - st.last_t
        due = since >= self.interval or (step > st.last_step and since >= self.interval / 10)
        if not (due or finished):
            return
        elapsed = now - st.start
        rate = (done - st.first_done) / elapsed if elapsed > 0 else None
        st.last_t, st.last_step, st.finished = now, step, finished
        self._write(line(stage, done, total, elapsed, rate))

    def _write(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()
