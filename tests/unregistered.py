"""A signal that lands while a thread pool starts a worker: ``Thread.start`` waits for the thread
to begin, interruptibly, so the worker can already have taken a task that the pool never
registered (``ThreadPoolExecutor.shutdown`` then does not wait for it)."""

from __future__ import annotations

import threading

import pytest


def interrupt_thread_start(monkeypatch: pytest.MonkeyPatch, prefix: str, running: threading.Event) -> None:
    """The next thread named ``prefix``… starts, and once ``running`` is set (its first task
    began) ``Thread.start`` raises KeyboardInterrupt in the caller: once."""
    start = threading.Thread.start

    def start_then_signal(thread: threading.Thread) -> None:
        start(thread)
        if thread.name.startswith(prefix):
            monkeypatch.setattr(threading.Thread, "start", start)  # once
            running.wait(timeout=10)  # the new thread took its first task
            raise KeyboardInterrupt  # the signal, before the executor registered the thread

    monkeypatch.setattr(threading.Thread, "start", start_then_signal)
