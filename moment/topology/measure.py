"""``moment bench``: measure the bandwidths the planner would otherwise take from spec tables.

Read-only and safe: SSDs are measured by random reads of a file (or of a block device opened
read-only), twice: of one page (4 KiB, :data:`~moment.ssd_reads.PAGE_BYTES`), whose rate
is the drive's ``iops``, and of large blocks (1 MiB), whose GB/s is its ``read_gbps`` — the two
figures the planner charges an SSD with (:mod:`moment.ssd_reads`). DRAM by a memory copy;
with CUDA, host→GPU copies per GPU and GPU→GPU peer copies. Measured figures go into a copy of the
profile (``gbps`` on links, ``read_gbps``/``iops`` on SSDs, ``dram_gbps`` on sockets), where they
override the bandwidth table. (``scripts/bench_*`` are something else: benchmarks of moment itself.)
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moment import hw
from moment.cores import usable_cores
from moment.errors import MomentError, UsageError
from moment.hw import cuda_bus_ids, parse_bdf
from moment.preads import native_preads
from moment.topology.model import Machine

# Random reads per call of the compiled read loop in random_read (a few ms of reads at most).
READ_CHUNK = 64
PAGE_READ = 4096  # the page reads an SSD's iops is measured in (moment.ssd_reads.PAGE_BYTES)
LARGE_READ = 1 << 20  # reads large enough for an SSD's GB/s, not its IOPS, to bound them


@dataclass
class ReadResult:
    path: str
    gbps: float
    iops: float
    read_size: int
    queue_depth: int
    direct: bool  # O_DIRECT (page cache bypassed); False where the filesystem refused it


def _open(path: str) -> tuple[int, bool]:
    """Open read-only, with O_DIRECT where the filesystem allows it."""
    flags = os.O_RDONLY
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct), True
        except OSError:
            pass
    return os.open(path, flags), False


def file_spec(spec: str, machine: Any | None) -> tuple[str, str]:
    """``PATH[:DEVICE]`` of ``--file`` as (path, device id or ""), checked before anything is read:
    the path must be a file or block device, and DEVICE an NVMe SSD of the profile when one is given
    (with or without ``--out``: the figures are reported against it either way)."""
    path, dev = spec, ""
    head, _, tail = spec.rpartition(":")
    if head and tail and "/" not in tail:  # PATH:DEVICE
        path, dev = head, tail
    p = Path(path)
    if not p.exists():
        raise MomentError(f"{path}: no such file or device")
    if p.is_dir():
        raise MomentError(f"{path}: a directory, not a file or block device")
    if dev and machine is not None:
        check_ssd(machine, dev)
    return path, dev


def check_ssd(machine: Machine, dev_id: str) -> None:
    """``dev_id`` must name an NVMe SSD of ``machine`` (a GPU is not where a file sits)."""
    if not any(d.id == dev_id and d.kind == "nvme" for d in machine.devices()):
        raise UsageError(f"--file ...:{dev_id}: {dev_id} is not an NVMe SSD of {machine.name}")


def random_read(
    path: str, read_size: int = 4096, queue_depth: int = 32, seconds: float = 2.0, seed: int = 0
) -> ReadResult:
    """Random aligned reads of ``read_size`` bytes by ``queue_depth`` threads for ``seconds``.

    Each thread keeps one read in flight, so ``queue_depth`` reads are queued as an NVMe queue
    would see them. The reads run in the compiled loop of :mod:`moment.preads`, ``READ_CHUNK``
    per call with the GIL released: a Python ``os.preadv`` per read would cap the rate near
    0.5 M reads/s, below what one fast SSD delivers (``os.preadv`` is the fallback).
    """
    p = Path(path)
    if not p.exists():
        raise MomentError(f"{path}: no such file or device")
    try:
        # O_DIRECT needs 512-byte multiples; smaller rows are read buffered (page cache dropped).
        fd, direct = _open(path) if read_size % 512 == 0 else (os.open(path, os.O_RDONLY), False)
    except OSError as exc:
        raise MomentError(f"{path}: cannot open read-only: {exc.strerror}") from None
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        blocks = size // read_size
        if blocks < 1:
            raise UsageError(f"{path}: smaller than one read of {read_size} bytes")
        if not direct:  # buffered reads would measure the page cache: drop it for this file
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        native = native_preads()  # compiled before the clock starts
        done = [0] * queue_depth
        stop = time.perf_counter() + seconds

        errors: list[OSError] = []

        def worker(i: int) -> None:
            try:
                read_for(i)
            except OSError as exc:  # raised below, after every thread has stopped
                errors.append(exc)

        def read_for(i: int) -> None:
            rng = np.random.default_rng(seed * 1000 + i)
            buf = mmap.mmap(-1, read_size)  # page-aligned, as O_DIRECT needs
            n = 0
            if native is None:
                while time.perf_counter() < stop:
                    os.preadv(fd, [buf], int(rng.integers(blocks)) * read_size)
                    n += 1
            else:
                address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
                dests, sizes = np.zeros(READ_CHUNK, dtype=np.int64), np.full(READ_CHUNK, read_size, dtype=np.int64)
                while time.perf_counter() < stop:
                    offsets = rng.integers(0, blocks, READ_CHUNK, dtype=np.int64) * read_size
                    k, _ = native(fd, address, offsets, dests, sizes, 0)
                    if k < READ_CHUNK:  # a failed read: learn why from the same read in Python
                        os.preadv(fd, [buf], int(offsets[k]))
                        raise OSError(errno.EIO, f"{path}: short read at byte {int(offsets[k])}")
                    n += READ_CHUNK
            done[i] = n
            buf.close()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(queue_depth)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        raise MomentError(f"{path}: random reads failed: {errors[0].strerror or errors[0]}")
    reads = sum(done)
    return ReadResult(path, reads * read_size / elapsed / 1e9, reads / elapsed, read_size, queue_depth, direct)


def dram_copy_gbps(megabytes: int = 256, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes copied per second (one direction), best of ``repeats``, with one thread per core
    (numpy releases the GIL while copying): one thread alone reaches a fraction of a socket's
    memory bandwidth."""
    threads = threads or usable_cores()
    chunk = megabytes * 1024 * 1024 // 8 // threads
    src = [np.ones(chunk, dtype=np.float64) for _ in range(threads)]
    dst = [np.empty_like(a) for a in src]
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.copyto, args=(d, a)) for d, a in zip(dst, src)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, sum(a.nbytes for a in src) / (time.perf_counter() - t0) / 1e9)
    return best


