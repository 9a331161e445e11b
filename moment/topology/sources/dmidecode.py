"""Parse ``dmidecode`` (full, ``-t slot`` or ``-t 9``): physical slots, and the system's CPUs and memory.

The PCIe tree says which ports exist; only the BIOS's DMI type 9 records say which of them are
physical slots, what they are called on the board, and how wide they are. BIOS data is often
wrong (placeholder addresses, designations that disagree with the type), so the slots are
returned as written and :mod:`moment.topology.merge` decides what to trust.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moment.errors import SourceError
from moment.topology.pci import bdf_or_none
from moment.topology.sources.text import capture_lines, decimal, note_cut_short

_HANDLE_RE = re.compile(r"^Handle (?P<handle>0x[0-9A-Fa-f]+),\s*DMI type (?P<type>[0-9]{1,3})\b")
_FIELD_RE = re.compile(r"^(?P<key>[^:]+?)\s*:\s*(?P<value>.*)$")
_WIDTH_TOKEN_RE = re.compile(r"(?<![A-Za-z0-9])[xX](?P<width>[0-9]{1,2})(?![0-9])")  # "x16", "X8", not "PCIE_X1"
_TYPE_GEN_RE = re.compile(r"PCI Express\s+(?:Gen\s*)?(?P<gen>[0-9])\b", re.IGNORECASE)  # "PCI Express 3 x16"
_DESIGNATION_GEN_RES = (
    re.compile(r"Gen\s*(?P<gen>[0-9])\b", re.IGNORECASE),  # "PCIe Gen4", "PCIE1 Gen4 X16"
    re.compile(r"PCI-?E(?:xpress)?\s*(?P<gen>[0-9])\.0", re.IGNORECASE),  # "PCI-E 3.0", "PCIe 4.0"
)
_SIZE_RE = re.compile(r"^(?P<n>[0-9]{1,9}(?:\.[0-9]{1,6})?)\s*(?P<unit>[kKMGT])B\b")
_UNIT_GB = {"k": 1 / 1024**2, "K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}
_LANE_WIDTHS = {1, 2, 4, 8, 12, 16, 32}
_MAX_GEN = 7


@dataclass
class DmiSlot:
    """One DMI type 9 (System Slot) record, as the BIOS wrote it."""

    designation: str  # "CPU1 Slot8 PCI-E 3.0 X16"
    slot_type: str  # raw "Type:" value, e.g. "x16 PCI Express 3 x16", "x16 <OUT OF SPEC>"
    width: int | None  # electrical width
    gen: int | None  # PCIe generation if known
    form: str  # "pcie" | "m2" | "u2" | "e1s" | "ocp" | "other"
    in_use: bool | None  # Current Usage: In Use → True, Available → False, else None
    length: str | None  # "Long", "Short", ...
    slot_id: str | None  # "ID:" value
    bus_address: str | None  # normalized bdf of "Bus Address:"; None if absent/unparseable
    line: int  # 1-based line of the "Handle ..., DMI type 9" header


@dataclass
class _Record:
    handle: str  # unique within one dump: a repeat means the capture was appended to itself
    dmi_type: int
    line: int
    fields: dict[str, str]


def parse_dmidecode_slots(text: str, source: str = "dmidecode.txt", notes: list[str] | None = None) -> list[DmiSlot]:
    """The DMI type 9 slots of a dmidecode capture; [] when it has records but no slot.

    Records repeating a handle (a capture appended twice) are dropped, and a capture cut short
    (a full dump without its End Of Table record, a record without its closing blank line) is
    used up to the cut; both with a warning in ``notes``.
    """
    records = _records(capture_lines(text, source), source, notes)
    if not records:
        raise SourceError(source, "no 'Handle 0x..., DMI type N' record: not dmidecode output")
    types = {r.dmi_type for r in records}
    if notes is not None and 0 in types and 127 not in types:  # a full dump (BIOS record first) ends with type 127
        notes.append(f"{source}: no End Of Table record (truncated?): only the records before the cut are used")
    else:
        note_cut_short(text, source, notes, ending="\n\n")  # dmidecode ends every record with a blank line
    return [_slot(r) for r in records if r.dmi_type == 9]


@dataclass
class DmiCapture:
    """What one dmidecode capture gives: the physical slots and the system's CPUs and memory."""

    slots: list[DmiSlot]
    system: dict


def parse_dmidecode(text: str, source: str = "dmidecode.txt", notes: list[str] | None = None) -> DmiCapture:
    """Slots and system of a capture (SourceError, as for the slots, when it is not dmidecode output)."""
    return DmiCapture(parse_dmidecode_slots(text, source, notes), parse_dmidecode_system(text))


