"""Zero-copy ("UVA") views of host memory for CUDA kernels.

A CUDA kernel can read host memory directly over PCIe when the pages are page-locked and mapped
into the device's address space: ``cudaHostRegister`` does both for memory we already hold. On a
64-bit system with unified addressing the device address of registered memory is its host
address, so a tensor made from it is a ``cuda`` tensor whose reads go to host memory. The
sampler uses this for a CSR too big for GPU memory (:mod:`trainer.sampling`); the feature store
for its CPU tier, whose rows a GPU gather then reads in place (:mod:`trainer.featurestore`).

What this relies on, checked in PyTorch's source:

* ``torch.cuda.cudart().cudaHostRegister(ptr, size, flags)`` and ``cudaHostUnregister(ptr)``
  (torch/csrc/cuda/shared/cudart.cpp) return the ``cudaError_t`` (``int()`` of it is the code)
  without raising, wrapped in ``C10_CUDA_ERROR_HANDLED``, which is the bare expression
  (c10/cuda/CUDAException.h): a failure stays the thread's "last error", and torch's next
  kernel-launch check in that thread (``cudaGetLastError``) would raise it there, far from its
  cause. So both calls run in a short-lived thread of their own (the last error is per thread).
* ``torch.as_tensor(obj, device=...)`` for an object with ``__cuda_array_interface__`` wraps
  the pointer without a copy (torch/csrc/utils/tensor_numpy.cpp,
  ``tensor_from_cuda_array_interface``: ``at::from_blob`` on the given address; the CAI's
  read-only flag must be False). Older versions ask ``cudaPointerGetAttributes`` for the device
  (aten/src/ATen/cuda/CUDADevice.h ``getDeviceFromPtr``), which accepts registered host memory
  (type ``cudaMemoryTypeHost``) and names the device current at registration: registration
  sets ``device`` first.
* Flags (CUDA driver_types.h): ``cudaHostRegisterPortable`` 0x01 (pinned for every context, so
  any device may read it), ``cudaHostRegisterMapped`` 0x02 (mapped into the device address
  space).

Tests replace :func:`cudart` and :func:`from_cuda_array` with strict fakes (tests/uva_fake.py).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moment.errors import MomentError

PORTABLE, MAPPED = 0x01, 0x02
FLAGS = PORTABLE | MAPPED
# The codes registration can return (CUDA driver_types.h), for the error line.
ERRORS = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    304: "cudaErrorOperatingSystem",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
}


HINTS = {
    2: ": not enough host memory the driver could page-lock",
    304: ": an OS call failed (a sandbox such as gVisor, or a locked-memory limit: ulimit -l)",
    712: ": part of it is registered already",
    801: ": not supported by this system or driver",
}


class UvaError(MomentError):
    """Host memory could not be registered with CUDA (the caller falls back to the CPU)."""


def cudart() -> Any:
    """PyTorch's libcudart bindings (tests put a fake here)."""
    return torch.cuda.cudart()


