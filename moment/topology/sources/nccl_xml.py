"""Parser for NCCL topology dumps (``NCCL_TOPO_DUMP_FILE``): CPUs, PCI nodes, GPUs, NICs, NVLinks.

NCCL walks sysfs two levels at a time, skipping every downstream port and the root port, so
a whole PCIe switch appears as one ``<pci class="0x060400">`` node directly under its
``<cpu>`` with the endpoints as its children; a cascaded switch is a bridge node nested in
another. Every bridge node is therefore a switch (upstream port), and the parent pointers
skip the ports NCCL left out.

The file is read incrementally so that a truncated dump still yields what came before the
cut. Structural attributes (busid, numaid, gpu dev, nvlink target/count) must be valid or the
dump is rejected; descriptive ones (class, ids, link speed/width) are dropped when unreadable.
"""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from moment.errors import SourceError
from moment.topology.pci import UPSTREAM, PciFunction, normalize_bdf
from moment.topology.sources.text import capture_text, decimal, speed_gen

_VENDORS = {
    "10de": "NVIDIA",
    "15b3": "Mellanox",
    "11f8": "Microsemi",
    "10b5": "PLX",
    "1000": "Broadcom",
    "14e4": "Broadcom",
    "8086": "Intel",
    "1022": "AMD",
    "1002": "AMD",
}


@dataclass
class NcclTopo:
    """What an NCCL topology dump shows; functions are parents first, in file order."""

    functions: list[PciFunction] = field(default_factory=list)  # every <pci> node
    cpu_numa: dict[str, int] = field(default_factory=dict)  # top-level pci bdf -> its cpu's numaid
    gpu_dev: dict[str, int] = field(default_factory=dict)  # bdf -> <gpu dev=..>
    nvlinks: list[tuple[str, str, int]] = field(default_factory=list)  # (gpu bdf, target bdf, count)
    cpus: list[dict[str, str | int | None]] = field(default_factory=list)  # numaid, arch, vendor, familyid, modelid


def parse_nccl_xml(text: str, source: str = "nccl-topo.xml", notes: list[str] | None = None) -> NcclTopo:
    """The PCI functions, CPUs, GPU indices and NVLinks of an NCCL topology dump.

    Raises SourceError for empty or binary input, text that is not XML, XML whose root is not
    ``<system>`` and invalid structural attributes. A dump that stops being well-formed part way
    (truncated) is read up to the fault, with a warning in ``notes`` when given.
    """
    events, error = _read_events(capture_text(text, source))
    if not events:
        raise SourceError(source, f"not XML: {error}", _error_line(error))
    root = events[0][1]
    if root.tag != "system":
        raise SourceError(source, f"root element is <{root.tag}>, not NCCL's <system>")
    if error is not None and notes is not None:
        if events[-1] == ("end", root):  # <system> closed, then more: `>>` twice, not a cut
            notes.append(
                f"{source}:{_error_line(error)}: more XML after </system> (a dump appended twice?): "
                "only the first <system> is used"
            )
        else:
            notes.append(
                f"{source}:{_error_line(error)}: not well-formed XML ({error}): truncated? "
                "only what comes before this point is used"
            )
    walker = _Walker(source)
    for event, element in events[1:]:
        if event == "start":
            walker.start(element)
        elif element is not root:
            walker.end()
    return walker.finish()


def _read_events(text: str) -> tuple[list[tuple[str, ET.Element]], ET.ParseError | None]:
    """All start/end events up to the end or to the first syntax error, and that error."""
    events: list[tuple[str, ET.Element]] = []
    try:
        for event, element in ET.iterparse(io.StringIO(text), events=("start", "end")):
            events.append((event, element))
    except ET.ParseError as exc:
        return events, exc
    return events, None


def _error_line(error: ET.ParseError | None) -> int | None:
    return error.position[0] if error is not None else None


@dataclass
class _Frame:
    """An open element and what it inherits: the nearest enclosing <pci> and <cpu> numaid."""

    tag: str
    pci: PciFunction | None
    numa: int | None


