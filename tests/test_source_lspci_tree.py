"""parse_lspci_tree on a real ASUS ESC8000A-E12 ``lspci -tv`` capture, other lspci variants and bad input."""

from __future__ import annotations

import contextlib
import random
import re
from pathlib import Path

import pytest

from moment.errors import SourceError
from moment.topology import pci
from moment.topology.pci import PciFunction
from moment.topology.sources.lspci_tree import parse_lspci_tree

FIXTURES = Path(__file__).parent / "fixtures"
ASUS = FIXTURES / "asus-esc8000a-e12" / "lspci-tv.txt"
DMIDECODE = FIXTURES / "supermicro-sys-4029gp-trt" / "dmidecode.txt"
SMI = FIXTURES / "dgx-like-8xa100" / "nvidia-smi-topo-m.txt"
NCCL = FIXTURES / "switchtec-8x3090" / "nccl-topo.xml"

# The four structural switches under each HighPoint card, read off the capture.
ASUS_UPSTREAM = [
    "0000:61:00.0", "0000:63:00.0", "0000:69:00.0", "0000:6f:00.0",
    "0000:a1:00.0", "0000:a3:00.0", "0000:a9:00.0", "0000:af:00.0",
]  # fmt: skip


@pytest.fixture(scope="module")
def text() -> str:
    return ASUS.read_text()


@pytest.fixture(scope="module")
def functions(text: str) -> list[PciFunction]:
    return parse_lspci_tree(text)


@pytest.fixture(scope="module")
def by_bdf(functions: list[PciFunction]) -> dict[str, PciFunction]:
    return {f.bdf: f for f in functions}


def _unexpand(text: str) -> str:
    """What `unexpand -a` does: runs of blanks that end on a tab stop become tabs."""
    out = []
    for line in text.split("\n"):
        chunks = [line[i : i + 8] for i in range(0, len(line), 8)]
        out.append("".join(c.rstrip(" ") + "\t" if len(c) == 8 and c.endswith("  ") else c for c in chunks))
    return "\n".join(out)


# --- the real capture ----------------------------------------------------------------------


def test_function_count_matches_every_slot_in_the_art(text: str, functions: list[PciFunction]) -> None:
    slots = re.findall(r"-([0-9a-f]{2}\.[0-7])\b", text)
    assert len(functions) == len(slots) == 198
    assert len({f.bdf for f in functions}) == 198


def test_root_buses(functions: list[PciFunction]) -> None:
    roots = sorted({f.bdf[:7] for f in functions if f.parent is None})
    assert roots == [f"0000:{b}" for b in ("00", "20", "40", "60", "80", "a0", "c0", "e0")]


def test_cascaded_highpoint_switch_chain(by_bdf: dict[str, PciFunction]) -> None:
    f = by_bdf["0000:63:00.0"]
    assert (f.parent, f.secondary_bus, f.subordinate_bus, f.class_code) == ("0000:62:00.0", 0x64, 0x68, "0604")
    assert by_bdf["0000:62:00.0"].parent == "0000:61:00.0"
    assert by_bdf["0000:61:00.0"].parent == "0000:60:01.1"
    root = by_bdf["0000:60:01.1"]
    assert (root.parent, root.secondary_bus, root.subordinate_bus, root.port_type) == (None, 0x61, 0x73, pci.ROOT_PORT)
    assert by_bdf["0000:65:00.0"].parent == "0000:64:10.0"
    assert by_bdf["0000:65:00.0"].name == "Samsung Electronics Co Ltd NVMe SSD Controller S4LV008[Pascal]"


def test_empty_bridges_and_bus_72(functions: list[PciFunction], by_bdf: dict[str, PciFunction]) -> None:
    assert not [f for f in functions if f.bdf.startswith("0000:72:")]
    for bdf, sec in (("0000:70:14.0", 0x71), ("0000:70:15.0", 0x72), ("0000:62:1c.0", 0x73), ("0000:c0:03.2", 0xC2)):
        assert by_bdf[bdf].secondary_bus == by_bdf[bdf].subordinate_bus == sec
        assert by_bdf[bdf].class_code == "0604"
    assert by_bdf["0000:70:14.0"].parent == by_bdf["0000:70:15.0"].parent == "0000:6f:00.0"
    assert by_bdf["0000:71:00.0"].parent == "0000:70:14.0"
    assert by_bdf["0000:71:00.0"].name.startswith("HighPoint Technologies, Inc. SSD7540")
    assert not [f for f in functions if f.parent in ("0000:70:15.0", "0000:62:1c.0", "0000:c0:03.2")]


