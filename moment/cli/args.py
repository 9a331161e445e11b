"""argparse pieces every verb module shares: the parser whose usage errors are one line, the
integer types, and choices read from a stage's registry."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterator

from moment.cli.output import print_error


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line, naming the verb (its ``prog``), and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print_error(self.prog, f"{message} (see `{self.prog} --help`)")
        raise SystemExit(2)

    def format_help(self) -> str:
        """The help, with each registry option's text read from its registry now (not when the
        parser was built: see :class:`RegistryChoices`)."""
        for action in self._actions:
            if isinstance(action.choices, RegistryChoices) and action.choices.about:
                action.help = action.choices.help() + (f" (default {action.default})" if action.default else "")
        return super().format_help()


def _at_least(low: int, refusal: str) -> Callable[[str], int]:
    """argparse type: an integer >= ``low`` (a usage error saying ``refusal`` otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{refusal}, got {value}")
        return value

    return parse


non_negative = _at_least(0, "must be 0 or more")
positive = _at_least(1, "must be at least 1")


class RegistryChoices:
    """argparse ``choices`` that are the names in a registry (``module.NAME``: a dict's keys or a
    tuple), read when argparse first needs them (a value to check, a usage line to print): the
    registries live beside code that loads numba or torch, which ``moment --help`` and
    ``moment plan`` must not wait for. Attach with :func:`registry_choices`. ``about``: a function
    of the module giving the option's help from the registry (what each member does)."""

    def __init__(self, module: str, name: str, about: str | None = None) -> None:
        self.module, self.name, self.about = module, name, about

    def help(self) -> str:
        """The option's help text, from the registry's own ``about`` function."""
        return str(getattr(importlib.import_module(self.module), self.about or "")())

    def names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __contains__(self, value: object) -> bool:
        return value in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def registry_choices(action: argparse.Action, module: str, name: str, about: str | None = None) -> None:
    """Give an added option the names of ``module.NAME`` as its choices (and, with ``about``, the
    help that ``module.about()`` writes). Set after ``add_argument``, which would otherwise read
    them at once (it formats the option's usage)."""
    action.choices = RegistryChoices(module, name, about)