class _Walker:
    """Turns the element events below <system> into an :class:`NcclTopo`."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.topo = NcclTopo()
        self._stack: list[_Frame] = []
        self._kind: dict[str, str] = {}  # bdf -> "GPU" / "NIC" (from the child elements)
        self._net: dict[str, str] = {}  # bdf -> first <net name>
        self._linked: set[frozenset[str]] = set()

    def start(self, el: ET.Element) -> None:
        outer = self._stack[-1] if self._stack else _Frame("system", None, None)
        pci, numa = outer.pci, outer.numa
        if el.tag == "cpu":
            numa = self._cpu(el)
        elif el.tag == "pci":
            pci = self._pci(el, outer)
        elif pci is not None and el.tag == "gpu":
            self.topo.gpu_dev[pci.bdf] = self._required_int(el, "dev")
            self._kind[pci.bdf] = "GPU"
        elif pci is not None and el.tag == "nic" and outer.tag == "pci":
            self._kind[pci.bdf] = "NIC"
        elif pci is not None and el.tag == "net" and outer.tag == "nic" and (name := el.get("name")):
            self._net.setdefault(pci.bdf, name)
        elif pci is not None and el.tag == "nvlink" and outer.tag == "gpu":
            self._nvlink(el, pci)
        self._stack.append(_Frame(el.tag, pci, numa))

    def end(self) -> None:
        self._stack.pop()

    def finish(self) -> NcclTopo:
        """Name the functions now that their <gpu>/<nic> children are known."""
        for fn in self.topo.functions:
            fn.name = _name(fn, self._kind.get(fn.bdf), self._net.get(fn.bdf))
        return self.topo

    def _cpu(self, el: ET.Element) -> int | None:
        """Record a CPU; return its NUMA node for the functions below (None if unknown: -1)."""
        numaid = self._int(el, "numaid")
        self.topo.cpus.append(
            {
                "numaid": numaid,
                "arch": el.get("arch"),
                "vendor": el.get("vendor"),
                "familyid": decimal(el.get("familyid")),
                "modelid": decimal(el.get("modelid")),
            }
        )
        return numaid if numaid is not None and numaid >= 0 else None

    def _pci(self, el: ET.Element, outer: _Frame) -> PciFunction:
        class_code = _class_code(el.get("class"))
        fn = PciFunction(
            bdf=self._bdf(el.get("busid")),
            class_code=class_code,
            vendor_id=_hex4(el.get("vendor")),
            device_id=_hex4(el.get("device")),
            parent=outer.pci.bdf if outer.pci else None,
            port_type=UPSTREAM if class_code == "0604" else None,
            sta_gen=speed_gen(el.get("link_speed")),
            sta_width=_width(el.get("link_width")),
            numa_node=outer.numa,
        )
        if outer.tag == "cpu" and outer.numa is not None:
            self.topo.cpu_numa[fn.bdf] = outer.numa
        self.topo.functions.append(fn)
        return fn

    def _nvlink(self, el: ET.Element, gpu: PciFunction) -> None:
        """One link bundle; a GPU pair listed from both ends counts once."""
        target = self._bdf(el.get("target"))
        pair = frozenset((gpu.bdf, target))
        if pair not in self._linked:
            self._linked.add(pair)
            self.topo.nvlinks.append((gpu.bdf, target, self._required_int(el, "count")))

    def _bdf(self, value: str | None) -> str:
        try:
            return normalize_bdf(value or "")
        except ValueError:
            raise SourceError(self.source, f"bad PCI address {value!r}") from None

    def _int(self, el: ET.Element, attr: str) -> int | None:
        """An integer attribute the structure depends on; None when absent."""
        value = el.get(attr)
        return None if value is None else self._required_int(el, attr)

    def _required_int(self, el: ET.Element, attr: str) -> int:
        value = el.get(attr)
        try:
            return int(value or "")
        except ValueError:
            raise SourceError(self.source, f"<{el.tag} {attr}={value!r}>: not an integer") from None


def _hex(value: str | None) -> int | None:
    try:
        number = int(value or "", 16)
    except ValueError:
        return None
    return number if number >= 0 else None


def _hex4(value: str | None) -> str | None:
    """Vendor/device id: "0x10de" -> "10de"."""
    number = _hex(value)
    return f"{number:04x}" if number is not None and number <= 0xFFFF else None


def _class_code(value: str | None) -> str | None:
    """Class code without the programming interface: "0x060400" -> "0604"."""
    number = _hex(value)
    return f"{number >> 8:04x}" if number is not None and number <= 0xFFFFFF else None


def _width(value: str | None) -> int | None:
    width = decimal(value)
    return width if width else None


def _name(fn: PciFunction, kind: str | None, net: str | None) -> str:
    """A readable name from what NCCL records, e.g. "NVIDIA GPU 10de:2204", "Mellanox NIC mlx5_0"."""
    if kind is None:
        kind = "PCI bridge" if fn.class_code == "0604" else "PCI device"
    ids = f"{fn.vendor_id}:{fn.device_id}" if fn.vendor_id and fn.device_id else None
    words = [_VENDORS.get(fn.vendor_id or ""), kind, net or ids]
    return " ".join(w for w in words if w)
