"""parse_nvidia_smi_topo / smi_groups on a real 8x A100 ``nvidia-smi topo -m`` capture and variants."""

from __future__ import annotations

import contextlib
import random
import re
from pathlib import Path

import pytest

from moment.errors import SourceError
from moment.topology.sources.nvidia_smi import SmiTopo, parse_nvidia_smi_topo, smi_groups

FIXTURES = Path(__file__).parent / "fixtures"
DGX = FIXTURES / "dgx-like-8xa100" / "nvidia-smi-topo-m.txt"
DMIDECODE = FIXTURES / "supermicro-sys-4029gp-trt" / "dmidecode.txt"
LSPCI = FIXTURES / "asus-esc8000a-e12" / "lspci-tv.txt"
NCCL = FIXTURES / "switchtec-8x3090" / "nccl-topo.xml"

GPUS = [f"GPU{i}" for i in range(8)]
NICS = [f"NIC{i}" for i in range(17)]
TRAILING = ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]


@pytest.fixture(scope="module")
def text() -> str:
    return DGX.read_text()


@pytest.fixture(scope="module")
def topo(text: str) -> SmiTopo:
    return parse_nvidia_smi_topo(text)


def _as_the_tool_prints_it(text: str, ansi: bool = False) -> str:
    """The capture with tab-separated columns, as nvidia-smi writes them: the diagonal is " X ",
    GPU rows have an empty cell between the NUMA affinity and the GPU NUMA ID, NIC rows end in
    four empty cells, and on a terminal the header is underlined."""
    lines = text.split("\n")
    header = "\t" + "\t".join(lines[0].split()[:25] + TRAILING)
    if ansi:
        header = "\t\x1b[4m" + header[1:] + "\x1b[0m"
    rows = []
    for line in lines[1:26]:
        cells = [" X " if c == "X" else c for c in line.split()]
        values = cells[26:]
        values = [*values[:2], "", *values[2:]] if values else ["", "", "", ""]
        rows.append("\t".join(cells[:26] + values))
    return "\n".join([header, *rows, *lines[26:]])


# --- the real capture ----------------------------------------------------------------------


def test_devices(topo: SmiTopo) -> None:
    assert topo.gpus == GPUS
    assert list(topo.nics) == NICS
    assert topo.nics["NIC0"] == "mlx5_2"
    assert topo.nics["NIC15"] == "mlx5_17"
    assert topo.nics["NIC16"] == "mlx5_bond_0"


def test_nvlinks(topo: SmiTopo) -> None:
    assert len(topo.nvlinks) == 28
    assert set(topo.nvlinks.values()) == {12}
    assert all(a < b for a, b in topo.nvlinks)
    assert topo.nvlinks[("GPU0", "GPU7")] == 12


def test_relations(topo: SmiTopo) -> None:
    assert len(topo.relation) == 25 * 24  # every ordered pair but the diagonal
    assert topo.relation[("GPU0", "NIC3")] == topo.relation[("NIC3", "GPU0")] == "PXB"
    assert topo.relation[("GPU0", "NIC4")] == "SYS"
    assert topo.relation[("NIC0", "NIC1")] == "PIX"
    assert topo.relation[("NIC0", "NIC2")] == "PXB"
    assert topo.relation[("GPU2", "GPU3")] == "NV12"
    assert all(v != "X" and a != b for (a, b), v in topo.relation.items())
    assert all(topo.relation[(b, a)] == v for (a, b), v in topo.relation.items())
    assert {v for (a, b), v in topo.relation.items() if "NIC16" in (a, b)} == {"SYS"}


def test_affinity(topo: SmiTopo) -> None:
    assert topo.cpu_affinity == {g: "0-103" for g in GPUS}
    assert topo.numa == {g: 0 for g in GPUS}


def test_groups(topo: SmiTopo) -> None:
    assert smi_groups(topo) == [
        ["GPU0", "GPU1", "NIC0", "NIC1", "NIC2", "NIC3"],
        ["GPU2", "GPU3", "NIC4", "NIC5", "NIC6", "NIC7"],
        ["GPU4", "GPU5", "NIC8", "NIC9", "NIC10", "NIC11"],
        ["GPU6", "GPU7", "NIC12", "NIC13", "NIC14", "NIC15"],
        ["NIC16"],
    ]


# --- the same capture, reformatted -----------------------------------------------------------


def test_tab_separated_as_printed_by_the_tool(text: str, topo: SmiTopo) -> None:
    tabbed = _as_the_tool_prints_it(text)
    assert "0-103\t0\t\tN/A" in tabbed
    assert "\tSYS\t X \t\t\t\t\n" in tabbed
    assert parse_nvidia_smi_topo(tabbed) == topo


def test_crlf(text: str, topo: SmiTopo) -> None:
    assert parse_nvidia_smi_topo(text.replace("\n", "\r\n")) == topo
    assert parse_nvidia_smi_topo(_as_the_tool_prints_it(text).replace("\n", "\r\n")) == topo


def test_ansi_escapes(text: str, topo: SmiTopo) -> None:
    underlined = _as_the_tool_prints_it(text, ansi=True)
    assert underlined.startswith("\t\x1b[4mGPU0\tGPU1\t")
    assert parse_nvidia_smi_topo(underlined) == topo
    colored = re.sub(r"^(\w+)\t", "\x1b[1;32m\\1\x1b[0m\t", underlined, flags=re.M)
    assert colored.count("\x1b[1;32m") == 25
    assert parse_nvidia_smi_topo(colored) == topo


def test_header_lines_before_the_matrix(text: str, topo: SmiTopo) -> None:
    assert parse_nvidia_smi_topo("$ nvidia-smi topo -m\n\n" + text) == topo


