"""The bundled profiles of real machines are exactly what `moment profile --from` builds today."""

from __future__ import annotations

from pathlib import Path

import pytest

from moment.topology import profiler
from moment.topology.profile_io import bundled_profiles, dump_profile, load_profile

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_bundled_profile_matches_a_fresh_build(name: str) -> None:
    bundled = bundled_profiles()
    assert name in bundled, f"run scripts/make_capture_profiles.sh: {name} is not bundled"
    fresh, _ = profiler.build_profile(profiler.read_capture_dir(FIXTURES / name), name)
    assert dump_profile(load_profile(bundled[name])) == dump_profile(fresh), "run scripts/make_capture_profiles.sh"