def gpu_copies(megabytes: int = 512) -> tuple[dict[int, float], dict[tuple[int, int], float]]:
    """Host→GPU GB/s per CUDA device and GPU→GPU peer GB/s; empty without CUDA. Devices are
    numbered in PCI bus order, as the trainer numbers them.

    Each GPU's host buffer is allocated and pinned while this thread runs on the GPU's local CPUs
    (:func:`near`), so its pages sit in the GPU's NUMA node: a far socket's figure would be the
    inter-socket link's, not the GPU's PCIe link's, which is where the profile writes it. Pairs
    of GPUs without peer access are left out: their "peer" copy would be staged through host
    memory."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # read when CUDA initialises
    try:
        import torch
    except ImportError:
        return {}, {}
    if not torch.cuda.is_available():
        return {}, {}
    n = megabytes * 1024 * 1024
    bus = cuda_bus_ids()
    h2d: dict[int, float] = {}
    peer: dict[tuple[int, int], float] = {}
    for i in range(torch.cuda.device_count()):
        with near(bus[i] if i < len(bus) else None):
            host = torch.empty(n, dtype=torch.uint8).pin_memory()
            dev = torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}")
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(i)
            t0 = time.perf_counter()
            for _ in range(3):
                dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(i)
            h2d[i] = 3 * n / (time.perf_counter() - t0) / 1e9
            del host, dev
    for i in range(torch.cuda.device_count()):
        for j in range(torch.cuda.device_count()):
            if i != j and torch.cuda.can_device_access_peer(i, j):
                a = torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}")
                b = torch.empty(n, dtype=torch.uint8, device=f"cuda:{j}")
                b.copy_(a)
                _synchronize(torch, i, j)
                t0 = time.perf_counter()
                b.copy_(a)
                _synchronize(torch, i, j)  # the copy runs on i's stream, j's waits: both must be done
                peer[(i, j)] = n / (time.perf_counter() - t0) / 1e9
    return h2d, peer


@contextmanager
def near(bdf: str | None) -> Iterator[str | None]:
    """Run this thread on the CPUs local to the PCI device at ``bdf`` while inside, so memory it
    first touches (or pins) lands in the device's NUMA node; yields what it pinned to (None:
    nothing known about the device, nothing changed)."""
    cpus = hw.device_cpus(bdf) if bdf else set()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus & before or cpus)
    except OSError:
        yield None
        return
    try:
        yield f"CPUs local to {bdf}"
    finally:
        os.sched_setaffinity(0, before)


def _synchronize(torch: Any, *devices: int) -> None:
    """Wait for every device named (``torch.cuda.synchronize()`` waits for the current one only)."""
    for d in devices:
        torch.cuda.synchronize(d)


def apply_measurements(
    machine: Machine,
    ssd: dict[str, tuple[ReadResult, ReadResult]],
    dram: float | None,
    h2d: dict[str, float],
    peer: dict[tuple[str, str], float],
) -> Machine:
    """A copy of the profile with measured figures in place of table values.

    ``ssd``: device id → (page reads, large reads): ``iops`` from the first (when they were of
    :data:`PAGE_READ` bytes), ``read_gbps`` from the second; ``h2d``: GPU device id → host→GPU GB/s (set on the GPU's port
    link); ``peer``: (gpu, gpu) → GB/s (set on their NVLink, if they have one)."""
    m = machine.model_copy(deep=True)
    ports = {port.device.id: (port, port.device) for port, _ in m.iter_ports() if port.device is not None}
    for dev_id, (pages, large) in ssd.items():
        check_ssd(machine, dev_id)
        device = ports[dev_id][1]
        device.read_gbps = _figure(large.gbps)
        if pages.read_size == PAGE_READ:  # the planner counts IOPS in pages of this size
            device.iops = round(pages.iops)
    for gpu, gbps in h2d.items():
        if gpu in ports:
            ports[gpu][0].link.gbps = _figure(gbps)
    for nv in m.nvlinks:
        got = [peer[k] for k in (tuple(nv.between), tuple(reversed(nv.between))) if k in peer]
        if got:
            nv.gbps = _figure(min(got))
    if dram:
        for socket in m.sockets:
            socket.dram_gbps = _figure(dram)
    return m


def _figure(gbps: float) -> float:
    """A measured rate as the profile stores it: 4 significant digits (a slow disk's 0.0035 GB/s
    keeps its precision as well as a DRAM's 240.1)."""
    return float(f"{gbps:.4g}")


@dataclass
class Measured:
    """What one ``moment bench`` run measured: ``rows`` to report (JSON-ready), and the figures
    keyed by the profile's device ids for :func:`apply_measurements` (empty without a profile)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    ssd: dict[str, tuple[ReadResult, ReadResult]] = field(default_factory=dict)  # (page reads, large reads)
    dram: float | None = None
    h2d: dict[str, float] = field(default_factory=dict)
    peer: dict[tuple[str, str], float] = field(default_factory=dict)


def profile_gpus(machine: Any, bus_ids: Sequence[str]) -> dict[int, str]:
    """CUDA index → the profile's GPU id, matched by PCI address as the trainer matches them
    (:func:`moment.hw.parse_bdf`); a GPU the profile does not know is left out."""
    by_bdf = {parse_bdf(d.bdf): d.id for d in machine.devices() if d.kind == "gpu" and d.bdf}
    by_bdf.pop(None, None)
    return {i: by_bdf[key] for i, b in enumerate(bus_ids) if (key := parse_bdf(b)) in by_bdf}


def measure(
    files: Sequence[str],
    machine: Any | None,
    read_size: int = PAGE_READ,
    queue_depth: int = 32,
    seconds: float = 2.0,
    dram: bool = True,
    large_read: int = LARGE_READ,
) -> Measured:
    """Random reads of each ``PATH[:DEVICE]`` in ``files`` (all checked before any is read) of
    ``read_size`` bytes (the IOPS) and of ``large_read`` bytes (the GB/s), the DRAM copy
    (``dram``), and with CUDA the host→GPU and peer copies, matched to ``machine``'s devices
    where one is given."""
    got = Measured()
    for path, dev in [file_spec(spec, machine) for spec in files]:
        pair = []
        for size, gives in ((read_size, "iops"), (large_read, "read_gbps")):
            res = random_read(path, size, queue_depth, seconds)
            pair.append(res)
            note = None if gives != "iops" or size == PAGE_READ else f"not written: iops counts {PAGE_READ} B reads"
            got.rows.append(
                {
                    "what": f"random {size:,} B reads {path}",
                    "gbps": res.gbps,
                    "iops": res.iops,
                    "direct": res.direct,
                    "device": dev or None,
                    "gives": gives,
                    **({"note": note} if note else {}),
                }
            )
        if dev:
            got.ssd[dev] = (pair[0], pair[1])
    got.dram = dram_copy_gbps() if dram else None
    if got.dram:
        got.rows.append({"what": "DRAM copy", "gbps": got.dram})
    h2d_idx, peer_idx = gpu_copies()
    bus = cuda_bus_ids()
    gpu_of = profile_gpus(machine, bus) if machine is not None else {}
    for i, gbps in h2d_idx.items():
        got.rows.append(
            {"what": f"host→cuda:{i} ({bus[i] if i < len(bus) else '?'})", "gbps": gbps, "device": gpu_of.get(i)}
        )
    for (i, j), gbps in peer_idx.items():
        got.rows.append({"what": f"cuda:{i}→cuda:{j}", "gbps": gbps})
    if not h2d_idx:
        got.rows.append({"what": "GPU copies", "gbps": None, "note": "skipped: no CUDA device"})
    got.h2d = {gpu_of[i]: v for i, v in h2d_idx.items() if i in gpu_of}
    got.peer = {(gpu_of[i], gpu_of[j]): v for (i, j), v in peer_idx.items() if i in gpu_of and j in gpu_of}
    return got
