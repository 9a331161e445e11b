"""Write topology_profiles/moment-machine-{a,b}.yaml from REFERENCE_MACHINES.md's prose.

The profiles are generated rather than typed so the 4+8 device layouts stay consistent; every
assumption the paper's prose does not state is written into the YAML as a comment. Run:
    python scripts/make_reference_profiles.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parent.parent / "topology_profiles"

A100 = {
    "kind": "gpu",
    "model": "NVIDIA A100 40GB PCIe",
    "memory_gb": 40,
    "double_width": True,
    "max_gen": 4,
    "max_width": 16,
}
P5510 = {
    "kind": "nvme",
    "model": "Intel P5510 3.84TB",
    "capacity_gb": 3840,
    # Large reads: 8 P5510 together measured at about 48 GiB/s sequential (REFERENCE_MACHINES.md),
    # 6 GiB/s = 6.44 GB/s each (the datasheet says 6.5 GB/s sequential read).
    "read_gbps": 6.44,
    # Random 4 KiB reads: Moment's code measures its SSDs at the feature read size (4 KiB rows
    # of IGB; IOStack/ssd_bw.cu) and uses 4.8 GiB/s per drive: 1,258,291 reads/s, more than the
    # datasheet's 700k (with the datasheet's figure, classic-a and -c tie on Machine A, against the
    # paper's measured 15.9 s and 14.9 s: tests/test_reference_ranking.py).
    "iops": 1258291,
    "max_gen": 4,
    "max_width": 4,
}
NIC = {"kind": "nic", "model": "dual-port NIC", "max_gen": 4, "max_width": 16}
GEN4_X16 = {"gen": 4, "width": 16}
GEN4_X4 = {"gen": 4, "width": 4}


def gpu_slot(pid: str, name: str) -> dict:
    return {
        "id": pid,
        "kind": "downstream",
        "link": dict(GEN4_X16),
        "slot": {"name": name, "form": "pcie-double", "width": 16, "gen": 4},
    }


def ssd_slot(pid: str, name: str, kind: str = "downstream", form: str = "u2") -> dict:
    return {"id": pid, "kind": kind, "link": dict(GEN4_X4), "slot": {"name": name, "form": form, "width": 4, "gen": 4}}


def install(ports: dict[str, dict], layout: dict[str, str], devices: dict[str, dict]) -> None:
    for pid, dev in layout.items():
        ports[pid]["device"] = {"id": dev, **devices[dev]}


def devices() -> dict[str, dict]:
    out = {f"gpu{i}": dict(A100) for i in range(4)}
    out.update({f"nvme{i}": dict(P5510) for i in range(8)})
    return out


def machine_a() -> tuple[dict, str]:
    ports: dict[str, dict] = {}
    sockets = []
    for s in (0, 1):
        bays = [ssd_slot(f"cpu{s}-bay{i}", f"CPU{s} front bay {i} (Bus {i + 1})", kind="root_port") for i in range(4)]
        sw_ports = [gpu_slot(f"sw{s}-gpu{i}", f"switch {s} GPU slot {i}") for i in range(4)]
        sw_ports += [ssd_slot(f"sw{s}-ssd{i}", f"switch {s} SSD slot {i}") for i in range(4)]
        uplink = {
            "id": f"cpu{s}-x16",
            "kind": "root_port",
            "link": dict(GEN4_X16),
            "switch": {"id": f"sw{s}", "model": "PLX PCIe Gen4 switch", "ports": sw_ports},
        }
        root = bays + [uplink]
        if s == 1:
            root.append(
                {
                    "id": "cpu1-nic",
                    "kind": "root_port",
                    "link": dict(GEN4_X16),
                    "slot": {"name": "CPU1 NIC slot", "form": "pcie", "width": 16, "gen": 4},
                    "device": {"id": "nic0", **NIC},
                }
            )
        for p in bays + sw_ports:
            ports[p["id"]] = p
        sockets.append(
            {
                "id": f"cpu{s}",
                "numa_node": s,
                "model": "Intel Xeon Gold 5320",
                "cores": 26,
                "dram_gb": 384,
                "dram_gbps": 150,
                "ports": root,
            }
        )
    bays = [f"cpu{s}-bay{i}" for s in (0, 1) for i in range(4)]
    sw_ssd = [f"sw{s}-ssd{i}" for s in (0, 1) for i in range(4)]
    gpus = [f"gpu{i}" for i in range(4)]
    nvme = [f"nvme{i}" for i in range(8)]
    spread = ["sw0-gpu0", "sw0-gpu1", "sw1-gpu0", "sw1-gpu1"]
    same = [f"sw0-gpu{i}" for i in range(4)]
    layouts = {
        "classic-a": dict(zip(spread + bays, gpus + nvme)),
        "classic-b": dict(zip(same + bays, gpus + nvme)),
        "classic-c": dict(zip(spread + sw_ssd, gpus + nvme)),
        "classic-d": dict(zip(same + sw_ssd, gpus + nvme)),
    }
    install(ports, layouts["classic-a"], devices())
    body = {
        "name": "moment-machine-a",
        "description": "Moment paper (SC'25) Machine A: balanced PCIe, 2x Xeon Gold 5320, 4x A100 PCIe, 8x P5510",
        "sources": ["shared/design/REFERENCE_MACHINES.md (paper prose)"],
        "sockets": sockets,
        "socket_links": [{"between": ["cpu0", "cpu1"], "kind": "upi", "family": "icelake", "links": 3}],
        "layouts": layouts,
        "workload": WORKLOAD,
    }
    header = """\
