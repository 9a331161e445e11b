"""``moment profile``: gather captures (a folder of saved outputs, or this machine) into a Machine.

Each source is optional and independent; one that cannot be read becomes a warning naming it,
never a crash. The PCIe tree comes from the richest tree source present
(lspci -vvv > sysfs > lspci -tv > NCCL XML > nvidia-smi relations); dmidecode adds slots,
nvidia-smi and NCCL add NVLink.

The tools are listed once, in :data:`SOURCES`: a new one (hwloc, say) is its parser in
``moment/topology/sources/`` and one :class:`Source` line there, plus, where it brings a kind
of record the others do not, its :class:`Captures` field and its use in :func:`build_profile`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from moment.contracts import first_error
from moment.errors import MomentError, SourceError
from moment.topology import bandwidth, build, merge
from moment.topology.model import Machine, NvLink, Slot
from moment.topology.pci import PciFunction
from moment.topology.sources.dmidecode import DmiCapture, parse_dmidecode
from moment.topology.sources.lspci_tree import parse_lspci_tree
from moment.topology.sources.lspci_verbose import parse_lspci_verbose
from moment.topology.sources.nccl_xml import NcclTopo, parse_nccl_xml
from moment.topology.sources.nvidia_smi import SmiTopo, parse_nvidia_smi_topo
from moment.topology.sources.sysfs import read_sysfs

T = TypeVar("T")


@dataclass(frozen=True)
class Source:
    """One capture tool: where its output is found, how it is parsed, and what it contributes.

    ``parse(text, label, notes)`` turns the tool's output into records (SourceError when the text
    is not that tool's output); the records fill the :class:`Captures` field ``into``, which
    :func:`build_profile` reads. ``files``: what ``moment profile --from DIR`` looks for (the
    first present wins); ``command``: what ``moment profile`` runs on this machine (None: from a
    folder only; ``root_for``: it needs root, and a profile without it lacks this); ``scan``: a
    source read straight from this machine instead, given the sysfs root; ``title``: how a
    profile's ``sources`` names it where it gave the PCIe tree (default: ``name``)."""

    name: str
    into: str
    parse: Callable[[str, str, list[str]], object] | None = None
    files: tuple[str, ...] = ()
    command: tuple[str, ...] | None = None
    root_for: str | None = None
    scan: Callable[[str], object] | None = None
    title: str = ""

    def __post_init__(self) -> None:
        if self.into not in RECORDS:
            raise ValueError(f"capture source {self.name}: into={self.into!r} is none of {', '.join(RECORDS)}")
        if not self.title:
            object.__setattr__(self, "title", self.name)


@dataclass
class Captures:
    """What was read from each source (the ``into`` of :data:`SOURCES`); None where the source
    was absent or unreadable. ``by``: the source that filled each field."""

    origin: str
    verbose: list[PciFunction] | None = None
    tree: list[PciFunction] | None = None
    sysfs: list[PciFunction] | None = None
    dmi: DmiCapture | None = None
    smi: SmiTopo | None = None
    nccl: NcclTopo | None = None
    used: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    by: dict[str, Source] = field(default_factory=dict)

    def parse(self, label: str, fn: Callable[[], T]) -> T | None:
        """Run one parser; a SourceError (or unreadable file) becomes a warning and None."""
        try:
            result = fn()
        except SourceError as exc:
            self.warnings.append(f"skipped {label}: {exc}")
            return None
        except OSError as exc:
            self.warnings.append(f"skipped {label}: {exc.strerror or exc}")
            return None
        self.used.append(label)
        return result

    def take(self, source: Source, label: str, read: Callable[[], Any]) -> None:
        """Fill ``source``'s field with what ``read`` gives (text to parse, or a scan's records)."""
        parse = source.parse
        records = self.parse(label, read if parse is None else lambda: parse(read(), label, self.warnings))
        if records is not None:
            setattr(self, source.into, records)
            self.by[source.into] = source


# The kinds of record a source can fill (Captures' fields that build_profile reads).
RECORDS = tuple(f.name for f in fields(Captures) if f.name not in ("origin", "used", "warnings", "by"))


