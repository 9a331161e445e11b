"""`moment bench`: measurements on this machine (files, DRAM), written into a profile copy."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moment.errors import MomentError
from moment.topology import measure
from moment.topology.profile_io import load_profile


@pytest.fixture()
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "features.bin"
    path.write_bytes(os.urandom(8 * 1024 * 1024))
    return path


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_random_read_measures_something(data_file: Path, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not native:  # where the compiled loop cannot be built: os.preadv per read
        monkeypatch.setattr(measure, "native_preads", lambda: None)
    res = measure.random_read(str(data_file), read_size=4096, queue_depth=4, seconds=0.3)
    assert res.gbps > 0 and res.iops > 0
    assert res.gbps == pytest.approx(res.iops * 4096 / 1e9, rel=1e-9)


def test_random_read_failure_is_one_error_naming_the_file(data_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read failing in a worker thread stops the measurement with the file's name (it used to
    die inside the thread, printing a traceback, and report a rate from the other threads)."""

    def failing(fd: int, base: int, offsets, dests, sizes, start: int) -> tuple[int, int]:
        return 3, 0  # the fourth read failed

    def eio(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(measure, "native_preads", lambda: failing)
    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(MomentError, match=rf"{data_file.name}: random reads failed: Input/output error"):
        measure.random_read(str(data_file), read_size=4096, queue_depth=2, seconds=0.2)


def test_dram_copy() -> None:
    assert measure.dram_copy_gbps(megabytes=32, repeats=2) > 0.1


def test_bench_writes_measured_figures(data_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "measured.yaml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moment",
            "bench",
            "--profile",
            "moment-machine-b",
            "--out",
            str(out),
            "--file",
            f"{data_file}:nvme3",
            "--seconds",
            "0.3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["measurements"]
    pages = next(r for r in rows if r["what"].startswith("random 4,096 B reads"))
    large = next(r for r in rows if r["what"].startswith("random 1,048,576 B reads"))
    assert (pages["gives"], large["gives"]) == ("iops", "read_gbps")
    assert pages["gbps"] == pytest.approx(pages["iops"] * 4096 / 1e9)
    m = load_profile(out)
    nvme3 = next(d for d in m.devices() if d.id == "nvme3")
    assert nvme3.read_gbps == pytest.approx(large["gbps"], rel=1e-3)  # the GB/s of large reads
    assert nvme3.iops == round(pages["iops"])  # the rate of page reads
    nvme0 = next(d for d in m.devices() if d.id == "nvme0")
    assert (nvme0.read_gbps, nvme0.iops) == (6.44, 1_258_291)  # untouched
    dram = next(r for r in rows if r["what"] == "DRAM copy")
    assert m.sockets[0].dram_gbps == pytest.approx(dram["gbps"], rel=1e-3)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["bench", "--file", "/nonexistent/file"], "no such file"),
        (["bench", "--out", "x.yaml"], "--out needs --profile"),
        (
            [
                "bench",
                "--profile",
                "moment-machine-b",
                "--out",
                "x.yaml",
                "--file",
                "{f}:gpu0",
                "--no-dram",
                "--seconds",
                "0.1",
            ],
            "gpu0 is not an NVMe SSD",
        ),
        (["bench", "--read-size", "1000"], "--read-size must be a multiple of 512"),
        (["bench", "--large-read", "100"], "--large-read must be a multiple of 512"),
    ],
)
def test_bench_errors(args: list[str], needle: str, data_file: Path, tmp_path: Path) -> None:
    args = [a.replace("{f}", str(data_file)) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "moment", *args], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode != 0
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_gpu_copies_skip_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    h2d, peer = measure.gpu_copies(megabytes=16)
    if not torch.cuda.is_available():
        assert h2d == {} and peer == {}
    else:  # on a GPU machine: one figure per device
        assert len(h2d) == torch.cuda.device_count() and all(v > 0 for v in h2d.values())


def test_cuda_devices_match_profile_gpus_by_bus_id() -> None:
    machine = load_profile(Path(__file__).parent.parent / "topology_profiles" / "switchtec-8x3090.yaml")
    bus = ["0000:10:00.0", "0000:99:00.0", "0000:0f:00.0"]  # CUDA order; 99: a GPU the profile lacks
    assert measure.profile_gpus(machine, bus) == {0: "gpu1", 2: "gpu0"}


def test_iops_is_written_only_when_measured_in_pages() -> None:
    """The planner counts IOPS in 4 KiB pages: a rate of 8 KiB reads would overstate what the
    drive serves of pages, so it is reported but not written; read_gbps is the large reads'."""
    machine = load_profile(Path(__file__).parent.parent / "topology_profiles" / "moment-machine-b.yaml")

    def res(size: int, iops: float) -> measure.ReadResult:
        return measure.ReadResult("f", iops * size / 1e9, iops, size, 32, True)

    large = res(1 << 20, 3000.0)
    m = measure.apply_measurements(machine, {"nvme3": (res(4096, 500_000.0), large)}, None, {}, {})
    nvme3 = next(d for d in m.devices() if d.id == "nvme3")
    assert (nvme3.iops, nvme3.read_gbps) == (500_000, float(f"{large.gbps:.4g}"))
    m = measure.apply_measurements(machine, {"nvme3": (res(8192, 400_000.0), large)}, None, {}, {})
    assert next(d for d in m.devices() if d.id == "nvme3").iops == 1_258_291  # the profile's, kept
