"""Placement policies by name: which bin (GPU cache, CPU cache, SSD) holds each vertex.

``moment place --policy NAME`` looks the name up here, and the command line's choices and help
are this registry's. A policy's ``run`` is a function ``(hotness, bins, order, opts) ->
Placement``: ``order`` is the vertices hottest first (:func:`placement.ddak.hotness_order`,
computed once by the caller), ``opts`` the :class:`placement.place.PlaceOptions`. ``reads``
names the knobs of ``opts`` it uses beyond ``pool`` and ``seed``: placed.json records
``priority`` only for a policy that reads it. placed.json records the policy's name as a plain
string, so a policy added here runs through ``moment place`` end to end. Adding a policy: a
module with its function, one line in :data:`POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moment.errors import UsageError
from placement.ddak import BinSpec, Placement, ddak, hash_placement

if TYPE_CHECKING:
    from placement.place import PlaceOptions

PolicyRun = Callable[[np.ndarray, Sequence[BinSpec], np.ndarray, "PlaceOptions"], Placement]


@dataclass(frozen=True)
class Policy:
    """A registered policy: the function, one line for ``--policy``'s help, the optional knobs it reads."""

    run: PolicyRun
    about: str
    reads: frozenset[str] = frozenset()  # of "priority": what placed.json records beside the name

    def __call__(
        self, hotness: np.ndarray, bins: Sequence[BinSpec], order: np.ndarray, opts: PlaceOptions
    ) -> Placement:
        return self.run(hotness, bins, order, opts)


def _ddak(hotness: np.ndarray, bins: Sequence[BinSpec], order: np.ndarray, opts: PlaceOptions) -> Placement:
    """The paper's data-distribution-aware knapsack: each bin serves close to its target share."""
    return ddak(hotness, bins, pool=opts.pool, order=order, priority=opts.priority)


def _hash(hotness: np.ndarray, bins: Sequence[BinSpec], order: np.ndarray, opts: PlaceOptions) -> Placement:
    """The baseline: DDAK's tier split, a hash of the id picks the bin within a tier."""
    return hash_placement(hotness, bins, seed=opts.seed, order=order)


POLICIES: dict[str, Policy] = {
    "ddak": Policy(_ddak, "hottest rows to the caches, SSD bins balanced to their targets", frozenset({"priority"})),
    "hash": Policy(_hash, "a baseline spreading rows by id"),
}


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; a usage error naming the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UsageError(f"--policy {name!r}: expected {' or '.join(POLICIES)}") from None


def policy_help() -> str:
    """``--policy``'s help text, from :data:`POLICIES`."""
    return "; ".join(f"{name}: {p.about}" for name, p in POLICIES.items())