def test_gpus_with_audio(functions: list[PciFunction], by_bdf: dict[str, PciFunction]) -> None:
    gpus = [f.bdf for f in functions if pci.classify(f) == pci.GPU]
    assert gpus == ["0000:01:00.0", "0000:41:00.0", "0000:c1:00.0", "0000:e1:00.0"]
    for gpu in gpus:
        audio = by_bdf[gpu[:-1] + "1"]
        assert audio.name == "NVIDIA Corporation AD102 High Definition Audio Controller"
        assert audio.parent == by_bdf[gpu].parent
    assert by_bdf["0000:01:00.0"].name == "NVIDIA Corporation AD102GL [RTX 6000 Ada Generation]"
    assert by_bdf["0000:01:00.0"].parent == "0000:00:01.1"


def test_nvme_count(functions: list[PciFunction], by_bdf: dict[str, PciFunction]) -> None:
    samsung = [f for f in functions if f.name.startswith("Samsung")]
    assert len(samsung) == 17
    assert sum(pci.classify(f) == pci.NVME for f in functions) == 17
    assert by_bdf["0000:02:00.0"].parent == "0000:00:05.1"
    behind_switches = [f for f in samsung if f.bdf != "0000:02:00.0"]
    assert all(by_bdf[by_bdf[f.parent].parent].port_type == pci.UPSTREAM for f in behind_switches)


def test_port_types(functions: list[PciFunction], by_bdf: dict[str, PciFunction]) -> None:
    assert [f.bdf for f in functions if f.port_type == pci.UPSTREAM] == ASUS_UPSTREAM
    assert sum(f.port_type == pci.ROOT_PORT for f in functions) == 22
    downstream = [f for f in functions if f.port_type == pci.DOWNSTREAM]
    assert len(downstream) == 28
    assert all(by_bdf[f.parent].port_type == pci.UPSTREAM for f in downstream)
    # 62:00.0 leads to a cascaded switch but is itself a downstream port of the one above.
    assert by_bdf["0000:62:00.0"].port_type == pci.DOWNSTREAM
    # The ASPEED's PCIe-to-PCI bridge holds only an endpoint: not a switch.
    assert by_bdf["0000:74:00.0"].port_type is None
    assert by_bdf["0000:75:00.0"].parent == "0000:74:00.0"
    assert by_bdf["0000:75:00.0"].name == "ASPEED Technology, Inc. ASPEED Graphics Family"
    assert all(f.port_type is None for f in functions if f.secondary_bus is None)


def test_bridges_and_fields_the_tree_cannot_show(functions: list[PciFunction]) -> None:
    bridges = [f for f in functions if f.secondary_bus is not None]
    assert len(bridges) == 59
    assert all(f.class_code == "0604" and f.name == "" for f in bridges)
    endpoints = [f for f in functions if f.secondary_bus is None]
    assert all(f.class_code is None and f.subordinate_bus is None for f in endpoints)
    assert all(f.vendor_id is None and f.sta_gen is None for f in functions)


def test_parents_come_first(functions: list[PciFunction]) -> None:
    seen: set[str] = set()
    for f in functions:
        assert f.parent is None or f.parent in seen
        seen.add(f.bdf)


def test_nics_on_root_ports(by_bdf: dict[str, PciFunction]) -> None:
    for bdf, parent in (("0000:21:00.0", "0000:20:03.1"), ("0000:81:00.1", "0000:80:01.1")):
        assert by_bdf[bdf].parent == parent
        assert by_bdf[bdf].name == "Mellanox Technologies MT2910 Family [ConnectX-7]"
    assert by_bdf["0000:80:05.1"].subordinate_bus == 0x83


# --- the same capture, reformatted -----------------------------------------------------------


def test_tabs_crlf_and_trailing_blanks_change_nothing(text: str, functions: list[PciFunction]) -> None:
    tabbed = _unexpand(text)
    assert "\t" in tabbed
    assert parse_lspci_tree(tabbed) == functions
    assert parse_lspci_tree(text.replace("\n", "\r\n")) == functions
    assert parse_lspci_tree(tabbed.replace("\n", " \r\n")) == functions


