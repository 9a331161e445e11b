"""Named fault-injection points for crash-safety tests.

``MOMENT_FAULT=place:published`` makes the process ``os._exit(FAULT_EXIT)`` when it reaches the
point ``place:published``: no ``finally`` block, no buffered write, no lock release other than the
kernel's — what a ``kill -9`` at that instant leaves. Tests run a command once per point and check
that the re-run finishes and verifies (README, "Placement"). Unset, a point costs one dict lookup.
"""

from __future__ import annotations

import os

ENV = "MOMENT_FAULT"
FAULT_EXIT = 77


def point(name: str) -> None:
    """Die here if the environment names this point."""
    if os.environ.get(ENV) == name:
        os._exit(FAULT_EXIT)
