"""parse_nccl_xml on a real NCCL dump (8x RTX 3090 on two Switchtec switches) and synthetic dumps."""

from __future__ import annotations

import contextlib
import random
import re
from pathlib import Path

import pytest

from moment.errors import SourceError
from moment.topology import pci
from moment.topology.sources.nccl_xml import NcclTopo, parse_nccl_xml

FIXTURES = Path(__file__).parent / "fixtures"
SWITCHTEC = FIXTURES / "switchtec-8x3090" / "nccl-topo.xml"
DMIDECODE = FIXTURES / "supermicro-sys-4029gp-trt" / "dmidecode.txt"
LSPCI = FIXTURES / "asus-esc8000a-e12" / "lspci-tv.txt"
SMI = FIXTURES / "dgx-like-8xa100" / "nvidia-smi-topo-m.txt"

GPUS_0 = ["0000:0f:00.0", "0000:10:00.0", "0000:11:00.0", "0000:12:00.0"]
GPUS_1 = ["0000:9b:00.0", "0000:9c:00.0", "0000:9d:00.0", "0000:9e:00.0"]


@pytest.fixture(scope="module")
def text() -> str:
    return SWITCHTEC.read_text()


@pytest.fixture(scope="module")
def topo(text: str) -> NcclTopo:
    return parse_nccl_xml(text)


# --- the real dump ---------------------------------------------------------------------------


def test_cpus(topo: NcclTopo) -> None:
    assert topo.cpus == [
        {"numaid": 0, "arch": "x86_64", "vendor": "GenuineIntel", "familyid": 6, "modelid": 106},
        {"numaid": 1, "arch": "x86_64", "vendor": "GenuineIntel", "familyid": 6, "modelid": 106},
    ]


def test_switch_nodes(topo: NcclTopo) -> None:
    switches = [f for f in topo.functions if f.port_type == pci.UPSTREAM]
    assert [f.bdf for f in switches] == ["0000:0c:00.0", "0000:98:00.0"]
    for f in switches:
        assert (f.class_code, f.vendor_id, f.device_id, f.parent) == ("0604", "11f8", "4000", None)
        assert (f.sta_gen, f.sta_width) == (4, 16)
        assert f.name == "Microsemi PCI bridge 11f8:4000"
        assert pci.classify(f) == pci.BRIDGE
    assert topo.cpu_numa == {"0000:0c:00.0": 0, "0000:98:00.0": 1}


def test_gpus(topo: NcclTopo) -> None:
    by_bdf = {f.bdf: f for f in topo.functions}
    assert topo.gpu_dev == {bdf: i for i, bdf in enumerate(GPUS_0 + GPUS_1)}
    for bdfs, switch, numa in ((GPUS_0, "0000:0c:00.0", 0), (GPUS_1, "0000:98:00.0", 1)):
        for bdf in bdfs:
            f = by_bdf[bdf]
            assert (f.parent, f.numa_node, f.sta_gen, f.sta_width) == (switch, numa, 4, 16)
            assert (f.class_code, f.vendor_id, f.device_id) == ("0300", "10de", "2204")
            assert f.name == "NVIDIA GPU 10de:2204"
            assert f.port_type is None
            assert pci.classify(f) == pci.GPU


def test_nic(topo: NcclTopo) -> None:
    nic = next(f for f in topo.functions if f.bdf == "0000:9a:00.0")
    assert (nic.parent, nic.numa_node, nic.class_code, nic.vendor_id, nic.device_id) == (
        "0000:98:00.0", 1, "0207", "15b3", "101b",
    )  # fmt: skip
    assert nic.name == "Mellanox NIC mlx5_0"
    assert pci.classify(nic) == pci.NIC


def test_counts_and_order(topo: NcclTopo) -> None:
    assert len(topo.functions) == 11
    assert topo.nvlinks == []
    assert [f.bdf for f in topo.functions][:2] == ["0000:0c:00.0", "0000:0f:00.0"]  # parents first


# --- the same dump, reformatted --------------------------------------------------------------


