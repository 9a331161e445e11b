"""Profiles that cannot describe a real machine are refused on load, naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from moment.cli import main
from moment.errors import ProfileError
from moment.planner.network import build_network
from moment.planner.workload import load_workload
from moment.topology.profile_io import bundled_profiles, load_profile, machine_from_dict

MACHINE_B = yaml.safe_load(bundled_profiles()["moment-machine-b"].read_text())


def edited(change) -> dict:
    data = copy.deepcopy(MACHINE_B)
    change(data)
    return data


def refusal(data: dict) -> str:
    with pytest.raises(ProfileError) as caught:
        machine_from_dict(data, "p.yaml")
    return str(caught.value)


def test_two_sockets_without_a_socket_link_are_refused() -> None:
    msg = refusal(edited(lambda m: m.update(socket_links=[])))
    assert msg.startswith("p.yaml: socket_links: ") and "cpu1" in msg and "cpu0" in msg


def test_a_socket_link_from_a_socket_to_itself_is_refused() -> None:
    msg = refusal(edited(lambda m: m["socket_links"][0].update(between=["cpu0", "cpu0"])))
    assert msg == "p.yaml: socket_links[0]: joins cpu0 to itself"


def test_an_nvlink_from_a_gpu_to_itself_is_refused() -> None:
    msg = refusal(edited(lambda m: m.update(nvlinks=[{"between": ["gpu0", "gpu0"]}])))
    assert msg == "p.yaml: nvlinks[0]: joins gpu0 to itself"


def _three_sockets(m: dict) -> None:
    """cpu2 (no devices) sits between cpu0 and cpu1: there is no cpu0-cpu1 link."""
    m["sockets"].append({"id": "cpu2"})
    m["socket_links"] = [{"between": ["cpu0", "cpu2"]}, {"between": ["cpu2", "cpu1"]}]


def test_socket_paths_follow_the_profiles_links(tmp_path: Path) -> None:
    machine = machine_from_dict(edited(_three_sockets), "three.yaml")
    net = build_network(machine, load_workload(machine.workload))
    crossing = [p for alts in net.paths.values() for p in alts if any(k.startswith("upi:") for k in p)]
    assert crossing
    for path in crossing:
        assert all(k in net.edges for k in path)
        upi = [k for k in path if k.startswith("upi:")]
        assert upi in (["upi:cpu0>cpu2", "upi:cpu2>cpu1"], ["upi:cpu1>cpu2", "upi:cpu2>cpu0"])
    (tmp_path / "three.yaml").write_text(yaml.safe_dump(edited(_three_sockets)))
    assert main(["score", "--profile", str(tmp_path / "three.yaml")]) == 0


@pytest.mark.parametrize("verb", ["plan", "score", "inspect"])
def test_cli_refuses_a_profile_without_socket_links_in_one_line(tmp_path: Path, verb: str, capsys) -> None:
    path = tmp_path / "nolink.yaml"
    path.write_text(yaml.safe_dump(edited(lambda m: m.update(socket_links=[]))))
    assert main([verb, "--profile", str(path)] if verb != "inspect" else [verb, str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "nolink.yaml: socket_links:" in err and len(err.splitlines()) == 1


def test_every_bundled_profile_still_loads() -> None:
    for path in bundled_profiles().values():
        load_profile(path)
