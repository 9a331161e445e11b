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
    ``moment plan`` must not wait for. Attach with :func:`registry_choices`."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __contains__(self, value: object) -> bool:
        return value in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def registry_choices(action: argparse.Action, module: str, name: str) -> None:
    """Give an added option the names of ``module.NAME`` as its choices. Set after
    ``add_argument``, which would otherwise read them at once (it formats the option's usage)."""
    action.choices = RegistryChoices(module, name)
