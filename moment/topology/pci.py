"""One PCI function as the sources see it, and what kind of device it is.

Every source (lspci -tv, lspci -vvv, sysfs, NCCL XML) reduces its input to a flat list of
:class:`PciFunction` records with a ``parent`` pointer; :mod:`moment.topology.build` turns that
list into the machine model. Keeping the record flat and source-neutral is what lets one tree
builder serve all sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Port types, as lspci -vvv names them in "Express (v2) <type>".
ROOT_PORT = "root_port"
UPSTREAM = "upstream"
DOWNSTREAM = "downstream"
ENDPOINT = "endpoint"
PCI_BRIDGE = "pci_bridge"  # PCIe-to-PCI/PCI-X bridge: not a switch
RC_INTEGRATED = "rc_integrated"

# Device kinds in the model.
GPU = "gpu"
NVME = "nvme"
NIC = "nic"
STORAGE = "storage"  # non-NVMe storage/RAID controllers
BRIDGE = "bridge"
OTHER = "other"

_BDF_RE = re.compile(r"^(?:(?P<dom>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$")

_SPEED_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_BRIDGE_CLASSES = {"0604", "0609"}  # PCI-to-PCI bridge, semi-transparent PCI-to-PCI bridge


def normalize_bdf(text: str, domain: str = "0000") -> str:
    """Return ``dddd:bb:dd.f`` (lower case, 4-digit domain) or raise ValueError."""
    m = _BDF_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a PCI address: {text!r}")
    dom = (m.group("dom") or domain).lower()
    dom = dom[-4:] if int(dom, 16) < 0x10000 else dom
    return f"{dom.zfill(4)}:{m.group('bus').lower()}:{m.group('dev').lower()}.{m.group('fn')}"


def bdf_or_none(text: str) -> str | None:
    """:func:`normalize_bdf`, or None where ``text`` is not a PCI address."""
    try:
        return normalize_bdf(text)
    except ValueError:
        return None


def bus_of(bdf: str) -> tuple[str, int]:
    """(domain, bus number) of a normalized address."""
    dom, bus, _ = bdf.split(":")
    return dom, int(bus, 16)


def speed_to_gen(gts: float | None) -> int | None:
    """PCIe generation of a link speed in GT/s (2.5 → 1 … 64 → 6); None if unknown."""
    if gts is None:
        return None
    for speed, gen in _SPEED_TO_GEN.items():
        if abs(gts - speed) < 0.01:
            return gen
    return None


@dataclass
class PciFunction:
    """One PCI function, source-neutral. Fields a source cannot see stay None."""

    bdf: str
    name: str = ""
    class_code: str | None = None  # 4 hex digits: "0604", "0300", "0108", ...
    vendor_id: str | None = None  # 4 hex digits, lower case
    device_id: str | None = None
    parent: str | None = None  # bdf of the bridge above; None = on a root bus
    secondary_bus: int | None = None  # bridges only
    subordinate_bus: int | None = None
    port_type: str | None = None  # ROOT_PORT, UPSTREAM, DOWNSTREAM, ENDPOINT, PCI_BRIDGE, ...
    cap_gen: int | None = None  # LnkCap
    cap_width: int | None = None
    sta_gen: int | None = None  # LnkSta (negotiated)
    sta_width: int | None = None
    numa_node: int | None = None
    physical_slot: str | None = None
    driver: str | None = None
    acs_redirect: bool | None = None  # ACSCtl ReqRedir+: peer requests are sent up to the root complex

    @property
    def is_bridge(self) -> bool:
        if self.class_code is not None:
            return self.class_code in _BRIDGE_CLASSES
        return self.secondary_bus is not None

    @property
    def device_address(self) -> str:
        """The address without the function number: functions of one device share it."""
        return self.bdf.rsplit(".", 1)[0]


def drop_repeats(functions: list[PciFunction], source: str, notes: list[str] | None) -> list[PciFunction]:
    """The first record of every address: a capture appended to itself (``>>``) lists each twice.

    Each repeat would otherwise be a second child of its bridge, and the tree walk multiplies.
    The repeats are reported in ``notes`` (when given), naming ``source``.
    """
    unique: dict[str, PciFunction] = {}
    for fn in functions:
        unique.setdefault(fn.bdf, fn)
    repeats = len(functions) - len(unique)
    if repeats and notes is not None:
        notes.append(f"{source}: {repeats} repeated PCI function record(s) ignored (a capture appended twice?)")
    return list(unique.values())


def infer_port_types(functions: list[PciFunction]) -> None:
    """Fill the port type of bridges that have none from the shape of the tree alone.

    A bridge on a root bus is a root port; a bridge below an upstream port is a downstream
    port; otherwise a bridge whose secondary bus holds bridges is a switch's upstream port (a
    downstream port may lead to the upstream port of a cascaded switch). Other bridges (e.g. a
    BMC's PCIe-to-PCI bridge) stay unmarked. Parents are decided before their children, in the
    order the ``parent`` pointers give, whatever the order of ``functions``.
    """
    by_bdf = {fn.bdf: fn for fn in functions}
    above_bridges = {fn.parent for fn in functions if fn.is_bridge}
    for fn in sorted(functions, key=lambda f: _depth(f, by_bdf)):
        if fn.port_type is not None or not fn.is_bridge:
            continue
        parent = by_bdf.get(fn.parent) if fn.parent else None
        if fn.parent is None:
            fn.port_type = ROOT_PORT
        elif parent is not None and parent.port_type == UPSTREAM:
            fn.port_type = DOWNSTREAM
        elif fn.bdf in above_bridges:
            fn.port_type = UPSTREAM


def _depth(fn: PciFunction, by_bdf: dict[str, PciFunction]) -> int:
    """How many of ``by_bdf`` lie above ``fn`` along the parent pointers (a cycle ends the walk)."""
    seen = {fn.bdf}
    depth = 0
    while fn.parent in by_bdf and fn.parent not in seen:
        fn = by_bdf[fn.parent]
        seen.add(fn.bdf)
        depth += 1
    return depth


_GPU_VENDORS = {"10de", "1002", "8086"}  # NVIDIA, AMD, Intel (Intel only with a 0302/0380 class)
_BMC_VGA_VENDORS = {"1a03", "102b", "19a2", "1556"}  # ASPEED, Matrox, Emulex/ServerEngines, PLDA


def classify(fn: PciFunction) -> str:
    """Kind of device a function belongs to: GPU, NVME, NIC, STORAGE, BRIDGE or OTHER.

    Uses the class code when the source gives one, the name otherwise (lspci -tv prints names
    only). A BMC's display controller is not a GPU, and a GPU's audio/USB functions are OTHER.
    """
    name = fn.name.lower()
    cc = fn.class_code
    if cc is not None:
        base, sub = cc[:2], cc[2:]
        if cc in _BRIDGE_CLASSES:
            return BRIDGE
        if base == "03":
            if fn.vendor_id in _BMC_VGA_VENDORS or "aspeed" in name or "matrox" in name:
                return OTHER
            if sub == "00" and fn.vendor_id == "8086" and "arc" not in name:
                return OTHER  # integrated Intel graphics on a server board
            return GPU
        if base == "12":  # processing accelerators (e.g. Gaudi, some AI cards)
            return GPU
        if cc == "0108":
            return NVME
        if base == "01":
            return STORAGE
        if base == "02":
            return NIC
        return OTHER
    # Name-only classification (lspci -tv).
    if "bridge" in name and ("pci" in name or "pcie" in name) or re.search(r"\bswitch\b", name):
        return BRIDGE
    if any(w in name for w in ("audio", "usb", "ucsi", "serial bus")):
        return OTHER
    if "aspeed" in name or "matrox" in name:
        return OTHER
    if "nvidia" in name or re.search(r"\b(radeon|instinct|gaudi)\b", name):
        return GPU
    if "non-volatile memory" in name or ("nvme" in name and "raid" not in name):
        return NVME
    if any(w in name for w in ("raid", "sas", "sata", "storage controller", "scsi")):
        return STORAGE
    if any(w in name for w in ("ethernet", "network", "connectx", "infiniband", "bluefield")):
        return NIC
    return OTHER
