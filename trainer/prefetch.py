"""Preparing the next batches while the current one trains: a background thread samples and
fetches features ``depth`` batches ahead (on CUDA on a stream of its own), and the stream the
training itself runs on (:func:`compute_stream`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from placement.sampler import SampledBatch


@dataclass
class Prepared:
    """A batch ready to train on: blocks, features of ``batch.nodes``, labels of the seeds."""

    batch: SampledBatch
    x: torch.Tensor
    y: torch.Tensor
    ready: torch.cuda.Event | None = None  # recorded on the copy stream (CUDA)


class Prefetcher:
    """Prepares up to ``depth`` batches ahead in a background thread (bounded queue).

    On CUDA the thread works on its own stream, so sampling and host→GPU copies overlap the
    training kernels; the consumer's stream waits on each batch's event before using it. An
    exception in the thread is re-raised in the consumer."""

    _DONE = object()

    def __init__(
        self,
        seeds: Iterator[torch.Tensor],
        prepare: Callable[[torch.Tensor], Prepared],
        depth: int,
        device: torch.device,
    ) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._device = device
        self._thread = threading.Thread(target=self._work, args=(seeds, prepare), name="moment-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, seeds: Iterator[torch.Tensor], prepare: Callable[[torch.Tensor], Prepared]) -> None:
        try:
            stream = None
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread
                stream = torch.cuda.Stream(self._device)
            for s in seeds:
                if stream is None:
                    item = prepare(s)
                else:
                    with torch.cuda.stream(stream):
                        item = prepare(s)
                        item.ready = torch.cuda.Event()
                        item.ready.record(stream)
                if not self._put(item):
                    return
            self._put(self._DONE)
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            self._put(exc)

    def __iter__(self) -> Iterator[Prepared]:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            if item.ready is not None:
                current = torch.cuda.current_stream(self._device)
                current.wait_event(item.ready)
                for t in (item.x, item.y, *(b.edge_index for b in item.batch.blocks)):
                    t.record_stream(current)  # the allocator must not reuse them early
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def compute_stream(device: torch.device, stream: torch.cuda.Stream | None = None) -> Iterator[torch.cuda.Stream | None]:
    """Run the block's CUDA work (training, evaluation) on a stream of its own instead of the
    legacy default stream. kvikio's POSIX path copies each read on a blocking stream
    (``CU_STREAM_DEFAULT``) and its GDS reads synchronise the NULL stream first: both would wait
    for every training kernel queued on the legacy default stream, and training for them, so
    reads and compute would no longer overlap. torch's own streams are non-blocking. The stream
    starts after the work already queued on the current stream (parameters, the DDP broadcast),
    and the current stream, after the block, waits for the block's work (all-reduces,
    checkpoints). ``stream``: the run's one compute stream (a new one when None): autograd records
    the stream each parameter's gradient accumulator was made on (DDP makes them at its start) and
    synchronises, with a warning, when backward runs on another one. Nothing on a CPU device
    (yields None)."""
    if device.type != "cuda":
        yield None
        return
    outer = torch.cuda.current_stream(device)
    stream = stream if stream is not None else torch.cuda.Stream(device)
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        outer.wait_stream(stream)
