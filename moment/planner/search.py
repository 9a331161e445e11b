"""Which slots to put N GPUs and M SSDs in: enumerate, collapse equivalent layouts, rank.

Slots are grouped into *classes*: slots under the same switch (or socket) with the same form,
width and link are interchangeable, so a layout is a count of GPUs and SSDs per class. Layouts
whose trees are mirror images (the two sockets of a balanced board, twin switches) get the same
canonical signature and are evaluated once. ``brute_force`` enumerates concrete slot subsets
instead; tests check that both find the same best time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from moment.errors import UsageError
from moment.planner import flow
from moment.planner.bounds import LayoutBound
from moment.planner.layout import SlotSpace, pick_devices, slot_space
from moment.planner.network import Skeleton, device_link_gbps, skeleton_for, ssd_read_gbps, up_edge
from moment.planner.workload import Workload
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
    prediction: flow.Prediction | None = None
    counts: tuple = ()
    weight: int = 1  # raw layouts this one stands for


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
        slot = port.slot
        bw = port.link.bandwidth_gbps()
        key = f"{parents[port.id]}|{port.kind}|{slot.form}|{slot.width}|{bw}"  # type: ignore[union-attr]
        groups.setdefault(key, []).append(port)
    gpu_ids = {p.id for p in space.gpu_slots()}
    ssd_ids = {p.id for p in space.ssd_slots()}
    return [
        SlotClass(key, tuple(p.id for p in ports), ports[0].id in gpu_ids, ports[0].id in ssd_ids)
        for key, ports in groups.items()
    ]


def _distribute(n: int, caps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to put n identical items into bins of the given capacities."""
    if not caps:
        if n == 0:
            yield ()
        return
    for k in range(min(n, caps[0]), -1, -1):
        for rest in _distribute(n - k, caps[1:]):
            yield (k, *rest)


def _signature(machine: Machine, classes: list[SlotClass], g: tuple[int, ...], s: tuple[int, ...]) -> str:
    """Canonical form of the tree with per-class counts: equal for mirror-image layouts."""
    by_port = {}
    for c, gi, si in zip(classes, g, s):
        for port_id in c.ports:
            by_port[port_id] = (c.key.split("|", 1)[1], gi, si)

    def port_sig(port: Port) -> str:
        bw = port.link.bandwidth_gbps()
        if port.switch is not None:
            inner = sorted(port_sig(p) for p in port.switch.ports)
            return f"sw[{bw}]({','.join(inner)})"
        if port.id in by_port:
            shape, gi, si = by_port[port.id]
            return f"slot[{shape}|g{gi}|s{si}]"
        dev = port.device
        return f"fixed[{bw}|{dev.kind if dev else '-'}]"

    socket_sigs = sorted(f"{s.dram_gbps}:" + ",".join(sorted(port_sig(p) for p in s.ports)) for s in machine.sockets)
    return "|".join(socket_sigs)


def _materialise(
    classes: list[SlotClass], g: tuple[int, ...], s: tuple[int, ...], gpus: list[Device], ssds: list[Device]
) -> dict[str, str]:
    layout: dict[str, str] = {}
    gi, si = iter(gpus), iter(ssds)
    for c, ng, ns in zip(classes, g, s):
        for port_id in c.ports[:ng]:
            layout[port_id] = next(gi).id
        for port_id in c.ports[ng : ng + ns]:
            layout[port_id] = next(si).id
    return layout


def evaluate(skeleton: Skeleton, placed: dict[str, Device], workload: Workload) -> flow.Prediction:
    return flow.proportional(skeleton.network(placed, workload))


