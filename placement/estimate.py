"""How long a long step should take, said before it starts: what ``moment place`` prints before
writing, what ``moment dataset import --dry-run`` prints, and the README's projection for the
paper's Machine B (``scripts/place_projection.py``): one model, here.

The disks are measured now, never the page cache: a cold read drops the probed pages first
(``POSIX_FADV_DONTNEED``); a write is timed to its ``fsync``; what an input already has in the
page cache (``mincore``, sampled) is counted as read at no cost. The CPU side is a cost per
edge, vertex and feature byte measured on the development machine (2 cores): the estimate says
so, since another machine's cores make it shorter or longer. Each step counts the slower of its
disk and its CPU (they overlap: reads ahead, hashing and fsync run in threads).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from placement.writer import GROUP_THREADS

# import speed of the edges and labels / a copy's, per byte, on the 2-core development VM, 2 threads,
# 20 M vertices / 300 M edges, 16-dim: before the one-read CSR build 0.72-0.83x idle (0.13x at load
# average 8); with it (9c600af), idle, the import took 14.9 and 17.8 s against 45.8 and 26.0 s before
# (interleaved, page cache dropped, 2026-11-27 19:28 UTC) where a copy of its inputs took 15.6-20.6 s:
# about 1x. Kept at 0.5: the CSR build is CPU-bound, and a loaded machine or fewer cores than the
# disks need halves it; an estimate that comes out long is the safer mistake before a long job.
COPY_RATIO = 0.5
PROBE_BYTES = 64 << 20  # the read probe's and the write probe's size
PROBE_PREFIX = ".moment-write-probe-"  # + pid + random token: a file only this process created

# Wall seconds per unit of ``moment place`` after pre-sampling, on the 2-core development VM, idle
# (20 M vertices / 300 M edges, 16-dim float32, Machine B plan; README "place at 20 M / 300 M"):
# the CPU side, which is what bounds place there (its disk writes are buffered and fsynced in
# threads). The graph is not rewritten: the dataset's topology, labels and splits are linked, their
# checksums taken by the check scan as it reads them (before this estimate: no second read); where
# the file system refuses a link they are copied and the copies hashed in a thread beside the bin pass.
# The bin pass (read, group by bin, copy into the write buffers, hash) runs on up to BIN_CORES cores.
# Its CPU side with no disk (bins on /dev/shm), 2 threads on the VM's 2 cores, idle: 0.59-0.68 ns
# a feature byte (`python scripts/bench_bin_pass.py --rows 20000000 --dim 16 --threads 1,2 --dir
# /dev/shm/binpass`, and `--rows 312500 --dim 1024`, two runs each, 2026-11-27 20:35 UTC; one
# thread 0.55-0.74: one grouping thread already kept both cores about busy). Scaled by the cores
# up to BIN_CORES.
BIN_NS_PER_BYTE = 0.65
# The most cores the bin pass's CPU side speeds up with: the threads it groups with, at most 4
# (placement/writer.py GROUP_THREADS: the first 16-core server peaked at 4 threads, 3.67 GB/s, 0.27
# ns a byte of wall time; this model's 0.65 x 2 / 4 = 0.33 ns is that, with a fifth to spare).
BIN_CORES = GROUP_THREADS
HASH_NS_PER_BYTE = 0.2  # xxh3 of copied files read from the page cache, in their own thread (the
# bench's checksums: 0.68 busy seconds for the bins' 1.28 GB and the then-rehashed topology's 1.6 GB)
ARRAY_NS_PER_VERTEX = 8.0  # the row map (a counting sort by bin), written and hashed: 0.16 s at 20 M
FIXED_S = 0.3  # thread pools, small files, their fsync, the commit's renames
MEASURED_CORES = 2  # the cores those costs were measured with (the row map uses up to 4)


def read_rate(path: Path, probe: int = PROBE_BYTES) -> float | None:
    """Bytes per second a cold sequential read of ``path`` gets now: ``probe`` bytes from its middle,
    their cached pages dropped first (``posix_fadvise``); None where that cannot be measured."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            start = max(0, size // 2 - probe // 2) & ~4095
            length = min(probe, size - start)
            if length < 1 << 20:
                return None
            os.posix_fadvise(fh.fileno(), start, length, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = len(os.pread(fh.fileno(), length, start))
            took = time.perf_counter() - t0
    except (OSError, AttributeError):
        return None
    return got / took if took > 0 else None


def write_rate(directory: Path, probe: int = PROBE_BYTES, tries: int = 2) -> float | None:
    """Bytes per second ``probe`` bytes written and fsynced in ``directory`` (or its nearest
    existing parent: the same file system) get now, the faster of ``tries`` (one write stalled by
    another job's burst says little). The file is this process's own (created exclusively, named
    ``PROBE_PREFIX`` + pid + a random token) and removed afterwards; None where it cannot be
    written (read-only, no space)."""
    rates = [_write_once(directory, probe) for _ in range(tries)]
    return max((r for r in rates if r), default=None)


def _write_once(directory: Path, probe: int) -> float | None:
    where = Path(directory).absolute()
    while not where.is_dir() and where != where.parent:
        where = where.parent
    path = where / f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()  # not compressible
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        t0 = time.perf_counter()
        for _ in range(max(1, probe >> 20)):
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        took = time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        path.unlink()
    return max(1, probe >> 20) * len(block) / took if took > 0 else None


def cached_share(path: Path, offset: int = 0, windows: int = 256, window: int = 1 << 20) -> float:
    """Share of ``path``'s bytes from ``offset`` on that are in the page cache now (``mincore``
    over ``windows`` windows of ``window`` bytes spread over it); 0 where it cannot be told."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= offset:
                return 1.0
            mapped = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
    except (OSError, AttributeError, ValueError):
        return 0.0
    page = mmap.PAGESIZE
    try:
        base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
        first, pages = offset // page, -(-size // page) - offset // page
        span = max(1, window // page)
        starts = np.unique(
            np.linspace(first, first + max(0, pages - span), min(windows, -(-pages // span)), dtype=np.int64)
        )
        vec = (ctypes.c_ubyte * span)()
        seen = resident = 0
        for p in starts.tolist():
            length = min(span, first + pages - p)
            if libc.mincore(ctypes.c_void_p(base + p * page), ctypes.c_size_t(length * page), vec) != 0:
                return 0.0
            resident += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8)[:length] & 1))
            seen += length
        return resident / seen if seen else 0.0
    finally:
        mapped.close()


@dataclass
class PlaceCost:
    """``moment place`` after pre-sampling: the bin pass (copied dataset files hashed beside it) and
    the arrays (the row map; copies of the dataset's files where they cannot be linked), each
    the slower of its disk and its CPU side, and the fixed costs."""

    feature_bytes: int
    feature_read: int  # of them, bytes not in the page cache: read from disk
    bin_bytes_by_dir: dict[Path, int]
    out: Path  # where the arrays go
    array_bytes: int  # the row map, hotness, and copies of the dataset's files if any (to ``out``)
    topology_read: int  # bytes of the copied topology not in the page cache (links are not read again)
    copied_bytes: int  # the dataset's topology, labels and splits copied (not linked): hashed from the copy
    nodes: int
    read_rate: float | None  # cold read, bytes/s (None: not measured: reads count as free)
    write_rates: dict[Path, float | None]  # write+fsync per target directory (None: not measured)
    cores: int
    load: float = 0.0  # the 1-minute load average when estimated (others' runnable threads slow the CPU side)

    def _disk(self, read: int, writes: dict[Path, int]) -> float:
        seconds = read / self.read_rate if self.read_rate else 0.0
        return seconds + sum(b / r for d, b in writes.items() if (r := self.write_rates.get(d)))

    @property
    def slowdown(self) -> float:
        """How much longer the CPU side takes for the threads already running: the load average per
        core, at least 1 (an idle machine)."""
        return max(1.0, self.load / max(1, self.cores))

    @property
    def bins_s(self) -> float:
        cpu = self.feature_bytes * BIN_NS_PER_BYTE * 1e-9 * MEASURED_CORES / max(1, min(self.cores, BIN_CORES))
        cpu = max(cpu, self.copied_bytes * HASH_NS_PER_BYTE * 1e-9) * self.slowdown  # the hashing: one thread beside
        return max(cpu, self._disk(self.feature_read, self.bin_bytes_by_dir))

    @property
    def arrays_s(self) -> float:
        cpu = self.nodes * ARRAY_NS_PER_VERTEX * 1e-9
        cpu *= MEASURED_CORES / max(1, min(self.cores, 4)) * self.slowdown
        return max(cpu, self._disk(self.topology_read, {self.out: self.array_bytes}))

    @property
    def seconds(self) -> float:
        return FIXED_S * self.slowdown + self.bins_s + self.arrays_s

    def line(self) -> str:
        """What ``moment place`` prints before writing: the time, and what it assumes."""
        rates = [r for r in self.write_rates.values() if r]
        writes = (
            f"writes at {min(rates) / 1e9:.2f}"
            + (f"–{max(rates) / 1e9:.2f}" if max(rates) > min(rates) * 1.05 else "")
            + f" GB/s (a write+fsync of up to {PROBE_BYTES >> 20} MiB in each target directory just now, the faster of two)"
            if rates
            else "writes not measured"
        )
        reads = (
            f"{(self.feature_read + self.topology_read) / 1e9:.2f} GB of the input not in the page cache, read at "
            f"{self.read_rate / 1e9:.2f} GB/s (a cold {PROBE_BYTES >> 20} MiB read of the features just now)"
            if self.read_rate
            else "the input in the page cache"
            if not self.feature_read + self.topology_read
            else "reads not measured"
        )
        load = (
            f"; ×{self.slowdown:.1f} for the load average of {self.load:.1f} on {self.cores} cores"
            if self.slowdown > 1
            else ""
        )
        return (
            f"expected: about {_seconds(self.seconds)} from here (bin pass {_seconds(self.bins_s)}, row map and "
            f"arrays {_seconds(self.arrays_s)}), if the machine stays as loaded as now: {reads}; {writes}; CPU at "
            f"{BIN_NS_PER_BYTE} ns a feature byte, {HASH_NS_PER_BYTE:g} ns a byte of copied topology and "
            f"{ARRAY_NS_PER_VERTEX:g} ns a vertex on {MEASURED_CORES} idle cores (the development machine's){load}; "
            "each step the slower of disk and CPU"
        )


def _seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 10 else f"{s:.1f} s"
