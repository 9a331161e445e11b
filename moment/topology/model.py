"""The one model of a machine: sockets, their PCIe trees, devices, and the links between them.

The tree is made of *ports* — a root port or a switch's downstream port — because a port drives
exactly one PCIe link: whatever hangs below it (a device, a switch, or nothing: a free slot)
shares that link's bandwidth. A physical slot is an attribute of the port that feeds it.

The same classes are the YAML profile schema (pydantic validates on load and names the field
that is wrong), so the model and the file format cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from moment.topology import bandwidth

SCHEMA = "moment.topology/1"

DeviceKind = Literal["gpu", "nvme", "nic", "storage", "other"]
SlotForm = Literal["pcie", "pcie-double", "m2", "u2", "e1s", "ocp", "sxm", "onboard", "other"]
PortKind = Literal["root_port", "downstream", "integrated"]
SocketLinkKind = Literal["upi", "qpi", "infinity-fabric", "unknown"]
NvLinkVia = Literal["bridge", "nvswitch"]
PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)


def _at_most(limit: float, unit: str, slip: str) -> AfterValidator:
    """A ceiling far above any real part, so a figure typed in the wrong unit is caught by name."""

    def check(value: float | None) -> float | None:
        if value is not None and value > limit:
            raise ValueError(f"{value:g} {unit} is more than {limit:g} {unit}: did you give {slip}?")
        return value

    return AfterValidator(check)


# PCIe 6.0 x32 is 121 GB/s, an NVLink 4 GPU 450 GB/s each way, an HBM CPU socket ~1 TB/s.
LinkGBps = Annotated[float | None, Field(default=None, gt=0), _at_most(2000, "GB/s", "bytes/s")]
DramGBps = Annotated[float | None, Field(default=None, gt=0), _at_most(10000, "GB/s", "bytes/s")]
DeviceGB = Annotated[float | None, Field(default=None, gt=0), _at_most(1_000_000, "GB", "bytes")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Link(_Strict):
    """A PCIe link as negotiated (gen/width), its capability if higher, and a measured override."""

    gen: int | None = Field(default=None, ge=1, le=6)
    width: int | None = None
    max_gen: int | None = Field(default=None, ge=1, le=6)
    max_width: int | None = None
    gbps: LinkGBps = Field(default=None, description="measured GB/s per direction")

    @model_validator(mode="after")
    def _widths(self) -> Link:
        for name in ("width", "max_width"):
            value = getattr(self, name)
            if value is not None and value not in PCIE_WIDTHS:
                raise ValueError(f"{name} must be one of {PCIE_WIDTHS}, got {value}")
        return self

    def bandwidth_gbps(self) -> float | None:
        """Measured figure if any, else the table value for the link under load.

        Speed is taken at capability (``max_gen``): GPUs and NVMe drop to Gen1 when idle to save
        power, so a capture's negotiated speed understates the link. Width drops are physical
        (a x16 card in a x8 slot), so the negotiated width stands.
        """
        if self.gbps is not None:
            return self.gbps
        return bandwidth.pcie_gbps(self.max_gen or self.gen, self.width)


class Device(_Strict):
    """A GPU, NVMe SSD, NIC or other endpoint; ``functions`` lists all its PCI functions."""

    id: str
    kind: DeviceKind
    model: str = ""
    bdf: str | None = None
    functions: list[str] = Field(default_factory=list)
    vendor_id: str | None = None
    device_id: str | None = None
    numa_node: int | None = None
    max_gen: int | None = Field(default=None, ge=1, le=6, description="the device's own link capability")
    max_width: int | None = None
    memory_gb: DeviceGB = None
    capacity_gb: DeviceGB = None
    read_gbps: LinkGBps = Field(default=None, description="read GB/s of large reads (1 MiB; moment bench)")
    iops: float | None = Field(
        default=None, gt=0, description="random 4 KiB reads per second: bounds small random reads (moment/ssd_reads.py)"
    )
    double_width: bool | None = None
    tflops: Annotated[float | None, Field(default=None, gt=0), _at_most(10000, "TFLOP/s", "FLOP/s")] = Field(
        default=None,
        description="a GPU's sustained FP32 TFLOP/s training a GNN (measured): moment plan --nodes's compute "
        "(moment/topology/gpu_flops.py's datasheet peak × derating otherwise)",
    )


class Slot(_Strict):
    """A physical attachment point; ``inferred`` when no dmidecode said it exists."""

    name: str
    form: SlotForm = "pcie"
    width: int | None = None
    gen: int | None = Field(default=None, ge=1, le=6)
    inferred: bool = False


class Port(_Strict):
    """A root port or switch downstream port: one link, and at most one thing below it.

    ``integrated`` marks a device built into the root complex or chipset (RCiEP, PCH SATA, a
    VM's virtio devices): it has no PCIe link of its own, so no slot and no link bandwidth.
    """

    id: str
    kind: PortKind = "root_port"
    bdf: str | None = None
    root_complex: str | None = None
    link: Link = Field(default_factory=Link)
    slot: Slot | None = None
    device: Device | None = None
    switch: Switch | None = None
    acs_redirect: bool | None = Field(
        default=None,
        description="a switch downstream port whose ACS redirects peer requests up to the root complex "
        "(lspci ACSCtl ReqRedir+; Linux sets it when an IOMMU translates): its device cannot talk "
        "peer to peer through the switch",
    )

    @model_validator(mode="after")
    def _one_child(self) -> Port:
        if self.device is not None and self.switch is not None:
            raise ValueError("a port holds a device or a switch, not both")
        return self


class Switch(_Strict):
    """A physical PCIe switch (one upstream port); its uplink is the parent port's link."""

    id: str
    model: str = ""
    bdf: str | None = None
    vendor_id: str | None = None
    device_id: str | None = None
    ports: list[Port] = Field(default_factory=list)


class Socket(_Strict):
    """A CPU package with its DRAM and the root ports of its PCIe tree."""

    id: str
    numa_node: int | None = None
    model: str = ""
    cores: int | None = Field(default=None, ge=1)
    dram_gb: DeviceGB = None
    dram_gbps: DramGBps = None
    ports: list[Port] = Field(default_factory=list)


class SocketLink(_Strict):
    """The inter-socket link (UPI/QPI/Infinity Fabric) between two sockets."""

    between: tuple[str, str]
    kind: SocketLinkKind = "upi"
    family: str | None = Field(default=None, description="key of the bandwidth table")
    links: int | None = Field(default=None, ge=1)
    gbps: LinkGBps = Field(default=None, description="measured GB/s per direction")

    def bandwidth_gbps(self) -> float:
        return self.gbps if self.gbps is not None else bandwidth.socket_link_gbps(self.family)


class NvLink(_Strict):
    """GPU pair joined by NVLink (direct bridge or through NVSwitch)."""

    between: tuple[str, str]
    links: int = Field(default=1, ge=1)
    arch: str | None = None
    via: NvLinkVia = "bridge"
    gbps: LinkGBps = Field(default=None, description="measured GB/s per direction")

    def bandwidth_gbps(self) -> float:
        if self.gbps is not None:
            return self.gbps
        return self.links * bandwidth.nvlink_gbps(self.arch)


class Machine(_Strict):
    """A whole server. ``layouts`` name alternative placements: port id → device id."""

    schema_: str = Field(default=SCHEMA, alias="schema")
    name: str
    description: str = ""
    sources: list[str] = Field(default_factory=list)
    sockets: list[Socket] = Field(default_factory=list)
    socket_links: list[SocketLink] = Field(default_factory=list)
    nvlinks: list[NvLink] = Field(default_factory=list)
    loose_slots: list[Slot] = Field(default_factory=list, description="slots whose place in the tree is unknown")
    layouts: dict[str, dict[str, str]] = Field(default_factory=dict)
    workload: dict[str, object] | None = None
    nic_gbps: LinkGBps = Field(
        default=None, description="GB/s per direction of one node's network link (moment plan --nodes)"
    )

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @model_validator(mode="after")
    def _references(self) -> Machine:
        if self.schema_ != SCHEMA:
            raise ValueError(f"schema: expected {SCHEMA!r}, got {self.schema_!r}")
        _unique("socket id", [s.id for s in self.sockets])
        _unique("port id", [p.id for p, _ in self.iter_ports()])
        _unique("switch id", [s.id for s in self.switches()])
        devices = {d.id: d for d in self.devices()}
        _unique("device id", [d.id for d in self.devices()])
        sockets = {s.id for s in self.sockets}
        for i, link in enumerate(self.socket_links):
            for end in link.between:
                if end not in sockets:
                    raise ValueError(f"socket_links[{i}]: unknown socket {end!r}")
            if link.between[0] == link.between[1]:
                raise ValueError(f"socket_links[{i}]: joins {link.between[0]} to itself")
        self._sockets_connected()
        for i, nv in enumerate(self.nvlinks):
            for end in nv.between:
                if end not in devices or devices[end].kind != "gpu":
                    raise ValueError(f"nvlinks[{i}]: {end!r} is not a GPU of this profile")
            if nv.between[0] == nv.between[1]:
                raise ValueError(f"nvlinks[{i}]: joins {nv.between[0]} to itself")
        ports = {p.id for p, _ in self.iter_ports()}
        for name, layout in self.layouts.items():
            for port_id, dev_id in layout.items():
                if port_id not in ports:
                    raise ValueError(f"layouts.{name}: unknown slot/port {port_id!r}")
                if dev_id not in devices:
                    raise ValueError(f"layouts.{name}: unknown device {dev_id!r}")
            _unique(f"device in layouts.{name}", list(layout.values()))
        return self

    def _sockets_connected(self) -> None:
        """Data between sockets crosses socket links: every socket must be reachable from the first."""
        if len(self.sockets) < 2:
            return
        reached = {self.sockets[0].id}
        grew = True
        while grew:
            grew = False
            for link in self.socket_links:
                a, b = link.between
                if (a in reached) != (b in reached):
                    reached |= {a, b}
                    grew = True
        cut = [s.id for s in self.sockets if s.id not in reached]
        if cut:
            first = self.sockets[0].id
            raise ValueError(
                f"socket_links: {len(self.sockets)} sockets but no socket link joins {cut[0]} to {first} "
                f"(add `- between: [{first}, {cut[0]}]`)"
            )

    # --- traversal -------------------------------------------------------------------------
    def iter_ports(self) -> Iterator[tuple[Port, Socket]]:
        """Every port, depth first, with the socket it belongs to."""
        for socket in self.sockets:
            stack = list(reversed(socket.ports))
            while stack:
                port = stack.pop()
                yield port, socket
                if port.switch is not None:
                    stack.extend(reversed(port.switch.ports))

    def switches(self) -> list[Switch]:
        return [p.switch for p, _ in self.iter_ports() if p.switch is not None]

    def devices(self) -> list[Device]:
        return [p.device for p, _ in self.iter_ports() if p.device is not None]

    def slots(self) -> list[tuple[Port | None, Slot]]:
        """Every slot: (feeding port, slot), loose slots with port None."""
        placed = [(p, p.slot) for p, _ in self.iter_ports() if p.slot is not None]
        return placed + [(None, s) for s in self.loose_slots]

    def find_port(self, port_id: str) -> Port:
        for port, _ in self.iter_ports():
            if port.id == port_id:
                return port
        raise KeyError(port_id)

    def path_to(self, port_id: str) -> list[Port]:
        """Ports from the root port down to ``port_id`` (the links its traffic crosses)."""

        def walk(ports: list[Port], trail: list[Port]) -> list[Port] | None:
            for port in ports:
                here = trail + [port]
                if port.id == port_id:
                    return here
                if port.switch is not None:
                    found = walk(port.switch.ports, here)
                    if found:
                        return found
            return None

        for socket in self.sockets:
            found = walk(socket.ports, [])
            if found:
                return found
        raise KeyError(port_id)


def _unique(what: str, values: list[str]) -> None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"duplicate {what} {v!r}")
        seen.add(v)


Port.model_rebuild()
Machine.model_rebuild()
