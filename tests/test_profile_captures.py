"""`moment profile --from` on the real captures: counts and tree facts checked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from moment.topology import profiler
from moment.topology.inventory import counts
from moment.topology.model import Machine
from moment.topology.profile_io import load_profile, save_profile

FIXTURES = Path(__file__).parent / "fixtures"


def profile(name: str) -> tuple[Machine, list[str]]:
    return profiler.build_profile(profiler.read_capture_dir(FIXTURES / name), name)


def switch_of(machine: Machine, device_id: str) -> str | None:
    """The switch directly above a device, or None when it sits on a root port."""
    for port, _ in machine.iter_ports():
        if port.switch is not None:
            for child in port.switch.ports:
                if child.device is not None and child.device.id == device_id:
                    return port.switch.id
    return None


def socket_of(machine: Machine, device_id: str) -> str:
    return next(s.id for p, s in machine.iter_ports() if p.device is not None and p.device.id == device_id)


EXPECTED = {
    # sockets, switches, slots, gpus, nvme, nics, nvlinks
    "supermicro-sys-4029gp-trt": (2, 5, 11, 8, 0, 2, 0),
    "asus-esc8000a-e12": (2, 8, 33, 4, 17, 3, 0),
    "switchtec-8x3090": (2, 2, 9, 8, 0, 1, 0),
    "dgx-like-8xa100": (2, 4, 0, 8, 0, 17, 28),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_counts(name: str, tmp_path: Path) -> None:
    machine, _ = profile(name)
    c = counts(machine)
    keys = ("sockets", "switches", "slots", "gpus", "nvme", "nics", "nvlinks")
    assert tuple(c[k] for k in keys) == EXPECTED[name]
    # The written profile loads back to the same model.
    save_profile(machine, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == machine


def test_supermicro_tree() -> None:
    """4 PEX 8747 switches, two GPUs each; dmidecode slot names land on the ports feeding GPUs."""
    m, warnings = profile("supermicro-sys-4029gp-trt")
    gpus = {d.bdf: d for d in m.devices() if d.kind == "gpu"}
    assert sorted(gpus) == [f"0000:{b}:00.0" for b in ("1a", "1b", "3d", "3e", "88", "89", "b1", "b2")]
    # Each GPU's audio/USB/UCSI functions belong to the GPU, not to separate devices.
    assert len(gpus["0000:1a:00.0"].functions) == 4
    by_switch: dict[str, list[str]] = {}
    for bdf, dev in gpus.items():
        by_switch.setdefault(switch_of(m, dev.id), []).append(bdf[5:7])
    assert sorted(by_switch.values()) == [["1a", "1b"], ["3d", "3e"], ["88", "89"], ["b1", "b2"]]
    plx = [s for s in m.switches() if s.device_id == "8747"]
    assert sorted(s.bdf for s in plx) == ["0000:18:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"]
    # GPUs 1a-3e on socket 0, 88-b2 on socket 1 (NUMA node lines of the capture).
    assert {socket_of(m, gpus[f"0000:{b}:00.0"].id) for b in ("1a", "1b", "3d", "3e")} == {"cpu0"}
    assert {socket_of(m, gpus[f"0000:{b}:00.0"].id) for b in ("88", "89", "b1", "b2")} == {"cpu1"}
    # dmidecode "CPU1 Slot10" names bus 1a:00.0, the GPU behind the PLX port 19:08.0.
    port = m.find_port("0000:19:08.0")
    assert port.slot is not None and port.slot.name == "CPU1 Slot10 PCI-E 3.0 X16"
    assert port.device is not None and port.device.bdf == "0000:1a:00.0"
    # Every switch uplink and GPU link is Gen3 x16 = 12 GB/s (idle Gen1 links count at capability).
    for p in ("0000:17:00.0", "0000:3a:00.0", "0000:85:00.0", "0000:ae:00.0", "0000:3c:08.0", "0000:b0:10.0"):
        assert m.find_port(p).link.bandwidth_gbps() == pytest.approx(12.0), p
    idle = m.find_port("0000:3c:08.0").link  # 3d:00.0 trained at 2.5 GT/s while idle
    assert (idle.gen, idle.max_gen, idle.width) == (1, 3, 16)
    # Free slots: CPU2 Slot5 (its root port d7:02.0 is hidden by the BIOS) and PCH Slot7.
    free = sorted(s.name for p, s in m.slots() if p is not None and p.device is None and p.switch is None)
    assert free == ["CPU2 Slot5 PCI-E 3.0 X8", "PCH Slot7 PCI-E 3.0 X4"]
    # NICs: the 82599ES (2 functions) and the X722 behind the Lewisburg switch (2 functions).
    nics = sorted((d.bdf, len(d.functions)) for d in m.devices() if d.kind == "nic")
    assert nics == [("0000:5e:00.0", 2), ("0000:61:00.0", 2)]
    assert m.sockets[0].model.startswith("Intel(R) Xeon(R) Silver 4210") and m.sockets[0].cores == 10
    assert m.socket_links[0].family == "skylake"
    assert not any("no dmidecode" in w for w in warnings)


def test_asus_tree_from_lspci_tv() -> None:
    """HighPoint carrier cards: a switch, and under it three switches holding the M.2 drives."""
    m, warnings = profile("asus-esc8000a-e12")
    assert any("sockets inferred from root bus numbers" in w for w in warnings)
    card = m.find_port("0000:60:01.1")
    assert card.switch is not None and card.switch.bdf == "0000:61:00.0"
    inner = [p.switch for p in card.switch.ports if p.switch is not None]
    assert sorted(s.bdf for s in inner) == ["0000:63:00.0", "0000:69:00.0", "0000:6f:00.0"]
    drives = [p.device.bdf for s in inner for p in s.ports if p.device is not None and p.device.kind == "nvme"]
    assert len(drives) == 8
    # GPUs on root ports directly, two per socket; the audio function is part of the GPU.
    gpus = [d for d in m.devices() if d.kind == "gpu"]
    assert sorted(d.bdf for d in gpus) == ["0000:01:00.0", "0000:41:00.0", "0000:c1:00.0", "0000:e1:00.0"]
    assert all(switch_of(m, d.id) is None for d in gpus)
    assert [socket_of(m, d.id) for d in sorted(gpus, key=lambda d: d.bdf)] == ["cpu0", "cpu0", "cpu1", "cpu1"]
    # The BMC's ASPEED VGA is not a GPU; ConnectX-7 ports are one NIC each card.
    assert any("ASPEED" in d.model and d.kind == "other" for d in m.devices())
    cx7 = [d for d in m.devices() if "ConnectX-7" in d.model]
    assert [len(d.functions) for d in cx7] == [2, 2]
    assert m.socket_links[0].kind == "infinity-fabric"


def test_switchtec_tree_from_nccl_xml() -> None:
    m, _ = profile("switchtec-8x3090")
    switches = {s.bdf: s for s in m.switches()}
    assert set(switches) == {"0000:0c:00.0", "0000:98:00.0"}
    under = {bdf: sorted(p.device.kind for p in s.ports if p.device) for bdf, s in switches.items()}
    assert under == {"0000:0c:00.0": ["gpu"] * 4, "0000:98:00.0": ["gpu"] * 4 + ["nic"]}
    assert socket_of(m, "nic0") == "cpu1"
    for port, _ in m.iter_ports():
        assert (port.link.gen, port.link.width) == (4, 16)
    assert m.socket_links[0].family == "icelake"


def test_dgx_from_nvidia_smi_alone() -> None:
    m, warnings = profile("dgx-like-8xa100")
    assert any("reconstructed from nvidia-smi" in w for w in warnings)
    assert all(nv.links == 12 and nv.via == "nvswitch" for nv in m.nvlinks)
    # One switch per PXB group: GPU0/1 with mlx5_2..5, and so on; mlx5_bond_0 alone.
    for sw, gpus in zip(sorted(m.switches(), key=lambda s: s.id), [(0, 1), (2, 3), (4, 5), (6, 7)]):
        kinds = sorted(p.device.id for p in sw.ports if p.device and p.device.kind == "gpu")
        assert kinds == [f"gpu{i}" for i in gpus]
        assert sum(p.device.kind == "nic" for p in sw.ports if p.device) == 4
    assert [socket_of(m, f"gpu{i}") for i in range(8)] == ["cpu0"] * 4 + ["cpu1"] * 4


def test_nvidia_smi_adds_nvlink_to_a_pci_tree(tmp_path: Path) -> None:
    """With lspci and nvidia-smi together, NV# cells map to GPUs in PCI address order."""
    src = FIXTURES / "supermicro-sys-4029gp-trt"
    for f in ("lspci-vvnn.txt", "dmidecode.txt"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    names = [f"GPU{i}" for i in range(8)]
    rows = ["\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity"]
    for i, a in enumerate(names):
        cells = ["X" if a == b else ("NV2" if {i, j} == {0, 1} else "SYS") for j, b in enumerate(names)]
        rows.append("\t".join([a, *cells, "0-9" if i < 4 else "10-19", "0" if i < 4 else "1"]))
    (tmp_path / "nvidia-smi-topo-m.txt").write_text("\n".join(rows) + "\n")
    m, _ = profiler.build_profile(profiler.read_capture_dir(tmp_path), "sm")
    assert [(nv.between, nv.links) for nv in m.nvlinks] == [(("gpu0", "gpu1"), 2)]
    assert {d.id: d.bdf for d in m.devices() if d.id in ("gpu0", "gpu1")} == {
        "gpu0": "0000:1a:00.0",
        "gpu1": "0000:1b:00.0",
    }


def test_unreadable_source_is_skipped_with_a_warning(tmp_path: Path) -> None:
    src = FIXTURES / "supermicro-sys-4029gp-trt"
    (tmp_path / "lspci-vvnn.txt").write_bytes((src / "lspci-vvnn.txt").read_bytes())
    (tmp_path / "dmidecode.txt").write_bytes(bytes(range(256)) * 20)
    m, warnings = profiler.build_profile(profiler.read_capture_dir(tmp_path), "x")
    assert any(w.startswith("skipped dmidecode.txt") for w in warnings)
    assert counts(m)["gpus"] == 8