# Every capture source, in the order they are read (a profile's ``sources`` lists them so).
SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "lspci_verbose",
            "verbose",
            parse_lspci_verbose,
            files=("lspci-vvv.txt", "lspci-vvnn.txt", "lspci-vvvnn.txt", "lspci-vv.txt"),
            title="lspci -vvv",
        ),
        Source("sysfs", "sysfs", scan=read_sysfs),
        Source(
            "lspci_tree",
            "tree",
            parse_lspci_tree,
            files=("lspci-tv.txt", "lspci-t.txt", "lspci-tvnn.txt"),
            command=("lspci", "-tv"),
            title="lspci -tv",
        ),
        Source(
            "dmidecode",
            "dmi",
            parse_dmidecode,
            files=("dmidecode.txt", "dmidecode-t-slot.txt"),
            command=("dmidecode",),
            root_for="slot names",
        ),
        Source(
            "nvidia_smi",
            "smi",
            parse_nvidia_smi_topo,
            files=("nvidia-smi-topo-m.txt",),
            command=("nvidia-smi", "topo", "-m"),
            title="nvidia-smi",
        ),
        Source("nccl_xml", "nccl", parse_nccl_xml, files=("nccl-topo.xml",), title="NCCL XML"),
    )
}


def _kind(path: Path) -> str:
    """What a path that is not a regular file is, for a warning."""
    if path.is_dir():
        return "a directory"
    if path.is_fifo():
        return "a FIFO"
    if path.is_char_device() or path.is_block_device():
        return "a device" + (f" (a link to {path.resolve()})" if path.is_symlink() else "")
    return "not readable as a file"


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def read_capture_dir(directory: str | Path) -> Captures:
    """Parse whichever known capture files ``directory`` holds."""
    root = Path(directory)
    if not root.is_dir():
        raise MomentError(f"{root}: not a directory of captures")
    caps = Captures(origin=str(root))
    found = {s.name: next((root / n for n in s.files if (root / n).is_file()), None) for s in SOURCES.values()}
    for s in SOURCES.values():  # a capture's name on a directory, FIFO or device: said, not read
        for n in s.files:
            if (root / n).exists() and not (root / n).is_file():
                caps.warnings.append(f"skipped {n}: {_kind(root / n)}, not a regular file")
    if not any(found.values()):
        wanted = ", ".join(n for s in SOURCES.values() for n in s.files[:2])
        odd = f"; {'; '.join(caps.warnings)}" if caps.warnings else ""
        raise MomentError(f"{root}: no capture files found (looked for {wanted}){odd}")
    for source in SOURCES.values():
        if (path := found[source.name]) is not None:
            caps.take(source, path.name, partial(_read, path))
    return caps


