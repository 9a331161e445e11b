"""Cheap lower bounds on a layout's proportional-share time, for pruning the search.

Every bound is a cut: traffic that must cross some set of links whatever shares the LP picks.
* tier rates: the SSD tier's bytes over the SSDs' read rates, the CPU tier's over DRAM;
* GPU links: each GPU takes everything but its own cache's hits over its link;
* subtrees: a switch (or socket) holding k of G GPUs must carry their SSD bytes stored outside
  (and, for a switch, their CPU-cache reads) in, and the other GPUs' SSD bytes stored inside out,
  over its uplink (or inter-socket links), whatever share X of the SSD bytes is stored inside.
Candidates are evaluated in bound order; once the bound passes the k-th best time found, the
rest cannot enter the ranking.
"""

from __future__ import annotations

from dataclasses import dataclass

from moment.planner.network import Skeleton, device_link_gbps, is_socket, socket_node, ssd_read_gbps, switch_node
from moment.planner.workload import Workload
from moment.topology.model import Device, Machine


@dataclass
class _Cut:
    capacity: float  # GB/s per direction
    has_dram: bool
    fixed_gpus: int


class LayoutBound:
    def __init__(
        self,
        machine: Machine,
        skeleton: Skeleton,
        class_ports: list[tuple[str, ...]],
        workload: Workload,
        gpu: Device,
        ssd: Device | None,
        n_gpus: int,
    ) -> None:
        self.D = workload.demand_gb()
        self.memo: dict[tuple, float] = {}
        fixed = [d for d in skeleton.fixed.values() if d.kind == "gpu"]
        self.G = n_gpus + len(fixed)
        self.shares = workload.tier_shares()
        dram = [s.dram_gbps or 100.0 for s in machine.sockets]
        self.dram_bound = self.shares["cpu"] * self.D * self.G / sum(dram) if dram else 0.0
        # Cuts: every switch's subtree (capacity: its uplink) and every socket (its socket links).
        self.cuts: dict[str, _Cut] = {}
        for port, _ in machine.iter_ports():
            if port.switch is not None:
                self.cuts[switch_node(port.switch.id)] = _Cut(port.link.bandwidth_gbps() or float("inf"), False, 0)
        for s in machine.sockets:
            cap = sum(link.bandwidth_gbps() for link in machine.socket_links if s.id in link.between)
            if len(machine.sockets) > 1:
                self.cuts[socket_node(s.id)] = _Cut(cap, True, 0)
        anc = {}
        for port_id, pos in skeleton.positions.items():
            chain, node = [], pos.parent
            while True:
                if node in self.cuts:
                    chain.append(node)
                if is_socket(node):
                    break
                node = skeleton.parent[node][0]
            anc[port_id] = chain
        for port_id, dev in skeleton.fixed.items():
            if dev.kind == "gpu":
                for cut in anc[port_id]:
                    self.cuts[cut].fixed_gpus += 1
        self.class_cuts = [anc[ports[0]] for ports in class_ports]
        self.gpu_link = [
            device_link_gbps(skeleton.positions[ports[0]].link, gpu) or float("inf") for ports in class_ports
        ]
        self.ssd_rate = [  # feature bytes per second: an SSD and its link carry whole pages
            min(ssd_read_gbps(ssd, workload), device_link_gbps(skeleton.positions[ports[0]].link, ssd) or float("inf"))
            / workload.ssd_amplification()
            if ssd is not None
            else 0.0
            for ports in class_ports
        ]

    def __call__(self, g: tuple[int, ...], s: tuple[int, ...], cuts: bool = True) -> float:
        """The bound of the layout with ``g`` GPUs and ``s`` SSDs per class (``cuts`` False: the
        tier and GPU-link terms alone, a quicker and lower bound)."""
        D, G, h = self.D, self.G, self.shares
        best = self.dram_bound
        rate = sum(n * r for n, r in zip(s, self.ssd_rate))
        if h["ssd"] > 0:
            best = max(best, h["ssd"] * D * G / rate if rate > 0 else float("inf"))
        links = sum(n * c for n, c in zip(g, self.gpu_link))
        if links > 0:  # every byte but the GPU's own cache hits crosses its link
            best = max(best, D * G * (1 - h["gpu"]) / links)
        if not cuts:
            return best
        inside_gpus = {cut: c.fixed_gpus for cut, c in self.cuts.items()}
        inside_rate = {cut: 0.0 for cut in self.cuts}
        for above, ng, ns, r in zip(self.class_cuts, g, s, self.ssd_rate):
            for cut in above:
                inside_gpus[cut] += ng
                inside_rate[cut] += ns * r
        for cut, c in self.cuts.items():
            best = max(
                best, self._cut(inside_gpus[cut], inside_rate[cut], rate - inside_rate[cut], c.capacity, c.has_dram)
            )
        return best

    def for_gpus(self, g: tuple[int, ...], room: list[int], n_ssds: int, cuts: bool = True) -> float:
        """A bound for GPU placement ``g`` valid for every way of adding ``n_ssds`` SSDs (``room``:
        free SSD slots per class): each of :meth:`__call__`'s terms at its smallest over the SSD
        placements (a min of maxima is at least the max of the minima). The SSD tier gets the
        fastest SSDs that fit; a cut, its least over how many SSDs sit inside it, each side's
        SSDs read at its fastest rate (the cut's bound only falls as the rates rise). ``cuts``
        False: the tier and GPU-link terms alone, a quicker and lower bound."""
        D, G, h = self.D, self.G, self.shares
        best = self.dram_bound
        rate, left = 0.0, n_ssds
        for r, n in sorted(zip(self.ssd_rate, room), reverse=True):
            take = min(n, left)
            rate, left = rate + take * r, left - take
        if h["ssd"] > 0:
            best = max(best, h["ssd"] * D * G / rate if rate > 0 else float("inf"))
        links = sum(n * c for n, c in zip(g, self.gpu_link))
        if links > 0:
            best = max(best, D * G * (1 - h["gpu"]) / links)
        if not cuts:
            return best
        inside = {cut: c.fixed_gpus for cut, c in self.cuts.items()}
        room_in = {cut: 0 for cut in self.cuts}  # free SSD slots inside each cut ...
        rate_in = {cut: 0.0 for cut in self.cuts}  # ... and the fastest SSD rate among them
        for above, ng, n, r in zip(self.class_cuts, g, room, self.ssd_rate):
            for cut in above:
                inside[cut] += ng
                if n > 0:
                    room_in[cut] += n
                    rate_in[cut] = max(rate_in[cut], r)
        for cut, c in self.cuts.items():
            if c.capacity == float("inf"):
                continue
            outside = [r for cuts, n, r in zip(self.class_cuts, room, self.ssd_rate) if n > 0 and cut not in cuts]
            r_out = max(outside, default=0.0)
            lo, hi = max(0, n_ssds - (sum(room) - room_in[cut])), min(n_ssds, room_in[cut])
            if lo <= hi:  # the SSDs inside, n, read at most n times the fastest rate there (as outside)
                cut_bound = min(
                    self._cut(inside[cut], n * rate_in[cut], (n_ssds - n) * r_out, c.capacity, c.has_dram)
                    for n in range(lo, hi + 1)
                )
                best = max(best, cut_bound)
        return best

    def _cut(self, k: int, r_in: float, r_out: float, cap: float, dram_inside: bool) -> float:
        """:meth:`_solve_cut`, remembered: layouts of one search share most of their cuts."""
        key = (k, r_in, r_out, cap, dram_inside)
        if key not in self.memo:
            self.memo[key] = self._solve_cut(*key)
        return self.memo[key]

    def _solve_cut(self, k: int, r_in: float, r_out: float, cap: float, dram_inside: bool) -> float:
        """Smallest T at which some share X of the SSD bytes stored inside the cut satisfies:
        k·D·(c + s·(1-X)) ≤ T·cap into it (c: the CPU share, unless the socket's own cache copy
        is inside), (G-k)·D·s·X ≤ T·cap out of it, and the SSD read rates on each side
        (G·D·s·X ≤ T·r_in, G·D·s·(1-X) ≤ T·r_out). Cache hits never cross: each GPU has its
        own copy of the GPU cache and reads its own socket's copy of the CPU cache."""
        D, G, h = self.D, self.G, self.shares
        if cap == float("inf") or k == 0 and r_in == 0:
            return 0.0
        c, s = (0.0 if dram_inside else h["cpu"]), h["ssd"]
        lines = [(k * D * (c + s) / cap, -k * D * s / cap), (0.0, (G - k) * D * s / cap)]  # T ≥ a + b·X
        if r_in > 0:
            lines.append((0.0, G * D * s / r_in))
        if r_out > 0:
            lines.append((G * D * s / r_out, -G * D * s / r_out))
        lo = 1.0 if r_out == 0 and r_in > 0 else 0.0  # no SSD outside: all SSD bytes are inside
        hi = 0.0 if r_in == 0 else 1.0  # no SSD inside: none are
        return _min_max_lines(lines, lo, hi)


def _min_max_lines(lines: list[tuple[float, float]], lo: float = 0.0, hi: float = 1.0) -> float:
    """min over X in [lo, hi] of max_i (a_i + b_i·X): a convex piecewise-linear function, whose
    minimum lies at an end or where two lines cross."""
    xs = {lo, hi}
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1 :]:
            if b1 != b2:
                x = (a2 - a1) / (b1 - b2)
                if lo < x < hi:
                    xs.add(x)

    def at(x: float) -> float:
        return max(a + (b * x if b else 0.0) for a, b in lines)

    return max(min(at(x) for x in xs), 0.0)
