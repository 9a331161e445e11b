"""Staging buffers of the feature store: where SSD reads land and host rows are gathered before
one copy to the device. Reused across calls, so a call must not overwrite a buffer that the
previous call's asynchronous copies still read.

The host stage is pinned on CUDA, and torch's pinned allocator (the CachingHostAllocator) rounds
every request up to a power of two and keeps freed blocks pinned: a buffer grown by doubling
would leave its whole chain pinned, and each multi-GB ``cudaHostAlloc`` mid-training takes the
driver's lock for seconds. So the stage is allocated once, before training, from a bound on a
batch's rows (:func:`stage_bytes`, the same figure :mod:`trainer.memory` budgets), and a batch
beyond it grows it once to exactly what that batch needs (counted in :meth:`Staging.stats`).
"""

from __future__ import annotations

import math

import torch

# Staging buffers start at a page boundary so that O_DIRECT reads into them are aligned.
PAGE = 4096


def stage_bytes(rows: float, row_bytes: int) -> int:
    """Bytes of a staging buffer holding ``rows`` rows (page alignment included): the one figure
    for the store's allocation and the memory budget."""
    return math.ceil(rows) * row_bytes + PAGE


def pinned_bytes(nbytes: int) -> int:
    """What a pinned request of ``nbytes`` holds: the pinned allocator rounds to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(nbytes, 1))))


def allocate(nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
    """One staging allocation (tests spy on it)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


class Staging:
    """A byte buffer reused across calls, page-aligned, allocated once with ``reserve`` bytes
    (0: at first use) and grown only by a call that needs more, to exactly that; before it is
    reused it waits for the asynchronous copies that read it in the previous call (work on
    ``cuda``'s current stream: the stream the store's copies and gathers are queued on)."""

    def __init__(self, device: torch.device, pin: bool, cuda: torch.device | None, reserve: int = 0) -> None:
        self.device, self.pin, self.cuda = device, pin, cuda
        self.reserve = max(0, int(reserve))
        self.grown = 0  # allocations after the reserve: calls that needed more than the buffer held
        self._buf = self._allocate(self.reserve) if self.reserve else torch.empty(0, dtype=torch.uint8)
        self._event: torch.cuda.Event | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if nbytes + PAGE > self._buf.numel():
            if self.reserve or self._buf.numel():
                self.grown += 1
            self._buf = torch.empty(0, dtype=torch.uint8)  # the old buffer goes before the new one comes
            self._buf = self._allocate(nbytes + PAGE)
            if self.device.type == "cuda":
                # Fresh memory from the caching allocator may still be read by queued kernels, and
                # kvikio writes it outside the stream's order: let those kernels finish first.
                torch.cuda.current_stream(self.device).synchronize()
        skew = -self._buf.data_ptr() % PAGE
        return self._buf[skew : skew + nbytes]

    def _allocate(self, nbytes: int) -> torch.Tensor:
        # Pinned: ask for the power of two the allocator holds anyway, so all of it is usable.
        return allocate(pinned_bytes(nbytes) if self.pin else nbytes, self.device, self.pin)

    def release(self) -> None:
        """Mark the end of this call's use: the next take waits for the work queued so far."""
        if self.cuda is not None:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.cuda))

    def stats(self) -> dict[str, int]:
        """Bytes held now, bytes reserved up front, and how often a call grew the buffer."""
        return {"bytes": int(self._buf.numel()), "reserved": self.reserve, "grown": self.grown}