def test_without_names_as_lspci_t(text: str, functions: list[PciFunction]) -> None:
    bare = parse_lspci_tree(re.sub(r"(\.[0-7])  .*", r"\1", text))
    assert [f.bdf for f in bare] == [f.bdf for f in functions]
    assert all(f.name == "" for f in bare)
    for a, b in zip(bare, functions, strict=True):
        assert (a.parent, a.secondary_bus, a.subordinate_bus, a.port_type) == (
            b.parent, b.secondary_bus, b.subordinate_bus, b.port_type,
        )  # fmt: skip


def test_prompt_and_trailing_text_are_ignored(text: str, functions: list[PciFunction]) -> None:
    wrapped = "$ lspci -tv\n" + text + "\n$ exit\nlogout\n"
    assert parse_lspci_tree(wrapped) == functions


# --- other lspci variants --------------------------------------------------------------------

TVNN = """\
-[0000:00]-+-00.0  Intel Corporation 8th Gen Core Processor Host Bridge/DRAM Registers [8086:3ec2]
           +-01.0-[01]--+-00.0  NVIDIA Corporation TU104 [GeForce RTX 2080] [10de:1e87]
           |            \\-00.1  NVIDIA Corporation TU104 HD Audio Controller [10de:10f8]
           +-02.0  Device 1234:1111
           \\-1f.6  Intel Corporation Ethernet Connection (7) I219-LM [8086:15bb]
"""


def test_tvnn_ids_fill_vendor_and_device() -> None:
    fns = {f.bdf: f for f in parse_lspci_tree(TVNN, "lspci-tvnn.txt")}
    gpu = fns["0000:01:00.0"]
    assert (gpu.name, gpu.vendor_id, gpu.device_id) == ("NVIDIA Corporation TU104 [GeForce RTX 2080]", "10de", "1e87")
    assert gpu.class_code is None and gpu.parent == "0000:00:01.0"
    assert (fns["0000:00:1f.6"].vendor_id, fns["0000:00:1f.6"].device_id) == ("8086", "15bb")
    assert fns["0000:00:01.0"].vendor_id is None  # bridges print no name and no ids
    unknown = fns["0000:00:02.0"]
    assert (unknown.name, unknown.vendor_id, unknown.device_id) == ("Device 1234:1111", "1234", "1111")
    assert pci.classify(gpu) == pci.GPU


def test_tn_numeric_ids() -> None:
    fns = parse_lspci_tree("-[0000:00]-+-00.0  8086:3ec2\n           \\-01.0-[01]----00.0  10de:1e87\n")
    assert [(f.bdf, f.vendor_id, f.device_id) for f in fns] == [
        ("0000:00:00.0", "8086", "3ec2"), ("0000:00:01.0", None, None), ("0000:01:00.0", "10de", "1e87"),
    ]  # fmt: skip


def test_old_lspci_without_domain() -> None:
    old = "-[00]-+-00.0  Intel Corporation 440BX/ZX/DX - 82443BX/ZX/DX Host bridge\n      \\-01.0-[01]--\n"
    fns = parse_lspci_tree(old)
    assert [(f.bdf, f.secondary_bus, f.port_type) for f in fns] == [
        ("0000:00:00.0", None, None), ("0000:00:01.0", 1, pci.ROOT_PORT),
    ]  # fmt: skip


# A single-function root bus ("---") leading to two cascaded switches, and a VMD domain.
CASCADE = """\
-+-[0000:00]-+-00.0  Intel Corporation 82G33/G31/P35/P31 Express DRAM Controller
 |           \\-1f.0  Intel Corporation 82801IB (ICH9) LPC Interface Controller
 +-[0000:80]---00.0-[81-86]----00.0-[82-86]--+-00.0-[83-85]----00.0-[84-85]----00.0-[85]----00.0  NVIDIA Corporation GB110 [B300 SXM6 AC]
 |                                           \\-01.0-[86]--+-00.0  Mellanox Technologies MT2910 Family [ConnectX-7]
 |                                                        \\-00.1  Mellanox Technologies MT2910 Family [ConnectX-7]
 \\-[10000:00]-+-02.0-[01]----00.0  Samsung Electronics Co Ltd NVMe SSD Controller PM9A1/PM9A3/980PRO
              \\-03.0-[02]--
"""


