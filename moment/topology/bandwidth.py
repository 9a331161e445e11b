"""The one table of link bandwidths, in GB/s per direction, with where each figure comes from.

Defaults follow NCCL's topology model (NVIDIA/nccl, ``src/graph/topo.h`` and ``topo.cc``), the
public reference the GPU world already tunes against. A measured figure (``moment bench`` or a
``gbps:`` field in a profile) always overrides the table.
"""

from __future__ import annotations

import re

# PCIe: NCCL topo.cc maps link speed to a per-lane figure and computes width * speed / 80, which
# gives 12 GB/s for Gen3 x16 and 24 GB/s for Gen4 x16 (the paper's figure). Per lane, GB/s:
PCIE_GBPS_PER_LANE: dict[int, float] = {
    1: 15 / 80,  # 2.5 GT/s
    2: 30 / 80,  # 5 GT/s
    3: 60 / 80,  # 8 GT/s
    4: 120 / 80,  # 16 GT/s
    5: 240 / 80,  # 32 GT/s
    6: 480 / 80,  # 64 GT/s
}
PCIE_SOURCE = "NCCL src/graph/topo.cc: bw = width * {15,30,60,120,240,480}[gen] / 80 GB/s"

# Inter-socket links, whole socket-to-socket path per direction (NCCL topo.h *_QPI_BW, AMD_BW).
SOCKET_LINK_GBPS: dict[str, float] = {
    "qpi": 6.0,  # QPI_BW (Broadwell and older)
    "skylake": 10.0,  # SKL_QPI_BW: Skylake/Cascade Lake/Ice Lake UPI
    "icelake": 10.0,  # NCCL uses SKL_QPI_BW for Ice Lake too
    "sapphirerapids": 22.0,  # SRP_QPI_BW
    "emeraldrapids": 40.0,  # ERP_QPI_BW
    "amd": 16.0,  # AMD_BW: Infinity Fabric between EPYC sockets
    "unknown": 6.0,  # the conservative QPI figure
}
SOCKET_LINK_SOURCE = "NCCL src/graph/topo.h: QPI_BW, SKL_QPI_BW, SRP_QPI_BW, ERP_QPI_BW, AMD_BW"

# NVLink per link per direction, by GPU architecture (NCCL topo.h SMxx_NVLINK_BW).
NVLINK_GBPS_PER_LINK: dict[str, float] = {
    "pascal": 18.0,  # SM60
    "volta": 20.0,  # SM70
    "ampere": 20.0,  # SM80 (A100)
    "ampere-consumer": 12.0,  # SM86 (RTX 30xx/A40 bridges)
    "hopper": 20.6,  # SM90
    "blackwell": 40.1,  # SM100
    "unknown": 20.0,
}
NVLINK_SOURCE = "NCCL src/graph/topo.h: SM60/70/80/86/90/100_NVLINK_BW"


def pcie_gbps(gen: int | None, width: int | None) -> float | None:
    """Bandwidth of a PCIe link per direction in GB/s; None if gen or width is unknown."""
    if gen is None or width is None or gen not in PCIE_GBPS_PER_LANE:
        return None
    return PCIE_GBPS_PER_LANE[gen] * width


def socket_link_gbps(cpu_family: str | None) -> float:
    """Socket-to-socket bandwidth per direction for a CPU family key of SOCKET_LINK_GBPS."""
    return SOCKET_LINK_GBPS.get((cpu_family or "unknown").lower(), SOCKET_LINK_GBPS["unknown"])


def nvlink_gbps(arch: str | None) -> float:
    """NVLink bandwidth per link per direction for a GPU architecture key."""
    return NVLINK_GBPS_PER_LINK.get((arch or "unknown").lower(), NVLINK_GBPS_PER_LINK["unknown"])


def cpu_family_of(model: str) -> str:
    """Guess the SOCKET_LINK_GBPS key from a CPU model string (dmidecode / profile)."""
    m = model.lower()
    if "epyc" in m or "amd" in m:
        return "amd"
    if "xeon" in m:
        # Xeon Scalable: 1st digit after the tier word gives the generation (x1xx Skylake,
        # x2xx Cascade Lake, x3xx Ice Lake, x4xx Sapphire Rapids, x5xx Emerald Rapids).
        hit = re.search(r"(platinum|gold|silver|bronze)\s+(\d)(\d{3})", m)
        if hit:
            gen = int(hit.group(3)[0])
            return {1: "skylake", 2: "skylake", 3: "icelake", 4: "sapphirerapids", 5: "emeraldrapids"}.get(
                gen, "unknown"
            )
        return "qpi"
    return "unknown"


def gpu_arch_of(model: str) -> str:
    """Guess the NVLINK_GBPS_PER_LINK key from a GPU model string."""
    m = model.lower()
    for words, arch in (
        (("b100", "b200", "gb200", "blackwell"), "blackwell"),
        (("h100", "h200", "h800", "gh200", "hopper"), "hopper"),
        (("a100", "a800", "ga100"), "ampere"),
        (("rtx 30", "a40", "a10", "a6000", "ga10"), "ampere-consumer"),
        (("v100", "volta", "gv100"), "volta"),
        (("p100", "pascal", "gp100"), "pascal"),
    ):
        if any(w in m for w in words):
            return arch
    return "unknown"