# Machine A of the Moment paper (SC'25): the balanced PCIe topology.
# Stated by the paper: 2x Xeon Gold 5320 (Ice Lake-SP, 26 cores), 768 GB DRAM, UPI between sockets;
#   each socket: 4 NVMe front-board bays on the root complex (one x4 link each, "Bus 1-4") and one
#   PLX switch behind a single x16 uplink ("Bus 9"); 4x A100 40GB PCIe (Gen4 x16, double width),
#   8x Intel P5510 3.84 TB (Gen4 x4); the right socket also has the NICs.
# ASSUMED (the prose is silent):
#   - each switch offers 4 double-width x16 GPU slots and 4 x4 SSD slots downstream;
#   - switch-to-switch traffic crosses both root complexes and the UPI link (no switch-to-switch cable);
#   - UPI: 3 links; bandwidth from NCCL's SKL_QPI_BW (10 GB/s), which NCCL also uses for Ice Lake;
#     a measured figure (moment bench) should replace it;
#   - DRAM 384 GB per socket; 150 GB/s per socket (8x DDR4-2933 is 188 GB/s peak; ~80% achievable);
#   - SSD: 1,258,291 random 4 KiB reads/s per drive (4.8 GiB/s = 5.15 GB/s of 4 KiB rows, Moment's
#     code's measured figure at the feature read size; the datasheet says 700k), 6.44 GB/s of large
#     reads (the 48 GiB/s sequential measured for all 8); links from the NCCL table (Gen4 x16 =
#     24 GB/s, Gen4 x4 = 6 GB/s);
#   - the NIC: one dual-port card in a socket-1 x16 slot.
# Installed as layout classic-a. Layouts (port id -> device id), from REFERENCE_MACHINES.md:
#   classic-a: SSDs in the front bays, GPUs 2+2 over the switches
#   classic-b: SSDs in the front bays, all 4 GPUs on switch 0
#   classic-c: SSDs 4+4 over the switches, GPUs 2+2 over the switches
#   classic-d: SSDs 4+4 over the switches, all 4 GPUs on switch 0
# Generated by scripts/make_reference_profiles.py; edit that script, not this file.
"""
    return body, header


def machine_b() -> tuple[dict, str]:
    ports: dict[str, dict] = {}
    sw1_ports = [gpu_slot(f"sw1-{bus}", f"switch 1 slot (bus {bus})") for bus in ("35", "36", "37", "38", "39")]
    sw1_ports[1]["device"] = {"id": "nic0", **NIC}  # bus 36 holds a two-function device
    sw0_ports = [gpu_slot(f"sw0-{bus}", f"switch 0 slot (bus {bus})") for bus in ("3a", "3b", "3c", "3d")]
    cascade = {
        "id": "sw0-33",
        "kind": "downstream",
        "link": dict(GEN4_X16),
        "switch": {"id": "sw1", "model": "PCIe Gen4 switch 1 (cascaded, Bus 16)", "ports": sw1_ports},
    }
    rc0_slot = {
        "id": "rc0-17",
        "kind": "root_port",
        "root_complex": "0000:16",
        "link": dict(GEN4_X16),
        "slot": {"name": "root complex 0 x16 slot (bus 17)", "form": "pcie-double", "width": 16, "gen": 4},
    }
    sw0_root = {
        "id": "rc0-31",
        "kind": "root_port",
        "root_complex": "0000:30",
        "link": dict(GEN4_X16),
        "switch": {"id": "sw0", "model": "PCIe Gen4 switch 0 (Bus 11)", "ports": sw0_ports + [cascade]},
    }
    b1 = {
        "id": "rc1-b1",
        "kind": "root_port",
        "root_complex": "0000:b0",
        "link": dict(GEN4_X16),
        "slot": {"name": "root complex 1 x16 slot (bus b1)", "form": "pcie-double", "width": 16, "gen": 4},
    }
    bays = [
        ssd_slot(f"rc1-{bus}", f"front bay (bus {bus})", kind="root_port")
        for bus in ("ca", "cb", "cc", "cd", "e3", "e4", "e5", "e6")
    ]
    for b, rc in zip(bays, ["0000:c9"] * 4 + ["0000:e2"] * 4):
        b["root_complex"] = rc
    for p in sw0_ports + sw1_ports + [rc0_slot, b1] + bays:
        ports[p["id"]] = p
    sockets = [
        {
            "id": "cpu0",
            "numa_node": 0,
            "model": "Intel Xeon Gold 6426Y",
            "cores": 16,
            "dram_gb": 256,
            "dram_gbps": 240,
            "ports": [rc0_slot, sw0_root],
        },
        {
            "id": "cpu1",
            "numa_node": 1,
            "model": "Intel Xeon Gold 6426Y",
            "cores": 16,
            "dram_gb": 256,
            "dram_gbps": 240,
            "ports": [b1] + bays,
        },
    ]
    gpus = [f"gpu{i}" for i in range(4)]
    nvme = [f"nvme{i}" for i in range(8)]
    bay_ids = [b["id"] for b in bays]
    spread = ["sw0-3a", "sw0-3b", "sw1-35", "sw1-37"]
    same = ["sw0-3a", "sw0-3b", "sw0-3c", "sw0-3d"]
    layouts = {
        "classic-a": dict(zip(spread + bay_ids, gpus + nvme)),
        "classic-b": dict(zip(same + bay_ids, gpus + nvme)),
        "classic-c": dict(zip(spread + ["sw0-3c", "sw0-3d", "sw1-38", "sw1-39"] + bay_ids[:4], gpus + nvme)),
        "classic-d": dict(zip(same + ["sw1-35", "sw1-37", "sw1-38", "sw1-39"] + bay_ids[:4], gpus + nvme)),
    }
    install(ports, layouts["classic-a"], devices())
    body = {
        "name": "moment-machine-b",
        "description": "Moment paper (SC'25) Machine B: cascaded PCIe switches, 2x Xeon Gold 6426Y, 4x A100 PCIe, 8x P5510",
        "sources": ["shared/design/REFERENCE_MACHINES.md (paper prose + RC4ML/Moment pruned_tree.txt)"],
        "sockets": sockets,
        "socket_links": [{"between": ["cpu0", "cpu1"], "kind": "upi", "family": "sapphirerapids", "links": 3}],
        "layouts": layouts,
        "workload": WORKLOAD,
    }
    header = """\
