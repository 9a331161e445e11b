"""Parser for ``lspci -t`` bus trees (``-t``, ``-tv``, ``-tvnn``).

The tree is the one lspci view that shows, without root, which bridge every bus hangs off.
It is ASCII art: ``dd.f-[ss-uu]--`` says function ``dd.f`` is a bridge whose secondary bus
``ss`` holds what follows on the line, and a ``+-``/``\\-`` branch on a continuation line
continues the bus that was open at that same character column further up. So the parser
remembers, per column, which bus a branch there belongs to.

lspci prints the tree depth-first, so the functions come back parents first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moment.errors import SourceError
from moment.topology.pci import PciFunction, bus_of, drop_repeats, infer_port_types, normalize_bdf
from moment.topology.sources.text import capture_lines, note_cut_short

_TREE_START = re.compile(r"-(?:\+-)?\[")  # "-[0000:00]-+-..." or "-+-[0000:00]-+-..."
_CONTINUATION = re.compile(r"[ |]*[+\\]-")
# "lspci -tvv" prints each BAR on a line of its own below the function; it carries no topology.
_BAR_LINE = re.compile(r"[ |]*\s(?:Region \d+: )?(?:\[\w+\] )?(?:Memory at|I/O ports at) ")
_BRACKET = re.compile(r"\[(?:(?P<dom>[0-9a-f]{4,8}):)?(?P<lo>[0-9a-f]{2})(?:-(?P<hi>[0-9a-f]{2}))?\]", re.IGNORECASE)
_SLOT = re.compile(r"[0-9a-f]{2}\.[0-7]", re.IGNORECASE)
_IDS_SUFFIX = re.compile(r"\s*\[(?P<ven>[0-9a-f]{4}):(?P<dev>[0-9a-f]{4})\]$")  # -tvnn
# -tvn prints bare ids; -tv prints "Device vvvv:dddd" for a vendor missing from pci.ids.
_IDS_ONLY = re.compile(r"(?:Device )?(?P<ven>[0-9a-f]{4}):(?P<dev>[0-9a-f]{4})")


@dataclass(frozen=True)
class _Bus:
    """The bus the tree art is on at some point; ``number`` None means above the root buses."""

    domain: str
    number: int | None
    parent: str | None  # the bridge whose secondary side this bus is; None for a root bus


_HOST = _Bus("0000", None, None)


def parse_lspci_tree(text: str, source: str = "lspci-tv.txt", notes: list[str] | None = None) -> list[PciFunction]:
    """Every function of an ``lspci -t[v[nn]]`` capture, with parents and bridge bus ranges.

    Warnings (repeated records, a cut-short last line) are appended to ``notes`` when given.

    Raises SourceError when the text is empty or binary, holds no tree, or a line in the middle
    cannot be read; a last line cut short (a truncated capture) is read as far as it goes.
    """
    lines = _tree_lines(capture_lines(text, source))
    if not lines:
        raise SourceError(source, "no `lspci -t` tree found")
    parser = _TreeParser(source)
    for i, (lineno, line) in enumerate(lines):
        parser.feed(line, lineno, last=i == len(lines) - 1)
    if not parser.functions:
        raise SourceError(source, "the `lspci -t` tree lists no PCI functions")
    note_cut_short(text, source, notes)
    functions = drop_repeats(parser.functions, source, notes)
    infer_port_types(functions)  # the tree has no capability list
    return functions


def _tree_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, line) of the tree art: from its first line to the first line that is not art.

    Tabs are expanded first: the art is column-aligned, and an editor that turned runs of
    spaces into tabs must not change the result.
    """
    out: list[tuple[int, str]] = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.expandtabs().rstrip()
        if _TREE_START.match(line):
            out.append((lineno, line))
        elif out and _BAR_LINE.match(line):
            continue
        elif out and _CONTINUATION.match(line):
            out.append((lineno, line))
        elif out:
            break
    return out


