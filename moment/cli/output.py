"""Where the ``moment`` commands write: one console for results (stdout), one for diagnostics and
progress (stderr) and the one-line error format. Progress goes through
:class:`moment.progress.Reporter` on ``err`` (live bars on a terminal, plain lines in a log).

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
