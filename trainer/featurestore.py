"""The tiered feature store: feature rows of dataset vertex ids on the rank's device, from the
tiers the placement put them in.

A vertex's row is ``old_to_new[id]`` (the placement's row map, memory-mapped read-only so that
the ranks of a host share its pages), and rows are ranges — GPU bins first, then CPU bins, then
SSD bins — so a row's location is a range lookup (``np.searchsorted`` on the bin starts,
vectorised over a batch). Tiers, as :meth:`TieredFeatureStore.stats` names them:

* ``gpu``: the GPU cache bin, in one tensor on ``device``. The cache is replicated: every rank
  holds the same hottest rows in its own GPU's memory, so a hit never crosses a link (the plan's
  ``workload.gpu_cache_policy``; the planner models it so).
* ``cpu``: the CPU cache bin, one host tensor.

Host memory is shared by the processes of a socket with ``host_shm=PATH`` (a file in a memory
file system, e.g. /dev/shm; see :mod:`trainer.shm` for the protocol): the file holds the GPU and
CPU bins (they are the first rows, so the file is the row range [0, first SSD row)), and the CPU
tier — on a CPU device the ``gpu`` tier too — is a view of one shared mapping of it. Every
process that names the same path uses one copy: the first to come writes it, the others map it.
* ``ssd``: read per call: the batch's SSD rows are deduplicated and sorted, grouped per bin and
  read by the reader (coalesced, all bins at once) into a reusable staging buffer — pinned when
  the device is CUDA, so the host→device copy is asynchronous; in GPU memory when the reader is
  kvikio (``io``: see :func:`trainer.readers.make_reader`). In a packed placement (``moment place
  --pack``) a bin's rows lie in the order training batches read them: the bin's slot map gives
  each row's file row, and the reader gets those, sorted (the rows one batch reads are then
  mostly consecutive: few, long reads, few pages each); packed within a budget, a replayed
  training batch reads its chunk and shared pages instead (:mod:`trainer.packs`).

On a GPU, rows of host-resident tiers are gathered into the same staging buffer, after the SSD
rows, and after one host→device copy one final gather (``assemble`` in the stats) puts every row
in its place in the output, so each SSD row is copied once after its read. On a CPU device each
row is put straight into its place in the output by a compiled copy on the calling thread
(:func:`put_rows`): a host tier's rows from the tier, the SSD rows from the staging buffer
(``assemble``); every row is copied once, and the prefetch thread running it leaves the other
cores to training (torch's gathers would split over its intra-op threads). On CUDA the CPU tier is
instead registered with CUDA (``uva``, :mod:`trainer.uva`; ``--host-gather``) and its rows are
gathered by a kernel reading it in place over PCIe, straight into the output: no host gather,
no staging, no extra copy (GPU review #17); where registration fails they take the staging
path. Seconds in the stats are host wall time: on CUDA they include
issuing, not finishing, the asynchronous copies. A store is not thread-safe: one ``get`` at a
time (it reuses its staging buffers).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment.contracts.tiers import TIERS
from placement.placed import Placed, PlacedBin, PlacedError
from trainer.packs import BatchChunks
from trainer.readers import Reader, ReadRequest, make_reader
from trainer.shm import map_shared, not_in_memory
from trainer.staging import Staging
from trainer.uva import HostMapping, UvaError

GPU, CPU, SSD = range(len(TIERS))


class TieredFeatureStore:
    """Features of dataset ids from the GPU, CPU and SSD tiers of a placed dataset, on ``device``."""

    def __init__(
        self,
        placed: Placed,
        device: str | torch.device = "cpu",
        reader: Reader | None = None,
        pin_memory: bool | None = None,
        host_shm: str | Path | None = None,
        io: str = "auto",
        stage_reserve: int = 0,
        uva: bool | None = None,
    ) -> None:
        """``placed``: the opened placed dataset (``open_placed`` refuses a missing or truncated
        bin, naming it); ``reader``: how SSD bins are read (default: ``make_reader(device, io=io)``
        probing the SSD bins, closed with the store); ``stage_reserve``: bytes of the staging
        buffers, allocated once now (a bound on one call's rows: :func:`trainer.staging.stage_bytes`;
        0: sized by the first call), so no pinned buffer is grown mid-training; ``uva``: gather the
        CPU tier's rows on the device from the tier itself, registered with CUDA (zero-copy reads,
        :mod:`trainer.uva`), instead of into the staging buffer (None: on a CUDA device; when
        registration fails the store stages them and ``host_gather_note`` says why)."""
        self.placed = placed
        self.device = _indexed(torch.device(device))
        self.dtype = torch.from_numpy(np.zeros(0, dtype=self.placed.feature_dtype)).dtype
        self.dim = self.placed.feature_dim
        self.row_bytes = self.placed.row_bytes
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.pin = bool(pin) and torch.cuda.is_available()
        self._owns_reader = reader is None
        if reader is None:  # io=auto on CUDA: whichever reader a short probe of the SSD bins finds faster
            probe = [(str(b.path), self.row_bytes) for b in self.placed.bins if b.tier == "ssd"]
            reader = make_reader(self.device, io=io, probe=probe)
        self.reader: Reader = reader
        if self.reader.on_device and self.device.type != "cuda":
            raise ValueError(
                f"{type(self.reader).__name__} reads into GPU memory: it needs a CUDA device, not {self.device}"
            )
        self._rows = _row_map(placed)  # dataset id → row (a shared read-only mapping)
        bins = self.placed.bins
        self._tier = np.array([TIERS.index(b.tier) for b in bins], dtype=np.int8)
        self._starts = np.array([b.start for b in bins], dtype=np.int64)
        self._offset = np.zeros(len(bins), dtype=np.int64)
        self.host_shm = None if host_shm is None else Path(host_shm)  # where host tiers are mapped from, if shared
        if self.host_shm is None:
            host = torch.device("cpu")
            self.gpu, self.cpu = self._load(GPU, self.device), self._load(CPU, host)
        else:
            self.gpu, self.cpu = self._map_shared(self.host_shm)
        self._tensors = (self.gpu, self.cpu)
        self._cpu_reg: HostMapping | None = None
        self._cpu_view: torch.Tensor | None = None  # the CPU tier as the device reads it (uva)
        self.host_gather_note: str | None = None
        if (self.device.type == "cuda" if uva is None else uva) and self.cpu.numel():
            self._map_cpu_tier()
        self._ssd = self._bins(SSD)
        self._ssd_starts = np.array([b.start for b in self._ssd], dtype=np.int64)
        # packed bins: each row's file row, in memory (4 B per row; a mapping read at random would
        # fault its pages in, with readahead, again and again under memory pressure)
        self._slots = [None if b.slots is None else np.load(b.slots) for b in self._ssd]
        self.chunks = BatchChunks(self.placed, self._ssd)  # packed within a budget: per-batch chunks
        cuda = self.device if self.device.type == "cuda" else None
        self._host_stage = Staging(torch.device("cpu"), self.pin, cuda, stage_reserve)
        self._dev_stage = Staging(self.device, False, cuda, stage_reserve) if self.reader.on_device else None
        self.reset_stats()

    # Set-up ##################################################################

    def _bins(self, tier: int) -> list[PlacedBin]:
        return [self.placed.bins[i] for i in np.flatnonzero(self._tier == tier)]

    def _load(self, tier: int, device: torch.device) -> torch.Tensor:
        """One tensor holding a tier's bins back to back; records each bin's first row in it."""
        which = np.flatnonzero(self._tier == tier)
        bins = [self.placed.bins[i] for i in which]
        out = torch.empty((sum(b.count for b in bins), self.dim), dtype=self.dtype, device=device)
        row = 0
        for i, b in zip(which, bins):
            self._offset[i] = row
            if b.count == 0:  # an empty bin (no GPU cache, the default): nothing to read
                continue
            dst = out[row : row + b.count]
            if device.type == "cpu":
                _read_whole(b.path, dst)
            else:  # through one small host buffer, not a bin-sized copy (a GPU cache is tens of GB)
                read_in_chunks(b.path, dst)
            row += b.count
        return out

    def _map_shared(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        """The gpu and cpu tiers from a shared mapping of ``path`` (the GPU bins, then the CPU
        bins), written there first if nobody has yet; on a CUDA device the GPU bins are loaded
        into its memory as usual."""
        host = np.flatnonzero(self._tier != SSD)
        bins = [self.placed.bins[i] for i in host]
        if any(b.tier == "gpu" for b in bins[sum(b.tier == "gpu" for b in bins) :]):
            raise PlacedError(f"{self.placed.root}: GPU bins do not come before CPU bins in the manifest")
        counts = np.array([b.count for b in bins], dtype=np.int64)
        first = np.cumsum(counts) - counts
        rows, gpu_rows = int(counts.sum()), int(sum(b.count for b in bins if b.tier == "gpu"))
        self._offset[host] = np.where(self._tier[host] == CPU, first - gpu_rows, first)
        if rows == 0:
            empty = torch.empty((0, self.dim), dtype=self.dtype)
            return self._load(GPU, self.device), empty
        shared = map_shared(path, [b.path for b in bins], rows, self.dim, self.dtype, self.placed.root)
        gpu, cpu = shared[:gpu_rows], shared[gpu_rows:]
        if self.device.type == "cpu":
            return gpu, cpu
        out = torch.empty(gpu.shape, dtype=self.dtype, device=self.device)  # from the mapping, not the disk again
        copy_in_chunks(gpu, out)
        return out, cpu

    def _map_cpu_tier(self) -> None:
        """Register the CPU tier for the device and view it from there; on failure, say why and
        keep gathering it on the host."""
        reg = HostMapping.over(self.cpu, self.device)
        try:
            reg.register()
            flat = reg.view(0, self.cpu.numel(), np.dtype(self.placed.feature_dtype))
        except UvaError as exc:
            reg.close()
            why = not_in_memory(self.host_shm.parent) if self.host_shm is not None else None
            self.host_gather_note = f"{exc}: CPU-tier rows are gathered on the host" + (f" ({why})" if why else "")
            return
        self._cpu_reg, self._cpu_view = reg, flat.view(-1, self.dim)

    @property
    def host_gather(self) -> str:
        """How CPU-tier rows reach the device: ``uva`` (a device gather reading the registered
        tier in place) or ``stage`` (gathered on the host into the staging buffer, then copied)."""
        return "uva" if self._cpu_view is not None else "stage"

    # Reading #################################################################

    def get(self, ids: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        """Feature rows of ``ids`` (dataset vertex ids, any order, repeats allowed), in that order,
        on ``device``.

        On a GPU, rows held in host memory and distinct SSD rows are first put in one staging
        buffer, then one gather after one host→device copy puts every row in place; GPU-resident
        rows are gathered on the GPU. On a CPU device only the SSD rows are staged, and every row
        is copied straight to its place. ``batch``: its replay index (``chunks.first_batch``)."""
        start, cpu = time.perf_counter(), time.thread_time()
        # Each id's row in the bins, in the row map's type (int32 where the ids fit): an evaluation
        # batch's nodes approach N, and an int64 copy beside the ids cost 12 bytes a node more at
        # the peak (+54 MiB at 5 M vertices) where this costs 4.
        new = self._rows[self._as_ids(ids)]
        b = np.searchsorted(self._starts, new, side="right") - 1
        row = new - self._starts[b] + self._offset[b]
        where = [np.flatnonzero(self._tier[b] == t) for t in range(len(TIERS))]
        self._bin_rows += np.bincount(b, minlength=self._bin_rows.size)
        uniq, inverse = unique_inverse(np.asarray(new[where[SSD]], dtype=np.int64))
        host_tiers = [t for t in (GPU, CPU) if self._tensors[t].device.type == "cpu" and not self._mapped(t)]
        on_host = self.device.type == "cpu"  # every row straight into the output: only SSD rows staged
        ssd_rows = 0 if self.reader.on_device else uniq.size
        staged_rows = ssd_rows + (0 if on_host else sum(where[t].size for t in host_tiers))
        stage = self._host_stage.take(staged_rows * self.row_bytes).view(-1, self.row_bytes)
        out = torch.empty((new.size, self.dim), dtype=self.dtype, device=self.device)
        if on_host:
            for t in host_tiers:
                self._gather(t, row[where[t]], out, where[t])
            _, staged = self._read_ssd(b[where[SSD]], uniq, stage[:ssd_rows], batch)
            self._assemble_on_host(out, where[SSD], stage, inverse if staged is None else staged[inverse])
            self._gather_mapped(out, where[CPU], row[where[CPU]])
        else:
            src = np.zeros(new.size, dtype=np.int64)  # each staged row's row in the staging buffer
            at = ssd_rows
            for t in host_tiers:
                k = where[t].size
                self._gather(t, row[where[t]], stage[at : at + k])
                src[where[t]] = np.arange(at, at + k)
                at += k
            ssd_stage, staged = self._read_ssd(b[where[SSD]], uniq, stage[:ssd_rows], batch)
            src[where[SSD]] = inverse if staged is None else staged[inverse]
            self._assemble_on_device(out, where, row, stage, src, ssd_stage)
        self._host_stage.release()
        self._asked += new.size
        self._calls += 1
        self._seconds += time.perf_counter() - start
        self._cpu_seconds += time.thread_time() - cpu
        return out

    def _as_ids(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
        t = torch.as_tensor(ids)
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"ids must be a 1-D integer tensor, got {t.dtype} of shape {tuple(t.shape)}")
        new = t.detach().to("cpu", torch.int64).numpy()
        if new.size:
            lo, hi = int(new.min()), int(new.max())
            if lo < 0 or hi >= self.placed.num_nodes:
                raise IndexError(f"vertex id {lo if lo < 0 else hi} out of range [0, {self.placed.num_nodes})")
        return new

    def _gather(self, tier: int, rows: np.ndarray, dst: torch.Tensor, at: np.ndarray | None = None) -> None:
        """Copy rows of a host-resident tier into the staging buffer (its byte rows ``dst``), or
        with ``at`` into those rows of the host output ``dst``."""
        if rows.size == 0:
            return
        start = time.perf_counter()
        if at is None:
            gather_rows(self._tensors[tier], rows, dst)
        else:
            put_rows(_byte_rows(dst), at, _byte_rows(self._tensors[tier]), rows)
        self._count(tier, rows.size, rows.size * self.row_bytes, time.perf_counter() - start)

    def _read_ssd(
        self, bins: np.ndarray, uniq: np.ndarray, host_stage: torch.Tensor, batch: int | None = None
    ) -> tuple[torch.Tensor | None, np.ndarray | None]:
        """Read each distinct SSD row once, all bins together; returns the device staging buffer
        when the reader reads to the GPU, and where each of ``uniq`` was staged when a packed bin
        put them out of id order (None: in ``uniq``'s order)."""
        if uniq.size == 0:
            return None, None
        start = time.perf_counter()
        if self._dev_stage is not None:
            stage = self._dev_stage.take(uniq.size * self.row_bytes).view(-1, self.row_bytes)
            target: Any = stage
        else:
            stage, target = host_stage, host_stage.numpy()
        edges = [0, *np.searchsorted(uniq, self._ssd_starts[1:]).tolist(), uniq.size]
        which = [k for k in range(len(self._ssd)) if edges[k + 1] > edges[k]]
        staged = None
        requests, owner = [], []
        chunks0 = self.chunks.counts()
        for k in which:
            lo, hi = edges[k], edges[k + 1]
            rows = uniq[lo:hi] - self._ssd[k].start
            chunk = self.chunks.requests(k, batch, rows, target[lo:hi])
            if chunk is not None:  # a replayed batch: its chunk and shared rows
                reads, landed = chunk
                if landed is not None:
                    staged = np.arange(uniq.size) if staged is None else staged
                    staged[lo:hi] = lo + landed
                requests += reads
                owner += [k] * len(reads)
                continue
            if (slots := self._slots[k]) is not None:  # packed: read the file rows in file order
                rows = np.asarray(slots[rows], dtype=np.int64)
                order = np.argsort(rows)
                rows = rows[order]
                staged = np.arange(uniq.size) if staged is None else staged
                staged[lo + order] = np.arange(lo, hi)
            requests.append(ReadRequest(self._ssd[k].path, rows, target[lo:hi]))
            owner.append(k)
        self.chunks.batch_read(chunks0)
        seconds = self.reader.read_batch(requests)
        done = np.zeros(len(self._ssd))
        np.maximum.at(done, np.asarray(owner, dtype=np.int64), np.asarray(seconds, dtype=float))
        asked = np.bincount(bins - (len(self.placed.bins) - len(self._ssd)), minlength=len(self._ssd))
        for k in which:
            unique = edges[k + 1] - edges[k]
            self._bin_stats[k] += (asked[k], unique, unique * self.row_bytes, done[k])
        self._ssd_unique += uniq.size
        self._count(SSD, bins.size, uniq.size * self.row_bytes, time.perf_counter() - start)
        return (stage if self._dev_stage is not None else None), staged

    def _assemble_on_device(
        self,
        out: torch.Tensor,
        where: list[np.ndarray],
        row: np.ndarray,
        stage: torch.Tensor,
        src: np.ndarray,
        ssd_stage: torch.Tensor | None,
    ) -> None:
        """Fill a GPU output: the host-served rows in one host→device copy, the rest on the GPU."""
        dev = out.device
        on_device = np.zeros(out.shape[0], dtype=bool)
        if self._gather_mapped(out, where[CPU], row[where[CPU]]):
            on_device[where[CPU]] = True
        if self.gpu.device == dev and where[GPU].size:
            start = time.perf_counter()
            out.index_copy_(0, _on(where[GPU], dev), self.gpu.index_select(0, _on(row[where[GPU]], dev)))
            self._count(GPU, where[GPU].size, where[GPU].size * self.row_bytes, time.perf_counter() - start)
            on_device[where[GPU]] = True
        start = time.perf_counter()
        if ssd_stage is not None and self._dev_stage is not None:  # (the one with the other: _read_ssd)
            values = ssd_stage.view(self.dtype)
            out.index_copy_(0, _on(where[SSD], dev), values.index_select(0, _on(src[where[SSD]], dev)))
            on_device[where[SSD]] = True
            self._dev_stage.release()
        pos = np.flatnonzero(~on_device)
        if pos.size:
            values = stage.view(self.dtype).to(dev, non_blocking=self.pin)
            out.index_copy_(0, _on(pos, dev), values.index_select(0, _on(src[pos], dev)))
        self._assemble_seconds += time.perf_counter() - start

    def _mapped(self, tier: int) -> bool:
        return tier == CPU and self._cpu_view is not None

    def _gather_mapped(self, out: torch.Tensor, pos: np.ndarray, rows: np.ndarray) -> bool:
        """``out[pos] = cpu[rows]`` by a gather on ``out``'s device reading the registered CPU
        tier in place (no host copy, no staging); False when the tier is not registered."""
        if self._cpu_view is None:
            return False
        if pos.size:
            start = time.perf_counter()
            dev = out.device
            out.index_copy_(0, _on(pos, dev), self._cpu_view.index_select(0, _on(rows, dev)))
            self._count(CPU, pos.size, pos.size * self.row_bytes, time.perf_counter() - start)
        return True

    def _assemble_on_host(self, out: torch.Tensor, pos: np.ndarray, stage: torch.Tensor, src: np.ndarray) -> None:
        """Put the SSD rows of a host output (at ``pos``) from the staging buffer (its rows ``src``)."""
        start = time.perf_counter()
        put_rows(_byte_rows(out), pos, stage.numpy(), src)
        self._assemble_seconds += time.perf_counter() - start

    # Statistics ##############################################################

    def _count(self, tier: int, rows: int, nbytes: int, seconds: float) -> None:
        self._tier_stats[tier] += (rows, nbytes, seconds)

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. per epoch)."""
        self._tier_stats = np.zeros((len(TIERS), 3))
        self._bin_stats = np.zeros((len(self._ssd), 4))
        self._bin_rows = np.zeros(len(self.placed.bins), dtype=np.int64)  # rows asked of each bin, every tier
        self._ssd_unique = 0
        self._asked = 0
        self._calls = 0
        self._seconds = 0.0
        self._cpu_seconds = 0.0
        self._assemble_seconds = 0.0
        self._preads0 = self.reader.preads
        self._read_bytes0 = dict(self.reader.read_bytes)
        self._chunks0 = self.chunks.counts()
        self._placed0 = dict(self.chunks.read_bytes)

    def stats(self) -> dict[str, Any]:
        """Rows asked, bytes moved and seconds per tier and per SSD bin since the last reset; SSD
        bytes are distinct rows read, a bin's ``read_bytes`` the pages the reader's reads of it
        touched (what the SSD moved). Hit rates are rows served by a tier / rows asked."""
        tiers = {
            name: {"rows": int(r), "bytes": int(b), "seconds": float(s)}
            for name, (r, b, s) in zip(TIERS, self._tier_stats)
        }
        tiers["ssd"]["unique_rows"] = self._ssd_unique
        moved, before = self.reader.read_bytes, self._read_bytes0
        bins = {
            b.name: {
                "rows": int(r),
                "unique_rows": int(u),
                "bytes": int(n),
                "read_bytes": sum(
                    moved.get(str(f), 0) - before.get(str(f), 0) for f in (b.path, *self.chunks.files(k))
                ),
                "seconds": float(s),
            }
            for k, (b, (r, u, n, s)) in enumerate(zip(self._ssd, self._bin_stats))
        }
        asked = max(self._asked, 1)
        return {
            "asked": self._asked,
            "calls": self._calls,
            "seconds": self._seconds,
            # CPU time of the calling thread (the prefetch thread): what the reads take from training
            # on a machine whose cores are busy; ``seconds`` also counts waiting for the SSDs
            "cpu_seconds": self._cpu_seconds,
            "assemble_seconds": self._assemble_seconds,
            "tiers": tiers,
            "ssd_bins": bins,
            "staging": self._host_stage.stats(),
            "bin_rows": {b.name: int(r) for b, r in zip(self.placed.bins, self._bin_rows)},
            "hit_rate": {name: tiers[name]["rows"] / asked for name in ("gpu", "cpu")},
            "chunks": self.chunks.since(self._chunks0),  # budget-packed: reads served by chunks (trainer.packs)
            # pages of the placed directory's files read (the chunk row maps; the loop adds the
            # stored samples'), per key of placed.json ``files``
            "placed_read_bytes": {k: n - self._placed0[k] for k, n in self.chunks.read_bytes.items()},
            "io": {
                "reader": type(self.reader).__name__,
                "engine": self.reader.engine,  # FileReader: native (compiled) or python
                "preads": self.reader.preads - self._preads0,
                "modes": dict(self.reader.modes),
                "route": self.reader.route,
                "probe": dict(self.reader.probe),
                "config": self.reader.config,
                "routes": dict(self.reader.routes),
            },
        }

    def close(self) -> None:
        """Close the reader if this store made it; release the CPU tier's registration (uva)."""
        try:
            if self._owns_reader:
                self.reader.close()
        finally:
            self._cpu_view = None
            if self._cpu_reg is not None:
                reg, self._cpu_reg = self._cpu_reg, None
                reg.close()

    def __enter__(self) -> TieredFeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current device>``, so tensors' devices compare equal to it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def gather_rows(src: torch.Tensor, rows: np.ndarray, out: torch.Tensor) -> None:
    """``out[i] = src[rows[i]]`` for a 2-D host tensor ``src`` (a tier, maybe a shared mapping)
    into the byte rows ``out``: ATen's ``index_select`` splits the rows over torch's intra-op
    threads (numpy's ``take`` copies on one); bytes, not values, so every row is copied as is."""
    torch.index_select(src.view(torch.uint8), 0, torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), out=out)


