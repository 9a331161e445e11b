"""A strict stand-in for CUDA host registration and the CUDA-array-interface step, for CPU tests
of trainer/uva.py.

``FakeCudart`` has the two calls of ``torch.cuda.cudart()`` the code uses, with the binding's
signatures (torch/csrc/cuda/shared/cudart.cpp: ``cudaHostRegister(ptr: int, size: int, flags:
int)``, ``cudaHostUnregister(ptr: int)``, each returning the ``cudaError_t``, never raising) and
CUDA's answers: a range overlapping a registered one is ``cudaErrorHostMemoryAlreadyRegistered``
(712), unregistering a pointer that does not start a registration is
``cudaErrorHostMemoryNotRegistered`` (713), a zero size or unknown flag bits
``cudaErrorInvalidValue`` (1), and a registration over ``limit`` bytes in all
``cudaErrorMemoryAllocation`` (2). It records every call and the thread it came from.

``from_cuda_array`` checks the ``__cuda_array_interface__`` as torch's
``tensor_from_cuda_array_interface`` does (shape, typestr, a (ptr, False) data tuple, no
strides) and that every byte lies in a live registration, then returns a CPU tensor viewing
that memory: what a device kernel would read, on the CPU.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import pytest
import torch

from trainer import uva

KNOWN_FLAGS = 0x01 | 0x02 | 0x04 | 0x08


class CudaError:
    """What the binding returns: a pybind11 enum, read with ``int()`` (no comparison with ints)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __int__(self) -> int:
        return self.code


class FakeCudart:
    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.live: dict[int, int] = {}  # ptr -> size
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[str] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> CudaError:  # noqa: N802 (CUDA's name)
        return CudaError(self._register(ptr, size, flags))

    def cudaHostUnregister(self, ptr: int) -> CudaError:  # noqa: N802
        return CudaError(self._unregister(ptr))

    def _register(self, ptr: int, size: int, flags: int) -> int:
        assert all(type(v) is int for v in (ptr, size, flags)), (ptr, size, flags)
        self.calls.append(("register", ptr, size, flags))
        self.threads.append(threading.current_thread().name)
        if size <= 0 or ptr <= 0 or flags & ~KNOWN_FLAGS:
            return 1
        if any(p < ptr + size and ptr < p + s for p, s in self.live.items()):
            return 712
        if self.limit is not None and sum(self.live.values()) + size > self.limit:
            return 2
        self.live[ptr] = size
        return 0

    def _unregister(self, ptr: int) -> int:
        assert type(ptr) is int
        self.calls.append(("unregister", ptr))
        self.threads.append(threading.current_thread().name)
        if ptr not in self.live:
            return 713
        del self.live[ptr]
        return 0

    def registered(self, ptr: int, nbytes: int) -> bool:
        return any(p <= ptr and ptr + nbytes <= p + s for p, s in self.live.items())


def from_cuda_array(fake: FakeCudart, obj: Any, device: torch.device) -> torch.Tensor:
    cai = obj.__cuda_array_interface__
    assert isinstance(cai, dict) and cai["version"] == 3
    (count,) = cai["shape"]
    dtype = np.dtype(cai["typestr"])
    ptr, read_only = cai["data"]
    assert read_only is False, "torch refuses a read-only CUDA array interface"
    assert cai.get("strides") is None
    nbytes = count * dtype.itemsize
    assert fake.registered(ptr, nbytes), f"{nbytes} bytes at {ptr:#x}: not registered with CUDA"
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
    arr = np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(dtype)
    return torch.from_numpy(arr)


def install(monkeypatch: pytest.MonkeyPatch, limit: int | None = None) -> FakeCudart:
    fake = FakeCudart(limit)
    monkeypatch.setattr(uva, "cudart", lambda: fake)
    monkeypatch.setattr(uva, "from_cuda_array", lambda obj, device: from_cuda_array(fake, obj, device))
    return fake
