"""Where the ``moment`` commands write: one console for results (stdout), one for diagnostics and
progress (stderr), the one-line error format, and the rich progress bars behind
:class:`moment.progress.Progress`.

Highlighting is off once, here: the commands colour what they mean to (``[red]``, ``[bold]``),
and rich's guesses (numbers, paths) would only add noise.
"""

from __future__ import annotations

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)  # one message, one line: never wrapped


def print_error(who: str, message: str) -> None:
    """The one line a refused command prints on stderr: ``WHO: error: MESSAGE`` (rich markup in
    ``message`` is the caller's to escape)."""
    err.print(f"[red]{who}: error:[/] {message}")


class RichProgress:
    """A :class:`moment.progress.Progress`: one rich bar per stage, created when the stage first
    reports."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, object] = {}

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.bars.add_task(stage, total=total or None)
        self.bars.update(self.tasks[stage], completed=done, total=total or None)
