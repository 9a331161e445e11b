"""Which bin (GPU cache, CPU cache, SSD) holds each vertex's features: DDAK and a hash baseline.

DDAK (the Moment paper's data-distribution-aware knapsack) walks the vertices hottest first in
pools of ``pool`` vertices. Tiers fill in the order GPU > CPU > SSD, so the hottest vertices live
in the fastest tier. Inside a tier each pool goes to the bin that would fall furthest below its
target share if the rest of the tier were spread evenly over the free room:

    priority = (access + rate × fill × (capacity − used)) / target

with ``rate`` the mean hotness of the tier's unplaced vertices and ``fill`` the share of the free
room they will take. The next (hottest remaining) pool thus goes where accesses are short, and a
bin that will be filled with colder rows anyway is served hot pools early. Every bin ends up
serving close to the share of reads the plan gives it (``plan.json`` ``bin_targets``), whether
SSDs have room to spare or are filled exactly. (The simpler ``(access / target) × (used /
capacity)`` balances ``access × used``, so with equal capacities it serves shares in proportion
to √target, not target: 24% off for targets 1:2; ``access / target`` alone matches targets only
while no bin fills.)

The hash baseline keeps the same tier split but puts each vertex in a bin by a hash of its id,
weighted by capacity, ignoring targets: comparing the two isolates DDAK's use of the hotness
distribution.

The loops over pools and vertices are compiled with numba (100M vertices take seconds); without
numba the same functions run as plain Python, with the same results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moment.contracts.tiers import TIERS
from moment.errors import MomentError
from placement.relabel import id_type

try:
    import numba
    import numba.extending
except ImportError:  # pragma: no cover - numba is a dependency; this is the documented fallback
    numba = None

_SLOT_BITS = 16  # hash slots per tier: 2^16, so capacity weights are exact to 1/65536
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class BinSpec:
    name: str  # "gpu0", "dram:cpu0", "nvme3"
    tier: str  # "gpu" | "cpu" | "ssd"
    capacity: int  # rows (vertices) it can hold
    target: float  # share of all feature accesses the plan wants it to serve


@dataclass
class Placement:
    bin_of: np.ndarray  # int16 (int32 past 32767 bins), N: index into bins of every vertex
    bins: list[BinSpec]
    used: np.ndarray  # int64: rows per bin
    access: np.ndarray  # int64: accesses (sum of hotness) per bin

    def shares(self) -> np.ndarray:
        """Share of all accesses each bin serves (zeros when nothing is accessed)."""
        total = int(self.access.sum())
        return self.access / total if total > 0 else np.zeros(len(self.bins))

    def report(self) -> list[dict[str, Any]]:
        """Per bin: name, tier, capacity, used rows, target share and achieved share."""
        return [
            {
                "name": b.name,
                "tier": b.tier,
                "capacity": int(b.capacity),
                "used": int(u),
                "target": float(b.target),
                "achieved": float(s),
            }
            for b, u, s in zip(self.bins, self.used, self.shares())
        ]


def _compiled(fn: Callable) -> Callable:
    """``fn`` compiled by numba where it is installed, else ``fn`` itself (same results, slower)."""
    return numba.njit(cache=True)(fn) if numba is not None else fn


def _callable_from_compiled(fn: Callable) -> Callable:
    """``fn`` unchanged for Python callers, and callable from compiled kernels where numba is."""
    return numba.extending.register_jitable(fn) if numba is not None else fn


# ---- kernels: plain Python on plain arrays, compiled below -------------------------------------


def ddak_pools(
    order: np.ndarray,
    hotness: np.ndarray,
    total: int,
    tier_bins: np.ndarray,
    tier_ptr: np.ndarray,
    tier_end: np.ndarray,
    capacity: np.ndarray,
    target: np.ndarray,
    pool: int,
    bin_of: np.ndarray,
    used: np.ndarray,
    access: np.ndarray,
    paper: bool,
) -> None:
    """Place ``order`` (hottest first) pool by pool: tier t takes positions up to ``tier_end[t]``
    among bins ``tier_bins[tier_ptr[t]:tier_ptr[t+1]]``. Each pool (or the part of it that fits)
    goes to the bin with room of lowest projected access per target, ties to the emptier bin,
    then the lower index. ``total`` (all accesses) spares a pass over the last, largest tier."""
    pos = 0
    for t in range(tier_ptr.size - 1):
        lo, hi, end = tier_ptr[t], tier_ptr[t + 1], tier_end[t]
        left = total  # accesses of the tier's vertices not placed yet
        if end < order.size:
            left = 0
            for i in range(pos, end):
                left += int(hotness[order[i]])
        total -= left
        room = 0
        for j in range(lo, hi):
            room += capacity[tier_bins[j]] - used[tier_bins[j]]
        while pos < end:
            stop = min(pos + pool, end)
            while pos < stop:
                best = _lowest_projection(
                    tier_bins[lo:hi], capacity, target, used, access, left / (end - pos), (end - pos) / room, paper
                )
                take = min(stop - pos, capacity[best] - used[best])
                acc = 0
                for i in range(pos, pos + take):
                    v = order[i]
                    bin_of[v] = best
                    acc += int(hotness[v])
                used[best] += take
                access[best] += acc
                pos += take
                left -= acc
                room -= take


@_callable_from_compiled
def _lowest_projection(
    members: np.ndarray,
    capacity: np.ndarray,
    target: np.ndarray,
    used: np.ndarray,
    access: np.ndarray,
    rate: float,
    fill: float,
    paper: bool,
) -> int:
    """The bin with room whose access would fall furthest below its target if the rest of the
    tier (``rate`` accesses per row on average, filling a ``fill`` share of the free room) were
    spread evenly: projected = (access + rate × fill × room) / target; +inf for target 0, so
    such a bin is chosen only when no other has room. Once the rest of the tier has no accesses
    (rate 0) every choice leaves the shares as they are: all finite keys tie, spreading rows.
    ``paper``: the issue's formula instead, (access / target) × (used / capacity).
    Ties: lower used/capacity, then index."""
    inf = np.inf
    best, best_p, best_f = -1, inf, inf
    for b in members:
        if used[b] >= capacity[b]:
            continue
        p = inf
        if target[b] > 0 and paper:
            p = (access[b] / target[b]) * (used[b] / capacity[b])
        elif target[b] > 0:
            p = (access[b] + rate * fill * (capacity[b] - used[b])) / target[b] if rate > 0 else 0.0
        f = used[b] / capacity[b]
        if best < 0 or p < best_p or (p == best_p and f < best_f):
            best, best_p, best_f = b, p, f
    return best


def hash_fill(
    order: np.ndarray,
    hotness: np.ndarray,
    tier_bins: np.ndarray,
    tier_ptr: np.ndarray,
    tier_end: np.ndarray,
    slot_member: np.ndarray,
    capacity: np.ndarray,
    salt: np.uint64,
    bin_of: np.ndarray,
    used: np.ndarray,
    access: np.ndarray,
) -> None:
    """Vertex ``order[i]`` of tier t goes to member ``slot_member[t, hash slot of its id]``, or,
    when that bin is full, to the next member with room (cyclically): deterministic, and no bin
    overflows. (A table lookup, not a search over bounds: no unpredictable branches.)"""
    pos = 0
    for t in range(tier_ptr.size - 1):
        lo, hi = tier_ptr[t], tier_ptr[t + 1]
        while pos < tier_end[t]:
            v = order[pos]
            j = slot_member[t, _hash_slot(v, salt)]
            while used[tier_bins[j]] >= capacity[tier_bins[j]]:
                j = j + 1 if j + 1 < hi else lo
            b = tier_bins[j]
            bin_of[v] = b
            used[b] += 1
            access[b] += int(hotness[v])
            pos += 1


@_callable_from_compiled
def _hash_slot(v: int, salt: np.uint64) -> int:
    """Top 16 bits of splitmix64(id + salt): uniform over the slots, blind to the id's hotness."""
    x = np.uint64(v) + salt
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    x = x ^ (x >> np.uint64(31))
    return int(x >> np.uint64(64 - _SLOT_BITS))


