"""Profile format: bundled profiles load, round-trip exactly, and bad files fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moment.errors import ProfileError, UsageError
from moment.topology.inventory import counts
from moment.topology.profile_io import (
    bundled_profiles,
    dump_profile,
    load_profile,
    machine_from_dict,
    machine_to_dict,
    resolve_profile,
    save_profile,
)


@pytest.mark.parametrize("name", sorted(bundled_profiles()))
def test_bundled_profiles_round_trip_exactly(name: str, tmp_path: Path) -> None:
    machine = resolve_profile(name)
    path = tmp_path / "again.yaml"
    save_profile(machine, path)
    again = load_profile(path)
    assert again == machine
    assert dump_profile(again) == dump_profile(machine)


def test_reference_machines_match_the_paper() -> None:
    a, b = resolve_profile("moment-machine-a"), resolve_profile("moment-machine-b")
    for m in (a, b):
        c = counts(m)
        assert (c["sockets"], c["switches"], c["gpus"], c["nvme"]) == (2, 2, 4, 8)
        assert set(m.layouts) == {"classic-a", "classic-b", "classic-c", "classic-d"}
        for layout in m.layouts.values():  # every layout places all 4 GPUs and 8 SSDs
            assert sorted(layout.values()) == sorted([f"gpu{i}" for i in range(4)] + [f"nvme{i}" for i in range(8)])
    # Machine B: switch 1 reaches the CPU only through switch 0 (Bus 16 then Bus 11).
    path = [p.id for p in b.path_to("sw1-35")]
    assert path == ["rc0-31", "sw0-33", "sw1-35"]
    # Machine A: each GPU link is Gen4 x16 = 24 GB/s per NCCL's table; bays are Gen4 x4.
    assert a.find_port("sw0-gpu0").link.bandwidth_gbps() == pytest.approx(24.0)
    assert a.find_port("cpu0-bay0").link.bandwidth_gbps() == pytest.approx(6.0)
    # classic-b/-d put all four GPUs on one switch.
    for name in ("classic-b", "classic-d"):
        gpu_ports = [p for p, d in a.layouts[name].items() if d.startswith("gpu")]
        assert {p.split("-")[0] for p in gpu_ports} == {"sw0"}


def test_nvlink_variant() -> None:
    m = resolve_profile("moment-machine-a-nvlink")
    assert counts(m)["nvlinks"] == 2
    assert m.nvlinks[0].bandwidth_gbps() == pytest.approx(12 * 20.0)


def _data() -> dict:
    return machine_to_dict(resolve_profile("moment-machine-a"))


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["sockets"][0]["ports"][0]["link"].update(width=3), "sockets.0.ports.0.link"),
        (lambda d: d["sockets"][0]["ports"][0]["link"].update(gen=9), "sockets.0.ports.0.link.gen"),
        (lambda d: d["sockets"][0].update(colour="red"), "sockets.0.colour"),
        (lambda d: d["sockets"][1].update(id="cpu0"), "duplicate socket id"),
        (lambda d: d["layouts"]["classic-a"].update({"nowhere": "gpu0"}), "unknown slot/port 'nowhere'"),
        (lambda d: d["socket_links"][0].update(between=["cpu0", "cpu7"]), "unknown socket 'cpu7'"),
        (lambda d: d.update(schema="moment.topology/99"), "schema"),
        (lambda d: d["sockets"][0]["ports"][0]["device"].update(kind="toaster"), "sockets.0.ports.0.device.kind"),
        (lambda d: d.pop("name"), "name"),
    ],
)
def test_validation_names_the_field(mutate, field: str) -> None:
    data = _data()
    mutate(data)
    with pytest.raises(ProfileError) as info:
        machine_from_dict(data, "x.yaml")
    message = str(info.value)
    assert message.startswith("x.yaml: ")
    assert field in message
    assert "\n" not in message


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("schema: moment.topology/1\nname: x\nsockets: [\n  - id: cpu0\n")
    with pytest.raises(ProfileError, match=r"bad.yaml:\d+: YAML syntax error"):
        load_profile(path)


@pytest.mark.parametrize("text", ["", "just a string\n", "- a\n- list\n"])
def test_not_a_profile(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match="p.yaml"):
        load_profile(path)


def test_unknown_profile_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="moment-machine-a"):
        resolve_profile("no-such-machine")


def test_save_is_atomic(tmp_path: Path, monkeypatch) -> None:
    """A failed write leaves the old file intact and no temporary file behind."""
    machine = resolve_profile("moment-machine-b")
    path = tmp_path / "p.yaml"
    save_profile(machine, path)
    before = path.read_text()
    monkeypatch.setattr("moment.fileio.os.replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        save_profile(resolve_profile("moment-machine-a"), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]


def test_dump_is_plain_yaml() -> None:
    text = dump_profile(resolve_profile("moment-machine-a"))
    data = yaml.safe_load(text)
    assert data["schema"] == "moment.topology/1"
    assert list(data)[0] == "schema"
