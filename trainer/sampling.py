"""Where neighbour sampling runs, and where the graph's CSR lives for it (``--sampling``).

Three places (GPU review #16):

* ``gpu``: the CSR in GPU memory; sampling on the GPU. ``auto`` picks it when the CSR takes at
  most ``CSR_GPU_SHARE`` of the GPU's free memory (after the feature cache is loaded).
* ``uva``: the CSR in page-locked host memory registered with CUDA (:mod:`trainer.uva`);
  sampling kernels run on the GPU and read the CSR over PCIe, zero-copy, as the paper samples
  a graph bigger than GPU memory. ``auto`` picks it on CUDA when the GPU has no room and the
  host has (the CSR is at most ``HOST_PIN_SHARE`` of available host memory). With several
  ranks the socket's ranks map one copy in ``--shm-dir`` (:func:`trainer.shm.per_socket`), each
  rank registers that mapping for its GPU; without room there each rank pins a private copy.
* ``cpu``: the CSR stays a memory-mapped file; sampling on the CPU with the rank's share of its
  cores (``loop.sampling_setup``), batches copied to the GPU.

The ranks agree (:func:`agree`) on the lowest choice any of them made (cpu < uva < gpu), so
the shared copy is made by every rank of the socket or by none. A rank whose registration
fails falls back to ``cpu`` on its own and says why (``note`` in the metrics' ``sampling``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moment.fileio import atomic_file
from moment.outputs import short_of_space
from placement.placed import PlacedError
from placement.sampler import UPLOAD_CHUNK, csr_bytes, fits_on_gpu
from trainer.config import SAMPLING_CHOICES
from trainer.dist import all_gather
from trainer.shm import SharedMemoryFullError
from trainer.uva import HostMapping, UvaError

# Share of available host memory a pinned CSR may take when ``auto`` picks uva: the host tiers,
# staging buffers and the page cache need the rest.
HOST_PIN_SHARE = 0.5
_RANK = {"cpu": 0, "uva": 1, "gpu": 2}

Array = np.ndarray | torch.Tensor


@dataclass(frozen=True)
class Choice:
    where: str  # gpu | uva | cpu
    note: str | None = None  # why it is not what was asked (or what auto would pick)


def host_available() -> int | None:
    """Bytes of host memory available now (/proc/meminfo MemAvailable; None if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def choose(mode: str, device: torch.device, nbytes: int, gpu_free: int | None, host_free: int | None) -> Choice:
    """Where this rank would sample for ``--sampling mode`` (see the module docstring)."""
    if mode not in SAMPLING_CHOICES:
        raise ValueError(f"sampling mode {mode!r} is not one of {SAMPLING_CHOICES}")
    gib = f"{nbytes / 2**30:.2f} GiB"
    if device.type != "cuda":
        note = f"--sampling {mode} needs a CUDA device: sampling on the CPU" if mode in ("gpu", "uva") else None
        return Choice("cpu", note)
    if mode in ("gpu", "cpu"):
        return Choice(mode)
    if mode == "uva":  # asked for: tried even where auto would not (registration says if it fails)
        return Choice("uva")
    if gpu_free is not None and fits_on_gpu(nbytes, gpu_free):
        return Choice("gpu")
    if host_free is None or nbytes <= HOST_PIN_SHARE * host_free:
        return Choice("uva")
    room = f"{HOST_PIN_SHARE:.0%} of the {(host_free or 0) / 2**30:.2f} GiB of host memory available"
    return Choice("cpu", f"the CSR ({gib}) fits neither the GPU nor {room} if pinned: sampling on the CPU")


def agree(mine: Choice) -> Choice:
    """The lowest choice of all ranks (cpu < uva < gpu), with its note: every rank of a socket then
    takes part in making its shared copy, or none does. Without a process group: ``mine``."""
    choices = all_gather((mine.where, mine.note))
    where, note = min(choices, key=lambda c: _RANK[c[0]])
    if where == mine.where:
        return mine
    return Choice(where, note or f"another rank samples with {where}: so does this one")


@dataclass
class Csr:
    """The CSR as the sampler gets it: numpy arrays (gpu, cpu) or device tensors over registered
    host memory (uva); ``close`` releases the registration once the sampler is gone."""

    indptr: Array
    indices: Array
    where: str
    note: str | None = None
    mapping: HostMapping | None = None

    def close(self) -> None:
        self.indptr = self.indices = np.empty(0, dtype=np.int64)
        if self.mapping is not None:
            mapping, self.mapping = self.mapping, None
            mapping.close()


def _numpy(a: Array) -> np.ndarray:
    return a.numpy() if isinstance(a, torch.Tensor) else a


def write_csr(path: Path, indptr: Array, indices: Array) -> None:
    """The CSR (indptr as int64, then indices) into ``path``, atomically; without room in its
    file system a :class:`trainer.shm.SharedMemoryFullError` (the ranks then pin private copies)."""
    nbytes = csr_bytes(indptr, indices)
    for _, _, _, free in short_of_space({path.parent: nbytes}, headroom=False):
        raise SharedMemoryFullError(
            f"{path.parent}: {free / 2**30:.2f} GiB free, the CSR needs {nbytes / 2**30:.2f} GiB"
        )
    with atomic_file(path, binary=True, replace=False) as out:
        for arr, dtype in ((_numpy(indptr), np.int64), (_numpy(indices), None)):
            for lo in range(0, len(arr), UPLOAD_CHUNK):
                out.write(memoryview(np.ascontiguousarray(arr[lo : lo + UPLOAD_CHUNK], dtype=dtype)))


def map_csr(indptr: Array, indices: Array, device: torch.device, path: Path | None = None) -> HostMapping:
    """Host memory holding the CSR, not registered yet: a shared mapping of ``path`` (written first
    when nobody has yet), or without ``path`` an anonymous mapping filled here."""
    nbytes = csr_bytes(indptr, indices)
    if path is not None:
        if not path.exists():
            write_csr(path, indptr, indices)
        if (size := path.stat().st_size) != nbytes:
            raise PlacedError(
                f"{path}: holds {size} bytes, the CSR is {nbytes} bytes: a file of another run; remove it"
            )
        return HostMapping(nbytes, device, path)
    mapping = HostMapping(nbytes, device)
    offset = 0
    for arr, dtype in ((_numpy(indptr), np.dtype(np.int64)), (_numpy(indices), _numpy(indices).dtype)):
        dst = mapping.host(offset, len(arr), dtype)
        for lo in range(0, len(arr), UPLOAD_CHUNK):
            dst[lo : lo + UPLOAD_CHUNK] = arr[lo : lo + UPLOAD_CHUNK]
        offset += len(arr) * dtype.itemsize
        del dst
    return mapping


Share = Callable[[Callable[[Path | None], HostMapping]], HostMapping]


def open_csr(indptr: Array, indices: Array, choice: Choice, device: torch.device, share: Share | None = None) -> Csr:
    """The CSR for ``choice``: as given for gpu and cpu (the sampler uploads it or reads the
    memory map); for uva registered host memory (``share(open)``: one copy per socket, see
    :func:`trainer.shm.per_socket`), or the CPU when registration fails (the note says why)."""
    if choice.where != "uva":
        return Csr(indptr, indices, choice.where, choice.note)
    mapping = share(lambda path: map_csr(indptr, indices, device, path)) if share else map_csr(indptr, indices, device)
    try:
        mapping.register()
    except UvaError as exc:
        mapping.close()
        return Csr(indptr, indices, "cpu", f"{exc}: sampling on the CPU")
    index_type = np.dtype(_numpy(indices).dtype)
    return Csr(
        mapping.view(0, len(indptr), np.int64),
        mapping.view(len(indptr) * 8, len(indices), index_type),
        "uva",
        choice.note,
        mapping,
    )