def counting_order(hotness: np.ndarray, hmax: int, out: np.ndarray) -> np.ndarray:
    """``out`` = vertex ids by descending hotness, ties by ascending id: a stable counting sort,
    O(N + max)."""
    start = np.zeros(hmax + 2, dtype=np.int64)
    for v in range(hotness.size):
        start[hmax - int(hotness[v]) + 1] += 1
    for k in range(1, hmax + 2):
        start[k] += start[k - 1]
    for v in range(hotness.size):
        k = hmax - int(hotness[v])
        out[start[k]] = v
        start[k] += 1
    return out


ddak_pools_fast = _compiled(ddak_pools)
hash_fill_fast = _compiled(hash_fill)
counting_order_fast = _compiled(counting_order)


# ---- public API ---------------------------------------------------------------------------------


def hotness_order(hotness: np.ndarray) -> np.ndarray:
    """Vertex ids hottest first, ties by ascending id: int32 where the ids fit (4 bytes per
    vertex less at the peak of a placement), else int64.

    With numba, a counting sort (faster than numpy's radix sort, and still linear when counts pass
    65535); else, or for counts far larger than N, a stable argsort on the narrowest unsigned key
    ``max - h`` (numpy radix-sorts 16-bit keys)."""
    h = _check_hotness(hotness)
    if h.size == 0:
        return np.empty(0, dtype=np.int64)
    hmax = int(h.max())
    if numba is not None and hmax <= max(h.size, 1 << 16):
        return counting_order_fast(h, hmax, np.empty(h.size, dtype=id_type(h.size)))
    return argsort_order(h, hmax).astype(id_type(h.size))


