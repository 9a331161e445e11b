"""Cheap lower bounds on a layout's proportional-share time, for pruning the search.

Every bound is a cut: traffic that must cross some set of links whatever shares the LP picks.
* tier rates: the SSD tier's bytes over the SSDs' read rates, the CPU tier's over DRAM;
* GPU links: each GPU takes everything but its own cache share over its link (+ NVLink);
* subtrees: a switch (or socket) holding k of G GPUs must carry k·(1-X)·D down and (G-k)·X·D up
  over its uplink (or inter-socket link), X being the share of bytes stored inside; at best
  X = k/G, giving k(G-k)/G·D — unless the bins inside cannot hold that much.
Candidates are evaluated in bound order; once the bound passes the k-th best time found, the
rest cannot enter the ranking.
"""

from __future__ import annotations

from dataclasses import dataclass

from moment.planner.network import Skeleton, device_link_gbps
from moment.planner.workload import Workload
from moment.topology.model import Device, Machine


@dataclass
class _Cut:
    capacity: float  # GB/s per direction
    has_dram: bool
    fixed_gpus: int


class LayoutBound:
    def __init__(self, machine: Machine, skeleton: Skeleton, class_ports: list[tuple[str, ...]],
                 workload: Workload, gpu: Device, ssd: Device | None, n_gpus: int) -> None:
        self.D = workload.demand_gb()
        fixed = [d for d in skeleton.fixed.values() if d.kind == "gpu"]
        self.G = n_gpus + len(fixed)
        mem = [gpu.memory_gb or 0.0] * n_gpus + [d.memory_gb or 0.0 for d in fixed]
        self.shares = workload.tier_shares(mem)
        nv_in = sum(nv.bandwidth_gbps() for nv in machine.nvlinks)  # an upper bound for any cut
        self.nv = nv_in
        dram = [s.dram_gbps or 100.0 for s in machine.sockets]
        self.dram_bound = self.shares["cpu"] * self.D * self.G / sum(dram) if dram else 0.0
        # Cuts: every switch's subtree (capacity: its uplink) and every socket (its socket links).
        self.cuts: dict[str, _Cut] = {}
        for port, socket in machine.iter_ports():
            if port.switch is not None:
                self.cuts[f"W:{port.switch.id}"] = _Cut(port.link.bandwidth_gbps() or float("inf"), False, 0)
        for s in machine.sockets:
            cap = sum(link.bandwidth_gbps() for link in machine.socket_links if s.id in link.between)
            if len(machine.sockets) > 1:
                self.cuts[f"S:{s.id}"] = _Cut(cap, True, 0)
        anc = {}
        for port_id, pos in skeleton.positions.items():
            chain, node = [], pos.parent
            while True:
                if node in self.cuts:
                    chain.append(node)
                if node.startswith("S:"):
                    break
                node = skeleton.parent[node][0]
            anc[port_id] = chain
        for port_id, dev in skeleton.fixed.items():
            if dev.kind == "gpu":
                for cut in anc[port_id]:
                    self.cuts[cut].fixed_gpus += 1
        self.class_cuts = [anc[ports[0]] for ports in class_ports]
        self.gpu_link = [device_link_gbps(skeleton.positions[ports[0]].link, gpu) or float("inf") for ports in class_ports]
        self.ssd_rate = [
            min(ssd.read_gbps or 3.0, device_link_gbps(skeleton.positions[ports[0]].link, ssd) or float("inf"))
            if ssd is not None else 0.0
            for ports in class_ports
        ]

    def __call__(self, g: tuple[int, ...], s: tuple[int, ...]) -> float:
        D, G, h = self.D, self.G, self.shares
        best = self.dram_bound
        rate = sum(n * r for n, r in zip(s, self.ssd_rate))
        if h["ssd"] > 0:
            best = max(best, h["ssd"] * D * G / rate if rate > 0 else float("inf"))
        links = sum(n * c for n, c in zip(g, self.gpu_link)) + self.nv
        if links > 0 and h["gpu"] < G:
            best = max(best, D * (G - h["gpu"]) / links)
        inside_gpus = {cut: c.fixed_gpus for cut, c in self.cuts.items()}
        inside_rate = {cut: 0.0 for cut in self.cuts}
        for cuts, ng, ns, r in zip(self.class_cuts, g, s, self.ssd_rate):
            for cut in cuts:
                inside_gpus[cut] += ng
                inside_rate[cut] += ns * r
        for cut, c in self.cuts.items():
            best = max(best, self._cut(inside_gpus[cut], inside_rate[cut], rate - inside_rate[cut],
                                        c.capacity + self.nv, c.has_dram))
        return best

    def _cut(self, k: int, r_in: float, r_out: float, cap: float, dram_inside: bool) -> float:
        """Smallest T at which the share X of bytes stored inside can satisfy both directions:
        k·D·(1-X) ≤ T·cap (into the cut) and (G-k)·D·X ≤ T·cap (out of it), X made of GPU
        caches, DRAM and SSD bytes inside, the SSD part limited by the read rates on each side."""
        D, G, h = self.D, self.G, self.shares
        if cap == float("inf") or (k == 0 and r_in == 0) or (k == G and r_out == 0):
            return 0.0
        g_lo = h["gpu"] if k == G else 0.0
        g_hi = h["gpu"] if k > 0 else 0.0
        c_hi = h["cpu"] if dram_inside else 0.0
        lo0, hi0, hs = g_lo, g_hi + c_hi, h["ssd"]
        a, d = r_out / (G * D), r_in / (G * D)  # SSD share the outside / inside can serve per unit T
        out: list[float] = []
        if k < G:  # bytes leaving: lo(T) <= T*b
            b = cap / ((G - k) * D)
            out += [lo0 / b, (lo0 + hs) / (a + b)]
        if k > 0:  # bytes entering: 1 - T*c <= hi(T)
            c = cap / (k * D)
            out += [(1 - hi0 - hs) / c, (1 - hi0) / (c + d)]
            if k < G:
                out.append(1 / (b + c))
        return max(out, default=0.0)
