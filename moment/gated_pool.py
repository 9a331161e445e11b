"""A thread pool whose ``close`` returns only when no task of it runs any more, signals or not.

``ThreadPoolExecutor.shutdown(wait=True)`` joins the threads the executor knows. A signal that
raises in the main thread while ``submit`` starts a worker (``Thread.start`` waits for the thread
to begin, and that wait is interruptible) can leave a thread that already took a task but was
never registered: shutdown returns while it still runs. A reader that then closes its files
closes them under a read in flight; the descriptor numbers are reused (by the next io_uring
ring, say) and the read waits on its own ring forever, with the interpreter waiting on that
thread at exit (the SIGTERM test's hang in CI). Here every task passes a gate: ``close`` shuts
it, so no task starts afterwards, and waits until those that passed it have returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


class GatedPool:
    """``map`` or ``submit`` to a thread pool started at first use; ``close`` cancels what has
    not started and waits for what has (an interrupt meanwhile is raised once nothing runs)."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False

    def map(self, do: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``do`` of each item, in order, from the pool's threads."""
        return list(self._pool.map(lambda item: self._gated(do, item), items))

    def submit(self, do: Callable[..., _R], *args: Any) -> Future[_R]:
        """``do(*args)`` in one of the pool's threads: its future (cancelled once closed)."""
        return self._pool.submit(self._gated, do, *args)

    def _gated(self, do: Callable[..., _R], *args: Any) -> _R:
        with self._cond:
            if self._closed:
                raise CancelledError
            self._running += 1
        try:
            return do(*args)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """No task starts from now on; returns once none runs and the threads are told to stop."""
        close_all(self)

    def _drain(self) -> None:
        with self._cond:
            self._closed = True
            while self._running:
                self._cond.wait()
        self._pool.shutdown(wait=False, cancel_futures=True)


def close_all(*pools: GatedPool) -> None:
    """Close every pool (:meth:`GatedPool.close`); an interrupt meanwhile is raised once all are
    closed, so a caller's next step (closing the files their tasks use) never runs beside a task."""

    def drain() -> None:
        for pool in pools:  # again from the first after an interrupt: a closed pool drains at once
            pool._drain()  # noqa: SLF001 - the module's own class

    _uninterrupted(drain)


def _uninterrupted(step: Callable[[], None]) -> None:
    """``step`` until it completes; a KeyboardInterrupt (``Interrupted``) meanwhile is raised
    after it, not instead of it."""
    interrupted: BaseException | None = None
    while True:
        try:
            step()
            break
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
