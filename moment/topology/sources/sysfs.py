"""Read this machine's PCI functions from sysfs (``/sys/bus/pci/devices``).

sysfs needs no root and no tools, and it holds the real tree: each entry is a symlink into
``/sys/devices/pci<domain>:<bus>/<port>/.../<function>``, so a function's parent is the nearest
PCI address above it in that path. Link speeds and widths come from the kernel's link files; the
port type comes from the PCI Express capability in ``config`` when it is readable (root), else
from the shape of the tree. The root is a parameter so a fake tree can stand in for /sys.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from moment.errors import SourceError
from moment.topology.pci import (
    DOWNSTREAM,
    ENDPOINT,
    PCI_BRIDGE,
    RC_INTEGRATED,
    ROOT_PORT,
    UPSTREAM,
    PciFunction,
    bdf_or_none,
    bus_of,
    infer_port_types,
    normalize_bdf,
)
from moment.topology.sources.text import decimal, speed_gen

try:  # optional: names from the udev hardware database
    import pyudev
except ImportError:
    pyudev = None

_SLOT_ADDRESS_RE = re.compile(r"^(?P<dev>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})$")  # "0000:3b:00"
_NO_WIDTH = {0, 255}  # the kernel's "no link" / unknown widths

# PCI Express capability (id 0x10), "Device/Port Type" in bits 7:4 of its flags (offset 2).
_CAP_EXPRESS = 0x10
_CAP_LIST_BIT = 0x10  # status register (offset 6): a capability list exists
_MAX_CAPS = 48  # (256 - 64) / 4: more entries than that means a corrupt, looping list
_EXPRESS_PORT_TYPES = {
    0x0: ENDPOINT,
    0x1: ENDPOINT,  # legacy endpoint
    0x4: ROOT_PORT,
    0x5: UPSTREAM,
    0x6: DOWNSTREAM,
    0x7: PCI_BRIDGE,
    0x9: RC_INTEGRATED,
}


def read_sysfs(root: str | Path = "/sys/bus/pci/devices") -> list[PciFunction]:
    """Every PCI function under ``root``, with parent, link, NUMA, driver, port type and slot."""
    root = Path(root)
    if not root.is_dir():
        raise SourceError(str(root), "no such directory: cannot read PCI devices from sysfs")
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise SourceError(str(root), f"cannot list PCI devices: {exc.strerror or exc}") from None
    context = _udev_context()
    functions: list[PciFunction] = []
    for entry in entries:
        bdf = bdf_or_none(entry.name)
        if bdf is None:
            continue  # not a function entry
        real = Path(os.path.realpath(entry))
        ancestors = [a for a in (bdf_or_none(part) for part in real.parts[:-1]) if a]
        fn = _read_function(bdf, entry, ancestors[-1] if ancestors else None)
        fn.name = _udev_name(context, real) or f"vendor {fn.vendor_id or '????'} device {fn.device_id or '????'}"
        functions.append(fn)
    _derive_secondary_buses(functions)
    infer_port_types(functions)  # bridges whose config space gave no port type
    _assign_slots(functions, root.parent / "slots")
    return functions


def _read_function(bdf: str, entry: Path, parent: str | None) -> PciFunction:
    """One function from its sysfs files; a missing or unreadable file leaves its field None."""
    return PciFunction(
        bdf=bdf,
        class_code=_hex_field(entry / "class", shift=8),
        vendor_id=_hex_field(entry / "vendor"),
        device_id=_hex_field(entry / "device"),
        parent=parent,
        secondary_bus=_int_field(entry / "secondary_bus_number"),
        subordinate_bus=_int_field(entry / "subordinate_bus_number"),
        port_type=_config_port_type(_read_bytes(entry / "config")),
        cap_gen=_speed_gen(entry / "max_link_speed"),
        cap_width=_width(entry / "max_link_width"),
        sta_gen=_speed_gen(entry / "current_link_speed"),
        sta_width=_width(entry / "current_link_width"),
        numa_node=_numa(entry / "numa_node"),
        driver=_driver(entry / "driver"),
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _hex_field(path: Path, shift: int = 0) -> str | None:
    """4 hex digits of a ``0x...`` file: vendor "0x10de" → "10de", class "0x010802" → "0108"."""
    text = _read(path)
    try:
        value = int(text, 16) >> shift if text else None
    except ValueError:
        return None
    return f"{value & 0xFFFF:04x}" if value is not None else None


def _int_field(path: Path) -> int | None:
    return decimal(_read(path))


def _speed_gen(path: Path) -> int | None:
    return speed_gen(_read(path))  # "16.0 GT/s PCIe", "8 GT/s", "Unknown"


def _width(path: Path) -> int | None:
    width = _int_field(path)
    return None if width in _NO_WIDTH else width


def _numa(path: Path) -> int | None:
    text = _read(path)
    try:
        node = int(text) if text else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def _driver(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _config_port_type(config: bytes) -> str | None:
    """Port type from the PCI Express capability; None when config space beyond 64 bytes is
    unreadable (not root) or has no such capability."""
    if len(config) < 0x40 or not config[0x06] & _CAP_LIST_BIT:
        return None
    ptr = config[0x34] & 0xFC
    for _ in range(_MAX_CAPS):
        if ptr < 0x40 or ptr + 4 > len(config):
            return None
        if config[ptr] == _CAP_EXPRESS:
            return _EXPRESS_PORT_TYPES.get(config[ptr + 2] >> 4 & 0x0F)
        ptr = config[ptr + 1] & 0xFC
    return None


def _udev_context() -> object | None:
    if pyudev is None:
        return None
    try:
        return pyudev.Context()
    except Exception:  # noqa: BLE001 - libudev missing or unusable: names are optional
        return None


def _udev_name(context: object | None, sys_path: Path) -> str | None:
    """The "<vendor> <model>" of the udev hardware database, if pyudev and the entry allow."""
    if context is None:
        return None
    try:
        props = pyudev.Devices.from_sys_path(context, str(sys_path)).properties
        words = [props.get("ID_VENDOR_FROM_DATABASE"), props.get("ID_MODEL_FROM_DATABASE")]
    except Exception:  # noqa: BLE001 - any pyudev failure only costs the pretty name
        return None
    return " ".join(w for w in words if w) or None


def _children(functions: list[PciFunction]) -> dict[str, list[PciFunction]]:
    kids: dict[str, list[PciFunction]] = {}
    for fn in functions:
        if fn.parent is not None:
            kids.setdefault(fn.parent, []).append(fn)
    return kids


def _derive_secondary_buses(functions: list[PciFunction]) -> None:
    """A bridge without a ``secondary_bus_number`` file (old kernels) gets its children's bus."""
    kids = _children(functions)
    for fn in functions:
        if fn.secondary_bus is None and fn.bdf in kids:
            fn.secondary_bus = bus_of(kids[fn.bdf][0].bdf)[1]


def _assign_slots(functions: list[PciFunction], slots_dir: Path) -> None:
    """Give the port of each hotplug/ACPI slot in ``slots_dir`` the slot's name (best effort).

    A slot's ``address`` (``dddd:bb:dd``) names either the port itself (ACPI ``_SUN`` on a root
    or downstream port, which is what lspci shows) or the device in the slot (pciehp), whose
    port is the bridge above that bus.
    """
    try:
        slots = sorted(p for p in slots_dir.iterdir() if p.is_dir())
    except OSError:
        return
    for slot in slots:
        m = _SLOT_ADDRESS_RE.match(_read(slot / "address") or "")
        port = _slot_port(functions, normalize_bdf(f"{m['dev']}.0").rsplit(".", 1)[0]) if m else None
        if port is not None:
            port.physical_slot = slot.name


def _slot_port(functions: list[PciFunction], device_address: str) -> PciFunction | None:
    at_address = [f for f in functions if f.device_address == device_address]
    for fn in at_address:
        if fn.port_type in (ROOT_PORT, DOWNSTREAM):
            return fn
    domain, bus = bus_of(f"{device_address}.0")
    return next((f for f in functions if f.secondary_bus == bus and bus_of(f.bdf)[0] == domain), None)
