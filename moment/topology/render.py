"""Terminal views of a machine for people: the inventory table and the PCIe tree (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from moment.topology.inventory import counts
from moment.topology.model import Machine, Port

_STYLE = {"gpu": "green", "nvme": "dark_orange", "nic": "cyan", "storage": "magenta", "other": "dim"}


def _link(port: Port) -> str:
    link = port.link
    text = f"Gen{link.gen or '?'} x{link.width or '?'}"
    if link.max_gen or link.max_width:
        text += f" (can Gen{link.max_gen or link.gen or '?'} x{link.max_width or link.width or '?'})"
    bw = link.bandwidth_gbps()
    return text + (f" {bw:.3g} GB/s" if bw else "") + (" measured" if link.gbps else "")


def _port_label(port: Port) -> str:
    where = f"[bold]{port.slot.name}[/]" + (" (inferred)" if port.slot.inferred else "") if port.slot else port.id
    if port.kind == "integrated":
        return "integrated"
    kind = "root port" if port.kind == "root_port" else "port"
    return f"{kind} {where} [dim]{_link(port)}[/]"


def _add_port(parent: Tree, port: Port, show_other: bool) -> None:
    if port.device is not None:
        dev = port.device
        if dev.kind == "other" and port.slot is None and not show_other:
            return
        style = _STYLE.get(dev.kind, "")
        extra = f" {dev.memory_gb:g} GB" if dev.memory_gb else f" {dev.capacity_gb:g} GB" if dev.capacity_gb else ""
        parent.add(f"{_port_label(port)} → [{style}]{dev.id}[/] {dev.model}{extra} [dim]{dev.bdf or ''}[/]")
    elif port.switch is not None:
        sw = port.switch
        node = parent.add(f"{_port_label(port)} → [yellow]switch {sw.id}[/] {sw.model} [dim]{sw.bdf or ''}[/]")
        for child in sw.ports:
            _add_port(node, child, show_other)
    else:
        parent.add(f"{_port_label(port)} → [dim]free[/]")


def machine_tree(machine: Machine, show_other: bool = False) -> Tree:
    """The PCIe tree; integrated functions (kind other, no slot) are hidden unless asked."""
    root = Tree(f"[bold]{machine.name}[/] {machine.description}")
    for socket in machine.sockets:
        dram = f" {socket.dram_gb:g} GB DRAM" if socket.dram_gb else ""
        node = root.add(f"[bold]{socket.id}[/] {socket.model}{dram}")
        for port in socket.ports:
            _add_port(node, port, show_other)
    for link in machine.socket_links:
        root.add(f"[blue]{link.kind} {link.between[0]} ↔ {link.between[1]}[/] {link.bandwidth_gbps():.3g} GB/s")
    if machine.nvlinks:
        pairs = ", ".join(f"{a}-{b}×{nv.links}" for nv in machine.nvlinks for a, b in [nv.between])
        root.add(f"[green]NVLink[/] {pairs}")
    for slot in machine.loose_slots:
        root.add(f"[dim]slot {slot.name} (position in tree unknown)[/]")
    return root


def counts_table(machine: Machine) -> Table:
    table = Table(title=f"{machine.name}: inventory")
    c = counts(machine)
    for key in c:
        table.add_column(key, justify="right")
    table.add_row(*(str(v) for v in c.values()))
    return table


def print_summary(console: Console, machine: Machine) -> None:
    console.print(counts_table(machine))


def print_inspect(console: Console, machine: Machine) -> None:
    console.print(counts_table(machine))
    console.print(machine_tree(machine))
    if machine.layouts:
        console.print(f"layouts: {', '.join(sorted(machine.layouts))}")