def _row_map(placed: Placed) -> np.ndarray:
    """The placement's row map, memory-mapped read-only (the ranks of a host share its pages),
    its file asked into the page cache now (``POSIX_FADV_WILLNEED``: one sequential read-ahead
    by the kernel): a batch's ids read it at random, and its pages faulted in from disk one by
    one made the data wait of a cold 20-batch epoch at 20 M vertices (an 80 MB map) 1.4-1.5x the
    placement-before-it's (9.2-9.5 s against 6.3-6.6 s); read ahead, 1.1-1.2x (5.4-5.8 s against
    4.6-5.2 s, another window)."""
    path = placed.file("old_to_new")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
    return np.load(path, mmap_mode="r")


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` for 1-D integer ``ids``, by a stable sort: a
    batch's nodes are a few runs of ascending ids (the seeds, then each hop's new vertices in id order:
    :func:`placement.sampler._append_unique`), which numpy's stable sort (timsort) merges about
    3x faster than the quicksort ``np.unique`` uses (on ids in random order it is 1.3x slower)."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(ids.size, dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


# The compiled row copy (trainer.rows_kernel), looked up at first use; None: numpy's.
_COPY: list[Any] = []


def put_rows(dst: np.ndarray, at: np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
    """``dst[at] = src[rows]`` for byte rows (2-D uint8 of one width): each row copied once, on
    this thread alone (:mod:`trainer.rows_kernel`: numpy would copy every row twice, torch would
    split the copy over its intra-op threads); numpy where numba cannot build the kernel."""
    if at.size != rows.size:
        raise ValueError(f"{at.size} rows to put, {rows.size} to take")
    if at.size == 0:
        return
    for name, idx, n in (("output", at, dst.shape[0]), ("source", rows, src.shape[0])):
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise IndexError(f"{name} row out of range [0, {n})")
    if not _COPY:
        from trainer import rows_kernel

        _COPY.append(rows_kernel.copier())
    copy = _COPY[0]
    at, rows = np.ascontiguousarray(at, dtype=np.int64), np.ascontiguousarray(rows, dtype=np.int64)
    if copy is None:
        dst.view(np.dtype((np.void, dst.shape[1])))[at] = src.view(np.dtype((np.void, src.shape[1])))[rows]
    elif dst.shape[1] % 8 == 0 and dst.ctypes.data % 8 == 0 and src.ctypes.data % 8 == 0:
        copy(dst.view(np.uint64), at, src.view(np.uint64), rows)
    else:
        copy(dst, at, src, rows)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A 2-D host tensor's rows as bytes (no copy)."""
    return t.view(torch.uint8).numpy()


def _records(t: torch.Tensor) -> np.ndarray:
    """A 2-D host tensor's rows as numpy records: fancy indexing then moves whole rows, many
    times faster than torch's CPU index ops on short rows."""
    a = t.numpy().view(np.uint8)
    return a.view(np.dtype((np.void, a.shape[1])))[:, 0]


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device)


# Bytes per host→device copy while a GPU cache bin is loaded.
LOAD_CHUNK = 64 << 20


def read_in_chunks(path: Path, dst: torch.Tensor) -> None:
    """Fill ``dst`` (any device) from a raw file through one host buffer of at most LOAD_CHUNK bytes."""
    flat = dst.view(-1).view(torch.uint8)
    buf = torch.empty(min(LOAD_CHUNK, flat.numel()), dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        for pos in range(0, flat.numel(), buf.numel()):
            n = min(buf.numel(), flat.numel() - pos)
            _fill(f, memoryview(buf.numpy())[:n], path)
            flat[pos : pos + n].copy_(buf[:n])


def copy_in_chunks(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` in pieces of at most LOAD_CHUNK bytes (a pageable copy of a whole bin
    would stage all of it at once)."""
    rows = max(1, LOAD_CHUNK // max(src[:1].numel() * src.element_size(), 1))
    for lo in range(0, src.shape[0], rows):
        dst[lo : lo + rows].copy_(src[lo : lo + rows])


def _fill(f: Any, view: memoryview, path: Path) -> None:
    while len(view):
        got = f.readinto(view)
        if not got:
            raise PlacedError(f"{path}: shorter than its manifest says: truncated while in use")
        view = view[got:]


def _read_whole(path: Path, dst: torch.Tensor) -> None:
    """Fill a host tensor from a raw file (no intermediate copy)."""
    view = memoryview(dst.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        while len(view):
            got = f.readinto(view)
            if not got:
                raise PlacedError(f"{path}: shorter than its manifest says: truncated while in use")
            view = view[got:]
