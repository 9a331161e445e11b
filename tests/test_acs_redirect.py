"""ACS request redirect: read from lspci -vvv, and the planner routes peer reads through the root complex."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moment.planner import flow
from moment.planner.network import build_network
from moment.topology.model import Machine
from moment.topology.profiler import build_profile, read_capture_dir
from planner_fixtures import SSD_ONLY, one_switch

CAPTURE = Path(__file__).parent / "fixtures" / "supermicro-sys-4029gp-trt"


def _acs_ports(machine: Machine) -> dict[str, bool]:
    return {p.id: p.acs_redirect for p, _ in machine.iter_ports() if p.acs_redirect is not None}


def test_real_capture_has_acs_off() -> None:
    """The capture prints ACSCtl on its switch downstream ports, all with ReqRedir- (20 lines, 9 ports)."""
    machine, _ = build_profile(read_capture_dir(CAPTURE), "sm")
    ports = _acs_ports(machine)
    assert len(ports) == 9 and not any(ports.values())


def test_redirect_read_from_capture(tmp_path: Path) -> None:
    """The same capture with ACS turned on (as Linux does when an IOMMU translates): every switch port redirects."""
    work = tmp_path / "caps"
    shutil.copytree(CAPTURE, work)
    verbose = work / "lspci-vvnn.txt"
    lines = verbose.read_text().splitlines(keepends=True)
    controls = [i for i, line in enumerate(lines) if line.strip().startswith("ACSCtl:")]
    assert len(controls) == 20
    for i in controls:
        lines[i] = lines[i].replace("ReqRedir-", "ReqRedir+")
    verbose.write_text("".join(lines))
    machine, _ = build_profile(read_capture_dir(work), "sm")
    ports = _acs_ports(machine)
    assert len(ports) == 9 and all(ports.values())
    assert all(p.kind == "downstream" for p, _ in machine.iter_ports() if p.id in ports)


def _narrow_uplink(acs: bool) -> Machine:
    """one_switch with a Gen4 x4 uplink (6 GB/s) so that the route through it shows in the time."""
    raw = one_switch(read=50.0).model_dump(by_alias=True, exclude_none=True)
    root = raw["sockets"][0]["ports"][0]
    root["link"]["width"] = 4
    for port in root["switch"]["ports"]:
        port["acs_redirect"] = acs
    return Machine.model_validate(raw)


def test_redirect_sends_peer_reads_through_the_uplink() -> None:
    """2 GPUs × 1 GB from 2 SSDs behind 6 GB/s x4 links. Peer to peer under the switch: T = 2 GB / 12 GB/s.
    Redirected: all 2 GB go up and down the 6 GB/s uplink: T = 2 / 6 s."""
    free = build_network(_narrow_uplink(acs=False), SSD_ONLY)
    redirected = build_network(_narrow_uplink(acs=True), SSD_ONLY)
    assert flow.proportional(free).iteration_s == pytest.approx(2 / 12, rel=1e-6)
    prop = flow.proportional(redirected)
    assert prop.iteration_s == pytest.approx(2 / 6, rel=1e-6)
    assert {"up:rp0", "down:rp0"} <= set(prop.bottleneck)
    assert any("ACS" in n for n in redirected.notes) and not any("ACS" in n for n in free.notes)
    for engine in flow.MAX_FLOW_ENGINES:  # the paper's edge model has no routes: ACS does not change it
        assert flow.paper(redirected, engine).iteration_s == pytest.approx(2 / 12, rel=1e-5)
