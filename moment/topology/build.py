"""Turn a flat list of PCI functions into the machine model (sockets → ports → switches → devices).

One builder serves every tree source (lspci -tv, lspci -vvv, sysfs, NCCL XML): each gives
functions with parent pointers and whatever fields it can see. What a source cannot see is
inferred here and reported as a warning, so the user knows which figures are guesses.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from moment.topology import pci
from moment.topology.model import (
    Device,
    DeviceKind,
    Link,
    Port,
    PortKind,
    Slot,
    Socket,
    SocketLink,
    SocketLinkKind,
    Switch,
)
from moment.topology.pci import PciFunction

# Order in which a multi-function device is named for its most important function.
# A device's kind by its primary function's class, in the order the primary function is chosen by.
_DEVICE_KINDS: dict[str, DeviceKind] = {
    pci.GPU: "gpu",
    pci.NVME: "nvme",
    pci.NIC: "nic",
    pci.STORAGE: "storage",
    pci.OTHER: "other",
}
_KIND_RANK = {k: i for i, k in enumerate(_DEVICE_KINDS)}
_ADD_IN_KINDS = {pci.GPU, pci.NVME, pci.NIC, pci.STORAGE}


@dataclass
class TreeBuild:
    """The sockets built from functions, plus what was guessed along the way."""

    sockets: list[Socket]
    warnings: list[str] = field(default_factory=list)
    cpu_family: str | None = None


class _Builder:
    def __init__(self, functions: list[PciFunction]) -> None:
        functions = pci.drop_repeats(functions, "", None)  # the parsers report repeats; never walk them twice
        self.by_bdf = {f.bdf: f for f in functions}
        self.children: dict[str | None, list[PciFunction]] = defaultdict(list)
        for f in sorted(functions, key=lambda f: f.bdf):
            parent = f.parent if f.parent in self.by_bdf else None
            self.children[parent].append(f)
        self.kind_count: Counter[str] = Counter()
        self.switch_count = 0
        self.synthetic_ports = 0
        self.warnings: list[str] = []

    # --- structure -----------------------------------------------------------------------
    def is_bridge(self, f: PciFunction) -> bool:
        return f.is_bridge or bool(self.children.get(f.bdf))

    def is_switch(self, f: PciFunction) -> bool:
        """An upstream switch port: a bridge whose secondary bus holds bridges (or NCCL's node)."""
        if f.port_type == pci.UPSTREAM:
            return True
        if f.port_type in (pci.ROOT_PORT, pci.DOWNSTREAM, pci.PCI_BRIDGE):
            return False
        return any(self.is_bridge(c) for c in self.children.get(f.bdf, []))

    def descendants(self, f: PciFunction) -> list[PciFunction]:
        """Everything below ``f``, each once (a visited set: a parent cycle must not loop)."""
        out: list[PciFunction] = []
        seen = {f.bdf}
        stack = list(self.children.get(f.bdf, []))
        while stack:
            c = stack.pop()
            if c.bdf in seen:
                continue
            seen.add(c.bdf)
            out.append(c)
            stack.extend(self.children.get(c.bdf, []))
        return out

    # --- devices -------------------------------------------------------------------------
    def make_device(self, functions: list[PciFunction]) -> Device:
        """One device from all the functions found below a port (a GPU's audio is not a device)."""
        endpoints = [f for f in functions if not f.is_bridge] or functions
        primary = min(endpoints, key=lambda f: (_KIND_RANK.get(pci.classify(f), 9), f.bdf))
        kind = _DEVICE_KINDS.get(pci.classify(primary), "other")
        index = self.kind_count[kind]
        self.kind_count[kind] += 1
        return Device(
            id=f"{kind}{index}",
            kind=kind,
            model=primary.name,
            bdf=primary.bdf,
            functions=sorted(f.bdf for f in functions),
            vendor_id=primary.vendor_id,
            device_id=primary.device_id,
            numa_node=primary.numa_node,
            max_gen=primary.cap_gen,
            max_width=_valid_width(primary.cap_width),
        )

    # --- ports ---------------------------------------------------------------------------
    def make_port(self, f: PciFunction, kind: PortKind, root_complex: str | None) -> Port:
        below = self.children.get(f.bdf, [])
        port = Port(
            id=f.bdf,
            kind=kind,
            bdf=f.bdf,
            root_complex=root_complex,
            acs_redirect=f.acs_redirect if kind == "downstream" else None,
        )
        child_link: PciFunction | None = below[0] if below else None
        switch_fn = next((c for c in below if self.is_switch(c)), None)
        if switch_fn is not None:
            port.switch = self.make_switch(switch_fn, root_complex)
            child_link = switch_fn
        elif below:
            port.device = self.make_device(below + [d for c in below for d in self.descendants(c)])
        port.link = _link(f, child_link, empty=not below)
        return port

    def synthetic_port(self, kind: PortKind, link_from: PciFunction, root_complex: str | None) -> Port:
        """A port a source does not list (NCCL omits root and downstream ports)."""
        self.synthetic_ports += 1
        return Port(
            id=f"{'rp' if kind == 'root_port' else 'dp'}-{link_from.bdf}",
            kind=kind,
            root_complex=root_complex,
            link=_link(None, link_from, empty=False),
        )

    def make_switch(self, up: PciFunction, root_complex: str | None) -> Switch:
        switch = Switch(
            id=f"sw{self.switch_count}",
            model=up.name,
            bdf=up.bdf,
            vendor_id=up.vendor_id,
            device_id=up.device_id,
        )
        self.switch_count += 1
        endpoints: dict[str, list[PciFunction]] = defaultdict(list)
        for child in self.children.get(up.bdf, []):
            if self.is_bridge(child) and not self.is_switch(child):
                switch.ports.append(self.make_port(child, "downstream", root_complex))
            elif self.is_switch(child):  # NCCL nests switches directly
                port = self.synthetic_port("downstream", child, root_complex)
                port.switch = self.make_switch(child, root_complex)
                switch.ports.append(port)
            elif pci.classify(child) in _ADD_IN_KINDS:  # NCCL: endpoints straight under the switch
                endpoints[child.device_address].append(child)
        for functions in endpoints.values():
            port = self.synthetic_port("downstream", functions[0], root_complex)
            port.device = self.make_device(functions)
            switch.ports.append(port)
        return switch

    def root_ports(self) -> list[tuple[PciFunction, Port]]:
        """(first function, port) for every top-level port, in address order."""
        out: list[tuple[PciFunction, Port]] = []
        integrated: dict[str, Device] = {}  # device address -> its device
        for f in self.children.get(None, []):
            rc = f.bdf.rsplit(":", 1)[0]
            if self.is_switch(f):  # NCCL lists the switch under the CPU, not its root port
                port = self.synthetic_port("root_port", f, rc)
                port.switch = self.make_switch(f, rc)
            elif self.is_bridge(f):
                port = self.make_port(f, "root_port", rc)
            elif pci.classify(f) in _ADD_IN_KINDS and f.sta_width:
                # An endpoint on a root bus with a link of its own hangs off a root port the source
                # does not list (NCCL).
                port = self.synthetic_port("root_port", f, rc)
                port.device = self.make_device([f])
            elif pci.classify(f) in _ADD_IN_KINDS:  # chipset SATA, RCiEP NICs, virtio in a VM
                if f.device_address in integrated:
                    integrated[f.device_address].functions.append(f.bdf)
                    continue
                port = Port(id=f"int-{f.bdf}", kind="integrated", root_complex=rc)
                port.device = integrated[f.device_address] = self.make_device([f])
            else:
                continue  # host bridges, integrated registers
            out.append((f, port))
        return out


def _link(port_fn: PciFunction | None, child: PciFunction | None, empty: bool) -> Link:
    """The link a port drives: negotiated gen/width, and the capability when it is higher.

    An empty port has no negotiated link, so its capability is what a card would get.
    """
    cap_gen = port_fn.cap_gen if port_fn else None
    cap_width = port_fn.cap_width if port_fn else None
    if empty:
        return Link(gen=cap_gen, width=_valid_width(cap_width))
    gens = [x for x in (port_fn and port_fn.sta_gen, child and child.sta_gen) if x]
    widths = [x for x in (port_fn and port_fn.sta_width, child and child.sta_width) if x]
    gen = min(gens) if gens else cap_gen
    width = _valid_width(min(widths)) if widths else _valid_width(cap_width)
    caps = [x for x in (cap_gen, child and child.cap_gen) if x]
    both_gen = min(caps) if caps else None
    max_gen = both_gen if both_gen and gen and both_gen > gen else None
    max_width = _valid_width(cap_width) if cap_width and width and cap_width > width else None
    return Link(gen=gen, width=width, max_gen=max_gen, max_width=max_width)


def _valid_width(width: int | None) -> int | None:
    return width if width in (1, 2, 4, 8, 12, 16, 32) else None


def _socket_of_root_bus(
    functions: list[PciFunction], roots: list[PciFunction], builder: _Builder
) -> tuple[dict[str, int], str | None]:
    """Socket index per root bus: from NUMA nodes when any source gave them, else by bus number."""
    numa_votes: dict[str, Counter[int]] = defaultdict(Counter)
    rc_of = {}
    for root in roots:
        rc = root.bdf.rsplit(":", 1)[0]
        rc_of[root.bdf] = rc
        for f in [root] + builder.descendants(root):
            if f.numa_node is not None:
                numa_votes[rc][f.numa_node] += 1
    rcs = sorted({root.bdf.rsplit(":", 1)[0] for root in roots})
    if numa_votes:
        numa_of = {rc: votes.most_common(1)[0][0] for rc, votes in numa_votes.items()}
        nodes = sorted(set(numa_of.values()))
        fallback = nodes[0]
        return {rc: numa_of.get(rc, fallback) for rc in rcs}, None
    buses = [pci.bus_of(rc + ":00.0")[1] for rc in rcs]
    if buses and min(buses) < 0x80 <= max(buses):
        note = "no NUMA information: sockets inferred from root bus numbers (buses >= 0x80 on socket 1)"
        return {rc: int(pci.bus_of(rc + ":00.0")[1] >= 0x80) for rc in rcs}, note
    note = "no NUMA information: all root buses assumed on one socket"
    return {rc: 0 for rc in rcs}, note


def build_tree(functions: list[PciFunction], sockets_hint: int | None = None) -> TreeBuild:
    """Sockets with their PCIe trees from a function list.

    ``sockets_hint`` (from dmidecode's CPU count) folds NUMA nodes into sockets when a socket
    has several NUMA nodes (AMD NPS2/4, Intel SNC).
    """
    builder = _Builder(functions)
    tops = builder.root_ports()
    roots = [f for f, _ in tops]
    numa_of_rc, note = _socket_of_root_bus(functions, roots, builder)
    warnings = [note] if note else []
    nodes = sorted(set(numa_of_rc.values())) or [0]
    n_sockets = sockets_hint or len(nodes)
    if sockets_hint and sockets_hint > len(nodes):
        warnings.append(f"{sockets_hint} CPUs but devices on only {len(nodes)} NUMA node(s)")

    def socket_index(node: int) -> int:
        return min(nodes.index(node) * n_sockets // len(nodes), n_sockets - 1)

    sockets = [Socket(id=f"cpu{i}") for i in range(n_sockets)]
    for i, s in enumerate(sockets):
        owned = [n for n in nodes if socket_index(n) == i]
        s.numa_node = owned[0] if len(owned) == 1 and not note else (i if note else None)
    for _, port in tops:
        sockets[socket_index(numa_of_rc[port.root_complex or ""])].ports.append(port)
    if builder.synthetic_ports:
        warnings.append(f"{builder.synthetic_ports} port(s) not listed by the source were added")
    return TreeBuild(sockets=sockets, warnings=warnings + builder.warnings, cpu_family=_cpu_family(functions))


def _cpu_family(functions: list[PciFunction]) -> str | None:
    """AMD vs Intel from the root complex's own functions (a fallback when dmidecode is absent)."""
    vendors = Counter(
        (
            f.vendor_id
            or (
                "1022"
                if f.name.startswith("Advanced Micro Devices")
                else "8086"
                if f.name.startswith("Intel Corporation")
                else ""
            )
        )
        for f in functions
        if f.parent is None
    )
    if vendors.get("1022", 0) > vendors.get("8086", 0):
        return "amd"
    return None


def link_sockets(sockets: list[Socket], family: str | None) -> list[SocketLink]:
    """Inter-socket links: a chain (a 2-socket board has one link; more are rare here)."""
    kind: SocketLinkKind = (
        "infinity-fabric" if family == "amd" else ("upi" if family not in (None, "qpi", "unknown") else "unknown")
    )
    return [SocketLink(between=(a.id, b.id), kind=kind, family=family) for a, b in zip(sockets, sockets[1:])]


def infer_slots(sockets: list[Socket]) -> int:
    """Without dmidecode: every leaf port with an add-in device, or with nothing, is a slot."""
    count = 0
    for socket in sockets:
        stack = list(socket.ports)
        while stack:
            port = stack.pop()
            if port.switch is not None:
                stack.extend(port.switch.ports)
                continue
            if port.kind == "integrated":
                continue
            if port.device is None or port.device.kind in _ADD_IN_KINDS:
                port.slot = Slot(
                    name=f"port {port.bdf or port.id}",
                    width=port.link.max_width or port.link.width,
                    gen=port.link.max_gen or port.link.gen,
                    inferred=True,
                )
                count += 1
    return count
