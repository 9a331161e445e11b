"""read_sysfs on this machine's /sys and on a fake sysfs tree built in tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moment.errors import SourceError
from moment.topology.pci import DOWNSTREAM, ENDPOINT, ROOT_PORT, UPSTREAM, PciFunction
from moment.topology.sources.sysfs import read_sysfs

LIVE = Path("/sys/bus/pci/devices")


@pytest.mark.skipif(not LIVE.is_dir(), reason="no /sys/bus/pci on this machine")
def test_live_sysfs():
    fns = read_sysfs()
    assert len(fns) >= 1
    for fn in fns:
        assert (LIVE / fn.bdf).exists()
        assert fn.parent is None or (LIVE / fn.parent).exists()
        assert fn.name


def test_missing_root(tmp_path):
    with pytest.raises(SourceError, match="no such directory"):
        read_sysfs(tmp_path / "nope")


# --- a fake sysfs -------------------------------------------------------------------------------


def _express_config(port_type: int) -> bytes:
    """256 bytes of config space with one PCI Express capability at 0x40 (as root reads it)."""
    config = bytearray(256)
    config[0x06] = 0x10  # capability list present
    config[0x34] = 0x40
    config[0x40:0x44] = bytes([0x10, 0x00, 0x02 | port_type << 4, 0x00])
    return bytes(config)


def _device(sys: Path, path: str, files: dict[str, str | bytes], driver: str | None = None) -> None:
    """Create /sys/devices/<path> with ``files`` and its /sys/bus/pci/devices symlink."""
    real = sys / "devices" / path
    real.mkdir(parents=True)
    for name, content in files.items():
        (real / name).write_bytes(content if isinstance(content, bytes) else f"{content}\n".encode())
    if driver:
        os.symlink(f"../../../../bus/pci/drivers/{driver}", real / "driver")
    bdf = real.name
    os.symlink(f"../../../devices/{path}", sys / "bus" / "pci" / "devices" / bdf)


def _link(cap: str, cap_w: str, sta: str, sta_w: str) -> dict[str, str]:
    return {"max_link_speed": cap, "max_link_width": cap_w, "current_link_speed": sta, "current_link_width": sta_w}


@pytest.fixture
def fake_sys(tmp_path: Path) -> Path:
    """Root port 00:01.0 → switch (up 01:00.0, down 02:00.0/02:01.0/02:02.0) → GPU 03:00.0, NVMe 04:00.0."""
    sys = tmp_path / "sys"
    (sys / "bus" / "pci" / "devices").mkdir(parents=True)
    bridge = {"class": "0x060400", "vendor": "0x1000", "numa_node": "0"}
    rp = "pci0000:00/0000:00:01.0"
    up = f"{rp}/0000:01:00.0"
    _device(sys, "pci0000:00/0000:00:00.0", {"class": "0x060000", "vendor": "0x8086", "device": "0x09a2"})
    _device(
        sys, rp,
        {**bridge, "vendor": "0x8086", "device": "0x347a", "secondary_bus_number": "1",
         "subordinate_bus_number": "4", **_link("16.0 GT/s PCIe", "16", "16.0 GT/s PCIe", "16")},
        driver="pcieport",
    )  # fmt: skip
    _device(sys, up, {**bridge, "device": "0xc010", **_link("16.0 GT/s PCIe", "16", "16.0 GT/s PCIe", "16")})
    switch = {**bridge, "device": "0xc010"}
    _device(sys, f"{up}/0000:02:00.0", {**switch, **_link("16.0 GT/s PCIe", "16", "16.0 GT/s PCIe", "16")})
    _device(sys, f"{up}/0000:02:01.0", {**switch, **_link("16.0 GT/s PCIe", "4", "8.0 GT/s PCIe", "4")})
    _device(sys, f"{up}/0000:02:02.0", {**switch, **_link("16.0 GT/s PCIe", "8", "Unknown", "255")})
    _device(
        sys, f"{up}/0000:02:00.0/0000:03:00.0",
        {"class": "0x030200", "vendor": "0x10de", "device": "0x2330", "numa_node": "0",
         "config": bytes(64), **_link("32.0 GT/s PCIe", "16", "2.5 GT/s PCIe", "16")},
        driver="nvidia",
    )  # fmt: skip
    _device(
        sys, f"{up}/0000:02:01.0/0000:04:00.0",
        {"class": "0x010802", "vendor": "0x144d", "device": "0xa80a", "numa_node": "-1",
         "config": _express_config(0x0), **_link("16.0 GT/s PCIe", "4", "Unknown", "0")},
        driver="nvme",
    )  # fmt: skip
    other_domain = {"class": "0x030200", "vendor": "0x10de", "device": "0x20b0", "numa_node": "1"}
    _device(sys, "pci0001:00/0001:00:00.0", other_domain)
    (sys / "bus" / "pci" / "devices" / "README").write_text("not a device\n")
    for slot, address in (("1", "0000:00:01"), ("7", "0000:04:00"), ("9", "0000:0a:00"), ("bad", "nonsense")):
        (sys / "bus" / "pci" / "slots" / slot).mkdir(parents=True)
        (sys / "bus" / "pci" / "slots" / slot / "address").write_text(f"{address}\n")
    return sys


@pytest.fixture
def fns(fake_sys: Path) -> dict[str, PciFunction]:
    return {f.bdf: f for f in read_sysfs(fake_sys / "bus" / "pci" / "devices")}


def test_fake_tree_functions(fns):
    assert sorted(fns) == [
        "0000:00:00.0", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:02:01.0",
        "0000:02:02.0", "0000:03:00.0", "0000:04:00.0", "0001:00:00.0",
    ]  # fmt: skip


def test_fake_tree_parents(fns):
    parents = {b: f.parent for b, f in fns.items()}
    assert parents == {
        "0000:00:00.0": None,
        "0000:00:01.0": None,
        "0000:01:00.0": "0000:00:01.0",
        "0000:02:00.0": "0000:01:00.0",
        "0000:02:01.0": "0000:01:00.0",
        "0000:02:02.0": "0000:01:00.0",
        "0000:03:00.0": "0000:02:00.0",
        "0000:04:00.0": "0000:02:01.0",
        "0001:00:00.0": None,
    }


def test_fake_tree_ids_and_classes(fns):
    gpu, nvme = fns["0000:03:00.0"], fns["0000:04:00.0"]
    assert (gpu.class_code, gpu.vendor_id, gpu.device_id) == ("0302", "10de", "2330")
    assert (nvme.class_code, nvme.vendor_id, nvme.device_id) == ("0108", "144d", "a80a")
    assert fns["0000:00:00.0"].class_code == "0600"
    assert all(fns[b].class_code == "0604" for b in ("0000:00:01.0", "0000:01:00.0", "0000:02:00.0"))
    assert gpu.name == "vendor 10de device 2330"  # no pyudev, or a tree outside /sys that it cannot see


def test_fake_tree_links(fns):
    gpu, nvme = fns["0000:03:00.0"], fns["0000:04:00.0"]
    assert (gpu.cap_gen, gpu.cap_width, gpu.sta_gen, gpu.sta_width) == (5, 16, 1, 16)
    assert (nvme.cap_gen, nvme.cap_width, nvme.sta_gen, nvme.sta_width) == (4, 4, None, None)
    down = fns["0000:02:01.0"]
    assert (down.cap_gen, down.cap_width, down.sta_gen, down.sta_width) == (4, 4, 3, 4)
    empty = fns["0000:02:02.0"]
    assert (empty.sta_gen, empty.sta_width) == (None, None)
    host = fns["0000:00:00.0"]
    assert (host.cap_gen, host.cap_width, host.numa_node, host.driver) == (None, None, None, None)


def test_fake_tree_numa_and_driver(fns):
    assert fns["0000:03:00.0"].numa_node == 0 and fns["0000:03:00.0"].driver == "nvidia"
    assert fns["0000:04:00.0"].numa_node is None and fns["0000:04:00.0"].driver == "nvme"
    assert fns["0000:00:01.0"].driver == "pcieport"
    assert fns["0001:00:00.0"].numa_node == 1


def test_fake_tree_bus_numbers(fns):
    root = fns["0000:00:01.0"]
    assert (root.secondary_bus, root.subordinate_bus) == (1, 4)  # from the files
    assert (fns["0000:01:00.0"].secondary_bus, fns["0000:01:00.0"].subordinate_bus) == (2, None)  # from children
    assert fns["0000:02:00.0"].secondary_bus == 3 and fns["0000:02:01.0"].secondary_bus == 4
    assert fns["0000:02:02.0"].secondary_bus is None  # no file, no child
    assert fns["0000:03:00.0"].secondary_bus is None


def test_fake_tree_port_types(fns):
    types = {b: f.port_type for b, f in fns.items()}
    assert types == {
        "0000:00:00.0": None,  # a host bridge is not a port
        "0000:00:01.0": ROOT_PORT,
        "0000:01:00.0": UPSTREAM,
        "0000:02:00.0": DOWNSTREAM,
        "0000:02:01.0": DOWNSTREAM,
        "0000:02:02.0": DOWNSTREAM,
        "0000:03:00.0": None,  # config space cut at 64 bytes (not root): unknown
        "0000:04:00.0": ENDPOINT,  # from the PCI Express capability in config
        "0001:00:00.0": None,
    }


def test_semi_transparent_bridges_are_bridges_too(fake_sys):
    """Class 0609 (semi-transparent PCI-to-PCI bridge) gets port types from the shape like 0604."""
    up = fake_sys / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0"
    for port in (up.parent, up, up / "0000:02:00.0"):
        (port / "class").write_text("0x060940\n")
    fns = {f.bdf: f for f in read_sysfs(fake_sys / "bus" / "pci" / "devices")}
    assert all(fns[b].is_bridge for b in ("0000:00:01.0", "0000:01:00.0", "0000:02:00.0"))
    assert fns["0000:00:01.0"].port_type == ROOT_PORT
    assert fns["0000:01:00.0"].port_type == UPSTREAM
    assert fns["0000:02:00.0"].port_type == DOWNSTREAM


def test_fake_tree_slots(fns):
    assert fns["0000:00:01.0"].physical_slot == "1"  # ACPI style: the address is the port's own
    assert fns["0000:02:01.0"].physical_slot == "7"  # pciehp style: the device in the slot
    assert [b for b, f in fns.items() if f.physical_slot] == ["0000:00:01.0", "0000:02:01.0"]


def test_config_wins_over_tree_shape(fake_sys):
    """A switch cascaded below a downstream port: config says what each port is."""
    rp = fake_sys / "devices" / "pci0000:00" / "0000:00:01.0"
    (rp / "config").write_bytes(_express_config(0x4))
    (rp / "0000:01:00.0" / "config").write_bytes(_express_config(0x5))
    (rp / "0000:01:00.0" / "0000:02:00.0" / "config").write_bytes(_express_config(0x6))
    fns = {f.bdf: f for f in read_sysfs(fake_sys / "bus" / "pci" / "devices")}
    assert fns["0000:00:01.0"].port_type == ROOT_PORT
    assert fns["0000:01:00.0"].port_type == UPSTREAM
    assert fns["0000:02:00.0"].port_type == DOWNSTREAM


def test_looping_capability_list_is_harmless(fake_sys):
    config = bytearray(256)
    config[0x06], config[0x34] = 0x10, 0x40
    config[0x40:0x42] = bytes([0x05, 0x40])  # MSI capability pointing at itself
    gpu = fake_sys / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0" / "0000:02:00.0" / "0000:03:00.0"
    (gpu / "config").write_bytes(bytes(config))
    fns = {f.bdf: f for f in read_sysfs(fake_sys / "bus" / "pci" / "devices")}
    assert fns["0000:03:00.0"].port_type is None


def test_unreadable_and_garbage_files(fake_sys):
    nvme = next((fake_sys / "devices").rglob("0000:04:00.0"))
    (nvme / "class").write_text("garbage\n")
    (nvme / "numa_node").write_text("\n")
    (nvme / "max_link_width").unlink()
    (nvme / "device").unlink()
    (nvme / "device").mkdir()  # reading a directory fails with OSError
    fns = {f.bdf: f for f in read_sysfs(fake_sys / "bus" / "pci" / "devices")}
    f = fns["0000:04:00.0"]
    assert (f.class_code, f.numa_node, f.cap_width, f.device_id, f.vendor_id) == (None, None, None, None, "144d")
    assert f.parent == "0000:02:01.0"


def test_names_from_udev_database(fake_sys, monkeypatch):
    """With pyudev, names come from the hwdb; a device pyudev cannot read keeps the generic name."""
    from types import SimpleNamespace

    from moment.topology.sources import sysfs

    def from_sys_path(context, path):
        if path.endswith("0000:03:00.0"):
            names = {"ID_VENDOR_FROM_DATABASE": "NVIDIA Corporation", "ID_MODEL_FROM_DATABASE": "GH100 [H200 SXM]"}
            return SimpleNamespace(properties=names)
        raise OSError("no such device")

    stub = SimpleNamespace(Context=lambda: object(), Devices=SimpleNamespace(from_sys_path=from_sys_path))
    monkeypatch.setattr(sysfs, "pyudev", stub)
    fns = {f.bdf: f for f in read_sysfs(fake_sys / "bus" / "pci" / "devices")}
    assert fns["0000:03:00.0"].name == "NVIDIA Corporation GH100 [H200 SXM]"
    assert fns["0000:04:00.0"].name == "vendor 144d device a80a"


def test_root_that_is_a_file(tmp_path):
    not_a_dir = tmp_path / "devices"
    not_a_dir.write_text("")
    with pytest.raises(SourceError):
        read_sysfs(not_a_dir)