def search(machine: Machine, workload: Workload, n_gpus: int, n_ssds: int, keep: int = 10) -> SearchResult:
    """Rank every distinct layout of ``n_gpus`` GPUs and ``n_ssds`` SSDs by predicted time."""
    space = slot_space(machine)
    gpus, ssds = pick_devices(space, "gpu", n_gpus), pick_devices(space, "nvme", n_ssds)
    _check_room(space, n_gpus, n_ssds)
    classes = slot_classes(machine, space)
    gpu_caps = [len(c.ports) if c.gpu_ok else 0 for c in classes]
    seen: dict[str, Candidate] = {}
    raw = 0
    for g in _distribute(n_gpus, gpu_caps):
        ssd_caps = [len(c.ports) - gi if c.ssd_ok else 0 for c, gi in zip(classes, g)]
        for s in _distribute(n_ssds, ssd_caps):
            ways = math.prod(
                math.comb(len(c.ports), gi) * math.comb(len(c.ports) - gi, si) for c, gi, si in zip(classes, g, s)
            )
            raw += ways
            sig = _signature(machine, classes, g, s)
            if sig in seen:
                seen[sig].weight += ways
                continue
            seen[sig] = Candidate(_materialise(classes, g, s, gpus, ssds), counts=(g, s), weight=ways)
    skeleton = skeleton_for(machine)
    pool = {d.id: d for d in gpus + ssds}
    bound = (
        LayoutBound(
            machine,
            skeleton,
            [c.ports for c in classes],
            workload,
            gpus[0] if gpus else pool.get("gpu0"),
            ssds[0] if ssds else None,
            n_gpus,
        )
        if gpus
        else None
    )
    order = sorted(seen.values(), key=lambda c: bound(*c.counts) if bound else 0.0)
    done: list[Candidate] = []
    limit = max(keep, 1) if keep else len(order)
    best_t = math.inf
    for cand in order:
        lb = bound(*cand.counts) if bound else 0.0
        if len(done) >= limit:
            kth = sorted(c.prediction.iteration_s for c in done)[limit - 1]  # type: ignore[union-attr]
            # Past the k-th best nothing can enter the ranking; layouts that may tie with the
            # best are still evaluated (up to TIE_LIMIT) so the tie is broken on headroom.
            if lb >= kth * (1 - 1e-9) and (lb > best_t * (1 + 1e-6) or len(done) >= limit + TIE_LIMIT):
                break
        placed = {p: pool[d] for p, d in cand.layout.items()}
        cand.prediction = flow.proportional(skeleton.network(placed, workload), second_pass=False)
        best_t = min(best_t, cand.prediction.iteration_s)
        done.append(cand)
    tied = [c for c in done if c.prediction.iteration_s <= best_t * (1 + 1e-6)]  # type: ignore[union-attr]
    for cand in tied:  # balanced shares decide among equally fast layouts
        cand.prediction = evaluate(skeleton, {p: pool[d] for p, d in cand.layout.items()}, workload)
    done.sort(key=_rank_key)
    top = done[:keep] if keep else done
    for cand in top:  # the full answer (balanced shares, loads) for what is reported
        if cand not in tied:
            cand.prediction = evaluate(skeleton, {p: pool[d] for p, d in cand.layout.items()}, workload)
    top.sort(key=_rank_key)
    return SearchResult(ranked=top, raw=raw, distinct=len(seen), evaluated=len(done), devices=gpus + ssds)


TIE_LIMIT = 300


