"""How many threads a CPU-bound pass should use: the cores this process may run on (its
affinity, which a container or ``taskset`` narrows; ``os.cpu_count`` counts the host's), at most
the pass's own cap, at least one."""

from __future__ import annotations

import os


def usable_cores(cap: int | None = None) -> int:
    """The cores this process may run on, at most ``cap`` (None: no cap), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, cap) if cap is not None else cores)
