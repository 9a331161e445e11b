"""A slow measured link gives a slow prediction (both max-flow engines agree); absurd figures are refused."""

from __future__ import annotations

import copy

import pytest
import yaml

from moment.cli import main
from moment.errors import ProfileError
from moment.planner import flow
from moment.planner.network import build_network
from moment.planner.workload import load_workload
from moment.topology.profile_io import bundled_profiles, machine_from_dict

MACHINE_B = yaml.safe_load(bundled_profiles()["moment-machine-b"].read_text())
SWITCH_UPLINK = MACHINE_B["sockets"][0]["ports"][1]  # rc0-31: the uplink of the switch holding every GPU


def with_uplink(gbps: float) -> dict:
    data = copy.deepcopy(MACHINE_B)
    data["sockets"][0]["ports"][1]["link"]["gbps"] = gbps
    return data


@pytest.mark.parametrize("gbps", [0.1, 0.5, 2.0])
def test_a_slow_uplink_is_a_slow_prediction_on_both_engines(gbps: float) -> None:
    machine = machine_from_dict(with_uplink(gbps), "slow.yaml")
    net = build_network(machine, load_workload(machine.workload))
    need = net.demand_gb * len(net.gpus)
    # Every byte of every GPU crosses the one slow uplink, the other way round for nothing.
    expected = need / gbps
    times = {engine: flow.paper(net, engine=engine).iteration_s for engine in flow.MAX_FLOW_ENGINES}
    for engine, t in times.items():
        assert t == pytest.approx(expected, rel=1e-4), engine
    assert flow.proportional(net).iteration_s == pytest.approx(expected, rel=1e-4)


def test_a_link_too_slow_for_the_old_ceiling_still_gets_a_time() -> None:
    machine = machine_from_dict(with_uplink(1e-9), "slow.yaml")
    net = build_network(machine, load_workload(machine.workload))
    t = flow.paper(net, engine="ortools").iteration_s
    assert t == pytest.approx(net.demand_gb * len(net.gpus) / 1e-9, rel=1e-4)


def test_plan_uses_the_engine_it_is_given(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls = []

    def counting(arcs, source, sink):
        calls.append(1)
        return flow.networkx_max_flow(arcs, source, sink)

    monkeypatch.setitem(flow.MAX_FLOW_ENGINES, "networkx", counting)
    assert main(["plan", "--profile", "moment-machine-b", "--engine", "networkx", "--top", "1", "--json"]) == 0
    assert calls


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        (("sockets", 1, "ports", 1, "device", "read_gbps"), 6.8e9, "sockets.1.ports.1.device.read_gbps: 6.8e+09 GB/s"),
        (("sockets", 0, "ports", 1, "link", "gbps"), 16e9, "sockets.0.ports.1.link.gbps: 1.6e+10 GB/s"),
        (("sockets", 0, "dram_gbps"), 2e11, "sockets.0.dram_gbps: 2e+11 GB/s"),
        (("socket_links", 0, "gbps"), 4e10, "socket_links.0.gbps: 4e+10 GB/s"),
    ],
)
def test_a_rate_in_bytes_per_second_is_refused_naming_the_field(where: tuple, value: float, field: str) -> None:
    data = copy.deepcopy(MACHINE_B)
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(ProfileError) as caught:
        machine_from_dict(data, "bytes.yaml")
    assert str(caught.value).startswith(f"bytes.yaml: {field}") and "did you give bytes/s?" in str(caught.value)


@pytest.mark.parametrize("gbps", [0.3, 1.0, 2.3, 3.3, 6.8, 9.4])
def test_uplink_rates_glop_misreports_still_get_a_proportional_time(gbps: float) -> None:
    """GLOP called these LPs ABNORMAL (presolve) or INFEASIBLE (warm second pass) at first."""
    machine = machine_from_dict(with_uplink(gbps), "slow.yaml")
    net = build_network(machine, load_workload(machine.workload))
    t = flow.proportional(net).iteration_s
    if gbps < 5:  # the uplink is the bottleneck: every byte crosses it
        assert t == pytest.approx(net.demand_gb * len(net.gpus) / gbps, rel=1e-4)
    else:
        assert t == pytest.approx(flow.paper(net).iteration_s, rel=1e-4)