def parse_dmidecode_system(text: str) -> dict:
    """Best-effort {"manufacturer", "product", "cpus", "memory_gb"} of a dmidecode capture.

    Keys appear only when the capture has them; an unreadable capture gives {}.
    """
    try:
        records = _records(capture_lines(text, "dmidecode"), "dmidecode", None)
    except SourceError:
        return {}
    system: dict = {}
    board = next((r.fields for r in records if r.dmi_type == 1), {})
    for key, field in (("manufacturer", "Manufacturer"), ("product", "Product Name")):
        if board.get(field):
            system[key] = board[field]
    cpus = [_cpu(r.fields) for r in records if r.dmi_type == 4 and _populated(r.fields)]
    if cpus:
        system["cpus"] = cpus
    sizes = [gb for r in records if r.dmi_type == 17 and (gb := _size_gb(r.fields.get("Size", ""))) is not None]
    if sizes:
        system["memory_gb"] = round(sum(sizes), 3)
    return system


def _records(lines: list[str], source: str, notes: list[str] | None) -> list[_Record]:
    """Every "Handle" record with its ``Key: Value`` lines (first occurrence of a key wins);
    the first record of each handle only, repeats reported in ``notes`` (when given)."""
    records: list[_Record] = []
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if m := _HANDLE_RE.match(stripped):
            records.append(_Record(handle=m["handle"].lower(), dmi_type=int(m["type"]), line=number, fields={}))
        elif records and (f := _FIELD_RE.match(stripped)):
            records[-1].fields.setdefault(f["key"], f["value"].strip())
    unique: dict[str, _Record] = {}
    for r in records:
        unique.setdefault(r.handle, r)
    if len(unique) < len(records) and notes is not None:
        notes.append(
            f"{source}: {len(records) - len(unique)} repeated DMI record(s) ignored (a capture appended twice?)"
        )
    return list(unique.values())


def _slot(record: _Record) -> DmiSlot:
    fields = record.fields
    designation = fields.get("Designation", "")
    slot_type = fields.get("Type", "")
    return DmiSlot(
        designation=designation,
        slot_type=slot_type,
        width=_width(slot_type) or _width(designation),
        gen=_gen(fields.get("PCI Express Generation", ""), slot_type, designation),
        form=_form(f"{slot_type} {designation}"),
        in_use={"in use": True, "available": False}.get(fields.get("Current Usage", "").lower()),
        length=fields.get("Length") or None,
        slot_id=fields.get("ID") or None,
        bus_address=bdf_or_none(fields.get("Bus Address", "")),
        line=record.line,
    )


def _width(text: str) -> int | None:
    """The first ``xN`` token: in "x8 PCI Express 3 x16" that is the data bus (electrical) width.

    The newer "Data Bus Width:" line is not used: dmidecode 3.5 prints it as the raw SMBIOS
    code (13 for x16), not a lane count.
    """
    m = _WIDTH_TOKEN_RE.search(text)
    width = int(m["width"]) if m else None
    return width if width in _LANE_WIDTHS else None


def _gen(generation: str, slot_type: str, designation: str) -> int | None:
    """PCIe generation from "PCI Express Generation: N", the type, or the board's designation."""
    candidates = [generation.strip()]
    candidates += [m["gen"] for m in [_TYPE_GEN_RE.search(slot_type)] if m]
    candidates += [m["gen"] for r in _DESIGNATION_GEN_RES if (m := r.search(designation))]
    for text in candidates:
        gen = decimal(text)
        if gen is not None and 1 <= gen <= _MAX_GEN:
            return gen
    return None


def _form(text: str) -> str:
    """Slot form factor from the type and designation together."""
    low = text.lower()
    if re.search(r"(?<![a-z0-9])m\.?2(?![0-9])", low):
        return "m2"
    if "u.2" in low or "sff-8639" in low:
        return "u2"
    if "e1.s" in low or "edsff" in low:
        return "e1s"
    if "ocp" in low:
        return "ocp"
    if "pci express" in low or "pci-e" in low or "pcie" in low:
        return "pcie"
    return "other"


def _populated(fields: dict[str, str]) -> bool:
    """An empty CPU socket still has a type 4 record; its status says Unpopulated."""
    return not fields.get("Status", "").lower().startswith("unpopulated")


def _cpu(fields: dict[str, str]) -> dict:
    return {
        "socket": fields.get("Socket Designation"),
        "version": fields.get("Version"),
        "cores": decimal(fields.get("Core Count")),
        "threads": decimal(fields.get("Thread Count")),
    }


def _size_gb(text: str) -> float | None:
    """GB of a type 17 "Size:" ("32 GB", "16384 MB"); None for "No Module Installed"."""
    m = _SIZE_RE.match(text.strip())
    return float(m["n"]) * _UNIT_GB[m["unit"]] if m else None
