"""The live path: `moment profile` on this machine finds the PCI devices sysfs lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moment.topology.pci import GPU, NIC, NVME, STORAGE, PciFunction, classify
from moment.topology.profile_io import load_profile

SYSFS = Path("/sys/bus/pci/devices")


def _sysfs_devices() -> set[str]:
    """Addresses of the GPU/NVMe/NIC/storage functions sysfs lists, read here independently."""
    found = set()
    for entry in SYSFS.iterdir():
        cls = (entry / "class").read_text().strip()  # e.g. 0x020000
        vendor = (entry / "vendor").read_text().strip()[2:]
        fn = PciFunction(bdf=entry.name, class_code=cls[2:6], vendor_id=vendor)
        if classify(fn) in (GPU, NVME, NIC, STORAGE):
            found.add(entry.name)
    return found


@pytest.mark.skipif(not SYSFS.is_dir() or not any(SYSFS.iterdir()), reason="no PCI devices in sysfs here")
def test_live_profile_finds_sysfs_devices(tmp_path: Path) -> None:
    out = tmp_path / "live.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "moment", "profile", "--out", str(out), "--name", "live", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    machine = load_profile(out)
    in_profile = {f for d in machine.devices() for f in d.functions}
    expected = _sysfs_devices()
    assert expected <= in_profile, f"sysfs lists {sorted(expected - in_profile)} but the profile lacks them"
    data = json.loads(done.stdout)
    assert data["sockets"] >= 1
    assert data["gpus"] == sum(d.kind == "gpu" for d in machine.devices())
