"""The README's projection of ``moment place`` after pre-sampling on the paper's Machine B, from the
same model ``moment place`` prints its estimate with (placement.estimate.PlaceCost): the disks
at the array's sequential rates (an assumption, not a measurement: 8 × P5510, 48 GiB/s of reads,
a write-bound copy near 27 GB/s), every input byte cold, the CPU side at the development
machine's costs.

    python scripts/place_projection.py
"""

from __future__ import annotations

from pathlib import Path

from placement.estimate import (
    ARRAY_NS_PER_VERTEX,
    BIN_CORES,
    BIN_NS_PER_BYTE,
    HASH_NS_PER_BYTE,
    MEASURED_CORES,
    PlaceCost,
)

READ = 48 * 2**30  # bytes/s: 8 × P5510 sequential reads
WRITE = 27e9  # bytes/s: their sequential writes, by the vendor's sheet
CORES = 32  # 2 × Xeon Gold 6426Y (topology_profiles/moment-machine-b.yaml)

DATASETS = {  # vertices, edges, feature bytes per row, labels' bytes per vertex
    "IGB-full (269 M, 4.0 B edges, 1024-dim f32)": (269_346_174, 3_995_777_033, 4096, 1),
    "ogbn-papers100M (111 M, 1.6 B edges, 128-dim f32)": (111_059_956, 1_615_685_872, 512, 1),
}


def topology_bytes(nodes: int, edges: int, label_bytes: int) -> int:
    """The CSR, labels' bytes: what the check scan reads (and hashes) once, before pre-sampling."""
    return edges * (4 if nodes < 2**31 - 1 else 8) + (nodes + 1) * 8 + nodes * label_bytes


def projection(nodes: int, edges: int, row_bytes: int, label_bytes: int) -> PlaceCost:
    ids = 4 if nodes < 2**31 - 1 else 8
    out = Path("/out")
    return PlaceCost(
        feature_bytes=nodes * row_bytes,
        feature_read=nodes * row_bytes,
        bin_bytes_by_dir={out: nodes * row_bytes},
        out=out,
        array_bytes=nodes * (ids + 4),  # the row map and the hotness: the topology is linked (no bytes written)
        topology_read=0,  # read once, by the check scan (before this), which takes its checksums
        copied_bytes=0,
        nodes=nodes,
        read_rate=READ,
        write_rates={out: WRITE},
        cores=CORES,
    )


def main() -> None:
    print(
        f"place after pre-sampling on Machine B ({READ / 2**30:.0f} GiB/s reads, {WRITE / 1e9:.0f} GB/s writes, "
        f"{CORES} cores; CPU {BIN_NS_PER_BYTE} ns a feature byte on {MEASURED_CORES} cores, shared by up to "
        f"{BIN_CORES}, {HASH_NS_PER_BYTE:g} ns a copied topology byte (one thread; none here: linked), "
        f"{ARRAY_NS_PER_VERTEX:g} ns a vertex):"
    )
    for name, shape in DATASETS.items():
        c = projection(*shape)
        disk = c.feature_read / READ + c.feature_bytes / WRITE
        print(
            f"{name}: about {c.seconds / 60:.1f} min (bin pass {c.bins_s:,.0f} s: its disks alone {disk:,.0f} s; "
            f"row map and arrays {c.arrays_s:,.0f} s; reads {(c.feature_read + c.topology_read) / 1e9:,.0f} GB, "
            f"writes {(c.feature_bytes + c.array_bytes) / 1e9:,.0f} GB; the check scan, before pre-sampling, "
            f"reads and hashes the topology once: {topology_bytes(shape[0], shape[1], shape[3]) / 1e9:,.1f} GB)"
        )


if __name__ == "__main__":
    main()
