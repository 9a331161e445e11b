"""parse_lspci_verbose on a real Supermicro SYS-4029GP-TRT capture and on messy variants of it."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from moment.errors import SourceError
from moment.topology.pci import DOWNSTREAM, ENDPOINT, PCI_BRIDGE, RC_INTEGRATED, ROOT_PORT, UPSTREAM, PciFunction
from moment.topology.sources.lspci_verbose import CLASS_CODES, parse_lspci_verbose

FIXTURES = Path(__file__).parent / "fixtures"
SUPERMICRO = FIXTURES / "supermicro-sys-4029gp-trt"
PLX_UPSTREAM = ["0000:18:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"]
# GPU -> the PLX downstream port above it (read off the Bus: lines of the capture)
GPU_PORTS = {
    "0000:1a:00.0": "0000:19:08.0",
    "0000:1b:00.0": "0000:19:10.0",
    "0000:3d:00.0": "0000:3c:08.0",
    "0000:3e:00.0": "0000:3c:10.0",
    "0000:88:00.0": "0000:87:08.0",
    "0000:89:00.0": "0000:87:10.0",
    "0000:b1:00.0": "0000:b0:08.0",
    "0000:b2:00.0": "0000:b0:10.0",
}


@pytest.fixture(scope="module")
def text() -> str:
    return (SUPERMICRO / "lspci-vvnn.txt").read_text()


@pytest.fixture(scope="module")
def fns(text: str) -> dict[str, PciFunction]:
    return {f.bdf: f for f in parse_lspci_verbose(text, "lspci-vvnn.txt")}


def _children(fns: dict[str, PciFunction], bdf: str) -> list[PciFunction]:
    return [f for f in fns.values() if f.parent == bdf]


# --- the real capture ---------------------------------------------------------------------------


def test_counts(fns):
    assert len(fns) == 262
    assert sum(f.class_code == "0604" for f in fns.values()) == 25
    assert sum(f.numa_node is not None for f in fns.values()) == 262


def test_plx_switches(fns):
    plx_up = sorted(b for b, f in fns.items() if f.port_type == UPSTREAM and f.vendor_id == "10b5")
    assert plx_up == PLX_UPSTREAM
    for bdf in PLX_UPSTREAM:
        up = fns[bdf]
        assert up.device_id == "8747"
        assert up.name == "PLX Technology, Inc. PEX 8747 48-Lane, 5-Port PCI Express Gen 3 (8.0 GT/s) Switch"
        assert fns[up.parent].port_type == ROOT_PORT
        downs = _children(fns, bdf)
        assert len(downs) == 2 and all(d.port_type == DOWNSTREAM for d in downs)
    # the fifth upstream port is Intel's 37c0 in front of the X722 NIC, not a PLX switch
    assert sorted(b for b, f in fns.items() if f.port_type == UPSTREAM) == sorted([*PLX_UPSTREAM, "0000:5f:00.0"])


def test_gpu_chain(fns):
    gpu = fns["0000:1a:00.0"]
    assert (gpu.class_code, gpu.vendor_id, gpu.device_id) == ("0300", "10de", "1e89")
    assert gpu.name == "NVIDIA Corporation TU104 [GeForce RTX 2060]"
    assert gpu.port_type == ENDPOINT  # "Legacy Endpoint"
    assert gpu.driver == "nvidia"
    assert (gpu.cap_gen, gpu.cap_width, gpu.sta_gen, gpu.sta_width) == (3, 16, 3, 16)
    assert gpu.parent == "0000:19:08.0"
    down = fns["0000:19:08.0"]
    assert down.port_type == DOWNSTREAM and down.parent == "0000:18:00.0"
    assert (down.secondary_bus, down.subordinate_bus) == (0x1A, 0x1A)
    up = fns["0000:18:00.0"]
    assert up.parent == "0000:17:00.0"
    assert (up.secondary_bus, up.subordinate_bus) == (0x19, 0x1B)
    root = fns["0000:17:00.0"]
    assert root.port_type == ROOT_PORT and root.parent is None
    assert root.numa_node == 0 and root.physical_slot == "1" and root.driver == "pcieport"
    assert (root.secondary_bus, root.subordinate_bus) == (0x18, 0x1B)
    assert (root.cap_gen, root.cap_width, root.sta_gen, root.sta_width) == (3, 16, 3, 16)


def test_all_gpus(fns):
    nvidia_vga = sorted(b for b, f in fns.items() if f.class_code == "0300" and f.vendor_id == "10de")
    assert nvidia_vga == sorted(GPU_PORTS)
    for gpu, port in GPU_PORTS.items():
        assert fns[gpu].parent == port
        assert fns[port].port_type == DOWNSTREAM
        assert fns[gpu].cap_width == 16 and fns[gpu].sta_width == 16
    # idle GeForce cards drop their link to 2.5 GT/s ("downgraded")
    assert (fns["0000:3d:00.0"].cap_gen, fns["0000:3d:00.0"].sta_gen) == (3, 1)
    assert fns["0000:b2:00.0"].sta_gen == 1
    assert {f.device_id for f in fns.values() if f.class_code == "0300" and f.vendor_id == "10de"} == {"1e89", "1f02"}


def test_aspeed_bridge_and_bmc_vga(fns):
    bridge = fns["0000:02:00.0"]
    assert bridge.port_type == PCI_BRIDGE
    assert bridge.parent == "0000:00:1c.5" and fns["0000:00:1c.5"].port_type == ROOT_PORT
    vga = fns["0000:03:00.0"]
    assert (vga.class_code, vga.vendor_id, vga.parent, vga.driver) == ("0300", "1a03", "0000:02:00.0", "ast")
    assert vga.port_type is None  # no Express capability behind a PCI bridge


def test_numa_nodes_split_at_bus_80(fns):
    for bdf, f in fns.items():
        assert f.numa_node == (0 if int(bdf[5:7], 16) < 0x80 else 1), bdf
    assert fns["0000:d7:00.0"].numa_node == 1


def test_link_down_and_unknown(fns):
    host = fns["0000:00:00.0"]  # "Speed unknown (downgraded), Width x0 (downgraded)"
    assert host.class_code == "0600" and host.port_type == ROOT_PORT
    assert (host.cap_gen, host.cap_width, host.sta_gen, host.sta_width) == (3, 4, None, None)
    empty = fns["0000:d7:00.0"]  # empty slot: "Speed 2.5GT/s (downgraded), Width x0"
    assert empty.physical_slot == "7"
    assert (empty.cap_gen, empty.cap_width, empty.sta_gen, empty.sta_width) == (3, 4, None, None)
    nic = fns["0000:5e:00.0"]  # 82599ES: a Gen2 x8 card on a Gen3 root port
    assert (nic.cap_gen, nic.sta_gen, nic.sta_width, nic.parent) == (2, 2, 8, "0000:5d:00.0")


def test_root_ports_and_slots(fns):
    roots = sorted(b for b, f in fns.items() if f.port_type == ROOT_PORT and f.class_code == "0604")
    assert len(roots) == 10 and all(fns[b].parent is None for b in roots)
    slots = {f.physical_slot: b for b, f in fns.items() if f.physical_slot}
    assert slots == {
        "1": "0000:17:00.0", "2": "0000:3a:00.0", "3": "0000:5d:00.0", "4": "0000:5d:02.0",
        "5": "0000:85:00.0", "6": "0000:ae:00.0", "7": "0000:d7:00.0", "8": "0000:d7:01.0",
    }  # fmt: skip
    assert fns["0000:00:04.0"].port_type == RC_INTEGRATED


def test_parent_is_bridge_on_the_bus_above(fns):
    for f in fns.values():
        if f.parent is not None:
            parent = fns[f.parent]
            assert parent.secondary_bus == int(f.bdf[5:7], 16)
            assert parent.class_code == "0604"


# --- format variants ----------------------------------------------------------------------------


def _strip_ids(text: str) -> str:
    """The same capture as plain ``lspci -vvv`` would print it (no [cccc], no [vvvv:dddd])."""
    out = []
    for line in text.split("\n"):
        if re.match(r"^[0-9a-f]{2}:", line):
            line = re.sub(r" \[[0-9a-f]{4}\]:", ":", line, count=1)
            line = re.sub(r" \[[0-9a-f]{4}:[0-9a-f]{4}\]", "", line)
        out.append(line)
    return "\n".join(out)


def test_without_nn_maps_class_names(text, fns):
    plain = {f.bdf: f for f in parse_lspci_verbose(_strip_ids(text))}
    assert plain.keys() == fns.keys()
    assert all(f.vendor_id is None and f.device_id is None for f in plain.values())
    for bdf, f in plain.items():
        assert f.class_code == fns[bdf].class_code, bdf  # every class of this capture is in the table
        assert f.name == fns[bdf].name
        assert f.parent == fns[bdf].parent and f.port_type == fns[bdf].port_type
    assert plain["0000:1a:00.0"].name == "NVIDIA Corporation TU104 [GeForce RTX 2060]"


def test_class_table_required_names():
    required = {
        "PCI bridge": "0604", "VGA compatible controller": "0300", "3D controller": "0302",
        "Display controller": "0380", "Non-Volatile memory controller": "0108", "Ethernet controller": "0200",
        "Network controller": "0280", "Infiniband controller": "0207", "RAID bus controller": "0104",
        "SATA controller": "0106", "Serial Attached SCSI controller": "0107", "Processing accelerators": "1200",
        "Host bridge": "0600",
    }  # fmt: skip
    assert required.items() <= CLASS_CODES.items()


def test_unknown_class_name_is_none():
    fn = parse_lspci_verbose("00:01.0 Wondrous gadget: Acme Device 1234\n")[0]
    assert fn.class_code is None and fn.name == "Acme Device 1234"


def test_domain_prefix(text):
    with_domain = re.sub(r"(?m)^(?=[0-9a-f]{2}:[0-9a-f]{2}\.)", "0001:", text)
    fns = {f.bdf: f for f in parse_lspci_verbose(with_domain)}
    assert len(fns) == 262 and all(b.startswith("0001:") for b in fns)
    assert fns["0001:1a:00.0"].parent == "0001:19:08.0"
    assert fns["0001:17:00.0"].parent is None


def test_two_domains_do_not_mix():
    text = (
        "0000:00:01.0 PCI bridge [0604]: Acme Port [1234:0001]\n"
        "\tBus: primary=00, secondary=01, subordinate=01, sec-latency=0\n\n"
        "0000:01:00.0 3D controller [0302]: Acme GPU [1234:0002]\n\n"
        "0001:01:00.0 3D controller [0302]: Acme GPU [1234:0002]\n"
    )
    fns = {f.bdf: f for f in parse_lspci_verbose(text)}
    assert fns["0000:01:00.0"].parent == "0000:00:01.0"
    assert fns["0001:01:00.0"].parent is None


def test_unconfigured_bridge_is_nobodys_parent():
    text = (
        "00:02.0 PCI bridge [0604]: Acme Port [1234:0001]\n"
        "\tBus: primary=00, secondary=00, subordinate=00, sec-latency=0\n\n"
        "00:03.0 3D controller [0302]: Acme GPU [1234:0002]\n"
    )
    assert [f.parent for f in parse_lspci_verbose(text)] == [None, None]


def test_numeric_only_lspci_n():
    text = "00:00.0 0600: 8086:2020 (rev 07)\n\tNUMA node: 1\n"
    (fn,) = parse_lspci_verbose(text)
    assert (fn.class_code, fn.vendor_id, fn.device_id, fn.name, fn.numa_node) == ("0600", "8086", "2020", "", 1)


def test_newer_lspci_link_speeds():
    text = (
        "c1:00.0 Processing accelerators [1200]: Acme NPU [1234:0003] (rev 01)\n"
        "\tCapabilities: [80] Express (v2) Endpoint, IntMsgNum 0\n"
        "\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM not supported\n"
        "\t\tLnkSta:\tSpeed 16GT/s (downgraded), Width x8 (downgraded)\n"
        "\t\tLnkCap2: Supported Link Speeds: 2.5-32GT/s, Crosslink- Retimer+ 2Retimers+ DRS-\n"
        "\t\tLnkSta2: Current De-emphasis Level: -6dB\n"
    )
    (fn,) = parse_lspci_verbose(text)
    assert (fn.port_type, fn.cap_gen, fn.cap_width, fn.sta_gen, fn.sta_width) == (ENDPOINT, 5, 16, 4, 8)


# --- messy input --------------------------------------------------------------------------------


def test_crlf_tabs_to_spaces_prompt_and_indent(text, fns):
    messy = "user@gpu01:~$ sudo lspci -vvnn\r\n" + text.replace("\t", "    ").replace("\n", "\r\n")
    assert {f.bdf: f for f in parse_lspci_verbose(messy)} == fns
    indented = "# lspci -vvnn, pasted into a ticket\n" + "\n".join("  " + line for line in text.split("\n"))
    assert {f.bdf: f for f in parse_lspci_verbose(indented)} == fns


def test_truncated_capture(text, fns):
    cut = text[: len(text) // 2]
    assert not cut.endswith("\n")
    parsed = parse_lspci_verbose(cut)
    assert 0 < len(parsed) < 262
    assert [f.bdf for f in parsed] == list(fns)[: len(parsed)]
    for f in parsed[:-1]:  # all but the cut record are complete, and parents come first in lspci order
        assert f == fns[f.bdf]


def test_duplicate_capture_keeps_first(text):
    assert len(parse_lspci_verbose(text + "\n" + text)) == 262


def test_empty_and_blank():
    for bad in ("", "   \n\t\n", "\r\n"):
        with pytest.raises(SourceError, match="empty"):
            parse_lspci_verbose(bad, "x.txt")


def test_random_bytes():
    data = random.Random(0).randbytes(4096)
    with pytest.raises(SourceError, match="binary"):
        parse_lspci_verbose(data.decode("latin-1"))
    with pytest.raises(SourceError, match="binary"):
        parse_lspci_verbose(data)  # bytes, as read from a file without decoding
    no_nul = bytes(b or 1 for b in data).decode("latin-1")
    with pytest.raises(SourceError, match="unprintable"):
        parse_lspci_verbose(no_nul)


def test_other_captures_are_rejected():
    for name in ("supermicro-sys-4029gp-trt/dmidecode.txt", "asus-esc8000a-e12/lspci-tv.txt"):
        with pytest.raises(SourceError, match="no lspci function header") as err:
            parse_lspci_verbose((FIXTURES / name).read_text(), name)
        assert str(err.value).startswith(name)


def test_error_has_source_and_line():
    with pytest.raises(SourceError) as err:
        parse_lspci_verbose("00:00.0 Host bridge: x\n\x00\x01", "cap.txt")
    assert err.value.source == "cap.txt" and err.value.line == 2


def test_fuzzed_capture_never_raises_anything_else(text):
    """Deleted, repeated, cut and corrupted lines: a list or a SourceError, nothing else."""
    rng = random.Random(1)
    lines = text.split("\n")
    for _ in range(60):
        mutated = list(lines[: rng.randrange(len(lines))])
        for _ in range(30):
            i = rng.randrange(len(mutated) or 1)
            op = rng.randrange(4)
            if not mutated:
                break
            if op == 0:
                del mutated[i]
            elif op == 1:
                mutated.insert(i, mutated[rng.randrange(len(mutated))])
            elif op == 2:
                mutated[i] = mutated[i][: rng.randrange(len(mutated[i]) + 1)]
            else:
                mutated[i] = mutated[i].replace("0", rng.choice(["f", "x", ":", "", "-1"]))
        try:
            result = parse_lspci_verbose("\n".join(mutated))
        except SourceError:
            continue
        assert all(isinstance(f, PciFunction) for f in result)
