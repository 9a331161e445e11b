"""The one progress-callback type every long-running stage takes (synth, import, place).

A :class:`Progress` is told ``(stage, done, total)`` whenever a stage advances; the first call
for a stage starts it (``total`` 0: not known yet; ``done`` above 0: a resumed stage). Loops
inside one stage take the narrower :data:`Update`, ``(done, total)``, which
:func:`stage_update` makes from a ``Progress``. The CLI draws one rich bar per stage
(``moment.cli.output.RichProgress``); tests pass a plain function.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

Update = Callable[[int, int], None]  # done, total: one stage's advance


class Progress(Protocol):
    def __call__(self, stage: str, done: int, total: int) -> None: ...


def stage_update(progress: Progress | None, stage: str) -> Update | None:
    """``progress`` narrowed to one ``stage``, or None without one."""
    return None if progress is None else partial(progress, stage)
