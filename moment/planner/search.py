"""Which slots to put N GPUs and M SSDs in: enumerate, collapse equivalent layouts, rank.

Slots are grouped into *classes*: slots under the same switch (or socket) with the same form,
width and link are interchangeable, so a layout is a count of GPUs and SSDs per class. Layouts
whose trees are mirror images (the two sockets of a balanced board, twin switches) get the same
canonical signature and are evaluated once. ``brute_force`` enumerates concrete slot subsets
instead; tests check that both find the same best time.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from moment.errors import UsageError
from moment.planner import flow
from moment.planner.bounds import LayoutBound
from moment.planner.layout import SlotSpace, device_of, pick_devices, slot_of, slot_space
from moment.planner.network import Skeleton, device_link_gbps, skeleton_for, ssd_read_gbps, up_edge
from moment.planner.workload import Workload
from moment.progress import Update
from moment.topology.model import Device, Machine, Port


@dataclass(frozen=True)
class SlotClass:
    key: str  # parent node + slot shape
    ports: tuple[str, ...]  # port ids, in profile order
    gpu_ok: bool
    ssd_ok: bool


@dataclass
class Candidate:
    layout: dict[str, str]  # port id -> device id
    prediction: flow.Prediction | None = None  # None until the layout is evaluated (many never are)
    counts: tuple = ()

    @property
    def predicted(self) -> flow.Prediction:
        """The prediction of an evaluated candidate (every ranked one is)."""
        if self.prediction is None:
            raise ValueError(f"layout {self.layout} was not evaluated")
        return self.prediction


@dataclass
class SearchResult:
    ranked: list[Candidate]
    raw: int  # raw layouts (slot subsets) in the space
    distinct: int  # after collapsing interchangeable slots and mirror subtrees
    evaluated: int
    devices: list[Device] = field(default_factory=list)
    method: str = "enumerate"


def _parents(machine: Machine) -> dict[str, str]:
    """Port id -> id of the switch or socket it hangs off."""
    out = {}
    for socket in machine.sockets:
        for port in socket.ports:
            out[port.id] = socket.id
    for sw in machine.switches():
        for port in sw.ports:
            out[port.id] = sw.id
    return out


def slot_classes(machine: Machine, space: SlotSpace) -> list[SlotClass]:
    parents = _parents(machine)
    groups: dict[str, list[Port]] = {}
    for port in space.positions:
        slot = slot_of(port)
        bw = port.link.bandwidth_gbps()
        key = f"{parents[port.id]}|{port.kind}|{slot.form}|{slot.width}|{bw}"
        groups.setdefault(key, []).append(port)
    for port in space.fixed_gpus:  # GPUs fixed in place that a layout may leave idle
        key = f"{parents[port.id]}|fixed-gpu|{device_of(port).model}|{port.link.bandwidth_gbps()}"
        groups.setdefault(key, []).append(port)
    gpu_ids = {p.id for p in space.gpu_slots() + space.fixed_gpus}
    ssd_ids = {p.id for p in space.ssd_slots()}
    return [
        SlotClass(key, tuple(p.id for p in ports), ports[0].id in gpu_ids, ports[0].id in ssd_ids)
        for key, ports in groups.items()
    ]


def _distribute(n: int, caps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to put n identical items into bins of the given capacities (largest first in the
    first bin, as a depth-first walk would give them)."""
    return iter(_ways(n, tuple(caps)))


