"""The time estimates' measurements (placement.estimate): disks measured, not the page cache; the
write probe touches only a file of its own; cold and warm inputs give different estimates."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from placement import estimate as est
from placement.estimate import PlaceCost, cached_share, write_rate


def test_the_write_probe_leaves_the_directory_as_it_found_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed to its fsync, in a file of its own removed afterwards; a directory not there yet is
    measured at its nearest parent (the same file system); a file that happens to bear the probe's
    name is neither written nor removed (created exclusively)."""
    (tmp_path / "keep.bin").write_bytes(b"data")
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(est.os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    rate = write_rate(tmp_path / "not" / "yet", probe=2 << 20)
    assert rate is not None and rate > 0 and synced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin"]
    monkeypatch.setattr(est.secrets, "token_hex", lambda n: "fixed")
    theirs = tmp_path / f"{est.PROBE_PREFIX}{os.getpid()}-fixed"
    theirs.write_bytes(b"not ours")
    assert write_rate(tmp_path, probe=1 << 20) is None
    assert theirs.read_bytes() == b"not ours"


def test_cached_share_tells_the_page_cache_from_the_disk(tmp_path: Path) -> None:
    """A file just read is all in the page cache; once its pages are dropped it is not (where
    the file system lets them go: tmpfs keeps them)."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    with open(path, "rb") as fh:
        fh.read()
        assert cached_share(path) == 1.0
        assert cached_share(path, offset=4 << 20, windows=3, window=1 << 20) == 1.0
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    dropped = cached_share(path)
    if dropped == 1.0:
        pytest.skip("this file system keeps its pages in memory (tmpfs)")
    assert dropped < 0.5
    assert cached_share(tmp_path / "missing") == 0.0


def _cost(feature_read: int, read: float | None, writes: float | None) -> PlaceCost:
    out = Path("/out")
    return PlaceCost(
        feature_bytes=10 << 30,
        feature_read=feature_read,
        bin_bytes_by_dir={out: 10 << 30},
        out=out,
        array_bytes=2 << 30,
        topology_read=0,
        copied_bytes=1 << 30,
        nodes=10_000_000,
        read_rate=read,
        write_rates={out: writes},
        cores=2,
    )


def test_a_cold_input_and_a_slow_disk_lengthen_the_estimate_a_warm_one_does_not() -> None:
    """Each step the slower of its disk and its CPU: features in the page cache cost their CPU
    only; read from a 0.1 GB/s disk, their read time; and the line says what it assumed."""
    warm, cold = _cost(0, None, 100e9), _cost(10 << 30, 0.1e9, 100e9)
    cpu = (10 << 30) * est.BIN_NS_PER_BYTE * 1e-9
    assert warm.bins_s == pytest.approx(cpu)
    assert cold.bins_s == pytest.approx((10 << 30) / 0.1e9 + (10 << 30) / 100e9)
    slow_writes = _cost(0, None, 0.2e9)
    assert slow_writes.arrays_s == pytest.approx((2 << 30) / 0.2e9)
    assert warm.seconds == pytest.approx(est.FIXED_S + warm.bins_s + warm.arrays_s)  # load 0
    line = cold.line()
    assert "if the machine stays as loaded as now" in line and "not in the page cache, read at 0.10 GB/s" in line
    assert "writes at 100.00 GB/s (a write+fsync" in line and "ns a byte of copied topology" in line
    assert (
        "the input in the page cache" in _cost(0, None, None).line()
        and "writes not measured" in _cost(0, None, None).line()
    )


def test_the_bin_pass_cpu_side_shares_the_cores_up_to_its_cap() -> None:
    """The bin pass runs on up to BIN_CORES cores: 4 cores halve the 2 measured cores' CPU side,
    and past BIN_CORES (memory bandwidth, measured on a 16-core server) more cores change nothing."""
    two, four, many = _cost(0, None, 100e9), _cost(0, None, 100e9), _cost(0, None, 100e9)
    four.cores, many.cores = 4, 4 * est.BIN_CORES
    assert four.bins_s == pytest.approx(two.bins_s / 2)
    assert many.bins_s == pytest.approx(two.bins_s * est.MEASURED_CORES / est.BIN_CORES)


def test_the_load_average_slows_the_cpu_side_only() -> None:
    """Others' runnable threads take the cores the CPU side needs (load 8 on 2 cores: 4× as long);
    a disk-bound step is not slowed, and a load below the cores changes nothing."""
    idle, busy = _cost(0, None, 100e9), _cost(0, None, 100e9)
    busy.load = 8.0
    assert busy.bins_s == pytest.approx(4 * idle.bins_s) and busy.arrays_s == pytest.approx(4 * idle.arrays_s)
    assert "×4.0 for the load average of 8.0 on 2 cores" in busy.line() and "×" not in idle.line()
    cold, cold_busy = _cost(10 << 30, 0.1e9, 100e9), _cost(10 << 30, 0.1e9, 100e9)
    cold_busy.load = 8.0
    assert cold_busy.bins_s == pytest.approx(cold.bins_s)
    light = _cost(0, None, 100e9)
    light.load = 1.5
    assert light.seconds == pytest.approx(idle.seconds)
