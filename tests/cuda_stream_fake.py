"""A recorder standing in for torch's CUDA streams and events, for CPU tests of stream fencing.

``install(monkeypatch)`` replaces ``torch.cuda.Stream``, ``torch.cuda.stream`` (the context),
``torch.cuda.current_stream``, ``torch.cuda.default_stream``, ``torch.cuda.Event``,
``torch.cuda.set_device`` and ``torch.Tensor.record_stream``; tensors stay on the CPU. The
current stream is per thread, as in torch. Every call is appended to ``log`` as a tuple, so a
test can check the order: a consumer must ``wait_event`` on the event the producer recorded
after its work before it reads, and ``record_stream`` every tensor it takes across streams.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch


class FakeStream:
    _ids = itertools.count(1)

    def __init__(self, recorder: StreamRecorder, device: Any = None, default: bool = False) -> None:
        self.recorder, self.default = recorder, default
        self.id = 0 if default else next(self._ids)
        recorder.log.append(("new_stream", self.id))

    def wait_event(self, event: FakeEvent) -> None:
        self.recorder.log.append(("wait_event", self.id, event.id))

    def wait_stream(self, other: FakeStream) -> None:
        self.recorder.log.append(("wait_stream", self.id, other.id))

    def synchronize(self) -> None:
        self.recorder.log.append(("stream_sync", self.id))

    def __repr__(self) -> str:
        return f"stream{self.id}"


class FakeEvent:
    _ids = itertools.count(1)

    def __init__(self, recorder: StreamRecorder, *args: Any, **kwargs: Any) -> None:
        self.recorder, self.id = recorder, next(self._ids)
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self.recorder.current()
        self.recorder.log.append(("record", self.stream.id, self.id))

    def synchronize(self) -> None:
        self.recorder.log.append(("event_sync", self.id))


class StreamRecorder:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.default = FakeStream(self, default=True)
        self._local = threading.local()

    def current(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    @contextmanager
    def stream(self, s: FakeStream | None) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = s
        self.log.append(("enter", s.id if s else None))
        try:
            yield
        finally:
            self._local.stream = before
            self.log.append(("exit", s.id if s else None))

    def note(self, *what: Any) -> None:
        """A test's own event in the log (e.g. "the consumer reads batch k now, on this stream")."""
        self.log.append((*what, self.current().id))

    def index(self, entry: tuple[Any, ...]) -> int:
        return self.log.index(entry)


def install(monkeypatch: pytest.MonkeyPatch) -> StreamRecorder:
    rec = StreamRecorder()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: FakeStream(rec, device))
    monkeypatch.setattr(torch.cuda, "stream", rec.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", rec.current)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: rec.default)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: FakeEvent(rec, *a, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda self, stream: rec.log.append(("record_stream", id(self), stream.id))
    )
    return rec