# Machine B of the Moment paper (SC'25): the cascaded PCIe topology.
# Stated by the paper and the authors' published lspci tree (RC4ML/Moment pruned_tree.txt):
#   2x Xeon Gold 6426Y (Sapphire Rapids, 16 cores), 512 GB DRAM, UPI between sockets.
#   socket 0: root bus 16 -> one direct x16 slot (bus 17); root bus 30 -> switch 0 over one x16 link
#     ("Bus 11"); switch 0 has four slots (buses 3a-3d) and one port to switch 1 over one x16 link
#     ("Bus 16"): switch 1 reaches the CPU only through switch 0; switch 1 has five slots (35-39),
#     bus 36 holding a two-function device.
#   socket 1: root bus b0 -> one x16 slot (b1, the only socket-1 slot that takes a GPU); root buses
#     c9 and e2 -> four x4 bays each (ca-cd, e3-e6): eight SSD bays on root complex 1.
# ASSUMED (the prose is silent):
#   - every switch slot is electrically x16 and double-width (so the classic layouts' GPU and SSD
#     positions all fit); an SSD in a switch slot links at its own x4;
#   - the two-function device on bus 36 is a dual-port NIC (it keeps that slot);
#   - UPI: 3 links, bandwidth from NCCL's SRP_QPI_BW (22 GB/s); measure with moment bench;
#   - DRAM 256 GB per socket, 240 GB/s per socket (8x DDR5-4800 is 307 GB/s peak; ~80% achievable);
#   - SSD: 1,258,291 random 4 KiB reads/s (4.8 GiB/s at the feature read size, Moment's code's
#     measured figure), 6.44 GB/s of large reads; x16 links 24 GB/s (NCCL table; the authors
#     measured ~22.4 GiB/s).
# Installed as layout classic-a. Layouts (port id -> device id):
#   classic-a: SSDs in the 8 front bays, GPUs 2+2 (switch 0: 3a 3b, switch 1: 35 37)
#   classic-b: SSDs in the front bays, all 4 GPUs on switch 0
#   classic-c: SSDs 2+2 on the switches' free slots (the rest in bays), GPUs 2+2
#   classic-d: all 4 GPUs on switch 0, 4 SSDs on switch 1 (the most that fit), 4 in bays
# Generated by scripts/make_reference_profiles.py; edit that script, not this file.
"""
    return body, header


# The paper's workload (REFERENCE_MACHINES.md), IGB-HOM-like; the CPU-cache hit share is left to
# a measured hotness curve (moment place's pre-sampling), not guessed here.
WORKLOAD = {
    "dataset": "IGB-HOM-like",
    "nodes": 269_000_000,
    "edges": 4_000_000_000,
    "feature_dim": 1024,
    "feature_dtype": "float32",
    "fanouts": [25, 10],
    "batch_size": 8000,
    "train_fraction": 0.01,
    "cpu_cache_fraction": 0.01,
    "model": "graphsage",
    "hidden": 256,
}


def machine_a_nvlink() -> tuple[dict, str]:
    body, header = machine_a()
    body["name"] = "moment-machine-a-nvlink"
    body["description"] += ", NVLink bridges GPU0-GPU1 and GPU2-GPU3"
    body["nvlinks"] = [
        {"between": ["gpu0", "gpu1"], "links": 12, "arch": "ampere", "via": "bridge"},
        {"between": ["gpu2", "gpu3"], "links": 12, "arch": "ampere", "via": "bridge"},
    ]
    header = header.replace(
        "# Machine A of the Moment paper (SC'25): the balanced PCIe topology.",
        "# Machine A of the Moment paper (SC'25), NVLink variant: bridges between GPU 1-2 and GPU 3-4\n"
        "# (0-based gpu0-gpu1, gpu2-gpu3). ASSUMED: A100 PCIe NVLink bridge = 12 links (3 bridges x 4),\n"
        "# 20 GB/s per link per direction (NCCL SM80_NVLINK_BW). Otherwise identical to Machine A:",
    )
    return body, header


def large_8gpu() -> tuple[dict, str]:
    """Not a paper machine: the 8-GPU, 16-SSD, 4-switch server the planner must still plan fast."""
    gpu8 = {f"gpu{i}": dict(A100) for i in range(8)}
    ssd16 = {f"nvme{i}": dict(P5510) for i in range(16)}
    ports: dict[str, dict] = {}
    sockets = []
    for s in (0, 1):
        root = [ssd_slot(f"cpu{s}-bay{i}", f"CPU{s} front bay {i}", kind="root_port") for i in range(4)]
        for w in (2 * s, 2 * s + 1):
            sw_ports = [gpu_slot(f"sw{w}-gpu{i}", f"switch {w} GPU slot {i}") for i in range(4)]
            sw_ports += [ssd_slot(f"sw{w}-ssd{i}", f"switch {w} SSD slot {i}") for i in range(4)]
            root.append(
                {
                    "id": f"cpu{s}-x16-{w}",
                    "kind": "root_port",
                    "link": dict(GEN4_X16),
                    "switch": {"id": f"sw{w}", "model": "PCIe Gen4 switch", "ports": sw_ports},
                }
            )
            for p in sw_ports:
                ports[p["id"]] = p
        for p in root[:4]:
            ports[p["id"]] = p
        sockets.append(
            {
                "id": f"cpu{s}",
                "numa_node": s,
                "model": "Intel Xeon Gold 6426Y",
                "cores": 16,
                "dram_gb": 512,
                "dram_gbps": 240,
                "ports": root,
            }
        )
    layout = {f"sw{w}-gpu{i}": f"gpu{2 * w + i}" for w in range(4) for i in range(2)}
    layout.update({f"cpu{s}-bay{i}": f"nvme{4 * s + i}" for s in (0, 1) for i in range(4)})
    layout.update({f"sw{w}-ssd{i}": f"nvme{8 + 2 * w + i}" for w in range(4) for i in range(2)})
    install(ports, layout, {**gpu8, **ssd16})
    body = {
        "name": "example-8gpu-16ssd",
        "description": "Example large server: 2 sockets, 4 PCIe switches (2 per socket), 8x A100 PCIe, 16x P5510",
        "sources": ["scripts/make_reference_profiles.py (synthetic example, not a measured machine)"],
        "sockets": sockets,
        "socket_links": [{"between": ["cpu0", "cpu1"], "kind": "upi", "family": "sapphirerapids", "links": 3}],
        "layouts": {"installed-spread": layout},
        "workload": WORKLOAD,
    }
    header = """\
# An example large server (not a paper machine, not measured): 2 sockets; per socket 4 NVMe bays on
# the root complex and 2 PCIe Gen4 switches, each behind one x16 uplink with 4 double-width GPU
# slots and 4 x4 SSD slots. 8x A100 PCIe and 16x P5510 installed as 2 GPUs + 2 SSDs per switch and
# 8 SSDs in the bays. For planning at scale (moment plan --profile example-8gpu-16ssd).
# Generated by scripts/make_reference_profiles.py; edit that script, not this file.
"""
    return body, header


def main() -> None:
    for body, header in (machine_a(), machine_a_nvlink(), machine_b(), large_8gpu()):
        text = header + yaml.safe_dump({"schema": "moment.topology/1", **body}, sort_keys=False, width=110)
        (OUT / f"{body['name']}.yaml").write_text(text)
        print(f"wrote {OUT / (body['name'] + '.yaml')}")


if __name__ == "__main__":
    main()