@functools.lru_cache(maxsize=4096)
def _ways(n: int, caps: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """:func:`_distribute`'s list, remembered by (n, caps): a search asks again for the same tails
    (the SSDs over the classes after the first) for every GPU placement."""
    if not caps:
        return ((),) if n == 0 else ()
    if n > sum(caps):
        return ()
    return tuple((k, *rest) for k in range(min(n, caps[0]), -1, -1) for rest in _ways(n - k, caps[1:]))


class Signer:
    """Canonical signatures of class-count layouts: equal for mirror-image trees.

    A subtree's signature depends only on the counts of the classes under it, so each subtree's
    is remembered by those counts: a search signs thousands of layouts that differ in one corner.
    """

    def __init__(self, machine: Machine, classes: list[SlotClass]) -> None:
        self.shape = {p: (i, c.key.split("|", 1)[1]) for i, c in enumerate(classes) for p in c.ports}
        self.memo: dict[tuple[str, tuple], str] = {}
        self.under: dict[str, tuple[int, ...]] = {}  # port or socket id -> classes below it
        self.sockets = [(s.id, f"{s.dram_gbps}:", s.ports) for s in machine.sockets]
        for sid, _, ports in self.sockets:
            self.under["S:" + sid] = tuple(sorted({i for p in ports for i in self._classes(p)}))

    def _classes(self, port: Port) -> tuple[int, ...]:
        if port.switch is not None:
            found = tuple(sorted({i for p in port.switch.ports for i in self._classes(p)}))
        else:
            found = (self.shape[port.id][0],) if port.id in self.shape else ()
        self.under[port.id] = found
        return found

    def __call__(self, g: tuple[int, ...], s: tuple[int, ...]) -> str:
        return "|".join(sorted(self._socket(sid, head, ports, g, s) for sid, head, ports in self.sockets))

    def _key(self, node: str, g: tuple[int, ...], s: tuple[int, ...]) -> tuple[str, tuple]:
        return node, tuple((g[i], s[i]) for i in self.under[node])

    def _socket(self, sid: str, head: str, ports: list[Port], g: tuple[int, ...], s: tuple[int, ...]) -> str:
        key = self._key("S:" + sid, g, s)
        if key not in self.memo:
            self.memo[key] = head + ",".join(sorted(self._port(p, g, s) for p in ports))
        return self.memo[key]

    def _port(self, port: Port, g: tuple[int, ...], s: tuple[int, ...]) -> str:
        if port.id in self.shape:
            i, shape = self.shape[port.id]
            return f"slot[{shape}|g{g[i]}|s{s[i]}]"
        bw = port.link.bandwidth_gbps()
        if port.switch is not None:
            key = self._key(port.id, g, s)
            if key not in self.memo:
                inner = ",".join(sorted(self._port(p, g, s) for p in port.switch.ports))
                self.memo[key] = f"sw[{bw}]({inner})"
            return self.memo[key]
        dev = port.device
        return f"fixed[{bw}|{dev.kind if dev else '-'}]"


@dataclass
class Space:
    """What every search of one machine shares, worked out once: the slot space, its classes,
    the graph skeleton and the signer (a sweep plans many counts on one machine)."""

    machine: Machine
    slots: SlotSpace
    classes: list[SlotClass]
    skeleton: Skeleton
    signer: Signer
    placements: dict[int, dict[str, tuple[int, ...]]] = field(default_factory=dict)  # GPU count -> ...

    @classmethod
    def of(cls, machine: Machine) -> Space:
        slots = slot_space(machine)
        classes = slot_classes(machine, slots)
        skeleton = skeleton_for(machine, choose_fixed=bool(slots.fixed_gpus))
        return cls(machine, slots, classes, skeleton, Signer(machine, classes))

    @property
    def own(self) -> dict[str, str]:
        """Port id -> the GPU fixed there, where a layout chooses among fixed GPUs."""
        return {p.id: device_of(p).id for p in self.slots.fixed_gpus}

    def devices(self, n_gpus: int, n_ssds: int) -> tuple[list[Device], list[Device]]:
        """The GPUs and SSDs a layout of these counts places (refused where they do not fit);
        where GPUs are fixed in place, all of them (a layout picks ``n_gpus``)."""
        if (why := self.misfit(n_gpus, n_ssds)) is not None:
            raise UsageError(f"{n_gpus} GPUs and {n_ssds} SSDs do not fit: {why}")
        fixed = [device_of(p) for p in self.slots.fixed_gpus]
        gpus = fixed if fixed else pick_devices(self.slots, "gpu", n_gpus)
        return gpus, pick_devices(self.slots, "nvme", n_ssds)

    def misfit(self, n_gpus: int, n_ssds: int) -> str | None:
        """Why ``n_gpus`` GPUs and ``n_ssds`` SSDs do not fit the slots (the same words for every
        count that fails the same way, so a sweep can list them together), or None."""
        gpu_slots, ssd_slots = len(self.slots.gpu_slots()), len(self.slots.ssd_slots())
        room = len({p.id for p in self.slots.gpu_slots() + self.slots.ssd_slots()})
        fixed = len(self.slots.fixed_gpus)
        if n_gpus + sum(d.kind == "gpu" for d in self.skeleton.fixed.values()) == 0:
            return "a layout needs at least one GPU"
        if fixed and n_gpus > fixed:
            return f"more GPUs than the profile's {fixed}, which are fixed in place (no slot for another)"
        if not fixed and n_gpus > gpu_slots:
            return f"more GPUs than the profile's {gpu_slots} GPU-capable slots"
        if n_ssds > ssd_slots:
            return f"more SSDs than the profile's {ssd_slots} slots an SSD fits"
        if (0 if fixed else n_gpus) + n_ssds > room:
            return f"more devices than the profile's {room} free or movable slots"
        return None

    def gpu_placements(self, n_gpus: int) -> dict[str, tuple[int, ...]]:
        """The distinct ways to put ``n_gpus`` GPUs into the classes (one per mirror image), by
        signature; remembered, as a sweep asks for each GPU count once per SSD count."""
        if n_gpus not in self.placements:
            nothing, found = (0,) * len(self.classes), {}
            for g in _distribute(n_gpus, [len(c.ports) if c.gpu_ok else 0 for c in self.classes]):
                found.setdefault(self.signer(g, nothing), g)
            self.placements[n_gpus] = found
        return self.placements[n_gpus]

    def size(self, n_gpus: int, n_ssds: int) -> int:
        """Number of class-count layouts (the ``(g, s)`` vectors :func:`search` enumerates)."""
        return count_layouts(self.classes, n_gpus, n_ssds)


def _materialise(
    classes: list[SlotClass],
    g: tuple[int, ...],
    s: tuple[int, ...],
    gpus: list[Device],
    ssds: list[Device],
    own: dict[str, str] | None = None,
) -> dict[str, str]:
    """The layout of per-class counts: the first slots of each class, the devices in order
    (``own``: the GPU fixed at a port, which only it can hold)."""
    layout: dict[str, str] = {}
    gi, si = iter(gpus), iter(ssds)
    own = own or {}
    for c, ng, ns in zip(classes, g, s):
        for port_id in c.ports[:ng]:
            layout[port_id] = own[port_id] if port_id in own else next(gi).id
        for port_id in c.ports[ng : ng + ns]:
            layout[port_id] = next(si).id
    return layout


def evaluate(skeleton: Skeleton, placed: dict[str, Device], workload: Workload) -> flow.Prediction:
    return flow.proportional(skeleton.network(placed, workload))


def _bound(sp: Space, workload: Workload, gpus: list[Device], ssds: list[Device], n_gpus: int) -> LayoutBound | None:
    if not gpus:
        return None
    ports = [c.ports for c in sp.classes]
    return LayoutBound(sp.machine, sp.skeleton, ports, workload, gpus[0], ssds[0] if ssds else None, n_gpus)


def search(
    machine: Machine,
    workload: Workload,
    n_gpus: int,
    n_ssds: int,
    keep: int = 10,
    space: Space | None = None,
    progress: Update | None = None,
    ties: int = 300,
) -> SearchResult:
    """Rank every distinct layout of ``n_gpus`` GPUs and ``n_ssds`` SSDs by predicted time
    (``space``: the machine's :class:`Space`, when the caller plans several counts). Layouts
    whose bound says they can at best tie with the best are still evaluated, up to ``ties`` of
    them, so that the tie is broken on headroom (0: the first layout that reaches the best time)."""
    sp = space or Space.of(machine)
    gpus, ssds = sp.devices(n_gpus, n_ssds)
    classes = sp.classes
    gpu_caps = [len(c.ports) if c.gpu_ok else 0 for c in classes]
    seen: dict[str, Candidate] = {}
    for g in _distribute(n_gpus, gpu_caps):
        ssd_caps = [len(c.ports) - gi if c.ssd_ok else 0 for c, gi in zip(classes, g)]
        for s in _distribute(n_ssds, ssd_caps):
            sig = sp.signer(g, s)
            if sig not in seen:
                seen[sig] = Candidate({}, counts=(g, s))  # its layout is made if it is evaluated
    raw = count_layouts(classes, n_gpus, n_ssds, slots=True)
    skeleton = sp.skeleton
    pool = {d.id: d for d in gpus + ssds}
    bound = _bound(sp, workload, gpus, ssds, n_gpus)
    order = list(seen.values())
    # In bound order (ties in enumeration order), the bound worked out lazily: each layout gets
    # the quick one (tiers and GPU links), a layout whose turn comes the full one, and waits again.
    heap = [(bound(*c.counts, cuts=False) if bound else 0.0, i, 1) for i, c in enumerate(order)]
    heapq.heapify(heap)
    done: list[Candidate] = []
    limit = max(keep, 1) if keep else len(order)
    best_t = math.inf
    while heap:
        lb, i, quick = heapq.heappop(heap)
        cand = order[i]
        if quick and bound:
            heapq.heappush(heap, (max(lb, bound(*cand.counts)), i, 0))
            continue
        if len(done) >= limit:
            kth = sorted(c.predicted.iteration_s for c in done)[limit - 1]
            # Past the k-th best nothing can enter the ranking; layouts that may tie with the
            # best are still evaluated (up to ``ties``) so the tie is broken on headroom.
            if lb >= kth * (1 - 1e-9) and (lb > best_t * (1 + 1e-6) or len(done) >= limit + ties):
                break
        cand.layout = _materialise(classes, *cand.counts, gpus, ssds, sp.own)
        placed = {p: pool[d] for p, d in cand.layout.items()}
        cand.prediction = flow.proportional(skeleton.network(placed, workload), second_pass=False)
        best_t = min(best_t, cand.prediction.iteration_s)
        done.append(cand)
        if progress is not None:
            progress(len(done), len(order))
    if progress is not None:  # the rest were settled by the bound
        progress(len(order), len(order))
    tied = [c for c in done if c.predicted.iteration_s <= best_t * (1 + 1e-6)]
    for cand in tied:  # balanced shares decide among equally fast layouts
        cand.prediction = evaluate(skeleton, {p: pool[d] for p, d in cand.layout.items()}, workload)
    done.sort(key=_rank_key)
    top = done[:keep] if keep else done
    for cand in top:  # the full answer (balanced shares, loads) for what is reported
        if cand not in tied:
            cand.prediction = evaluate(skeleton, {p: pool[d] for p, d in cand.layout.items()}, workload)
    top.sort(key=_rank_key)
    return SearchResult(ranked=top, raw=raw, distinct=len(seen), evaluated=len(done), devices=gpus + ssds)


def search_milp(
    machine: Machine,
    workload: Workload,
    n_gpus: int,
    n_ssds: int,
    keep: int = 10,
    solver: str = "ortools",
    space: Space | None = None,
    progress: Update | None = None,
    ties: float = math.inf,
) -> SearchResult:
    """For large machines: enumerate only the distinct GPU placements; for each, a MILP picks how
    many SSDs go in each slot class (and the read shares) to minimise T (``solver``: a name of
    :data:`~moment.planner.flow.milp.MILP_SOLVERS`).

    Exact for the proportional model: SSDs of one class share every link above their own slot, so
    a class behaves like one bin whose read rate and own link scale with its count. Placements are
    solved in the order of a bound valid for every way of adding the SSDs
    (:meth:`~moment.planner.bounds.LayoutBound.for_gpus`); once it passes the k-th best time
    found, the rest cannot enter the ranking (once it reaches it, they can only tie: ``ties``
    of them are still solved, by default all).
    """
    sp = space or Space.of(machine)
    gpus, ssds = sp.devices(n_gpus, n_ssds)
    classes, skeleton = sp.classes, sp.skeleton
    template = ssds[0] if ssds else None
    pool = {d.id: d for d in gpus + ssds}
    placements = sp.gpu_placements(n_gpus)
    raw = count_layouts(classes, n_gpus, n_ssds, slots=True)
    nothing = (0,) * len(classes)
    bound = _bound(sp, workload, gpus, ssds, n_gpus)

    def lower(g: tuple[int, ...], cuts: bool) -> float:
        room = [len(c.ports) - gi if c.ssd_ok else 0 for c, gi in zip(classes, g)]
        return bound.for_gpus(g, room, n_ssds, cuts=cuts) if bound else 0.0

    # Best first by the bound, worked out lazily: every placement gets the quick bound (no cuts),
    # one whose turn comes gets the full bound and waits again (ahead of equal quick bounds).
    heap = [(lower(g, False), 1, key) for key, g in placements.items()]
    heapq.heapify(heap)
    found: list[Candidate] = []
    limit = max(keep, 1) if keep else len(placements)
    n = 0
    while heap:
        lb, quick, key = heapq.heappop(heap)
        if len(found) >= limit:
            kth = sorted(c.predicted.iteration_s for c in found)[limit - 1]
            if lb >= kth * (1 - 1e-9) and (lb > kth * (1 + 1e-6) or len(found) >= limit + ties):
                break
        g = placements[key]
        if quick:
            heapq.heappush(heap, (max(lb, lower(g, True)), 0, key))
            continue
        n += 1
        placed = {p: pool[d] for p, d in _materialise(classes, g, nothing, gpus, [], sp.own).items()}
        reps: dict[str, flow.SsdClass] = {}
        for i, (c, gi) in enumerate(zip(classes, g)):
            room = len(c.ports) - gi
            if c.ssd_ok and room > 0 and template is not None:
                rep = template.model_copy(update={"id": f"ssd-class{i}", "bdf": None, "functions": []})
                port_id = c.ports[gi]
                placed[port_id] = rep
                link = skeleton.positions[port_id].link
                rate = min(ssd_read_gbps(rep, workload), device_link_gbps(link, rep) or math.inf)
                reps[rep.id] = flow.SsdClass(max_count=min(room, n_ssds), rate_gbps=rate, uplink=up_edge(port_id))
        if progress is not None:
            progress(n, len(placements))
        if n_ssds and not reps:
            continue
        net = skeleton.network(placed, workload)
        pred = flow.proportional(net, second_pass=False, ssd_classes=reps, n_ssds=n_ssds, milp_solver=solver)
        s = tuple(pred.ssd_counts.get(f"ssd-class{i}", 0) for i in range(len(classes)))
        found.append(Candidate(_materialise(classes, g, s, gpus, ssds, sp.own), counts=(g, s)))
        found[-1].prediction = pred
    if progress is not None:  # the rest were settled by the bound
        progress(len(placements), len(placements))
    found.sort(key=lambda c: c.predicted.iteration_s)
    top = found[:keep] if keep else found
    for cand in top:  # the exact LP on the concrete layout, with balanced shares
        cand.prediction = evaluate(skeleton, {p: pool[d] for p, d in cand.layout.items()}, workload)
    top.sort(key=_rank_key)
    return SearchResult(
        ranked=top, raw=raw, distinct=len(placements), evaluated=len(found), devices=gpus + ssds, method="milp"
    )


ENUMERATION_LIMIT = 20_000  # class-count layouts; beyond this "auto" switches to the MILP


def plan_search(
    machine: Machine,
    workload: Workload,
    n_gpus: int,
    n_ssds: int,
    keep: int = 10,
    method: str = "auto",
    milp_solver: str = "ortools",
    space: Space | None = None,
    progress: Update | None = None,
    ties: int | None = None,
) -> SearchResult:
    """The front door: ``enumerate`` (every distinct layout, bound-pruned), ``milp`` (GPU placements
    enumerated, SSD counts by MILP on ``milp_solver``), or ``auto``: enumeration while the space is
    small. ``progress(done, total)``: layouts or GPU placements evaluated; ``ties``: how many
    layouts that can only tie with the best are still evaluated (default: each method's own)."""
    sp = space or Space.of(machine)
    if method == "auto":
        method = "enumerate" if sp.size(n_gpus, n_ssds) <= ENUMERATION_LIMIT else "milp"
    extra = {} if ties is None else {"ties": ties}
    if method == "milp":
        return search_milp(
            machine, workload, n_gpus, n_ssds, keep, solver=milp_solver, space=sp, progress=progress, **extra
        )
    return search(machine, workload, n_gpus, n_ssds, keep, space=sp, progress=progress, **extra)


def _space_size(machine: Machine, n_gpus: int, n_ssds: int) -> int:
    """Number of class-count layouts of ``machine`` (:meth:`Space.size`)."""
    return Space.of(machine).size(n_gpus, n_ssds)


def count_layouts(classes: list[SlotClass], n_gpus: int, n_ssds: int, slots: bool = False) -> int:
    """Class-count layouts of ``n_gpus`` and ``n_ssds`` (``slots``: raw layouts, the slot subsets
    they stand for), counted class by class rather than enumerated: a sweep asks for every count."""
    ways = {(0, 0): 1}  # (GPUs, SSDs) placed in the classes so far -> ways
    for c in classes:
        n, nxt = len(c.ports), {}
        for (a, b), k in ways.items():
            for gi in range(min(n, n_gpus - a) + 1 if c.gpu_ok else 1):
                for si in range(min(n - gi, n_ssds - b) + 1 if c.ssd_ok else 1):
                    each = math.comb(n, gi) * math.comb(n - gi, si) if slots else 1
                    nxt[a + gi, b + si] = nxt.get((a + gi, b + si), 0) + k * each
        ways = nxt
    return ways.get((n_gpus, n_ssds), 0)


def _rank_key(c: Candidate) -> tuple[float, float]:
    """Faster first; among equal times (1e-6), the one that loads the links least."""
    p = c.predicted
    return (round(p.iteration_s, 6 - int(math.floor(math.log10(max(p.iteration_s, 1e-12))))), p.link_load)


def brute_force(machine: Machine, workload: Workload, n_gpus: int, n_ssds: int, limit: int = 50_000) -> SearchResult:
    """Evaluate every concrete choice of GPU slots and SSD slots (the baseline the reduced
    search is checked and timed against)."""
    sp = Space.of(machine)
    space = sp.slots
    gpus, ssds = sp.devices(n_gpus, n_ssds)
    gpu_slots = [p.id for p in space.gpu_slots()]
    ssd_slots = [p.id for p in space.ssd_slots()]
    skeleton = sp.skeleton
    ranked: list[Candidate] = []
    for gsel in itertools.combinations(gpu_slots, n_gpus):
        rest = [p for p in ssd_slots if p not in gsel]
        for ssel in itertools.combinations(rest, n_ssds):
            if len(ranked) >= limit:
                raise UsageError(f"brute force stopped after {limit} layouts: the space is too large")
            placed = dict(zip(gsel + ssel, gpus + ssds))
            layout = {p: d.id for p, d in placed.items()}
            ranked.append(Candidate(layout, evaluate(skeleton, placed, workload)))
    ranked.sort(key=_rank_key)
    return SearchResult(
        ranked=ranked, raw=len(ranked), distinct=len(ranked), evaluated=len(ranked), devices=gpus + ssds
    )