def test_tabs_and_crlf_change_nothing(text: str, topo: NcclTopo) -> None:
    tabbed = re.sub(r"^( {2})+", lambda m: "\t" * (len(m.group()) // 2), text, flags=re.M)
    assert "\t\t<pci" in tabbed
    assert parse_nccl_xml(tabbed) == topo
    assert parse_nccl_xml(text.replace("\n", "\r\n")) == topo
    assert parse_nccl_xml('<?xml version="1.0" encoding="UTF-8"?>\n' + text) == topo


# --- synthetic dumps -------------------------------------------------------------------------

NVLINKED = """\
<system version="1">
  <cpu numaid="0" affinity="ffffffff" arch="x86_64" vendor="AuthenticAMD" familyid="25" modelid="1">
    <pci busid="0000:07:00.0" class="0x060400" vendor="0x1000" device="0xc010" link_speed="32.0 GT/s PCIe" link_width="16">
      <pci busid="0000:09:00.0" class="0x060400" vendor="0x1000" device="0xc010" link_speed="32.0 GT/s PCIe" link_width="16">
        <pci busid="0000:0F:00.0" class="0x030200" vendor="0x10de" device="0x2330" link_speed="32.0 GT/s PCIe" link_width="16">
          <gpu dev="0" sm="90" rank="0" gdr="1">
            <nvlink target="0000:10:00.0" count="4" tclass="0x030200"/>
            <nvlink target="0000:a5:00.0" count="2" tclass="0x068000"/>
          </gpu>
        </pci>
        <pci busid="0000:10:00.0" class="0x030200" vendor="0x10de" device="0x2330" link_speed="Unknown" link_width="0">
          <gpu dev="1" sm="90" rank="1" gdr="1">
            <nvlink target="0000:0f:00.0" count="4" tclass="0x030200"/>
          </gpu>
        </pci>
      </pci>
      <pci busid="0000:0c:00.0" class="0x020700" vendor="0x15b3" device="0x1021" link_speed="32 GT/s" link_width="16">
        <nic>
          <net name="mlx5_0" dev="0" speed="400000" port="1"/>
          <net name="mlx5_1" dev="1" speed="400000" port="1"/>
        </nic>
      </pci>
    </pci>
    <nic>
      <net name="eth9" dev="2"/>
    </nic>
  </cpu>
  <pci busid="0000:e0:00.0" class="0x010802" vendor="0x144d" device="0xa80a"/>
</system>
"""


def test_nvlinks_one_per_pair() -> None:
    topo = parse_nccl_xml(NVLINKED)
    assert topo.nvlinks == [("0000:0f:00.0", "0000:10:00.0", 4), ("0000:0f:00.0", "0000:a5:00.0", 2)]
    assert topo.gpu_dev == {"0000:0f:00.0": 0, "0000:10:00.0": 1}


def test_cascaded_switch_nodes_are_upstream_ports() -> None:
    by_bdf = {f.bdf: f for f in parse_nccl_xml(NVLINKED).functions}
    assert by_bdf["0000:07:00.0"].port_type == by_bdf["0000:09:00.0"].port_type == pci.UPSTREAM
    assert by_bdf["0000:09:00.0"].parent == "0000:07:00.0"
    assert by_bdf["0000:0f:00.0"].parent == "0000:09:00.0"
    assert by_bdf["0000:07:00.0"].name == "Broadcom PCI bridge 1000:c010"
    assert all(f.numa_node == 0 for f in by_bdf.values() if f.bdf != "0000:e0:00.0")


def test_link_fields_and_names() -> None:
    by_bdf = {f.bdf: f for f in parse_nccl_xml(NVLINKED).functions}
    assert (by_bdf["0000:0f:00.0"].sta_gen, by_bdf["0000:0f:00.0"].sta_width) == (5, 16)
    assert (by_bdf["0000:10:00.0"].sta_gen, by_bdf["0000:10:00.0"].sta_width) == (None, None)
    assert (by_bdf["0000:0c:00.0"].sta_gen, by_bdf["0000:0c:00.0"].name) == (5, "Mellanox NIC mlx5_0")
    assert by_bdf["0000:0f:00.0"].class_code == "0302"


def test_pci_outside_any_cpu() -> None:
    topo = parse_nccl_xml(NVLINKED)
    nvme = next(f for f in topo.functions if f.bdf == "0000:e0:00.0")
    assert (nvme.parent, nvme.numa_node, nvme.class_code, nvme.name) == (None, None, "0108", "PCI device 144d:a80a")
    assert topo.cpu_numa == {"0000:07:00.0": 0}
    assert topo.cpus == [{"numaid": 0, "arch": "x86_64", "vendor": "AuthenticAMD", "familyid": 25, "modelid": 1}]


def test_unknown_numa_node() -> None:
    topo = parse_nccl_xml(NVLINKED.replace('numaid="0"', 'numaid="-1"'))
    assert topo.cpus[0]["numaid"] == -1
    assert topo.cpu_numa == {}
    assert all(f.numa_node is None for f in topo.functions)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "  \n", random.Random(0).randbytes(4000).decode("latin-1")])
