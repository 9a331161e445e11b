"""Parse ``lspci -vvv`` / ``-vvnn`` / ``-vvvnn`` (with or without ``-D``) into PciFunction records.

``lspci -vv`` is the richest capture a user can paste: it gives each function's class, ids, port
type, link capability and status, NUMA node and slot. It does not print the tree, so the parent
of each function is rebuilt from the bridges' bus ranges. Real captures are messy (prompts,
CRLF, re-indented pastes, truncation), so unknown lines are ignored and a record that cannot be
read is skipped; only input that is not an lspci capture at all raises :class:`SourceError`.
"""

from __future__ import annotations

import re

from moment.errors import SourceError
from moment.topology.pci import (
    DOWNSTREAM,
    ENDPOINT,
    PCI_BRIDGE,
    RC_INTEGRATED,
    ROOT_PORT,
    UPSTREAM,
    PciFunction,
    bus_of,
    drop_repeats,
    normalize_bdf,
    speed_to_gen,
)
from moment.topology.sources.text import capture_lines, note_cut_short

_HEADER_RE = re.compile(
    r"^(?P<addr>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<cls>[A-Za-z0-9][^:\[\]]*?)(?:\s*\[(?P<cc>[0-9a-fA-F]{4})\])?:\s*(?P<desc>.*)$"
)
_TAIL_RE = re.compile(r"\s+\((?:rev|prog-if)\s")  # "(rev a1)", "(prog-if 00 [Normal decode])"
_IDS_RE = re.compile(r"\s*\[(?P<ven>[0-9a-fA-F]{4}):(?P<dev>[0-9a-fA-F]{4})\]$")  # -nn
_BARE_IDS_RE = re.compile(r"^(?P<ven>[0-9a-fA-F]{4}):(?P<dev>[0-9a-fA-F]{4})$")  # -n
_NUMERIC_CLASS_RE = re.compile(r"^(?:Class\s+)?(?P<cc>[0-9a-fA-F]{4})$")  # -n, or a class lspci cannot name
_BUS_RE = re.compile(
    r"^Bus:\s*primary=[0-9a-fA-F]+,\s*secondary=(?P<sec>[0-9a-fA-F]+),\s*subordinate=(?P<sub>[0-9a-fA-F]+)"
)
_EXPRESS_RE = re.compile(r"^Capabilities:\s*\[[0-9a-fA-F]+[^\]]*\]\s*Express\s*(?:\(v\d+\)\s*)?(?P<type>[^,(]+)")
_SPEED_RE = re.compile(r"Speed\s+(?P<gts>[0-9]{1,3}(?:\.[0-9]{1,3})?)\s*GT/s")
_WIDTH_RE = re.compile(r"Width\s+x(?P<width>[0-9]{1,3})\b")
_NUMA_RE = re.compile(r"^NUMA node:\s*(?P<node>-?[0-9]{1,6})\b")
_SLOT_RE = re.compile(r"^Physical Slot:\s*(?P<slot>\S.*)$")
_DRIVER_RE = re.compile(r"^Kernel driver in use:\s*(?P<driver>\S+)")
_ACS_RE = re.compile(r"^ACSCtl:.*\bReqRedir(?P<on>[+-])")  # Access Control Services, as configured

# lspci -vvv without -nn names the class only; these are pci.ids' names for the codes we need.
CLASS_CODES = {
    "Non-VGA unclassified device": "0000",
    "SCSI storage controller": "0100",
    "IDE interface": "0101",
    "RAID bus controller": "0104",
    "SATA controller": "0106",
    "Serial Attached SCSI controller": "0107",
    "Non-Volatile memory controller": "0108",
    "Mass storage controller": "0180",
    "Ethernet controller": "0200",
    "Infiniband controller": "0207",
    "Fabric controller": "0208",
    "Network controller": "0280",
    "VGA compatible controller": "0300",
    "3D controller": "0302",
    "Display controller": "0380",
    "Audio device": "0403",
    "Memory controller": "0580",
    "Host bridge": "0600",
    "ISA bridge": "0601",
    "PCI bridge": "0604",
    "Communication controller": "0780",
    "PIC": "0800",
    "System peripheral": "0880",
    "USB controller": "0c03",
    "Fibre Channel": "0c04",
    "SMBus": "0c05",
    "Serial bus controller": "0c80",
    "Performance counters": "1101",
    "Signal processing controller": "1180",
    "Processing accelerators": "1200",
    "Unassigned class": "ff00",
}

# "Express (v2) <type>" of the PCI Express capability.
_PORT_TYPES = {
    "Root Port": ROOT_PORT,
    "Upstream Port": UPSTREAM,
    "Downstream Port": DOWNSTREAM,
    "Endpoint": ENDPOINT,
    "Legacy Endpoint": ENDPOINT,
    "PCI-Express to PCI/PCI-X Bridge": PCI_BRIDGE,
    "Root Complex Integrated Endpoint": RC_INTEGRATED,
}


