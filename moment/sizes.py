"""Sizes a user types (``4GB``, ``512MiB``, ``2e9``, ``1%``, ``20000rows``): one parser for every
option that takes one, so each accepts the same forms and refuses a mistake the same way, in one
line naming the option.

A size is bytes (a bare number, or with ``B``, ``KB``/``MB``/``GB``/``TB``: powers of 1000, or
``KiB``/``MiB``/``GiB``/``TiB``: powers of 1024; the ``B`` may be left out), a share of the
vertices (``%``), a count of rows (``rows``) or a multiple of a size the option names (``2x``). Where rows are what an option means (a feature
cache), :meth:`Size.rows` turns any of the three into rows of the dataset at hand; where bytes
are (a memory budget), :func:`parse_bytes` accepts bytes only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from moment.errors import UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\+?\d+)?|\.\d+(?:e\+?\d+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)
_BYTES = {
    "": 1,
    "b": 1,
    **{p: 1000**i for i, p in enumerate("kmgt", 1)},
    **{p + "b": 1000**i for i, p in enumerate("kmgt", 1)},
    **{p + "i": 1024**i for i, p in enumerate("kmgt", 1)},
    **{p + "ib": 1024**i for i, p in enumerate("kmgt", 1)},
}
Unit = Literal["bytes", "share", "rows", "multiple"]
EXAMPLES: dict[Unit, str] = {"bytes": "4GB, 512MiB, 2e9", "share": "1%", "rows": "20000rows", "multiple": "2x"}
WHAT: dict[Unit, str] = {
    "bytes": "a number of bytes",
    "share": "a share of the vertices",
    "rows": "a count of rows",
    "multiple": "a multiple of a size",
}


class SizeError(UsageError):
    """A size that does not parse: ``problem`` says what is wrong without naming the option (for
    argparse, which names it itself)."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.problem = problem


@dataclass(frozen=True)
class Size:
    """A parsed size: ``amount`` bytes, percent of the vertices, or rows."""

    amount: float
    unit: Unit

    def rows(self, num_nodes: int, row_bytes: int) -> int:
        """The rows this size holds of a dataset of ``num_nodes`` rows of ``row_bytes`` each
        (rounded down; not capped: the caller caps by what the dataset has)."""
        if self.unit == "rows":
            return int(self.amount)
        if self.unit == "share":
            return int(num_nodes * self.amount / 100)
        return int(self.amount // row_bytes)

    def bytes_of(self, whole: int) -> int:
        """Bytes: the size's own, or (a multiple, ``2x``) that many times ``whole`` bytes."""
        return int(self.amount * whole) if self.unit == "multiple" else int(self.amount)


def parse_size(text: str, option: str, units: tuple[Unit, ...] = ("bytes", "share", "rows")) -> Size:
    """``text`` as a size in one of ``units``; a :class:`SizeError` naming ``option`` otherwise."""
    like = "a size like " + ", ".join(EXAMPLES[u] for u in units)
    m = _SIZE.match(text)
    suffix = (m.group(2) if m else "").lower()
    units_of: dict[str, Unit] = {"%": "share", "row": "rows", "rows": "rows", "x": "multiple"}
    unit: Unit | None = units_of.get(suffix)
    if unit is None and suffix in _BYTES:
        unit = "bytes"
    if m is None or unit is None:
        raise SizeError(option, f"{text!r}: expected {like}")
    if unit not in units:
        raise SizeError(option, f"{text!r} is {WHAT[unit]}: expected {like}")
    amount = float(m.group(1)) * (_BYTES[suffix] if unit == "bytes" else 1)
    if not math.isfinite(amount):
        raise SizeError(option, f"{text!r}: expected {like}")
    if unit == "share" and amount > 100:
        raise SizeError(option, f"{text!r}: a share of the vertices is at most 100%")
    if unit == "rows" and amount != int(amount):
        raise SizeError(option, f"{text!r}: a whole number of rows")
    return Size(amount, unit)


def parse_bytes(text: str, option: str) -> int:
    """A positive number of bytes (a memory budget): ``4GB``, ``512MiB``, ``2e9``."""
    size = parse_size(text, option, ("bytes",))
    if size.amount < 1:
        raise SizeError(option, f"{text!r}: a memory budget must be at least 1 byte")
    return int(size.amount)
