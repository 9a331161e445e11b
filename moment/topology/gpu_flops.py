"""The one table of GPU arithmetic rates, with where each figure comes from, and the share of it
GNN training sustains: ``moment plan --nodes N``'s compute term (``moment/planner/nodes.py``).

Rates are FP32, not TF32 or other tensor-core rates: the trainer computes in float32, and PyTorch
runs float32 matmuls in full FP32 unless told otherwise (``torch.backends.cuda.matmul.allow_tf32``
is False by default since PyTorch 1.12). A profile's GPU ``tflops`` (a sustained rate, measured)
replaces the table's figure and its derating.
"""

from __future__ import annotations

import re

from moment.topology.model import Device

# Peak FP32 TFLOP/s (non-tensor), first match wins, from the vendor's datasheet or whitepaper.
PEAK_FP32_TFLOPS: tuple[tuple[str, float, str], ...] = (
    (r"h200 nvl", 60.0, "NVIDIA H200 NVL datasheet"),
    (r"h200", 67.0, "NVIDIA H200 SXM datasheet"),
    (r"h100 nvl", 60.0, "NVIDIA H100 NVL datasheet"),
    (r"h100 pcie", 51.0, "NVIDIA H100 PCIe datasheet"),
    (r"h100", 67.0, "NVIDIA H100 SXM datasheet"),
    (r"a100", 19.5, "NVIDIA A100 datasheet (PCIe and SXM)"),
    (r"v100", 15.7, "NVIDIA V100 SXM2 datasheet (PCIe: 14)"),
    (r"l40s", 91.6, "NVIDIA L40S datasheet"),
    (r"a40\b", 37.4, "NVIDIA A40 datasheet"),
    (r"rtx 6000 ada", 91.1, "NVIDIA RTX 6000 Ada Generation datasheet"),
    (r"rtx 4090", 82.6, "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090)"),
    (r"rtx 3090|10de:2204", 35.6, "NVIDIA GA102 architecture whitepaper (GeForce RTX 3090, PCI id 10de:2204)"),
    (r"rtx 2070", 7.5, "NVIDIA Turing architecture whitepaper (GeForce RTX 2070: 2,304 cores × 2 × 1.62 GHz)"),
    (r"rtx 2060", 6.5, "NVIDIA GeForce RTX 2060 specifications (1,920 cores × 2 × 1.68 GHz)"),
)
# A GPU the table does not know: an A100's figure, said so wherever it is used.
UNKNOWN_TFLOPS = 19.5
# Share of the peak that GNN training sustains: an assumption, not a measurement. GNN layers are
# memory-bound: a mean aggregation does one add per 4-byte element it gathers (0.25 FLOP/B),
# against the ~12.5 FLOP/B an A100 needs to reach its peak (19.5 TFLOP/s over 1,555 GB/s of HBM2),
# and the dense parts are narrow matmuls over a few thousand to a million rows. A measured figure
# (``--compute-from`` a training run's metrics.json, or the profile's ``tflops``) replaces it.
DERATE = 0.1


def gpu_tflops(device: Device) -> tuple[float, str]:
    """Sustained FP32 TFLOP/s of ``device`` for GNN training, and where the figure came from."""
    if device.tflops is not None:
        return device.tflops, f"{device.id}: the profile's tflops"
    name = " ".join(
        x for x in (device.model, f"{device.vendor_id}:{device.device_id}" if device.device_id else "") if x
    )
    for pattern, peak, source in PEAK_FP32_TFLOPS:
        if re.search(pattern, name.lower()):
            return (
                peak * DERATE,
                f"{device.id}: {peak:g} TFLOP/s FP32 peak ({source}) × {DERATE:g}, GNN layers being memory-bound",
            )
    return UNKNOWN_TFLOPS * DERATE, (
        f"{device.id}: model {device.model or 'unknown'!r} not in the table: an A100's {UNKNOWN_TFLOPS:g} TFLOP/s "
        f"FP32 peak × {DERATE:g}, GNN layers being memory-bound"
    )
