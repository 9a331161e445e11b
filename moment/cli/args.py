"""argparse pieces every verb module shares: the parser whose usage errors are one line, and
the integer types."""

from __future__ import annotations

import argparse

from moment.cli.output import print_error


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print_error("moment", f"{message} (see `{self.prog} --help`)")
        raise SystemExit(2)


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