def parse_lspci_verbose(text: str, source: str = "lspci-vvv.txt", notes: list[str] | None = None) -> list[PciFunction]:
    """Every function of an ``lspci -vv[v][nn][D]`` capture, with ``parent`` rebuilt from bus ranges.

    Warnings (repeated records, a truncated last record) are appended to ``notes`` when given.
    """
    records = _split_records(capture_lines(text, source))
    if not records:
        example = "'00:1f.2 SATA controller: ...'"
        raise SourceError(source, f"no lspci function header (like {example}): not lspci -vvv output")
    functions: list[PciFunction] = []
    for header, body in records:
        try:
            functions.append(_parse_record(header, body))
        except ValueError:
            continue  # an address or number lspci would never print: skip the record, keep the rest
    note_cut_short(text, source, notes, ending="\n\n")  # lspci ends every record with a blank line
    result = drop_repeats(functions, source, notes)  # a capture pasted twice: the first copy wins
    _link_parents(result)
    return result


def _split_records(lines: list[str]) -> list[tuple[re.Match[str], list[str]]]:
    """(header match, stripped body lines) per function; anything before the first header is dropped."""
    records: list[tuple[re.Match[str], list[str]]] = []
    for line in lines:
        stripped = line.strip()
        header = _HEADER_RE.match(stripped)
        if header:
            records.append((header, []))
        elif records and stripped:
            records[-1][1].append(stripped)
    return records


def _parse_record(header: re.Match[str], body: list[str]) -> PciFunction:
    fn = PciFunction(bdf=normalize_bdf(header["addr"]))
    _fill_identity(fn, header["cls"].strip(), header["cc"], header["desc"])
    for line in body:
        _apply_line(fn, line)
    return fn


def _fill_identity(fn: PciFunction, cls: str, cc: str | None, desc: str) -> None:
    """Name, class code and ids from the header's ``<class> [cccc]: <name> [vvvv:dddd] (rev ..)``."""
    numeric = _NUMERIC_CLASS_RE.match(cls)
    code = cc or (numeric["cc"] if numeric else CLASS_CODES.get(cls))
    fn.class_code = code.lower() if code else None
    tail = _TAIL_RE.search(desc)
    name = (desc[: tail.start()] if tail else desc).strip()
    ids = _IDS_RE.search(name) or _BARE_IDS_RE.match(name)
    if ids:
        fn.vendor_id, fn.device_id = ids["ven"].lower(), ids["dev"].lower()
        name = name[: ids.start()].strip()
    fn.name = name


def _apply_line(fn: PciFunction, line: str) -> None:
    """Fill whatever field one body line carries; other lines are ignored."""
    if m := _BUS_RE.match(line):
        fn.secondary_bus, fn.subordinate_bus = int(m["sec"], 16), int(m["sub"], 16)
    elif (m := _EXPRESS_RE.match(line)) and fn.port_type is None:
        fn.port_type = _PORT_TYPES.get(m["type"].strip())
    elif line.startswith("LnkCap:"):
        fn.cap_gen, fn.cap_width = _link(line)
    elif line.startswith("LnkSta:"):
        fn.sta_gen, fn.sta_width = _link(line)
    elif m := _NUMA_RE.match(line):
        node = int(m["node"])
        fn.numa_node = node if node >= 0 else None
    elif m := _SLOT_RE.match(line):
        fn.physical_slot = m["slot"].strip()
    elif m := _DRIVER_RE.match(line):
        fn.driver = m["driver"]
    elif m := _ACS_RE.match(line):
        fn.acs_redirect = m["on"] == "+"


def _link(line: str) -> tuple[int | None, int | None]:
    """(gen, width) of a LnkCap/LnkSta line; a link of width x0 is down, so both are None."""
    width_m = _WIDTH_RE.search(line)
    width = int(width_m["width"]) if width_m else None
    if width == 0:
        return None, None
    speed_m = _SPEED_RE.search(line)
    return (speed_to_gen(float(speed_m["gts"])) if speed_m else None), width


def _link_parents(functions: list[PciFunction]) -> None:
    """A function's parent is the bridge whose secondary bus is the function's bus (same domain).

    A bridge whose secondary bus is not above its own bus (unconfigured: ``secondary=00``) is
    ignored, which also rules out cycles.
    """
    below: dict[tuple[str, int], str] = {}
    for fn in functions:
        if fn.secondary_bus is None:
            continue
        domain, bus = bus_of(fn.bdf)
        if fn.secondary_bus > bus:
            below.setdefault((domain, fn.secondary_bus), fn.bdf)
    for fn in functions:
        fn.parent = below.get(bus_of(fn.bdf))
