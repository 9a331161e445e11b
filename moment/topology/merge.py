"""Combine what each source knows: slots from dmidecode, NVLink from nvidia-smi or NCCL.

The PCIe tree comes from one tree source (see :mod:`moment.topology.build`); the others only
annotate it. Matching is by PCI address, walking up the tree, because real BIOSes give a slot's
address as the port, as the endpoint behind it, or as a placeholder.
"""

from __future__ import annotations

from collections import Counter

from moment.topology import bandwidth
from moment.topology.model import Device, Link, NvLink, NvLinkVia, Port, Slot, SlotForm, Socket, Switch
from moment.topology.pci import PciFunction, bus_of
from moment.topology.sources.dmidecode import DmiSlot
from moment.topology.sources.nvidia_smi import SmiTopo, smi_groups


def _bogus_addresses(slots: list[DmiSlot]) -> set[str]:
    """Addresses no real slot has: repeated by several slots, or the host bridge / all-ones."""
    counts = Counter(s.bus_address for s in slots if s.bus_address)
    bogus = {a for a, n in counts.items() if n > 1}
    for addr in counts:
        _, bus = bus_of(addr)
        if addr.endswith(":00:00.0") or bus == 0xFF:
            bogus.add(addr)
    return bogus


def attach_dmi_slots(
    sockets: list[Socket], slots: list[DmiSlot], functions: dict[str, PciFunction]
) -> tuple[list[Slot], list[str]]:
    """Set ``port.slot`` for each dmidecode slot; return the slots that could not be placed.

    A slot's bus address may name the port itself, a function behind it (endpoint, or a card's
    switch), or a port that does not exist because the slot is empty and the BIOS hid it; in the
    last case a root port is added on the root bus the address names.
    """
    ports: dict[str, Port] = {}
    owner: dict[str, Port] = {}  # any function bdf -> the port whose link reaches it
    socket_of_rc: dict[str, Socket] = {}
    for socket in sockets:
        for port in _walk(socket.ports):
            if port.bdf:
                ports[port.bdf] = port
            if port.root_complex:
                socket_of_rc.setdefault(port.root_complex, socket)
            for bdf in _functions_below(port):
                owner.setdefault(bdf, port)
    bogus = _bogus_addresses(slots)
    loose: list[Slot] = []
    warnings: list[str] = []
    for dmi in slots:
        slot = Slot(name=dmi.designation, form=_form(dmi.form), width=_width(dmi.width), gen=dmi.gen)
        port = None
        if dmi.bus_address and dmi.bus_address not in bogus:
            port = ports.get(dmi.bus_address) or owner.get(dmi.bus_address)
            if port is None and dmi.bus_address in functions:
                port = _port_above(functions, dmi.bus_address, ports)
            if port is None:
                rc = dmi.bus_address.rsplit(":", 1)[0]
                if rc in socket_of_rc:
                    port = Port(
                        id=dmi.bus_address,
                        bdf=dmi.bus_address,
                        root_complex=rc,
                        link=Link(gen=dmi.gen, width=_width(dmi.width)),
                    )
                    socket_of_rc[rc].ports.append(port)
                    ports[dmi.bus_address] = port
        if port is None or port.slot is not None:
            why = "placeholder address" if dmi.bus_address in bogus else "no matching port"
            warnings.append(f"dmidecode line {dmi.line}: slot {dmi.designation!r} not placed in the tree ({why})")
            loose.append(slot)
            continue
        port.slot = slot
        if dmi.in_use is False and port.device is not None:
            warnings.append(
                f"dmidecode line {dmi.line}: slot {dmi.designation!r} says Available but holds {port.device.id}"
            )
    return loose, warnings


def _port_above(functions: dict[str, PciFunction], bdf: str, ports: dict[str, Port]) -> Port | None:
    node = functions.get(bdf)
    while node is not None:
        if node.bdf in ports:
            return ports[node.bdf]
        node = functions.get(node.parent) if node.parent else None
    return None


def _walk(ports: list[Port]):
    for port in ports:
        yield port
        if port.switch is not None:
            yield from _walk(port.switch.ports)


def _functions_below(port: Port) -> list[str]:
    if port.device is not None:
        return list(port.device.functions)
    if port.switch is not None:
        return [port.switch.bdf] if port.switch.bdf else []
    return []


# dmidecode's slot forms that are a profile's too (the rest: "other").
_FORMS: dict[str, SlotForm] = {"pcie": "pcie", "m2": "m2", "u2": "u2", "e1s": "e1s", "ocp": "ocp"}


def _form(form: str) -> SlotForm:
    return _FORMS.get(form, "other")


def _width(width: int | None) -> int | None:
    return width if width in (1, 2, 4, 8, 12, 16, 32) else None