def test_empty_and_random_bytes(bad: str) -> None:
    with pytest.raises(SourceError):
        parse_nccl_xml(bad)


@pytest.mark.parametrize("path", [DMIDECODE, LSPCI, SMI])
def test_capture_of_another_kind(path: Path) -> None:
    with pytest.raises(SourceError, match="not XML"):
        parse_nccl_xml(path.read_text(), path.name)


def test_xml_that_is_not_an_nccl_dump() -> None:
    with pytest.raises(SourceError, match="<html>"):
        parse_nccl_xml("<html><body><pci busid='0000:01:00.0'/></body></html>")


def test_truncated_dump_gives_what_came_before_the_cut(text: str, topo: NcclTopo) -> None:
    half = parse_nccl_xml(text[: len(text) // 2])
    assert 0 < len(half.functions) < len(topo.functions)
    assert half.functions == topo.functions[: len(half.functions)]
    assert half.cpus == topo.cpus  # the second <cpu> opens before the middle of the file
    assert half.cpu_numa == {"0000:0c:00.0": 0}


def test_any_cut_point_is_partial_or_a_source_error(text: str, topo: NcclTopo) -> None:
    for cut in range(0, len(text), 41):
        try:
            part = parse_nccl_xml(text[:cut])
        except SourceError:
            assert cut < 20  # before <system> is complete
            continue
        assert [f.bdf for f in part.functions] == [f.bdf for f in topo.functions[: len(part.functions)]]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('busid="0000:10:00.0"', 'busid="pci10"', "bad PCI address"),
        ('<gpu dev="1"', '<gpu dev="one"', "not an integer"),
        ('numaid="1"', 'numaid="?"', "not an integer"),
    ],
)
def test_bad_structural_attributes(text: str, old: str, new: str, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        parse_nccl_xml(text.replace(old, new))


def test_bad_nvlink() -> None:
    with pytest.raises(SourceError, match="not an integer"):
        parse_nccl_xml(NVLINKED.replace(' count="2"', ""))
    with pytest.raises(SourceError, match="bad PCI address"):
        parse_nccl_xml(NVLINKED.replace('target="0000:a5:00.0"', 'target="nvswitch0"'))


def test_unreadable_descriptive_attributes_are_dropped(text: str) -> None:
    mangled = text.replace('class="0x030000"', 'class="vga"', 1).replace('vendor="0x11f8"', 'vendor="-1"', 1)
    by_bdf = {f.bdf: f for f in parse_nccl_xml(mangled).functions}
    assert by_bdf["0000:0f:00.0"].class_code is None
    assert by_bdf["0000:0c:00.0"].vendor_id is None


def test_only_source_errors_on_mangled_dumps(text: str) -> None:
    rng = random.Random(3)
    alphabet = '<>/="x0123456789abcdef: \n²'
    for _ in range(300):
        chars = list(text)
        for _ in range(rng.randint(1, 8)):
            chars[rng.randrange(len(chars))] = rng.choice(alphabet)
        with contextlib.suppress(SourceError):
            parse_nccl_xml("".join(chars))


@pytest.mark.parametrize("number", ["²", "1" * 5000])
def test_unreadable_numbers_give_a_source_error_or_none(number: str) -> None:
    """Numbers int() rejects: dropped where descriptive, a SourceError where structural; no ValueError."""
    dump = (
        f'<system version="1"><cpu numaid="0" familyid="{number}" modelid="{number}">'
        f'<pci busid="0000:01:00.0" link_speed="{number} GT/s" link_width="{number}"/></cpu></system>'
    )
    topo = parse_nccl_xml(dump)
    assert (topo.cpus[0]["familyid"], topo.cpus[0]["modelid"]) == (None, None)
    assert (topo.functions[0].sta_gen, topo.functions[0].sta_width) == (None, None)
    with pytest.raises(SourceError, match="not an integer"):
        parse_nccl_xml(f'<system version="1"><cpu numaid="{number}"/></system>')