def test_cascaded_switches_below_a_single_function_root_bus() -> None:
    fns = {f.bdf: f for f in parse_lspci_tree(CASCADE)}
    expect = {
        "0000:80:00.0": (None, pci.ROOT_PORT),
        "0000:81:00.0": ("0000:80:00.0", pci.UPSTREAM),
        "0000:82:00.0": ("0000:81:00.0", pci.DOWNSTREAM),
        "0000:82:01.0": ("0000:81:00.0", pci.DOWNSTREAM),
        "0000:83:00.0": ("0000:82:00.0", pci.UPSTREAM),
        "0000:84:00.0": ("0000:83:00.0", pci.DOWNSTREAM),
        "0000:85:00.0": ("0000:84:00.0", None),
        "0000:86:00.1": ("0000:82:01.0", None),
    }
    for bdf, (parent, port_type) in expect.items():
        assert (fns[bdf].parent, fns[bdf].port_type) == (parent, port_type), bdf
    assert fns["0000:81:00.0"].subordinate_bus == 0x86


def test_domain_above_ffff() -> None:
    fns = {f.bdf: f for f in parse_lspci_tree(CASCADE)}
    assert fns["10000:01:00.0"].parent == "10000:00:02.0"
    assert fns["10000:00:02.0"].port_type == pci.ROOT_PORT
    assert fns["10000:00:03.0"].secondary_bus == 2


def test_tvv_bar_lines_are_skipped() -> None:
    tvv = (
        "-[0000:00]-+-00.0  Intel Corporation Device 9b61\n"
        "           +-02.0  Intel Corporation Device 9b41\n"
        "           |         Memory at a0000000 (64-bit, non-prefetchable) [size=16M]\n"
        "           |         I/O ports at 3000 [size=64]\n"
        "           \\-1f.6  Intel Corporation Ethernet Connection (11) I219-LM\n"
    )
    assert [f.bdf for f in parse_lspci_tree(tvv)] == ["0000:00:00.0", "0000:00:02.0", "0000:00:1f.6"]


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "   \n\n", random.Random(0).randbytes(4000).decode("latin-1")])
def test_empty_and_random_bytes(bad: str) -> None:
    with pytest.raises(SourceError):
        parse_lspci_tree(bad)


@pytest.mark.parametrize("path", [DMIDECODE, SMI, NCCL])
def test_capture_of_another_kind(path: Path) -> None:
    with pytest.raises(SourceError, match="no `lspci -t` tree"):
        parse_lspci_tree(path.read_text(), path.name)


def test_truncated_capture_gives_a_prefix(text: str, functions: list[PciFunction]) -> None:
    half = parse_lspci_tree(text[: len(text) // 2])
    assert 0 < len(half) < len(functions)
    assert [f.bdf for f in half] == [f.bdf for f in functions[: len(half)]]
    assert [f.parent for f in half] == [f.parent for f in functions[: len(half)]]


def test_any_cut_point_is_a_prefix_or_a_source_error(text: str, functions: list[PciFunction]) -> None:
    for cut in range(0, len(text), 53):
        try:
            part = parse_lspci_tree(text[:cut])
        except SourceError:
            assert cut < 40  # only before the first function is complete
            continue
        assert [f.bdf for f in part] == [f.bdf for f in functions[: len(part)]]


def test_misaligned_line_in_the_middle_names_its_line(text: str) -> None:
    lines = text.split("\n")
    lines[4] = "   " + lines[4]  # "+-01.1-[01]--..." moved off its column
    with pytest.raises(SourceError) as err:
        parse_lspci_tree("\n".join(lines))
    assert err.value.line == 5
    assert err.value.source == "lspci-tv.txt"


def test_misaligned_last_line_is_an_error_too() -> None:
    with pytest.raises(SourceError) as err:
        parse_lspci_tree("-[0000:00]-+-00.0  Host bridge\n       \\-01.0-[01]--\n")
    assert err.value.line == 2


def test_garbage_inside_the_art_is_an_error() -> None:
    with pytest.raises(SourceError) as err:
        parse_lspci_tree("-[0000:00]-+-00.0  Host bridge\n           +-zz.0  Oops\n           \\-01.0  Fine\n")
    assert err.value.line == 2


def test_only_source_errors_on_mangled_captures(text: str) -> None:
    rng = random.Random(1)
    alphabet = "-+\\|[]:. 0123456789abcdef\n\t²"
    for _ in range(300):
        chars = list(text)
        for _ in range(rng.randint(1, 8)):
            chars[rng.randrange(len(chars))] = rng.choice(alphabet)
        with contextlib.suppress(SourceError):
            parse_lspci_tree("".join(chars))
