"""The reduced search finds what brute force finds; its bounds never cut a better layout."""

from __future__ import annotations

import pytest

from moment.errors import UsageError
from moment.planner import search
from moment.planner.bounds import LayoutBound
from moment.planner.flow.milp import MILP_SOLVERS
from moment.planner.layout import slot_space
from moment.planner.workload import Workload, load_workload
from moment.topology.profile_io import resolve_profile
from planner_fixtures import SSD_ONLY, one_switch, two_sockets

CACHED = Workload(
    nodes=2_000_000, feature_dim=1000, unique_per_batch=250_000, gpu_cache_gb=1.0, cpu_cache_fraction=0.05
)


@pytest.mark.parametrize("workload", [SSD_ONLY, CACHED], ids=["ssd-only", "with-caches"])
@pytest.mark.parametrize(("gpus", "ssds"), [(1, 1), (2, 2), (2, 3), (3, 2)])
def test_reduced_search_matches_brute_force(workload: Workload, gpus: int, ssds: int) -> None:
    machine = one_switch(extra_slots=True)
    reduced = search.search(machine, workload, gpus, ssds, keep=0)
    brute = search.brute_force(machine, workload, gpus, ssds)
    assert reduced.ranked[0].prediction.iteration_s == pytest.approx(brute.ranked[0].prediction.iteration_s, rel=1e-6)
    assert reduced.raw == brute.raw  # the counting of raw layouts is exact
    assert reduced.distinct < reduced.raw or reduced.raw <= 2


def test_reduced_search_matches_brute_force_on_machine_b() -> None:
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    reduced = search.search(machine, workload, 1, 2, keep=3)
    brute = search.brute_force(machine, workload, 1, 2)
    assert reduced.raw == brute.raw
    assert reduced.ranked[0].prediction.iteration_s == pytest.approx(brute.ranked[0].prediction.iteration_s, rel=1e-6)
    assert reduced.evaluated <= reduced.distinct < reduced.raw


def test_mirror_sockets_collapse() -> None:
    """Two identical sockets: a GPU on either side is the same layout."""
    machine = two_sockets()
    result = search.search(machine, SSD_ONLY, 1, 1, keep=0)
    assert result.raw == 6  # GPU in 2 slots × SSD in the 3 left (a GPU slot takes an SSD too)
    assert result.distinct == 3  # SSD beside the GPU, in the other bay, in the other GPU slot


@pytest.mark.parametrize(("name", "gpus", "ssds"), [("moment-machine-b", 4, 8), ("moment-machine-a-nvlink", 2, 3)])
def test_bounds_are_lower_bounds(name: str, gpus: int, ssds: int) -> None:
    machine = resolve_profile(name)
    workload = load_workload(machine.workload)
    space = slot_space(machine)
    classes = search.slot_classes(machine, space)
    skeleton = search.skeleton_for(machine)
    bound = LayoutBound(machine, skeleton, [c.ports for c in classes], workload, space.gpus[0], space.ssds[0], gpus)
    result = search.search(machine, workload, gpus, ssds, keep=0)
    checked = 0
    for cand in result.ranked:
        if cand.counts:
            assert bound(*cand.counts) <= cand.prediction.iteration_s * (1 + 1e-6)
            checked += 1
    assert checked == result.evaluated


def test_pruned_search_keeps_the_best() -> None:
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    full = search.search(machine, workload, 4, 8, keep=0)
    pruned = search.search(machine, workload, 4, 8, keep=5)
    assert pruned.evaluated < full.evaluated
    assert [c.prediction.iteration_s for c in pruned.ranked] == pytest.approx(
        [c.prediction.iteration_s for c in full.ranked[:5]], rel=1e-6
    )


def test_too_many_devices_is_a_usage_error() -> None:
    machine = one_switch()
    with pytest.raises(UsageError, match="GPU-capable slots"):
        search.search(machine, SSD_ONLY, 5, 1)
    with pytest.raises(UsageError, match="do not fit"):
        search.search(machine, SSD_ONLY, 2, 9)


@pytest.mark.parametrize("name", ["moment-machine-a", "moment-machine-b", "moment-machine-a-nvlink"])
def test_milp_agrees_with_enumeration(name: str) -> None:
    machine = resolve_profile(name)
    workload = load_workload(machine.workload)
    enum = search.search(machine, workload, 4, 8, keep=1)
    milp = search.search_milp(machine, workload, 4, 8, keep=1)
    assert milp.ranked[0].prediction.iteration_s == pytest.approx(enum.ranked[0].prediction.iteration_s, rel=1e-6)
    assert milp.raw == enum.raw  # both count the same space of slot subsets