def search_milp(
    machine: Machine, workload: Workload, n_gpus: int, n_ssds: int, keep: int = 10, solver: str = "ortools"
) -> SearchResult:
    """For large machines: enumerate only the distinct GPU placements; for each, a MILP picks how
    many SSDs go in each slot class (and the read shares) to minimise T (``solver``: a name of
    :data:`~moment.planner.flow.milp.MILP_SOLVERS`).

    Exact for the proportional model: SSDs of one class share every link above their own slot, so
    a class behaves like one bin whose read rate and own link scale with its count.
    """
    space = slot_space(machine)
    gpus, ssds = pick_devices(space, "gpu", n_gpus), pick_devices(space, "nvme", n_ssds)
    _check_room(space, n_gpus, n_ssds)
    classes = slot_classes(machine, space)
    skeleton = skeleton_for(machine)
    template = ssds[0] if ssds else None
    placements: dict[str, tuple[int, ...]] = {}
    raw = 0
    for g in _distribute(n_gpus, [len(c.ports) if c.gpu_ok else 0 for c in classes]):
        room = sum(len(c.ports) - gi for c, gi in zip(classes, g) if c.ssd_ok)
        raw += math.prod(math.comb(len(c.ports), gi) for c, gi in zip(classes, g)) * math.comb(room, n_ssds)
        placements.setdefault(_signature(machine, classes, g, (0,) * len(classes)), g)
    found: list[Candidate] = []
    for g in placements.values():
        layout = _materialise(classes, g, (0,) * len(classes), gpus, [])
        placed = {p: d for p, d in zip(layout, gpus)}
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
        if n_ssds and not reps:
            continue
        net = skeleton.network(placed, workload)
        pred = flow.proportional(net, second_pass=False, ssd_classes=reps, n_ssds=n_ssds, milp_solver=solver)
        s = tuple(pred.ssd_counts.get(f"ssd-class{i}", 0) for i in range(len(classes)))
        found.append(Candidate(_materialise(classes, g, s, gpus, ssds), counts=(g, s)))
        found[-1].prediction = pred
    found.sort(key=lambda c: c.prediction.iteration_s)  # type: ignore[union-attr]
    top = found[:keep] if keep else found
    pool = {d.id: d for d in gpus + ssds}
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
) -> SearchResult:
    """The front door: ``enumerate`` (every distinct layout, bound-pruned), ``milp`` (GPU placements
    enumerated, SSD counts by MILP on ``milp_solver``), or ``auto``: enumeration while the space is small."""
    if method == "auto":
        method = "enumerate" if _space_size(machine, n_gpus, n_ssds, ENUMERATION_LIMIT) <= ENUMERATION_LIMIT else "milp"
    if method == "milp":
        return search_milp(machine, workload, n_gpus, n_ssds, keep, solver=milp_solver)
    return search(machine, workload, n_gpus, n_ssds, keep)


def _space_size(machine: Machine, n_gpus: int, n_ssds: int, limit: int) -> int:
    """Number of class-count layouts, counted up to ``limit`` + 1."""
    space = slot_space(machine)
    classes = slot_classes(machine, space)
    n = 0
    for g in _distribute(n_gpus, [len(c.ports) if c.gpu_ok else 0 for c in classes]):
        for _ in _distribute(n_ssds, [len(c.ports) - gi if c.ssd_ok else 0 for c, gi in zip(classes, g)]):
            n += 1
            if n > limit:
                return n
    return n


def _rank_key(c: Candidate) -> tuple[float, float]:
    """Faster first; among equal times (1e-6), the one that loads the links least."""
    p = c.prediction
    return (round(p.iteration_s, 6 - int(math.floor(math.log10(max(p.iteration_s, 1e-12))))), p.link_load)  # type: ignore[union-attr]


def brute_force(machine: Machine, workload: Workload, n_gpus: int, n_ssds: int, limit: int = 50_000) -> SearchResult:
    """Evaluate every concrete choice of GPU slots and SSD slots (the baseline the reduced
    search is checked and timed against)."""
    space = slot_space(machine)
    gpus, ssds = pick_devices(space, "gpu", n_gpus), pick_devices(space, "nvme", n_ssds)
    _check_room(space, n_gpus, n_ssds)
    gpu_slots = [p.id for p in space.gpu_slots()]
    ssd_slots = [p.id for p in space.ssd_slots()]
    skeleton = skeleton_for(machine)
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


def _check_room(space: SlotSpace, n_gpus: int, n_ssds: int) -> None:
    if n_gpus > len(space.gpu_slots()):
        raise UsageError(f"{n_gpus} GPUs asked for, but the profile has {len(space.gpu_slots())} GPU-capable slots")
    if n_gpus + n_ssds > len({p.id for p in space.gpu_slots() + space.ssd_slots()}) or n_ssds > len(space.ssd_slots()):
        raise UsageError(
            f"{n_gpus} GPUs and {n_ssds} SSDs do not fit the profile's {len(space.positions)} free or movable slots"
        )
