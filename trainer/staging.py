"""Staging buffers of the feature store: where SSD reads land and host rows are gathered before
one copy to the device. Reused across calls, so a call must not overwrite a buffer that the
previous call's asynchronous copies still read."""

from __future__ import annotations

import torch

# Staging buffers start at a page boundary so that O_DIRECT reads into them are aligned.
PAGE = 4096


class Staging:
    """A byte buffer reused across calls (grown by doubling), page-aligned; before it is
    reused it waits for the asynchronous copies that read it in the previous call (work on
    ``cuda``'s current stream: the stream the store's copies and gathers are queued on)."""

    def __init__(self, device: torch.device, pin: bool, cuda: torch.device | None) -> None:
        self.device, self.pin, self.cuda = device, pin, cuda
        self._buf = torch.empty(0, dtype=torch.uint8, device=device)
        self._event: torch.cuda.Event | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if nbytes + PAGE > self._buf.numel():
            size = max(nbytes + PAGE, 2 * self._buf.numel())
            self._buf = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
            if self.device.type == "cuda":
                # Fresh memory from the caching allocator may still be read by queued kernels, and
                # kvikio writes it outside the stream's order: let those kernels finish first.
                torch.cuda.current_stream(self.device).synchronize()
        skew = -self._buf.data_ptr() % PAGE
        return self._buf[skew : skew + nbytes]

    def release(self) -> None:
        """Mark the end of this call's use: the next take waits for the work queued so far."""
        if self.cuda is not None:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.cuda))