# --- other nvidia-smi versions ---------------------------------------------------------------

OLD_NO_LEGEND = """\
\tGPU0\tGPU1\tmlx5_0\tmlx5_1\tCPU Affinity
GPU0\t X \tNV2\tPIX\tSYS\t0-11
GPU1\tNV2\t X \tSYS\tPIX\t12-23
mlx5_0\tPIX\tSYS\t X \tSYS\t
mlx5_1\tSYS\tPIX\tSYS\t X \t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""

NO_NICS = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      PHB     SYS     SYS     0-15    0
GPU1    PHB      X      SYS     SYS     0-15    0
GPU2    SYS     SYS      X      NODE    16-31   N/A
GPU3    SYS     SYS     NODE     X      16-31   1
"""


def test_old_version_rows_named_by_device() -> None:
    topo = parse_nvidia_smi_topo(OLD_NO_LEGEND)
    assert topo.gpus == ["GPU0", "GPU1"]
    assert topo.nics == {"mlx5_0": "mlx5_0", "mlx5_1": "mlx5_1"}
    assert topo.nvlinks == {("GPU0", "GPU1"): 2}
    assert topo.cpu_affinity == {"GPU0": "0-11", "GPU1": "12-23"}
    assert topo.numa == {}
    assert smi_groups(topo) == [["GPU0", "mlx5_0"], ["GPU1", "mlx5_1"]]


def test_no_nics_host_bridge_relations_are_singletons() -> None:
    topo = parse_nvidia_smi_topo(NO_NICS)
    assert topo.nics == {}
    assert topo.nvlinks == {}
    assert topo.relation[("GPU2", "GPU3")] == "NODE"
    assert topo.numa == {"GPU0": 0, "GPU1": 0, "GPU2": None, "GPU3": 1}
    assert smi_groups(topo) == [["GPU0"], ["GPU1"], ["GPU2"], ["GPU3"]]


def test_gpus_behind_one_switch_group_directly() -> None:
    topo = parse_nvidia_smi_topo(NO_NICS.replace("PHB", "PIX"))
    assert smi_groups(topo) == [["GPU0", "GPU1"], ["GPU2"], ["GPU3"]]


def test_single_gpu_with_all_trailing_columns() -> None:
    topo = parse_nvidia_smi_topo("\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-7\t0\t\tN/A\n")
    assert (topo.gpus, topo.relation, topo.cpu_affinity, topo.numa) == (["GPU0"], {}, {"GPU0": "0-7"}, {"GPU0": 0})


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", " \n\t\n", random.Random(0).randbytes(4000).decode("latin-1")])
def test_empty_and_random_bytes(bad: str) -> None:
    with pytest.raises(SourceError):
        parse_nvidia_smi_topo(bad)


@pytest.mark.parametrize("path", [DMIDECODE, LSPCI, NCCL])
def test_capture_of_another_kind(path: Path) -> None:
    with pytest.raises(SourceError, match="no GPU matrix header"):
        parse_nvidia_smi_topo(path.read_text(), path.name)


def test_truncated_capture_is_read_as_far_as_it_goes(text: str, topo: SmiTopo) -> None:
    half = parse_nvidia_smi_topo(text[: len(text) // 2])
    assert half.gpus == GPUS
    assert list(half.nics) == NICS and half.nics["NIC0"] == "NIC0"  # the legend was cut off
    assert 0 < len(half.relation) < len(topo.relation)
    assert all(topo.relation[k] == v for k, v in half.relation.items())
    assert half.nvlinks == topo.nvlinks


def test_any_cut_point_is_partial_or_a_source_error(text: str, topo: SmiTopo) -> None:
    for cut in range(0, len(text), 61):
        try:
            part = parse_nvidia_smi_topo(text[:cut])
        except SourceError:
            continue
        assert all(topo.relation[k] == v for k, v in part.relation.items())
        smi_groups(part)


def test_unknown_cell_in_the_middle_names_its_line(text: str) -> None:
    lines = text.split("\n")
    lines[3] = lines[3].replace("PXB", "QQQ", 1)
    with pytest.raises(SourceError) as err:
        parse_nvidia_smi_topo("\n".join(lines))
    assert err.value.line == 4


def test_short_row_in_the_middle_is_an_error(text: str) -> None:
    lines = text.split("\n")
    lines[12] = lines[12][:40]
    with pytest.raises(SourceError, match="cells for 25 columns"):
        parse_nvidia_smi_topo("\n".join(lines))


def test_only_source_errors_on_mangled_captures(text: str) -> None:
    rng = random.Random(2)
    alphabet = "XNV0123456789 \t\n\x1b[m:²PIXSYS"
    for _ in range(300):
        chars = list(text)
        for _ in range(rng.randint(1, 8)):
            chars[rng.randrange(len(chars))] = rng.choice(alphabet)
        with contextlib.suppress(SourceError):
            smi_groups(parse_nvidia_smi_topo("".join(chars)))


@pytest.mark.parametrize("number", ["²", "1" * 5000])
def test_unreadable_numbers_give_a_source_error_or_none(number: str) -> None:
    """A NUMA node or NVLink count that int() rejects (isdecimal() accepts both) is no ValueError."""
    numa = parse_nvidia_smi_topo(f"\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\t{number}\n")
    assert numa.numa == {"GPU0": None}
    with pytest.raises(SourceError, match="unknown relation"):
        parse_nvidia_smi_topo(f"\tGPU0\tGPU1\nGPU0\t X \tNV{number}\nGPU1\tNV{number}\t X \n")
