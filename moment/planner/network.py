"""The capacity graph of one machine + layout + workload, shared by every flow model.

Nodes: ``S:<socket>`` root complexes, ``W:<switch>`` switches, ``D:<device>`` a device's PCIe
end (where its data leaves), ``G:<gpu>`` a GPU as consumer, ``B:<bin>`` storage bins: the GPU
cache (a copy in every GPU: edges ``local:<gpu>``), the CPU cache (a copy in every socket's
memory: edges ``dram:<socket>``; each GPU reads its own socket's copy), each SSD. Every PCIe link is two directed edges (``up:``/``down:``
+ port id), PCIe being full duplex; ``upi:a>b`` likewise. Splitting a GPU into ``D:`` and ``G:``
keeps data from relaying through a GPU. Capacities are GB/s; loads are the bytes that move: an
SSD bin's feature bytes × its ``amplification`` (whole pages, :mod:`moment.ssd_reads`),
and an SSD's ``read:`` edge is what it serves of them (``min(read_gbps, iops × page)`` for rows
read at random). These names are spelled and parsed
only by the helpers below (``socket_node``, ``up_edge``, ``edge_kind`` ...).

The machine's fixed part (sockets, switches, their links, fixed devices) is walked once into a
:class:`Skeleton`; a layout only adds the devices in slots, which keeps the search fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from moment.contracts.tiers import Tier
from moment.errors import MomentError
from moment.planner.layout import DEFAULT_SSD, slot_space
from moment.planner.workload import Workload
from moment.ssd_reads import PAGE_BYTES, random_read_gbps
from moment.topology import bandwidth
from moment.topology.model import Device, Link, Machine

INF = math.inf
DEFAULT_DRAM_GBPS = 100.0  # per socket, when the profile has no figure
DEFAULT_SSD_GBPS = 3.0  # per SSD at the feature read size, when the profile has no figure
GPU_CACHE = "gpu-cache"  # the bin of the replicated GPU cache (every GPU holds it)
CPU_CACHE = "cpu-cache"  # the bin of the CPU cache (a copy in every socket's memory)


# --- names of nodes and edges: the one place that spells or parses them --------------------


def _named(kind: str) -> Callable[[str], str]:
    def name(ident: str) -> str:
        return f"{kind}:{ident}"

    return name


socket_node = _named("S")  # a socket's root complex
switch_node = _named("W")
device_node = _named("D")  # a device's PCIe end, where its data leaves (a GPU's consumer side: gpu_node)
gpu_node = _named("G")
bin_node = _named("B")
up_edge = _named("up")  # a PCIe link towards the root complex, by port id
down_edge = _named("down")  # ... and away from it
read_edge = _named("read")  # an SSD's own read rate
dram_edge = _named("dram")  # the CPU cache's copy in a socket's memory
cache_edge = _named("local")  # a GPU reading its own copy of the GPU cache
LINK_EDGES = ("up", "down", "upi")  # the kinds of edge that are links between devices, not reads


def socket_edge(a: str, b: str) -> str:
    """The inter-socket link from socket ``a`` to socket ``b``."""
    return f"upi:{a}>{b}"


def is_socket(node: str) -> bool:
    return node.startswith("S:")


def node_id(node: str) -> str:
    """The socket, switch, device or bin id a node is named for (``S:cpu1`` → ``cpu1``)."""
    return node.split(":", 1)[1]


def edge_kind(key: str) -> str:
    """``up``, ``down``, ``upi``, ``read``, ``dram`` or ``local``."""
    return key.partition(":")[0]


def edge_target(key: str) -> str:
    """What an edge is named for: a port (``up``/``down``), a device, a socket, a socket pair."""
    return key.partition(":")[2]


@dataclass(frozen=True)
class Bin:
    id: str  # GPU_CACHE, CPU_CACHE or an SSD's device id ("nvme3")
    tier: Tier
    node: str  # B: node


@dataclass
class Network:
    edges: dict[str, tuple[str, str, float]]  # key -> (tail, head, GB/s)
    labels: dict[str, str]  # key -> human name
    bins: list[Bin]
    gpus: list[str]
    paths: dict[tuple[str, str], list[list[str]]]  # (bin, gpu) -> alternative edge-key paths
    demand_gb: float  # per GPU per iteration
    shares: dict[str, float]  # tier -> share of accesses
    notes: list[str] = field(default_factory=list)
    amplification: dict[str, float] = field(default_factory=dict)  # bin -> bytes moved per feature byte (absent: 1)

    def tier_bins(self, tier: str) -> list[Bin]:
        return [b for b in self.bins if b.tier == tier]

    def moved(self, bin_id: str) -> float:
        """Bytes a bin moves per feature byte it serves (an SSD's whole pages; 1 for the caches)."""
        return self.amplification.get(bin_id, 1.0)

    def tier_moved(self, tier: str) -> float:
        """The same for a tier (its bins move alike: the workload's row size and read pattern)."""
        return max((self.moved(b.id) for b in self.tier_bins(tier)), default=1.0)


def device_link_gbps(link: Link, dev: Device) -> float | None:
    """A device's link runs at the slower of port and device (an x4 SSD in an x16 slot)."""
    if link.gbps is not None:
        return link.gbps
    gens = [x for x in (link.max_gen or link.gen, dev.max_gen) if x]
    widths = [x for x in (link.width, dev.max_width) if x]
    return bandwidth.pcie_gbps(min(gens) if gens else None, min(widths) if widths else None)


@dataclass
class _Position:
    port_id: str
    parent: str  # node above the port
    link: Link
    where: str  # slot name or port id, for labels
    integrated: bool


class Skeleton:
    """The fixed part of a machine's graph, reusable across layouts."""

    def __init__(self, machine: Machine, movable: set[str] | None = None) -> None:
        """``movable``: port ids whose devices a layout decides (default: none; the machine's
        devices are all taken as installed)."""
        self.machine = machine
        self.edges: dict[str, tuple[str, str, float]] = {}
        self.labels: dict[str, str] = {}
        self.parent: dict[str, tuple[str, str]] = {}  # child node -> (node above, port id)
        self.positions: dict[str, _Position] = {}
        self.fixed: dict[str, Device] = {}  # port id -> device that stays
        self.notes: list[str] = []
        movable = movable or set()
        switch_of = {p.id: sw.id for sw in machine.switches() for p in sw.ports}
        for port, socket in machine.iter_ports():
            above = switch_node(switch_of[port.id]) if port.id in switch_of else socket_node(socket.id)
            where = port.slot.name if port.slot else port.id
            pos = _Position(port.id, above, port.link, where, port.kind == "integrated")
            if port.switch is not None:
                cap = port.link.bandwidth_gbps()
                if cap is None:
                    self.notes.append(
                        f"uplink of {port.switch.id} ({port.id}) has no known bandwidth: treated as unlimited"
                    )
                sw = switch_node(port.switch.id)
                self._link(pos, sw, sw, cap, f"uplink of {port.switch.id}")
            elif port.id in movable:
                self.positions[port.id] = pos
            elif port.device is not None and port.device.kind in ("gpu", "nvme"):
                self.positions[port.id] = pos
                self.fixed[port.id] = port.device
        self.sockets = [s.id for s in machine.sockets]
        for link in machine.socket_links:
            a, b = link.between
            for x, y in ((a, b), (b, a)):
                cap = link.bandwidth_gbps()
                self._add(socket_edge(x, y), socket_node(x), socket_node(y), cap, f"{link.kind} {x}→{y}")
        # Switch ports whose ACS sends peer requests up to the root complex: no turn at that switch.
        self.redirect = {port.id for port, _ in machine.iter_ports() if port.acs_redirect}
        self.socket_path = _socket_paths(self.sockets, [link.between for link in machine.socket_links])
        self.dram = {s.id: s.dram_gbps for s in machine.sockets}

    def _add(self, key: str, tail: str, head: str, cap: float | None, label: str) -> None:
        self.edges[key] = (tail, head, INF if cap is None else cap)
        self.labels[key] = label

    def _link(
        self,
        pos: _Position,
        up_tail: str,
        down_head: str,
        cap: float | None,
        what: str,
        edges: dict | None = None,
        labels: dict | None = None,
        parent: dict | None = None,
    ) -> None:
        edges = self.edges if edges is None else edges
        labels = self.labels if labels is None else labels
        parent = self.parent if parent is None else parent
        parent[up_tail] = (pos.parent, pos.port_id)
        for key, tail, head, way in (
            (up_edge(pos.port_id), up_tail, pos.parent, "up"),
            (down_edge(pos.port_id), pos.parent, down_head, "down"),
        ):
            edges[key] = (tail, head, INF if cap is None else cap)
            labels[key] = f"{what} ({pos.where}) {way}"

    def network(self, placement: dict[str, Device], workload: Workload) -> Network:
        """The graph with ``placement`` (port id -> device) installed on top of the fixed devices."""
        edges, labels, parent = dict(self.edges), dict(self.labels), dict(self.parent)
        notes = list(self.notes)
        gpus: list[Device] = []
        ssds: list[Device] = []
        for port_id, dev in {**self.fixed, **placement}.items():
            pos = self.positions[port_id]
            cap = None if pos.integrated else device_link_gbps(pos.link, dev)
            if cap is None and not pos.integrated:
                notes.append(f"link of {dev.id} ({pos.where}) has no known bandwidth: treated as unlimited")
            node = device_node(dev.id)
            head = gpu_node(dev.id) if dev.kind == "gpu" else node
            self._link(pos, node, head, cap, f"link of {dev.id}", edges, labels, parent)
            (gpus if dev.kind == "gpu" else ssds).append(dev)
        if self.machine.nvlinks:
            notes.append("NVLink carries no feature reads: each GPU reads its own cache copy, host memory and SSDs")
        bins: list[Bin] = [Bin(GPU_CACHE, "gpu", bin_node(GPU_CACHE)), Bin(CPU_CACHE, "cpu", bin_node(CPU_CACHE))]
        self._check_cache(gpus, workload)
        for g in gpus:  # the replicated cache: each GPU reads its own copy, no link crossed
            edges[cache_edge(g.id)] = (bin_node(GPU_CACHE), gpu_node(g.id), INF)
            labels[cache_edge(g.id)] = f"{g.id} cache"
        for s, gbps in self.dram.items():  # one copy per socket
            if gbps is None:
                notes.append(f"{s} DRAM bandwidth unknown: {DEFAULT_DRAM_GBPS:g} GB/s assumed")
            edges[dram_edge(s)] = (bin_node(CPU_CACHE), socket_node(s), gbps or DEFAULT_DRAM_GBPS)
            labels[dram_edge(s)] = f"{s} DRAM"
        if any(d.model == DEFAULT_SSD.model for d in ssds):
            notes.append(
                f"the profile has no SSD of its own: {DEFAULT_SSD.model}, "
                f"{DEFAULT_SSD.read_gbps:g} GB/s read, assumed (see moment/planner/layout.py)"
            )
        for d in ssds:
            bins.append(Bin(d.id, "ssd", bin_node(d.id)))
            if d.read_gbps is None:
                notes.append(f"{d.id} read bandwidth unknown: {DEFAULT_SSD_GBPS:g} GB/s assumed")
            edges[read_edge(d.id)] = (bin_node(d.id), device_node(d.id), ssd_read_gbps(d, workload))
            labels[read_edge(d.id)] = f"{d.id} reads"
        amp = workload.ssd_amplification() if ssds else 1.0
        notes.extend(_ssd_notes(ssds, workload, amp))
        ancestry = {n: _ancestry(n, parent) for n in [device_node(d.id) for d in gpus + ssds]}
        direct = {g.id: workload.ssd_reads == "direct" and can_p2p(g) for g in gpus}
        if ssds and workload.ssd_reads == "direct" and not all(direct.values()):
            notes.append("GeForce GPUs cannot take SSD data peer to peer: their reads go through host memory")
        if ssds and self.redirect and any(direct.values()):
            notes.append(
                f"ACS redirects peer requests at {len(self.redirect)} switch port(s): SSD reads "
                "between devices there go up to the root complex and back (lspci ACSCtl ReqRedir+)"
            )
        paths: dict[tuple[str, str], list[list[str]]] = {}
        for b in bins:
            for g in gpus:
                target = ancestry[device_node(g.id)]
                if b.tier == "gpu":
                    alts = [[cache_edge(g.id)]]
                elif b.tier == "cpu":  # from the copy in the GPU's own socket
                    alts = [[dram_edge(node_id(target[-1][1])), *_downs(target)]]
                else:
                    route = self._tree_path if direct[g.id] else self._host_path
                    alts = [[read_edge(b.id), *route(ancestry[device_node(b.id)], target)]]
                paths[(b.id, g.id)] = alts
        return Network(
            edges=edges,
            labels=labels,
            bins=bins,
            gpus=[g.id for g in gpus],
            paths=paths,
            demand_gb=workload.demand_gb(),
            shares=workload.tier_shares(),
            notes=notes,
            amplification={b.id: amp for b in bins if b.tier == "ssd"},
        )

    @staticmethod
    def _check_cache(gpus: list[Device], workload: Workload) -> None:
        """The GPU cache must fit in every GPU (each holds a full copy)."""
        if workload.gpu_cache_rows is None:  # as typed, before the dataset was known
            gb = workload.gpu_cache_gb or 0.0
            given = f"gpu_cache_gb: {gb:g} GB"
        else:
            gb = workload.gpu_cache_rows * workload.row_bytes / 1e9
            given = f"gpu_cache_rows: {workload.gpu_cache_rows:,} rows ({gb:.3g} GB)"
        small = [g for g in gpus if g.memory_gb is not None and gb > g.memory_gb]
        if small:
            g = min(small, key=lambda d: d.memory_gb or 0.0)
            raise MomentError(
                f"workload {given} per GPU does not fit in {g.id} ({g.memory_gb:g} GB); every GPU holds a full copy "
                "of the GPU cache"
            )

    def _tree_path(self, a: list[tuple[str, str]], b: list[tuple[str, str]]) -> list[str]:
        """Up from one device to the lowest switch or socket it shares with the other, then down.

        Devices under one switch talk peer to peer through it without touching the root complex,
        unless ACS on either one's switch port redirects peer requests upwards (then the turn is at
        the next level up: the switch's uplink carries the data twice); devices on different
        sockets cross the inter-socket link."""
        depth_in_b = {up: i for i, (_, up) in enumerate(b)}
        keys = []
        for port_id, up in a:
            keys.append(up_edge(port_id))
            if up in depth_in_b and not {port_id, b[depth_in_b[up]][0]} & self.redirect:
                return keys + _downs(b[: depth_in_b[up] + 1])
        return keys + self.socket_path[(node_id(a[-1][1]), node_id(b[-1][1]))] + _downs(b)

    def _host_path(self, a: list[tuple[str, str]], b: list[tuple[str, str]]) -> list[str]:
        """Up from the SSD to its socket's memory, across to the GPU's socket, down to the GPU:
        the route of a read through a host buffer, whatever switch the two share."""
        return [up_edge(p) for p, _ in a] + self.socket_path[(node_id(a[-1][1]), node_id(b[-1][1]))] + _downs(b)


# PCI device ids of GeForce boards that name no "GeForce" in a profile (an nvidia-smi or NCCL
# capture gives "NVIDIA GPU 10de:XXXX"): GA102/GA104/GA106 (RTX 30) and AD102/AD103/AD104 (RTX 40).
GEFORCE_IDS = {
    "2204",
    "2206",
    "2208",
    "2216",
    "2482",
    "2484",
    "2486",
    "2488",
    "2489",
    "2503",
    "2504",
    "2507",
    "2684",
    "2702",
    "2704",
    "2705",
    "2782",
    "2783",
    "2786",
    "2803",
    "2805",
}


def ssd_read_gbps(ssd: Device, workload: Workload) -> float:
    """Page-rounded GB/s an SSD serves this workload: no more than its IOPS × the page for rows
    read at random (:mod:`moment.ssd_reads`); packed reads count one request per read of
    ``ssd_pack_bytes`` (a large pack: ``read_gbps``; a packed placement's short runs may still
    be IOPS-bound)."""
    gbps = ssd.read_gbps or DEFAULT_SSD_GBPS
    if workload.ssd_pack_bytes is not None:
        return random_read_gbps(gbps, ssd.iops, page=max(PAGE_BYTES, workload.ssd_pack_bytes))
    return random_read_gbps(gbps, ssd.iops)


def _ssd_notes(ssds: list[Device], workload: Workload, amp: float) -> list[str]:
    """What the SSD figures rest on: the bytes moved per feature byte, and which SSDs their IOPS
    bound (or could, were it known)."""
    if not ssds:
        return []
    if workload.ssd_pack_bytes is not None:
        return [
            f"packed SSD reads of {workload.ssd_pack_bytes:,} B: each SSD at the lesser of its read GB/s and its "
            f"IOPS × the read, {amp:.2f}× bytes moved"
        ]
    notes = []
    if amp > 1.0005:
        notes.append(
            f"SSD rows of {workload.row_bytes:,} B are read in {PAGE_BYTES} B pages: {amp:.2f}× the feature bytes "
            f"move from the SSDs and over their links"
        )
    bound = [d for d in ssds if d.iops and ssd_read_gbps(d, workload) < (d.read_gbps or DEFAULT_SSD_GBPS)]
    if bound:
        d = bound[0]
        notes.append(
            f"{len(bound)} SSD(s) bound by random-read IOPS: {d.id} {d.iops:,.0f} IOPS × {PAGE_BYTES} B = "
            f"{ssd_read_gbps(d, workload):.2f} GB/s (< its {d.read_gbps or DEFAULT_SSD_GBPS:g} GB/s read)"
        )
    unknown = [d.id for d in ssds if not d.iops]
    if unknown:
        notes.append(
            f"random-read IOPS unknown for {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}: only their "
            f"GB/s bounds them (moment bench measures IOPS)"
        )
    return notes


def can_p2p(gpu: Device) -> bool:
    """Whether the GPU takes peer-to-peer DMA (GPUDirect Storage, P2P): not GeForce boards
    (NVIDIA limits P2P and GDS to data-centre and professional GPUs; nccl#1309, #1086)."""
    model = gpu.model or ""
    pci = model.rsplit("10de:", 1)[-1].lower()[:4] if "10de:" in model else ""
    return "geforce" not in model.lower() and pci not in GEFORCE_IDS


def _downs(steps: list[tuple[str, str]]) -> list[str]:
    return [down_edge(p) for p, _ in reversed(steps)]


def _ancestry(node: str, parent: dict[str, tuple[str, str]]) -> list[tuple[str, str]]:
    """(port id, node above) for each step from ``node`` up to its socket's ``S:`` node."""
    steps = []
    while node in parent:
        up, port_id = parent[node]
        steps.append((port_id, up))
        node = up
    return steps


def _socket_paths(sockets: list[str], links: list[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    """Inter-socket edge keys between every pair of sockets: the fewest hops over the profile's
    own socket links (breadth first), never a link the profile does not have."""
    neighbours: dict[str, list[str]] = {s: [] for s in sockets}
    for a, b in links:
        neighbours[a].append(b)
        neighbours[b].append(a)
    out: dict[tuple[str, str], list[str]] = {}
    for start in sockets:
        route: dict[str, list[str]] = {start: []}
        frontier = [start]
        while frontier:
            nxt = []
            for here in frontier:
                for there in neighbours[here]:
                    if there not in route:
                        route[there] = route[here] + [socket_edge(here, there)]
                        nxt.append(there)
            frontier = nxt
        out.update({(start, end): keys for end, keys in route.items()})
    return out


def skeleton_for(machine: Machine, choose_fixed: bool = False) -> Skeleton:
    """The machine's graph with every slot position left for a layout to fill (``choose_fixed``:
    and the GPUs fixed in place of a profile without GPU slots, for a layout that picks some)."""
    space = slot_space(machine)
    chosen = {p.id for p in space.fixed_gpus} if choose_fixed else set()
    return Skeleton(machine, movable={p.id for p in space.positions} | chosen)


def build_network(machine: Machine, workload: Workload) -> Network:
    """The graph of a machine as installed."""
    return Skeleton(machine).network({}, workload)
