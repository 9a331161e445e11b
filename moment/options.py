"""Run options declared once: a dataclass whose fields carry their command-line form.

A run's options (``trainer.config.TrainConfig``, ``trainer.infer.InferOptions``) are one typed
dataclass. Each field declared with :func:`option` holds its help, argparse type and choices, so
the ``moment`` verb's parser, the rank's own parser (``python -m trainer``) and the argv a
launcher hands the ranks are all generated from it (:func:`add_arguments`, :func:`to_argv`):
a name or a default is written in one place. Nothing here imports torch or a stage, so building
``moment``'s parser stays cheap; choices that live in a stage's registry are read when argparse
first needs them (:class:`Registry`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_META = "option"


class Registry:
    """argparse ``choices`` that are the names in a registry (``module.NAME``: a dict's keys or a
    tuple), read when argparse first needs them (a value to check, a usage line to print): the
    registries live beside code that loads numba or torch, which ``moment --help`` and
    ``moment plan`` must not wait for. ``about``: a function of the module that writes the
    option's help from the registry (what each member does), read when the help is printed
    (:class:`OptionParser`); ``also``: choices the option has besides the members (``auto``),
    first. Read each time, so that a member registered later (a test's) is a choice too."""

    def __init__(self, module: str, name: str, about: str | None = None, also: tuple[str, ...] = ()) -> None:
        self.module, self.name, self.about, self.also = module, name, about, also

    def names(self) -> tuple[str, ...]:
        return (*self.also, *getattr(importlib.import_module(self.module), self.name))

    def help(self) -> str:
        """The option's help text, from the registry's own ``about`` function."""
        return str(getattr(importlib.import_module(self.module), self.about or "")())

    def __contains__(self, value: object) -> bool:
        return value in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


class OptionParser(argparse.ArgumentParser):
    """argparse whose registry options take their help from the registry when it is printed, as
    does its description where ``describe`` writes it (from a registry that ``moment --help``
    must not wait to import)."""

    describe: Callable[[], str] | None = None

    def format_help(self) -> str:
        if self.describe is not None:
            self.description = self.describe()
        for action in self._actions:
            if isinstance(action.choices, Registry) and action.choices.about:
                action.help = action.choices.help() + (f" (default {action.default})" if action.default else "")
        return super().format_help()


@dataclasses.dataclass(frozen=True)
class Spec:
    """How a field looks on a command line."""

    help: str
    type: Callable[[str], Any] | None = None  # argparse type (text -> value); None: the text
    choices: Sequence[str] | Registry | None = None
    metavar: str | None = None
    to_text: Callable[[Any], str] = str  # value -> the text ``type`` reads back


def option(default: Any = dataclasses.MISSING, help: str = "", **spec: Any) -> Any:
    """A dataclass field that is also a command-line option ``--field-name`` (no default: required)."""
    return dataclasses.field(default=default, metadata={_META: Spec(help, **spec)})


def flag(name: str) -> str:
    """``--field-name`` for the field ``field_name``."""
    return "--" + name.replace("_", "-")


def _options(cls: type, only: Sequence[str] | None = None) -> list[tuple[dataclasses.Field[Any], Spec]]:
    fields = [(f, f.metadata[_META]) for f in dataclasses.fields(cls) if _META in f.metadata]
    return [(f, s) for f, s in fields if only is None or f.name in only]


def add_arguments(parser: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None) -> None:
    """Add ``cls``'s options (those named in ``only``, else all) to ``parser``, each with the
    field's default: a bool is a switch, a field without a default is required."""
    for f, s in _options(cls, only):
        kw: dict[str, Any] = {"help": s.help, "dest": f.name}
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if f.default is False:
            kw["action"] = "store_true"
        else:
            kw.update({k: v for k, v in (("type", s.type), ("metavar", s.metavar)) if v is not None})
        action = parser.add_argument(flag(f.name), **kw)
        if s.choices is not None:  # after add_argument, which would read a Registry at once (its usage)
            action.choices = s.choices


def values(cls: type, args: argparse.Namespace, only: Sequence[str] | None = None) -> dict[str, Any]:
    """``cls``'s options as ``args`` holds them (for ``cls(**values(...))``)."""
    return {f.name: getattr(args, f.name) for f, _ in _options(cls, only)}


def to_argv(obj: Any, cls: type | None = None, only: Sequence[str] | None = None) -> list[str]:
    """The command line that parses back to ``obj``'s options (``obj``: an instance of ``cls``,
    or the argparse namespace :func:`add_arguments` filled): each one that differs from its
    default (a required one always), in declaration order."""
    argv: list[str] = []
    for f, s in _options(cls or type(obj), only):
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if value is True and f.default is False:
            argv.append(flag(f.name))
        elif value is not None:
            argv += [flag(f.name), s.to_text(value)]
    return argv


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


def ints(values: Sequence[int]) -> str:
    """``25,10``: how a tuple of integers is written on a command line."""
    return ",".join(str(int(v)) for v in values)


def path(text: str) -> Path:
    """argparse type of a path option."""
    return Path(text)