class _TreeParser:
    """Reads tree lines one by one, keeping the bus each branch column belongs to."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.functions: list[PciFunction] = []
        self._columns: dict[int, _Bus] = {}

    def feed(self, line: str, lineno: int, last: bool = False) -> None:
        """Read one line; on the ``last`` line, stop quietly where the text was cut short."""
        pos = len(line) - len(line.lstrip(" |"))
        if line.startswith("-"):  # the first line of a tree
            self._columns.clear()
            bus = _HOST
        elif pos in self._columns:
            bus = self._columns[pos]
        else:
            raise SourceError(self.source, f"branch at column {pos + 1} continues no branch above", lineno)
        self._walk(line, pos, bus, lineno, last)

    def _walk(self, line: str, pos: int, bus: _Bus, lineno: int, last: bool) -> None:
        """Read one line's tokens left to right: branches, dashes, brackets, functions, a name."""
        pending: PciFunction | None = None  # the function a following "-[..]" makes a bridge
        while pos < len(line):
            if line.startswith(("+-", "\\-"), pos):
                self._branch(pos, bus)
                pending = None
                pos += 2
            elif line[pos] == "-":
                pos += 1
            elif m := _BRACKET.match(line, pos):
                bus = self._bridge(pending, m, lineno) if pending else self._bus(bus, m, lineno)
                pending = None
                pos = m.end()
            elif m := _SLOT.match(line, pos):
                pending = self._function(bus, m.group(), lineno)
                pos = m.end()
                if line[pos : pos + 1].isspace():
                    _set_name(pending, line[pos:])
                    return
            elif last:
                return
            else:
                raise SourceError(self.source, f"cannot read {line[pos : pos + 20]!r} in the tree", lineno)

    def _branch(self, column: int, bus: _Bus) -> None:
        """A branch at ``column`` opens a new sub-tree there: deeper columns are stale."""
        for stale in [c for c in self._columns if c > column]:
            del self._columns[stale]
        self._columns[column] = bus

    def _function(self, bus: _Bus, slot: str, lineno: int) -> PciFunction:
        if bus.number is None:
            raise SourceError(self.source, f"function {slot} outside any bus", lineno)
        fn = PciFunction(bdf=normalize_bdf(f"{bus.domain}:{bus.number:02x}:{slot}"), parent=bus.parent)
        self.functions.append(fn)
        return fn

    def _bridge(self, fn: PciFunction, m: re.Match[str], lineno: int) -> _Bus:
        """``dd.f-[ss-uu]``: ``fn`` is a bridge, and the line goes on on its secondary bus."""
        if m.group("dom"):
            raise SourceError(self.source, f"bus range {m.group()} after {fn.bdf} names a domain", lineno)
        fn.class_code = "0604"
        fn.secondary_bus = int(m.group("lo"), 16)
        fn.subordinate_bus = int(m.group("hi") or m.group("lo"), 16)
        return _Bus(bus_of(fn.bdf)[0], fn.secondary_bus, fn.bdf)

    def _bus(self, bus: _Bus, m: re.Match[str], lineno: int) -> _Bus:
        """``[dddd:bb]``: a root bus (or one more bus behind the current bridge)."""
        if m.group("hi"):
            raise SourceError(self.source, f"bus range {m.group()} follows no function", lineno)
        domain = bus_of(normalize_bdf(f"{m.group('dom') or bus.domain}:00:00.0"))[0]
        return _Bus(domain, int(m.group("lo"), 16), bus.parent)


def _set_name(fn: PciFunction, text: str) -> None:
    """The device name as printed, less the ``[vvvv:dddd]`` of ``-tvnn``; ids go to vendor/device_id."""
    fn.name = text.strip()
    if suffix := _IDS_SUFFIX.search(fn.name):
        fn.name = fn.name[: suffix.start()]
    if ids := suffix or _IDS_ONLY.fullmatch(fn.name):
        fn.vendor_id, fn.device_id = ids.group("ven"), ids.group("dev")