PRIORITIES = ("projected", "paper")


def ddak(
    hotness: np.ndarray,
    bins: Sequence[BinSpec],
    pool: int = 100,
    order: np.ndarray | None = None,
    priority: str = "projected",
) -> Placement:
    """Data-distribution-aware placement: each bin serves close to its target share of accesses.

    ``order`` may pass a precomputed :func:`hotness_order` (vertex ids hottest first).
    ``priority``: ``projected`` (default, matches targets) or ``paper`` — the design's
    ``(access / target) × (used / capacity)``, kept to compare against (see the module doc)."""
    if priority not in PRIORITIES:
        raise MomentError(f"DDAK priority must be one of {PRIORITIES}, got {priority!r}")
    if pool < 1:
        raise MomentError(f"DDAK pool must be at least 1 vertex, got {pool}")
    h, bins, order, place = _prepare(hotness, bins, order)
    tier_bins, tier_ptr, tier_end = _tier_layout(bins, h.size)
    ddak_pools_fast(
        order,
        h,
        int(h.sum()),
        tier_bins,
        tier_ptr,
        tier_end,
        _capacities(bins),
        np.array([b.target for b in bins], dtype=np.float64),
        int(pool),
        place.bin_of,
        place.used,
        place.access,
        priority == "paper",
    )
    return _checked(place)


def hash_placement(
    hotness: np.ndarray, bins: Sequence[BinSpec], seed: int = 0, order: np.ndarray | None = None
) -> Placement:
    """Baseline: DDAK's tier split, but a capacity-weighted hash of the id picks the bin in a tier."""
    h, bins, order, place = _prepare(hotness, bins, order)
    tier_bins, tier_ptr, tier_end = _tier_layout(bins, h.size)
    capacity = _capacities(bins)
    slot_member = _slot_members(tier_bins, tier_ptr, capacity)
    salt = np.uint64((int(seed) + 1) * int(_GOLDEN) % (1 << 64))
    with np.errstate(over="ignore"):  # the hash wraps around on purpose (numba: silently)
        hash_fill_fast(
            order, h, tier_bins, tier_ptr, tier_end, slot_member, capacity, salt, place.bin_of, place.used, place.access
        )
    return _checked(place)


# ---- helpers ------------------------------------------------------------------------------------


def argsort_order(h: np.ndarray, hmax: int) -> np.ndarray:
    """Stable argsort of the key ``hmax - h`` in the narrowest unsigned type that holds it."""
    dtype = np.uint16 if hmax <= 0xFFFF else np.uint32 if hmax <= 0xFFFFFFFF else np.uint64
    key = np.empty(h.size, dtype=dtype)
    np.subtract(hmax, h, out=key, casting="unsafe")
    return np.argsort(key, kind="stable").astype(np.int64, copy=False)


def _check_hotness(hotness: np.ndarray) -> np.ndarray:
    """Hotness as a 1-D array of non-negative access counts (uint64 is narrowed to int64)."""
    h = np.asarray(hotness)
    if h.ndim != 1 or not np.issubdtype(h.dtype, np.integer):
        raise MomentError(f"hotness must be a 1-D array of integer access counts, got {h.dtype} with shape {h.shape}")
    if h.size and int(h.min()) < 0:
        raise MomentError("hotness has negative access counts")
    if h.dtype == np.uint64:
        if h.size and int(h.max()) > np.iinfo(np.int64).max:
            raise MomentError("hotness counts do not fit in int64")
        h = h.view(np.int64)
    return h


