"""The storage tiers, hottest first: the one vocabulary of planner, placement and trainer.

New vertex ids are laid out in this order (GPU cache rows first, then CPU cache, then SSDs), and
every report and metrics file names tiers with these words.
"""

from __future__ import annotations

from typing import Literal

Tier = Literal["gpu", "cpu", "ssd"]
TIERS: tuple[Tier, ...] = ("gpu", "cpu", "ssd")
