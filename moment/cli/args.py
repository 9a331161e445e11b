"""argparse pieces every verb module shares: the parser whose usage errors are one line, the
integer types, and choices read from a stage's registry."""

from __future__ import annotations

import argparse
from typing import NoReturn

from moment.cli.output import print_error
from moment.options import OptionParser, Registry, non_negative, positive

__all__ = ["Parser", "non_negative", "positive", "registry_choices"]


class Parser(OptionParser):
    """argparse that reports usage errors in one line, naming the verb (its ``prog``), and exits 2."""

    def error(self, message: str) -> NoReturn:
        print_error(self.prog, f"{message} (see `{self.prog} --help`)")
        raise SystemExit(2)


def registry_choices(action: argparse.Action, module: str, name: str, about: str | None = None) -> None:
    """Give an added option the names of ``module.NAME`` as its choices (and, with ``about``, the
    help that ``module.about()`` writes). Set after ``add_argument``, which would otherwise read
    them at once (it formats the option's usage)."""
    action.choices = Registry(module, name, about)