def _run(argv: list[str]) -> str:
    """Output of a command; SourceError if it is missing or fails (never a shell)."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise SourceError(argv[0], "not installed")
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceError(" ".join(argv), str(exc)) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise SourceError(" ".join(argv), f"exit {done.returncode}: {last}")
    return done.stdout


def capture_live(sysfs_root: str = "/sys/bus/pci/devices") -> Captures:
    """Profile this machine: sysfs always, and lspci/dmidecode/nvidia-smi where they exist."""
    caps = Captures(origin="this machine")
    root = not hasattr(os, "geteuid") or os.geteuid() == 0
    for source in SOURCES.values():
        if source.scan is not None:
            caps.take(source, source.name, partial(source.scan, sysfs_root))
        elif source.command is not None:
            label = " ".join(source.command)
            if source.root_for and not root:
                caps.warnings.append(f"skipped {label}: needs root (run `sudo moment profile` for {source.root_for})")
            else:
                caps.take(source, label, partial(_run, list(source.command)))
    return caps


def _tree_functions(caps: Captures) -> tuple[list[PciFunction] | None, str | None]:
    """The richest tree source, with names filled in from lspci where sysfs has none."""
    names = {f.bdf: f.name for f in (caps.tree or []) + (caps.verbose or []) if f.name}
    for into, functions in (("verbose", caps.verbose), ("sysfs", caps.sysfs), ("tree", caps.tree)):
        if functions:
            for f in functions:
                if f.bdf in names and (not f.name or f.name.startswith("vendor ")):
                    f.name = names[f.bdf]
            return functions, caps.by[into].title
    if caps.nccl is not None and caps.nccl.functions:
        return caps.nccl.functions, caps.by["nccl"].title
    return None, None


def build_profile(caps: Captures, name: str) -> tuple[Machine, list[str]]:
    """Assemble the Machine from parsed captures; returns it with every warning raised.

    Captures that contradict each other end in one line naming the capture folder, not a traceback.
    """
    try:
        return _build_profile(caps, name)
    except ValidationError as exc:
        raise MomentError(f"{caps.origin}: the captures do not make a consistent machine: {first_error(exc)}") from None


def _build_profile(caps: Captures, name: str) -> tuple[Machine, list[str]]:
    warnings = list(caps.warnings)
    functions, tree_source = _tree_functions(caps)
    slots, system = (caps.dmi.slots, caps.dmi.system) if caps.dmi is not None else (None, {})
    cpus = system.get("cpus") or []
    family = _family(caps, cpus)
    nvlinks: list[NvLink] = []
    if functions:
        tree = build.build_tree(functions, sockets_hint=len(cpus) or None)
        warnings += tree.warnings
        sockets = tree.sockets
        family = family or tree.cpu_family
    elif caps.smi is not None:
        sockets, nvlinks, smi_warnings = merge.machine_parts_from_smi(caps.smi)
        warnings += smi_warnings
        tree_source = caps.by["smi"].title
    else:
        why = "; ".join(caps.warnings) or "need lspci, sysfs, NCCL XML or nvidia-smi"
        raise MomentError(f"{caps.origin}: no usable source describes the PCIe tree ({why})")
    for socket, cpu in zip(sockets, cpus):
        socket.model = cpu.get("version") or ""
        socket.cores = cpu.get("cores") or None
    if system.get("memory_gb") and sockets:
        for socket in sockets:
            socket.dram_gb = round(system["memory_gb"] / len(sockets), 3)
    loose: list[Slot] = []
    if slots and functions:
        loose, slot_warnings = merge.attach_dmi_slots(sockets, slots, {f.bdf: f for f in functions})
        warnings += slot_warnings
    elif functions:
        n = build.infer_slots(sockets)
        warnings.append(f"no dmidecode: {n} slot(s) inferred from leaf ports (names are port addresses)")
    machine = Machine(
        name=name,
        description=_description(system),
        sources=[f"{s} ({Path(caps.origin).name})" for s in caps.used]
        + ([f"tree from {tree_source}"] if tree_source else []),
        sockets=sockets,
        socket_links=build.link_sockets(sockets, family),
        nvlinks=nvlinks,
        loose_slots=loose,
    )
    gpus = [d for d in machine.devices() if d.kind == "gpu"]
    if functions and caps.smi is not None:
        links, smi_warnings = merge.nvlinks_from_smi(caps.smi, gpus)
        warnings += smi_warnings
        machine.nvlinks = links
    elif caps.nccl is not None and caps.nccl.nvlinks:
        by_bdf = {d.bdf: d.id for d in gpus}
        machine.nvlinks = [
            NvLink(between=(by_bdf[a], by_bdf[b]), links=n, arch=bandwidth.gpu_arch_of(gpus[0].model))
            for a, b, n in caps.nccl.nvlinks
            if a in by_bdf and b in by_bdf
        ]
    return Machine.model_validate(machine.model_dump(by_alias=True)), warnings


def _family(caps: Captures, cpus: list[dict]) -> str | None:
    if cpus and cpus[0].get("version"):
        fam = bandwidth.cpu_family_of(cpus[0]["version"])
        if fam != "unknown":
            return fam
    if caps.nccl is not None and caps.nccl.cpus:
        cpu = caps.nccl.cpus[0]
        if "amd" in str(cpu.get("vendor", "")).lower():
            return "amd"
        return _intel_family(cpu.get("familyid"), cpu.get("modelid"))
    return None


def _intel_family(familyid: object, modelid: object) -> str | None:
    """NCCL's CPU ids to a bandwidth-table key (Intel family 6 model numbers)."""
    try:
        fam, model = int(str(familyid), 0), int(str(modelid), 0)
    except ValueError:
        return None
    if fam != 6:
        return None
    return {0x55: "skylake", 0x6A: "icelake", 0x6C: "icelake", 0x8F: "sapphirerapids", 0xCF: "emeraldrapids"}.get(
        model, "qpi"
    )


def _description(system: dict) -> str:
    words = [system.get("manufacturer", ""), system.get("product", "")]
    return " ".join(w for w in words if w).strip()
