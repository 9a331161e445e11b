"""An SVG picture of a machine: sockets on top, switches below, slots and devices as leaves.

Plain SVG written by hand (no graphviz binary on most servers): a tidy top-down tree where each
edge is one PCIe link labelled with gen × width and GB/s, devices coloured by kind, the
inter-socket link and NVLink pairs drawn across. The planner reuses it with flow labels and a
highlighted bottleneck (``edge_notes``/``hot``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from moment.topology.model import Machine, Port

COLOURS = {
    "socket": "#d9d9d9",
    "switch": "#ffe08a",
    "gpu": "#8fd694",
    "nvme": "#f6b26b",
    "nic": "#9fc5e8",
    "storage": "#c9a0dc",
    "other": "#eeeeee",
    "free": "#ffffff",
}
LEAF_W, GAP, LEVEL_H, BOX_H = 118, 14, 130, 46


@dataclass
class _Node:
    key: str
    label: list[str]
    colour: str
    children: list[_Node] = field(default_factory=list)
    edge: str = ""  # label of the link to the parent
    edge_key: str = ""  # port id of that link
    dashed: bool = False
    x: float = 0.0
    y: float = 0.0


def _link_label(port: Port) -> str:
    link = port.link
    parts = []
    if link.gen and link.width:
        parts.append(f"Gen{link.gen} x{link.width}")
    elif link.width:
        parts.append(f"x{link.width}")
    bw = link.bandwidth_gbps()
    if bw:
        parts.append(f"{bw:.3g} GB/s")
    return " · ".join(parts)


def _port_node(port: Port) -> _Node | None:
    if port.switch is not None:
        sw = port.switch
        node = _Node(sw.id, [sw.id, _short(sw.model, 22)], COLOURS["switch"])
        node.children = [c for p in sw.ports if (c := _port_node(p)) is not None]
    elif port.device is not None:
        dev = port.device
        if dev.kind == "other" and port.slot is None:
            return None  # integrated functions: noise in a topology picture
        lines = [dev.id, _short(dev.model, 22)]
        if port.slot:
            lines.append(_short(port.slot.name, 22))
        node = _Node(dev.id, lines, COLOURS.get(dev.kind, COLOURS["other"]))
    else:
        name = port.slot.name if port.slot else port.id
        node = _Node(
            port.id, ["free slot" if port.slot else "empty port", _short(name, 22)], COLOURS["free"], dashed=True
        )
    node.edge, node.edge_key = _link_label(port), port.id
    return node


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _layout(node: _Node, depth: int, cursor: list[float]) -> None:
    node.y = 30 + depth * LEVEL_H
    if not node.children:
        node.x = cursor[0] + LEAF_W / 2
        cursor[0] += LEAF_W + GAP
        return
    for child in node.children:
        _layout(child, depth + 1, cursor)
    node.x = (node.children[0].x + node.children[-1].x) / 2


def _walk(node: _Node):
    yield node
    for c in node.children:
        yield from _walk(c)


def render_svg(
    machine: Machine,
    edge_notes: dict[str, str] | None = None,
    hot: set[str] | None = None,
    title: str | None = None,
) -> str:
    """SVG text. ``edge_notes`` adds a line (e.g. flow) to the link into port id; ``hot`` marks
    port ids (or ``upi``) red."""
    edge_notes, hot = edge_notes or {}, hot or set()
    roots = []
    for s in machine.sockets:
        sock = _Node(s.id, [s.id, _short(s.model or "CPU socket", 22)], COLOURS["socket"])
        sock.children = [c for p in s.ports if (c := _port_node(p)) is not None]
        roots.append(sock)
    cursor = [20.0]
    for r in roots:
        _layout(r, 0, cursor)
        cursor[0] += GAP * 2
    nodes = [n for r in roots for n in _walk(r)]
    width = max(cursor[0], 400)
    height = max((n.y for n in nodes), default=0) + BOX_H + 110
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="10" y="16" font-size="13" font-weight="bold">{escape(title or machine.name)}</text>',
    ]
    for parent in nodes:
        for child in parent.children:
            red = child.edge_key in hot
            colour, w = ("#d62728", 3) if red else ("#555", 1.5)
            x1, y1, x2, y2 = parent.x, parent.y + BOX_H, child.x, child.y
            out.append(
                f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" stroke-width="{w}"/>'
            )
            # Labels sit just above the child box: children are LEAF_W apart, so they never collide.
            lines = [t for t in (child.edge, *edge_notes.get(child.edge_key, "").split("\n")) if t]
            for i, text in enumerate(reversed(lines)):
                out.append(
                    f'<text x="{x2:.1f}" y="{y2 - 4 - i * 11:.1f}" text-anchor="middle" fill="{colour}" '
                    f'font-size="9">{escape(text)}</text>'
                )
    for n in nodes:
        dash = ' stroke-dasharray="4 3"' if n.dashed else ""
        out.append(
            f'<rect x="{n.x - LEAF_W / 2:.1f}" y="{n.y:.1f}" width="{LEAF_W}" height="{BOX_H}" rx="6" '
            f'fill="{n.colour}" stroke="#333"{dash}/>'
        )
        for i, text in enumerate(n.label[:3]):
            weight = ' font-weight="bold"' if i == 0 else ""
            out.append(
                f'<text x="{n.x:.1f}" y="{n.y + 14 + i * 13:.1f}" text-anchor="middle"{weight}>{escape(text)}</text>'
            )
    pos = {n.key: n for n in nodes}
    for link in machine.socket_links:
        a, b = pos.get(link.between[0]), pos.get(link.between[1])
        if a and b:
            red = "upi" in hot
            colour = "#d62728" if red else "#1f77b4"
            y = a.y + BOX_H / 2
            out.append(
                f'<line x1="{a.x + LEAF_W / 2:.1f}" y1="{y:.1f}" x2="{b.x - LEAF_W / 2:.1f}" y2="{y:.1f}" stroke="{colour}" stroke-width="3"/>'
            )
            kind = "inter-socket link" if link.kind == "unknown" else link.kind.upper()
            label = f"{kind} {link.bandwidth_gbps():.3g} GB/s" + (
                f" · {edge_notes['upi']}" if "upi" in edge_notes else ""
            )
            out.append(
                f'<text x="{(a.x + b.x) / 2:.1f}" y="{y - 6:.1f}" text-anchor="middle" fill="{colour}">{escape(label)}</text>'
            )
    fabric = [nv for nv in machine.nvlinks if nv.via == "nvswitch"]
    gpu_nodes = sorted((pos[e] for e in {e for nv in fabric for e in nv.between} if e in pos), key=lambda n: n.x)
    if gpu_nodes:  # an NVSwitch joins every pair: one bus, not n(n-1)/2 arcs
        y = max(n.y for n in gpu_nodes) + BOX_H + 18
        out.append(
            f'<line x1="{gpu_nodes[0].x:.1f}" y1="{y:.1f}" x2="{gpu_nodes[-1].x:.1f}" y2="{y:.1f}" stroke="#2ca02c" stroke-width="3"/>'
        )
        for n in gpu_nodes:
            out.append(
                f'<line x1="{n.x:.1f}" y1="{n.y + BOX_H:.1f}" x2="{n.x:.1f}" y2="{y:.1f}" stroke="#2ca02c" stroke-width="1.5"/>'
            )
        label = f"NVSwitch: NV{fabric[0].links} per GPU pair, {fabric[0].bandwidth_gbps():.3g} GB/s"
        out.append(f'<text x="{gpu_nodes[0].x:.1f}" y="{y + 13:.1f}" fill="#2ca02c">{escape(label)}</text>')
    for nv in machine.nvlinks:
        a, b = pos.get(nv.between[0]), pos.get(nv.between[1])
        if a and b and nv.via != "nvswitch":
            y = max(a.y, b.y) + BOX_H
            out.append(
                f'<path d="M {a.x:.1f} {y:.1f} C {a.x:.1f} {y + 30:.1f}, {b.x:.1f} {y + 30:.1f}, {b.x:.1f} {y:.1f}" '
                f'fill="none" stroke="#2ca02c" stroke-width="2"/>'
            )
            out.append(
                f'<text x="{(a.x + b.x) / 2:.1f}" y="{y + 34:.1f}" text-anchor="middle" fill="#2ca02c">'
                f"NV{nv.links} {nv.bandwidth_gbps():.3g} GB/s</text>"
            )
    legend_y = height - 20
    for i, (kind, colour) in enumerate(COLOURS.items()):
        out.append(
            f'<rect x="{10 + i * 80}" y="{legend_y - 10}" width="12" height="12" fill="{colour}" stroke="#333"/>'
        )
        out.append(f'<text x="{26 + i * 80}" y="{legend_y}">{kind}</text>')
    out.append("</svg>")
    return "\n".join(out)