def from_cuda_array(obj: Any, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` wrapping ``obj.__cuda_array_interface__`` without a copy (tests put a
    fake here that checks the interface and returns a CPU view of the same memory)."""
    return torch.as_tensor(obj, device=device)


class CudaArray:
    """The ``__cuda_array_interface__`` (version 3) of ``count`` items of ``dtype`` at ``ptr``;
    holds ``owner`` so the memory outlives every tensor made from it."""

    def __init__(self, ptr: int, count: int, dtype: np.dtype, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (int(count),),
            "typestr": np.dtype(dtype).str,
            "data": (int(ptr), False),
            "strides": None,
            "version": 3,
        }


def indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current device>``: registration makes that device current first."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _in_thread(call: Callable[[], Any], device: torch.device) -> int:
    """``int(call())`` in a thread of its own with ``device`` current (see the module's note on
    CUDA's per-thread last error); an exception in it is raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            out["rc"] = int(call())
        except Exception as exc:  # noqa: BLE001 -- raised again in the caller's thread
            out["exc"] = exc

    thread = threading.Thread(target=run, name="moment-cuda-register")
    thread.start()
    thread.join()
    if "exc" in out:
        raise out["exc"]
    return out["rc"]


def error_name(code: int) -> str:
    return f"{ERRORS.get(code, 'cudaError')} ({code})"


class HostMapping:
    """``nbytes`` of page-aligned host memory, registered with CUDA for ``device``, handing out
    device tensors that read it in place.

    The memory is an anonymous mapping, or with ``path`` a shared mapping of that file (a memory
    file system: the ranks of a socket map one copy, :mod:`trainer.shm`). Fill it through
    :meth:`host` before :meth:`register`; :meth:`close` unregisters (once) and unmaps, after
    every tensor of :meth:`view` is gone."""

    _mm: mmap.mmap | None

    def __init__(self, nbytes: int, device: torch.device, path: Path | None = None) -> None:
        self.nbytes = int(nbytes)
        self.device = indexed(device)
        self.path = path
        size = max(self.nbytes, 1)
        if path is None:
            self._mm = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self._bytes: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self._bytes.ctypes.data)
        self._keep: torch.Tensor | None = None
        self.registered = False

    @classmethod
    def over(cls, tensor: torch.Tensor, device: torch.device) -> HostMapping:
        """The memory of an existing contiguous host tensor (a tier, maybe a shared mapping), kept
        alive by this object; :meth:`close` unregisters it and lets it go, unmapping nothing."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only a contiguous host tensor can be registered")
        self = cls.__new__(cls)
        self.nbytes, self.device, self.path = tensor.numel() * tensor.element_size(), indexed(device), None
        self._mm, self._bytes, self._keep = None, None, tensor
        self.ptr = int(tensor.data_ptr())
        self.registered = False
        return self

    def host(self, offset: int, count: int, dtype: np.dtype | type) -> np.ndarray:
        """A numpy view of ``count`` items of ``dtype`` at byte ``offset`` (to fill or to read)."""
        assert self._bytes is not None, "closed"
        dt = np.dtype(dtype)
        return self._bytes[offset : offset + count * dt.itemsize].view(dt)

    def register(self) -> None:
        """Page-lock and map the memory for the device; a failure is one :class:`UvaError` line."""
        if self.registered:
            return
        try:
            rc = _in_thread(lambda: cudart().cudaHostRegister(self.ptr, max(self.nbytes, 1), FLAGS), self.device)
        except (RuntimeError, AttributeError, ValueError) as exc:  # no usable cudart bindings or device
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UvaError(f"cudaHostRegister for {self.device}: {why}") from None
        if rc != 0:
            what = f"a shared mapping of {self.path}" if self.path else "anonymous" if self._mm else "a host tensor"
            raise UvaError(
                f"cudaHostRegister of {self.nbytes / 2**30:.2f} GiB of host memory ({what}) for {self.device} "
                f"failed: {error_name(rc)}{HINTS.get(rc, '')}"
            )
        self.registered = True

    def view(self, offset: int, count: int, dtype: np.dtype | type) -> torch.Tensor:
        """A tensor on the device reading ``count`` items of ``dtype`` at byte ``offset`` in place."""
        if not self.registered:
            raise RuntimeError("HostMapping.view before register")
        dt = np.dtype(dtype)
        if offset % dt.itemsize or offset + count * dt.itemsize > self.nbytes:
            raise ValueError(f"view of {count} × {dt} at {offset} does not fit {self.nbytes} bytes aligned")
        tensor = from_cuda_array(CudaArray(self.ptr + offset, count, dt, self), self.device)
        if tensor.data_ptr() != self.ptr + offset:  # torch copied instead of mapping: not zero-copy
            raise UvaError(f"a view of registered host memory came back as a copy on {tensor.device}")
        return tensor

    def close(self) -> None:
        """Unregister (once, when registered) and unmap."""
        if self.registered:
            self.registered = False
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no queued kernel reads it any more
            rc = _in_thread(lambda: cudart().cudaHostUnregister(self.ptr), self.device)
            if rc != 0:
                raise UvaError(f"cudaHostUnregister of {self.nbytes} bytes for {self.device}: {error_name(rc)}")
        self._keep = None
        if self._bytes is not None:
            self._bytes = None
            if self._mm is not None:
                self._mm.close()