def test_milp_on_a_large_machine_beats_random_layouts() -> None:
    """8 GPUs, 16 SSDs, 4 switches: the plan is never worse than any of 30 random layouts."""
    import random

    machine = resolve_profile("example-8gpu-16ssd")
    workload = load_workload(machine.workload)
    result = search.plan_search(machine, workload, 8, 16, keep=1)
    assert result.method == "milp"
    best = result.ranked[0].prediction.iteration_s
    space = slot_space(machine)
    skeleton = search.skeleton_for(machine)
    rng = random.Random(0)
    gpu_slots = [p.id for p in space.gpu_slots()]
    for _ in range(30):
        gsel = rng.sample(gpu_slots, 8)
        ssel = rng.sample([p.id for p in space.ssd_slots() if p.id not in gsel], 16)
        placed = dict(zip(gsel + ssel, space.gpus + space.ssds))
        assert search.evaluate(skeleton, placed, workload).iteration_s >= best * (1 - 1e-6)


@pytest.mark.parametrize("solver", list(MILP_SOLVERS))
@pytest.mark.parametrize(
    ("machine", "gpus", "ssds"),
    [
        ("one-switch", 2, 3),
        ("one-switch", 1, 2),
        ("moment-machine-b", 1, 2),
    ],
)
def test_each_milp_solver_finds_the_brute_force_best(solver: str, machine: str, gpus: int, ssds: int) -> None:
    """SCIP (ortools) and CBC (PuLP) pick a layout brute force ranks best, at its time."""
    m = one_switch(extra_slots=True) if machine == "one-switch" else resolve_profile(machine)
    workload = SSD_ONLY if machine == "one-switch" else load_workload(m.workload)
    milp = search.search_milp(m, workload, gpus, ssds, keep=1, solver=solver)
    brute = search.brute_force(m, workload, gpus, ssds)
    best = brute.ranked[0].prediction.iteration_s
    assert milp.ranked[0].prediction.iteration_s == pytest.approx(best, rel=1e-6)
    tied = [_slots(c.layout) for c in brute.ranked if c.prediction.iteration_s <= best * (1 + 1e-6)]
    assert _slots(milp.ranked[0].layout) in tied


def _slots(layout: dict[str, str]) -> tuple[set[str], set[str]]:
    """The slots holding GPUs and those holding SSDs (devices of a kind are alike here)."""
    gpus = {port for port, dev in layout.items() if dev.startswith("gpu")}
    return gpus, set(layout) - gpus


@pytest.mark.parametrize("name", ["moment-machine-b", "example-8gpu-16ssd", "asus-esc8000a-e12"])
def test_layouts_are_counted_as_enumerated(name: str) -> None:
    machine = resolve_profile(name)
    space = search.Space.of(machine)
    caps = [len(c.ports) if c.gpu_ok else 0 for c in space.classes]
    for gpus, ssds in [(1, 1), (2, 3), (3, 2), (4, 4)]:
        listed = [
            (g, s)
            for g in search._distribute(gpus, caps)
            for s in search._distribute(ssds, [len(c.ports) - n if c.ssd_ok else 0 for c, n in zip(space.classes, g)])
        ]
        assert space.size(gpus, ssds) == len(listed)


@pytest.mark.parametrize(("name", "gpus", "ssds"), [("moment-machine-b", 2, 5), ("moment-machine-a", 3, 6)])
def test_the_gpu_placement_bound_is_below_every_layout_of_it(name: str, gpus: int, ssds: int) -> None:
    """The MILP search prunes GPU placements with ``for_gpus``: it must not exceed the time of any
    layout that adds the SSDs to that placement."""
    machine = resolve_profile(name)
    workload = load_workload(machine.workload)
    space = search.Space.of(machine)
    g_dev, s_dev = space.devices(gpus, ssds)
    bound = LayoutBound(machine, space.skeleton, [c.ports for c in space.classes], workload, g_dev[0], s_dev[0], gpus)
    result = search.search(machine, workload, gpus, ssds, keep=0)
    assert result.ranked
    for cand in result.ranked:
        g, _ = cand.counts
        room = [len(c.ports) - n if c.ssd_ok else 0 for c, n in zip(space.classes, g)]
        assert bound.for_gpus(g, room, ssds) <= cand.prediction.iteration_s * (1 + 1e-6)


@pytest.mark.parametrize(("gpus", "ssds"), [(2, 6), (8, 16), (5, 9)])
def test_pruned_milp_and_untied_search_find_the_best_time(gpus: int, ssds: int) -> None:
    """What a sweep runs (bound-pruned, ties not broken) finds the time of the full search."""
    machine = resolve_profile("example-8gpu-16ssd")
    workload = load_workload(machine.workload)
    space = search.Space.of(machine)
    full = search.search_milp(machine, workload, gpus, ssds, keep=0, space=space)
    quick = search.search_milp(machine, workload, gpus, ssds, keep=1, space=space, ties=0)
    assert quick.evaluated <= full.evaluated
    assert quick.ranked[0].prediction.iteration_s == pytest.approx(full.ranked[0].prediction.iteration_s, rel=1e-6)
    if space.size(gpus, ssds) <= search.ENUMERATION_LIMIT:
        enum = search.search(machine, workload, gpus, ssds, keep=1, space=space, ties=0)
        assert enum.ranked[0].prediction.iteration_s == pytest.approx(full.ranked[0].prediction.iteration_s, rel=1e-6)
