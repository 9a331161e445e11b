"""Placement policies by name: which bin (GPU cache, CPU cache, SSD) holds each vertex.

``moment place --policy NAME`` looks the name up here, and the command line's choices are this
registry's keys. A policy is a function ``(hotness, bins, order, opts) -> Placement``: ``order``
is the vertices hottest first (:func:`placement.ddak.hotness_order`, computed once by the
caller), ``opts`` the :class:`placement.place.PlaceOptions` (a policy reads the knobs it has:
``pool``, ``priority``, ``seed``). Adding a policy: a module with its function, one line in
:data:`POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from moment.errors import UsageError
from placement.ddak import BinSpec, Placement, ddak, hash_placement

if TYPE_CHECKING:
    from placement.place import PlaceOptions

Policy = Callable[[np.ndarray, Sequence[BinSpec], np.ndarray, "PlaceOptions"], Placement]


def _ddak(hotness: np.ndarray, bins: Sequence[BinSpec], order: np.ndarray, opts: PlaceOptions) -> Placement:
    """The paper's data-distribution-aware knapsack: each bin serves close to its target share."""
    return ddak(hotness, bins, pool=opts.pool, order=order, priority=opts.priority)


def _hash(hotness: np.ndarray, bins: Sequence[BinSpec], order: np.ndarray, opts: PlaceOptions) -> Placement:
    """The baseline: DDAK's tier split, a hash of the id picks the bin within a tier."""
    return hash_placement(hotness, bins, seed=opts.seed, order=order)


POLICIES: dict[str, Policy] = {"ddak": _ddak, "hash": _hash}


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; a usage error naming the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UsageError(f"--policy {name!r}: expected {' or '.join(POLICIES)}") from None