def _check_bins(bins: Sequence[BinSpec], n: int) -> list[BinSpec]:
    """Bins with known tiers, non-negative capacities and targets, together holding every vertex."""
    bins = list(bins)
    if not bins:
        raise MomentError("placement needs at least one bin")
    for b in bins:
        if b.tier not in TIERS:
            raise MomentError(f"bin {b.name}: unknown tier {b.tier!r} (expected one of {', '.join(TIERS)})")
        if b.capacity < 0 or not (np.isfinite(b.target) and b.target >= 0):
            raise MomentError(f"bin {b.name}: capacity and target must be non-negative (got {b.capacity}, {b.target})")
    total = sum(b.capacity for b in bins)
    if total < n:
        raise MomentError(f"bins hold {total:,} rows but there are {n:,} vertices: {n - total:,} rows short")
    return bins


def _check_order(order: np.ndarray, n: int) -> np.ndarray:
    """A caller's order as int32 or int64 (the kernels' two compiled variants): n vertex ids in
    range (duplicates are caught after placement)."""
    o = np.asarray(order)
    if o.shape != (n,) or not np.issubdtype(o.dtype, np.integer):
        raise MomentError(f"order must be {n:,} integer vertex ids, got {o.dtype} with shape {o.shape}")
    if n and (int(o.min()) < 0 or int(o.max()) >= n):
        raise MomentError(f"order has vertex ids outside [0, {n})")
    return o if o.dtype in (np.int32, np.int64) else o.astype(np.int64)


def _prepare(
    hotness: np.ndarray, bins: Sequence[BinSpec], order: np.ndarray | None
) -> tuple[np.ndarray, list[BinSpec], np.ndarray, Placement]:
    """Validated inputs and an empty placement (every vertex unplaced: -1)."""
    h = _check_hotness(hotness)
    bins = _check_bins(bins, h.size)
    order = hotness_order(h) if order is None else _check_order(order, h.size)
    dtype = np.int16 if len(bins) <= np.iinfo(np.int16).max else np.int32
    place = Placement(
        np.full(h.size, -1, dtype=dtype), bins, np.zeros(len(bins), dtype=np.int64), np.zeros(len(bins), dtype=np.int64)
    )
    return h, bins, order, place


def _checked(place: Placement) -> Placement:
    """The placement, unless a vertex was left out (possible only with a duplicate in ``order``)."""
    if place.bin_of.size and int(place.bin_of.min()) < 0:
        raise MomentError("order is not a permutation of the vertex ids: some vertices were never placed")
    return place


def _capacities(bins: list[BinSpec]) -> np.ndarray:
    return np.array([b.capacity for b in bins], dtype=np.int64)


def _tier_layout(bins: list[BinSpec], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tiers present, fastest first: their bins (CSR: ``tier_bins[tier_ptr[t]:tier_ptr[t+1]]``,
    in bin order) and the end of each tier's span of the hotness order (the hottest vertices fill
    the GPU tier to capacity, the next the CPU tier, the rest the SSDs)."""
    groups = [[i for i, b in enumerate(bins) if b.tier == tier] for tier in TIERS]
    groups = [g for g in groups if g]
    tier_bins = np.array([i for g in groups for i in g], dtype=np.int64)
    tier_ptr = np.cumsum([0] + [len(g) for g in groups], dtype=np.int64)
    held = np.cumsum([sum(bins[i].capacity for i in g) for g in groups], dtype=np.int64)
    return tier_bins, tier_ptr, np.minimum(held, n)


def _slot_members(tier_bins: np.ndarray, tier_ptr: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """For each tier and hash slot, the member (position in ``tier_bins``) owning it: members own
    runs of slots in proportion to their capacity (a bin of zero capacity owns none)."""
    centres = (np.arange(1 << _SLOT_BITS) + 0.5) / (1 << _SLOT_BITS)
    table = np.empty((tier_ptr.size - 1, centres.size), dtype=np.int32)
    for t in range(tier_ptr.size - 1):
        lo, hi = int(tier_ptr[t]), int(tier_ptr[t + 1])
        cum = np.cumsum(capacity[tier_bins[lo:hi]]).astype(np.float64)
        table[t] = lo + np.minimum(np.searchsorted(cum / max(cum[-1], 1.0), centres, side="right"), hi - lo - 1)
    return table
