"""Parser for ``nvidia-smi topo -m``: GPU/NIC relation matrix, NVLink counts, CPU/NUMA affinity.

The matrix does not show the PCIe tree, only how each pair of devices reaches each other
(PIX/PXB: through switches only; PHB/NODE/SYS: through a host bridge or the CPUs; NV#: over
NVLink). That is still enough to tell which devices share a switch (:func:`smi_groups`).

The real tool separates columns with tabs; captures pasted into documents often have spaces.
Cells never contain blanks, so rows are split on any whitespace. Only the header needs care:
its trailing columns ("CPU Affinity", ...) are several words each. Their values are matched
by order, not by position, because nvidia-smi leaves an empty cell between "NUMA Affinity" and
"GPU NUMA ID" in data rows, which shifts the values against the header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moment.errors import SourceError
from moment.topology.sources.text import capture_lines, decimal, note_cut_short

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_GPU = re.compile(r"GPU\d+")
_NVLINK = re.compile(r"NV([0-9]{1,6})")
_CELL = re.compile(r"X|NV[0-9]{1,6}|PIX|PXB|PHB|NODE|SYS|SOC")  # SOC: older drivers' name for SYS
_TRAILING = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID")
# A trailing header: a known one, else words up to a tab, two blanks or the end of the line.
_TRAILING_HEADER = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+(?: \S+)*?(?=\t| {2,}|$)")
_NIC_LEGEND = re.compile(r"\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_SAME_SWITCH = {"PIX", "PXB"}


@dataclass
class SmiTopo:
    """What ``nvidia-smi topo -m`` shows, keyed by its row/column labels."""

    gpus: list[str] = field(default_factory=list)  # ["GPU0", ...] in order
    nics: dict[str, str] = field(default_factory=dict)  # "NIC0" -> "mlx5_2" (label if no legend)
    relation: dict[tuple[str, str], str] = field(default_factory=dict)  # both orders, no "X"
    nvlinks: dict[tuple[str, str], int] = field(default_factory=dict)  # sorted pair -> link count
    cpu_affinity: dict[str, str] = field(default_factory=dict)  # "GPU0" -> "0-103"
    numa: dict[str, int | None] = field(default_factory=dict)  # "GPU0" -> 0; "N/A" -> None


def parse_nvidia_smi_topo(text: str, source: str = "nvidia-smi-topo-m.txt", notes: list[str] | None = None) -> SmiTopo:
    """The matrix, legend and affinities of an ``nvidia-smi topo -m`` capture.

    Raises SourceError for empty or binary input and for text without the GPU matrix header.
    A last row cut short (a truncated capture) is read as far as it goes. Only the first matrix
    is read; a second one (a capture appended twice) is reported in ``notes`` when given.
    """
    lines = capture_lines(_ANSI.sub("", text), source)  # a terminal's escapes are not binary data
    start = _header_index(lines)
    if start is None:
        raise SourceError(source, "no GPU matrix header (is this `nvidia-smi topo -m` output?)")
    labels, headers = _split_header(lines[start])
    topo = SmiTopo(gpus=[label for label in labels if _GPU.fullmatch(label)])
    reader = _MatrixReader(source, topo, labels, headers)
    end = reader.read(lines, start + 1)
    if notes is not None and (again := _header_index(lines[end:])) is not None:
        notes.append(
            f"{source}:{end + again + 1}: a second GPU matrix (a capture appended twice?): only the first is used"
        )
    elif notes is not None and (short := [label for label in labels if label not in reader.complete]):
        notes.append(
            f"{source}: the matrix stops before the row of {short[0]} ({len(short)} of {len(labels)} rows "
            "missing or cut short; truncated?): only the rows before are used"
        )
    else:
        note_cut_short(text, source, notes)
    legend = {m.group(1): m.group(2) for line in lines[end:] if (m := _NIC_LEGEND.match(line))}
    topo.nics = {label: legend.get(label, label) for label in labels if not _GPU.fullmatch(label)}
    return topo


def _header_index(lines: list[str]) -> int | None:
    """The header starts with GPU0's column label; unlike GPU0's row it has no "X" cell."""
    for i, line in enumerate(lines):
        tokens = line.split()
        if tokens and _GPU.fullmatch(tokens[0]) and "X" not in tokens:
            return i
    return None


def _split_header(line: str) -> tuple[list[str], list[str]]:
    """(device column labels, trailing column headers such as "CPU Affinity")."""
    m = _TRAILING.search(line)
    cut = m.start() if m else len(line)
    return line[:cut].split(), _TRAILING_HEADER.findall(line[cut:])


class _MatrixReader:
    """Reads the data rows below the header into a :class:`SmiTopo`."""

    def __init__(self, source: str, topo: SmiTopo, labels: list[str], headers: list[str]) -> None:
        self.source = source
        self.topo = topo
        self.labels = labels
        self.headers = headers
        self.complete: set[str] = set()  # rows read with every cell

    def read(self, lines: list[str], start: int) -> int:
        """Read rows from ``start``; return the index of the first line after the matrix."""
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        for i in range(start, len(lines)):
            tokens = lines[i].split()
            if not tokens:
                continue
            if tokens[0] not in self.labels:
                return i
            self._row(tokens, i + 1, cut_short=i == last)
        return len(lines)

    def _row(self, tokens: list[str], lineno: int, cut_short: bool) -> None:
        row, n = tokens[0], len(self.labels)
        cells, values = tokens[1 : 1 + n], tokens[1 + n :]
        for column, cell in zip(self.labels, cells, strict=False):
            if not _CELL.fullmatch(cell):
                if cut_short:
                    return
                raise SourceError(self.source, f"row {row}: unknown relation {cell!r} in column {column}", lineno)
            self._cell(row, column, cell)
        if len(cells) < n and not cut_short:
            raise SourceError(self.source, f"row {row} has {len(cells)} cells for {n} columns", lineno)
        if len(cells) == n:
            self.complete.add(row)
        for header, value in zip(self.headers, values, strict=False):
            self._value(row, header, value)

    def _cell(self, row: str, column: str, cell: str) -> None:
        if cell == "X":
            return
        self.topo.relation[(row, column)] = cell
        self.topo.relation.setdefault((column, row), cell)  # its own row, when read, wins
        if m := _NVLINK.fullmatch(cell):
            a, b = sorted((row, column))
            self.topo.nvlinks[(a, b)] = int(m.group(1))

    def _value(self, row: str, header: str, value: str) -> None:
        if header == "CPU Affinity":
            self.topo.cpu_affinity[row] = value
        elif header == "NUMA Affinity":
            self.topo.numa[row] = decimal(value)


def smi_groups(topo: SmiTopo) -> list[list[str]]:
    """Devices that share a PCIe switch: connected by PIX/PXB relations, transitively.

    PIX/PXB means the path avoids the host bridge, i.e. both sit below one root port; that is
    an equivalence, so chains of such relations form one group. NV# cells hide the PCIe
    relation of a GPU pair, but such GPUs still join through a NIC both reach by PIX/PXB.
    Devices with only PHB/NODE/SYS relations are groups of one. Groups keep matrix order.
    """
    devices = topo.gpus + list(topo.nics)
    root = {d: d for d in devices}

    def find(d: str) -> str:
        while root[d] != d:
            root[d] = root[root[d]]
            d = root[d]
        return d

    for (a, b), rel in topo.relation.items():
        if rel in _SAME_SWITCH and a in root and b in root:
            root[find(a)] = find(b)
    groups: dict[str, list[str]] = {}
    for d in devices:
        groups.setdefault(find(d), []).append(d)
    return list(groups.values())