def nvlinks_from_smi(topo: SmiTopo, gpus: list[Device]) -> tuple[list[NvLink], list[str]]:
    """NVLink pairs of ``nvidia-smi topo -m``; GPU i is the i-th GPU in PCI address order,
    which is nvidia-smi's default enumeration."""
    warnings: list[str] = []
    ordered = sorted(gpus, key=lambda d: d.bdf or d.id)
    if len(ordered) != len(topo.gpus):
        warnings.append(
            f"nvidia-smi lists {len(topo.gpus)} GPUs but the PCIe tree has {len(ordered)}: NVLink not mapped"
        )
        return [], warnings
    index = {name: dev for name, dev in zip(topo.gpus, ordered)}
    via: NvLinkVia = "nvswitch" if _all_pairs(topo) else "bridge"
    arch = bandwidth.gpu_arch_of(ordered[0].model) if ordered else None
    links = [
        NvLink(between=(index[a].id, index[b].id), links=count, via=via, arch=arch)
        for (a, b), count in sorted(topo.nvlinks.items())
    ]
    return links, warnings


def _all_pairs(topo: SmiTopo) -> bool:
    n = len(topo.gpus)
    return n >= 4 and len(topo.nvlinks) == n * (n - 1) // 2


def machine_parts_from_smi(topo: SmiTopo) -> tuple[list[Socket], list[NvLink], list[str]]:
    """A coarse tree from ``nvidia-smi topo -m`` alone: one switch per PIX/PXB group.

    nvidia-smi shows relations, not the tree: devices that reach each other without the host
    bridge (PIX/PXB) share a switch; SYS means the path crosses the inter-socket link, so there
    are at least two sockets even when every device reports NUMA node 0.
    """
    warnings = ["PCIe tree reconstructed from nvidia-smi relations: one switch per PIX/PXB group, link widths unknown"]
    numas = sorted({n for n in topo.numa.values() if n is not None})
    has_sys = any(r == "SYS" for r in topo.relation.values())
    n_sockets = max(len(numas), 2 if has_sys else 1)
    groups = smi_groups(topo)
    sockets = [Socket(id=f"cpu{i}", numa_node=i) for i in range(n_sockets)]
    if len(numas) < n_sockets:
        warnings.append(
            f"relations say {n_sockets} sockets but NUMA affinity shows {len(numas) or 'no'} node(s): groups split across sockets in order"
        )
    gpus: dict[str, Device] = {}
    nic_n = 0
    for gi, group in enumerate(groups):
        devices = []
        for name in group:
            if name in topo.gpus:
                dev = Device(
                    id=f"gpu{topo.gpus.index(name)}", kind="gpu", model="NVIDIA GPU", numa_node=topo.numa.get(name)
                )
                gpus[name] = dev
            else:
                dev = Device(id=f"nic{nic_n}", kind="nic", model=topo.nics.get(name, name))
                nic_n += 1
            devices.append(dev)
        numa = next((topo.numa.get(n) for n in group if topo.numa.get(n) is not None), None)
        socket = _pick_socket(sockets, numas, numa, _position(topo, group))
        rp = Port(id=f"rp{gi}", kind="root_port")
        if len(devices) > 1:
            rp.switch = Switch(id=f"sw{gi}", model="PCIe switch (from nvidia-smi PIX/PXB)")
            rp.switch.ports = [Port(id=f"rp{gi}.{i}", kind="downstream", device=d) for i, d in enumerate(devices)]
        else:
            rp.device = devices[0]
        socket.ports.append(rp)
    links = [
        NvLink(between=(gpus[a].id, gpus[b].id), links=count, via="nvswitch" if _all_pairs(topo) else "bridge")
        for (a, b), count in sorted(topo.nvlinks.items())
        if a in gpus and b in gpus
    ]
    return sockets, links, warnings


def _position(topo: SmiTopo, group: list[str]) -> float:
    """Where a group sits in enumeration order, 0..1: by its first GPU, else its first NIC."""
    gpus = [topo.gpus.index(n) for n in group if n in topo.gpus]
    if gpus:
        return min(gpus) / max(len(topo.gpus), 1)
    nics = list(topo.nics) or group
    return min(nics.index(n) for n in group if n in nics) / max(len(nics), 1)


def _pick_socket(sockets: list[Socket], numas: list[int], numa: int | None, position: float) -> Socket:
    """The group's NUMA node when every socket has one; otherwise split in enumeration order
    (GPU 0..n/2-1 on socket 0 is how 2-socket GPU servers number their GPUs)."""
    if len(numas) == len(sockets) and numa in numas:
        return sockets[numas.index(numa)]
    return sockets[min(int(position * len(sockets)), len(sockets) - 1)]
