"""``moment profile``: gather captures (a folder of saved outputs, or this machine) into a Machine.

Each source is optional and independent; one that cannot be read becomes a warning naming it,
never a crash. The PCIe tree comes from the richest tree source present
(lspci -vvv > sysfs > lspci -tv > NCCL XML > nvidia-smi relations); dmidecode adds slots,
nvidia-smi and NCCL add NVLink.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from moment.contracts import first_error
from moment.errors import MomentError, SourceError
from moment.topology import bandwidth, build, merge
from moment.topology.model import Machine, NvLink
from moment.topology.pci import PciFunction
from moment.topology.sources.dmidecode import DmiSlot, parse_dmidecode_slots, parse_dmidecode_system
from moment.topology.sources.lspci_tree import parse_lspci_tree
from moment.topology.sources.lspci_verbose import parse_lspci_verbose
from moment.topology.sources.nccl_xml import NcclTopo, parse_nccl_xml
from moment.topology.sources.nvidia_smi import SmiTopo, parse_nvidia_smi_topo
from moment.topology.sources.sysfs import read_sysfs

# File names ``moment profile --from DIR`` looks for, per source.
CAPTURE_NAMES: dict[str, tuple[str, ...]] = {
    "lspci_tree": ("lspci-tv.txt", "lspci-t.txt", "lspci-tvnn.txt"),
    "lspci_verbose": ("lspci-vvv.txt", "lspci-vvnn.txt", "lspci-vvvnn.txt", "lspci-vv.txt"),
    "dmidecode": ("dmidecode.txt", "dmidecode-t-slot.txt"),
    "nvidia_smi": ("nvidia-smi-topo-m.txt",),
    "nccl_xml": ("nccl-topo.xml",),
}

T = TypeVar("T")


@dataclass
class Captures:
    """What was read from each source; None where the source was absent or unreadable."""

    origin: str
    verbose: list[PciFunction] | None = None
    tree: list[PciFunction] | None = None
    sysfs: list[PciFunction] | None = None
    slots: list[DmiSlot] | None = None
    system: dict = field(default_factory=dict)
    smi: SmiTopo | None = None
    nccl: NcclTopo | None = None
    used: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

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


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def read_capture_dir(directory: str | Path) -> Captures:
    """Parse whichever known capture files ``directory`` holds."""
    root = Path(directory)
    if not root.is_dir():
        raise MomentError(f"{root}: not a directory of captures")
    caps = Captures(origin=str(root))
    found = {key: next((root / n for n in names if (root / n).is_file()), None) for key, names in CAPTURE_NAMES.items()}
    if not any(found.values()):
        wanted = ", ".join(n for names in CAPTURE_NAMES.values() for n in names[:2])
        raise MomentError(f"{root}: no capture files found (looked for {wanted})")
    if p := found["lspci_verbose"]:
        caps.verbose = caps.parse(p.name, lambda: parse_lspci_verbose(_read(p), p.name, caps.warnings))
    if p := found["lspci_tree"]:
        caps.tree = caps.parse(p.name, lambda: parse_lspci_tree(_read(p), p.name, caps.warnings))
    if p := found["dmidecode"]:
        text = _read(p)
        caps.slots = caps.parse(p.name, lambda: parse_dmidecode_slots(text, p.name, caps.warnings))
        if caps.slots is not None:
            caps.system = parse_dmidecode_system(text)
    if p := found["nvidia_smi"]:
        caps.smi = caps.parse(p.name, lambda: parse_nvidia_smi_topo(_read(p), p.name, caps.warnings))
    if p := found["nccl_xml"]:
        caps.nccl = caps.parse(p.name, lambda: parse_nccl_xml(_read(p), p.name, caps.warnings))
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
    caps.sysfs = caps.parse("sysfs", lambda: read_sysfs(sysfs_root))
    caps.tree = caps.parse("lspci -tv", lambda: parse_lspci_tree(_run(["lspci", "-tv"]), "lspci -tv", caps.warnings))
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        caps.warnings.append("skipped dmidecode: needs root (run `sudo moment profile` for slot names)")
    else:
        text = caps.parse("dmidecode", lambda: _run(["dmidecode"]))
        if text is not None:
            caps.slots = caps.parse("dmidecode slots", lambda: parse_dmidecode_slots(text, "dmidecode", caps.warnings))
            caps.system = parse_dmidecode_system(text)
    caps.smi = caps.parse(
        "nvidia-smi topo -m",
        lambda: parse_nvidia_smi_topo(_run(["nvidia-smi", "topo", "-m"]), "nvidia-smi topo -m", caps.warnings),
    )
    return caps


def _tree_functions(caps: Captures) -> tuple[list[PciFunction] | None, str | None]:
    """The richest tree source, with names filled in from lspci where sysfs has none."""
    names = {f.bdf: f.name for f in (caps.tree or []) + (caps.verbose or []) if f.name}
    for label, functions in (("lspci -vvv", caps.verbose), ("sysfs", caps.sysfs), ("lspci -tv", caps.tree)):
        if functions:
            for f in functions:
                if f.bdf in names and (not f.name or f.name.startswith("vendor ")):
                    f.name = names[f.bdf]
            return functions, label
    if caps.nccl is not None and caps.nccl.functions:
        return caps.nccl.functions, "NCCL XML"
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
    cpus = caps.system.get("cpus") or []
    family = _family(caps, cpus)
    nvlinks = []
    if functions:
        tree = build.build_tree(functions, sockets_hint=len(cpus) or None)
        warnings += tree.warnings
        sockets = tree.sockets
        family = family or tree.cpu_family
    elif caps.smi is not None:
        sockets, nvlinks, smi_warnings = merge.machine_parts_from_smi(caps.smi)
        warnings += smi_warnings
        tree_source = "nvidia-smi"
    else:
        why = "; ".join(caps.warnings) or "need lspci, sysfs, NCCL XML or nvidia-smi"
        raise MomentError(f"{caps.origin}: no usable source describes the PCIe tree ({why})")
    for socket, cpu in zip(sockets, cpus):
        socket.model = cpu.get("version") or ""
        socket.cores = cpu.get("cores") or None
    if caps.system.get("memory_gb") and sockets:
        for socket in sockets:
            socket.dram_gb = round(caps.system["memory_gb"] / len(sockets), 3)
    loose = []
    if caps.slots and functions:
        loose, slot_warnings = merge.attach_dmi_slots(sockets, caps.slots, {f.bdf: f for f in functions})
        warnings += slot_warnings
    elif functions:
        n = build.infer_slots(sockets)
        warnings.append(f"no dmidecode: {n} slot(s) inferred from leaf ports (names are port addresses)")
    machine = Machine(
        name=name,
        description=_description(caps),
        sources=[f"{s} ({Path(caps.origin).name})" for s in caps.used] + ([f"tree from {tree_source}"] if tree_source else []),
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
    return {0x55: "skylake", 0x6A: "icelake", 0x6C: "icelake", 0x8F: "sapphirerapids", 0xCF: "emeraldrapids"}.get(model, "qpi")


def _description(caps: Captures) -> str:
    system = caps.system
    words = [system.get("manufacturer", ""), system.get("product", "")]
    return " ".join(w for w in words if w).strip()
