"""What ``moment inspect`` counts, counted as a person reading the hardware would.

switches: physical switches (one per upstream port; root ports are not switches);
slots: physical slots, used or free (dmidecode's when present, inferred leaf ports otherwise);
gpus/nvme/nics: devices, not functions (a GPU's audio function is not a GPU; a dual-port NIC
is one NIC); nvlinks: GPU pairs joined by NVLink or NVSwitch.
"""

from __future__ import annotations

from typing import Any

from moment.topology.model import Machine


def counts(machine: Machine) -> dict[str, int]:
    devices = machine.devices()
    slots = machine.slots()
    return {
        "sockets": len(machine.sockets),
        "switches": len(machine.switches()),
        "slots": len(slots),
        "slots_free": sum(1 for port, _ in slots if port is None or (port.device is None and port.switch is None)),
        "gpus": sum(d.kind == "gpu" for d in devices),
        "nvme": sum(d.kind == "nvme" for d in devices),
        "nics": sum(d.kind == "nic" for d in devices),
        "nvlinks": len(machine.nvlinks),
    }


def inventory(machine: Machine) -> dict[str, Any]:
    """Counts plus the lists behind them, for ``moment inspect --json``."""
    out: dict[str, Any] = {"name": machine.name, **counts(machine)}
    out["devices"] = [
        {
            "id": d.id,
            "kind": d.kind,
            "model": d.model,
            "bdf": d.bdf,
            "socket": socket.id,
            "port": port.id,
            "slot": port.slot.name if port.slot else None,
            "link": {"gen": port.link.gen, "width": port.link.width, "gbps": port.link.bandwidth_gbps()},
        }
        for port, socket in machine.iter_ports()
        if (d := port.device) is not None and d.kind != "other"
    ]
    out["slot_list"] = [
        {
            "name": slot.name,
            "port": port.id if port else None,
            "form": slot.form,
            "width": slot.width,
            "gen": slot.gen,
            "inferred": slot.inferred,
            "holds": (port.device.id if port and port.device else port.switch.id if port and port.switch else None),
        }
        for port, slot in machine.slots()
    ]
    out["switch_list"] = [
        {"id": s.id, "model": s.model, "bdf": s.bdf, "ports": len(s.ports)} for s in machine.switches()
    ]
    out["nvlink_pairs"] = [
        {"between": list(nv.between), "links": nv.links, "gbps": nv.bandwidth_gbps()} for nv in machine.nvlinks
    ]
    out["socket_links"] = [
        {"between": list(link.between), "kind": link.kind, "gbps": link.bandwidth_gbps()}
        for link in machine.socket_links
    ]
    return out
