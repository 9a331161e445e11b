"""Layouts: which GPU or SSD sits in which slot, and what fits where.

A layout maps port ids (the port feeding a slot) to device ids. GPUs and NVMe SSDs in slots are
movable; everything else (NICs, SXM GPUs without a slot, integrated devices) stays put.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moment.errors import MomentError, UsageError
from moment.topology.model import Device, Machine, Port, Slot

MOVABLE = ("gpu", "nvme")

# The SSD ``--ssds N`` installs in a profile that has none of its own (captures of GPU servers
# often list no NVMe drive): an Intel/Solidigm D7-P5510 3.84 TB, Gen4 x4, with the figures the
# bundled moment-machine-a profile uses for the same drive (the Moment paper's Machine A, see
# scripts/make_reference_profiles.py): 6.44 GB/s of large reads (48 GiB/s measured for 8 drives
# sequential) and 1,258,291 random 4 KiB reads/s (4.8 GiB/s, Moment's code's measured figure at the
# feature read size; the datasheet says 700k).
DEFAULT_SSD = Device(
    id="nvme0",
    kind="nvme",
    model="Intel/Solidigm D7-P5510 3.84TB (moment's default SSD)",
    capacity_gb=3840,
    read_gbps=6.44,
    iops=1_258_291,
    max_gen=4,
    max_width=4,
)


def slot_of(port: Port) -> Slot:
    """The slot of a port that :class:`SlotSpace` lists as a position (each has one)."""
    if port.slot is None:
        raise ValueError(f"port {port.id} has no slot")
    return port.slot


def device_of(port: Port) -> Device:
    """The device of a port that :class:`SlotSpace` lists as a fixed GPU (each holds one)."""
    if port.device is None:
        raise ValueError(f"port {port.id} holds no device")
    return port.device


def gpu_fits(slot: Slot, double_width_known: bool) -> bool:
    """A GPU needs a double-width x16-class slot; where the profile never says which slots are
    double width (captures), any x8+ PCIe slot is allowed."""
    if slot.form == "pcie-double":
        return True
    return not double_width_known and slot.form == "pcie" and (slot.width or 16) >= 8


def ssd_fits(slot: Slot) -> bool:
    """An NVMe SSD goes in a bay, an M.2 socket, or any PCIe slot (with an adapter)."""
    return slot.form in ("u2", "e1s", "m2", "pcie", "pcie-double")


def fits(device: Device, slot: Slot, double_width_known: bool) -> bool:
    if device.kind == "gpu":
        return gpu_fits(slot, double_width_known)
    if device.kind == "nvme":
        return ssd_fits(slot)
    return False


@dataclass
class SlotSpace:
    """The slots devices can move between, and the movable devices of a profile.

    A profile whose GPUs are all fixed in place (SXM boards: no GPU-capable slot) cannot move or
    add a GPU, but a layout can still use some of them: ``fixed_gpus`` lists their ports then,
    and a layout names the ones it uses (each mapped to its own GPU); the others stay idle."""

    positions: list[Port]  # ports with a slot that hold nothing fixed
    gpus: list[Device]
    ssds: list[Device]
    double_width_known: bool
    fixed_gpus: list[Port] = field(default_factory=list)  # only where no GPU-capable slot exists

    def gpu_slots(self) -> list[Port]:
        return [p for p in self.positions if gpu_fits(slot_of(p), self.double_width_known)]

    def ssd_slots(self) -> list[Port]:
        return [p for p in self.positions if ssd_fits(slot_of(p))]


def slot_space(machine: Machine) -> SlotSpace:
    positions, gpus, ssds = [], [], []
    for port, _ in machine.iter_ports():
        dev = port.device
        movable = dev is not None and dev.kind in MOVABLE and port.slot is not None
        if port.slot is not None and port.switch is None and (dev is None or movable):
            positions.append(port)
        if dev is not None and movable:
            (gpus if dev.kind == "gpu" else ssds).append(dev)
    double = any(slot_of(p).form == "pcie-double" for p in positions)
    space = SlotSpace(positions=positions, gpus=gpus, ssds=ssds, double_width_known=double)
    if not space.gpu_slots():
        space.fixed_gpus = [
            p for p, _ in machine.iter_ports() if p.device is not None and p.device.kind == "gpu" and p.slot is None
        ]
    return space


def names_fixed_gpus(machine: Machine, layout: dict[str, str]) -> bool:
    """Whether ``layout`` chooses among GPUs fixed in place (see :class:`SlotSpace`)."""
    return any(p.id in layout for p in slot_space(machine).fixed_gpus)


def installed_layout(machine: Machine) -> dict[str, str]:
    """The layout as the profile has it installed (movable devices only)."""
    return {p.id: p.device.id for p in slot_space(machine).positions if p.device is not None}


def pick_devices(space: SlotSpace, kind: str, count: int) -> list[Device]:
    """``count`` devices of a kind: the profile's own, then copies of its first for what-ifs
    (of :data:`DEFAULT_SSD` for SSDs when the profile has none)."""
    have = space.gpus if kind == "gpu" else space.ssds
    if count <= len(have):
        return have[:count]
    if not have and kind == "gpu":
        raise UsageError(f"the profile has no GPU to take as a model for {count}")
    template = have[0] if have else DEFAULT_SSD
    extra = [
        template.model_copy(update={"id": f"{kind}{i}", "bdf": None, "functions": []}) for i in range(len(have), count)
    ]
    return have + extra


def assign_devices(machine: Machine, layout: dict[str, str], devices: list[Device] | None = None) -> dict[str, Device]:
    """Check ``layout`` (port id -> device id) against the profile; return port id -> device.
    A layout that does not fit is bad input (a layout file's, or a plan's): exit 1.

    ``devices`` lists the devices the layout may use (default: the profile's movable ones).
    """
    space = slot_space(machine)
    pool = {d.id: d for d in (devices if devices is not None else space.gpus + space.ssds)}
    by_id = {p.id: p for p in space.positions}
    own = {p.id: device_of(p) for p in space.fixed_gpus}
    if len(set(layout.values())) != len(layout):
        raise MomentError("layout places the same device in two slots")
    out: dict[str, Device] = {}
    for port_id, dev_id in layout.items():
        if port_id in own:  # a GPU fixed in place: only its own, which the layout uses
            if dev_id != own[port_id].id:
                raise MomentError(f"layout puts {dev_id!r} at {port_id!r}, where {own[port_id].id} is fixed in place")
            out[port_id] = own[port_id]
            continue
        if port_id not in by_id:
            raise MomentError(
                f"layout names slot/port {port_id!r}, which is not a free or movable slot of {machine.name}"
            )
        if dev_id not in pool:
            raise MomentError(f"layout names device {dev_id!r}, which is not a GPU or NVMe SSD of {machine.name}")
        slot, dev = slot_of(by_id[port_id]), pool[dev_id]
        if not fits(dev, slot, space.double_width_known):
            raise MomentError(f"{dev_id} ({dev.kind}) does not fit slot {slot.name!r} ({slot.form})")
        out[port_id] = dev
    return out


def apply_layout(machine: Machine, layout: dict[str, str], devices: list[Device] | None = None) -> Machine:
    """A copy of ``machine`` with every movable device taken out and ``layout`` installed."""
    placed = assign_devices(machine, layout, devices)
    m = machine.model_copy(deep=True)
    space = slot_space(m)
    for port in space.positions:
        port.device = placed[port.id].model_copy() if port.id in placed else None
    if any(p.id in placed for p in space.fixed_gpus):  # the fixed GPUs it does not use stay idle
        for port in space.fixed_gpus:
            if port.id not in placed:
                port.device = None
    return m
