"""Every bundled profile can be planned from the command line: as given, or with the command the
refusal suggests (profiles without SSDs get the documented default SSD model)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from moment.cli import main
from moment.planner.layout import DEFAULT_SSD
from moment.topology.profile_io import bundled_profiles


def plan_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("name", sorted(bundled_profiles()))
def test_every_bundled_profile_plans_from_the_cli(name: str, tmp_path: Path, capsys) -> None:
    rc, out, err = plan_cli(["plan", "--profile", name, "--top", "1", "--json"], capsys)
    if rc != 0:
        assert err.count("\n") == 1, err
        suggested = re.findall(r"`(moment plan [^`]+)`", err)
        assert suggested, f"{name}: the refusal suggests no command line: {err}"
        argv = shlex.split(suggested[-1])[1:]
        if "W.yaml" in argv:
            (tmp_path / "W.yaml").write_text("cpu_cache_fraction: 1.0\n")
            argv[argv.index("W.yaml")] = str(tmp_path / "W.yaml")
        rc, out, err = plan_cli([*argv, "--top", "1", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["best"]["predicted_iteration_s"] > 0


def test_ssds_in_a_profile_without_any_take_the_default_model(capsys) -> None:
    rc, out, err = plan_cli(["plan", "--profile", "supermicro-sys-4029gp-trt", "--ssds", "2", "--top", "1"], capsys)
    assert rc == 0, err
    assert DEFAULT_SSD.model in out.replace("\n", " ") or "default SSD" in out
