"""The processes a command starts, and how they stop together.

A launcher (``moment train``, ``moment infer --nproc N``) runs torchrun through :func:`supervise`:

* torchrun starts in a session of its own, so a terminal's Ctrl-C reaches the launcher alone,
  which forwards it: one signal, one report, no traceback per rank;
* SIGINT, SIGTERM and SIGHUP sent to the launcher's PID are forwarded to torchrun, which
  forwards them to the ranks;
* after :data:`GRACE_S` every process of the job still alive is killed (SIGKILL, by PID): each
  carries the job's token in its environment (:data:`JOB_ENV`), so ranks that torchrun started
  in sessions of their own, or that lost their parent, are found too; the same sweep runs when
  torchrun exits by itself, so no rank outlives its launcher;
* then, the job's processes gone, the launcher removes the files they left under names carrying
  the token's random part (:func:`job_token`; the ranks' shared host files, :mod:`trainer.shm`);
* the caller gets :class:`moment.errors.Interrupted` after a signal, the exit status otherwise.

Every rank runs inside :func:`interruptible` (SIGINT, SIGTERM and SIGHUP raise ``Interrupted``, a
KeyboardInterrupt: the rank unwinds, closes what it holds, exits 128 + signal, quietly) and calls
:func:`guard`: a watchdog thread stops the rank when the launcher that started the job is gone (killed with
SIGKILL, say) or its parent (torchrun) is.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from moment.errors import Interrupted

JOB_ENV = "MOMENT_JOB"  # "<launcher pid>:<launcher start time>:<random token>", inherited by the job
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 5.0  # from the forwarded signal to SIGKILL of what is still alive
POLL_S = 0.5  # how often a rank's watchdog looks at its launcher and parent

_stopping: list[int] = []  # the signal this process is stopping on (guard's handlers)


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot; None if it is gone): with the
    PID it names one process, never a later one given the same PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def job_token(value: str | None = None) -> str | None:
    """The random part of a job's :data:`JOB_ENV` (``value``, else this process's environment):
    16 hex digits naming the job alone, which a rank puts in the names of the files it leaves for
    its launcher to remove (:func:`trainer.shm.shm_path`); None outside a launched job."""
    value = os.environ.get(JOB_ENV) if value is None else value
    token = (value or "").rpartition(":")[2]
    return token if len(token) == 16 and all(c in "0123456789abcdef" for c in token) else None


def job_processes(token: str) -> list[int]:
    """PIDs of the processes (other than this one) whose environment holds ``JOB_ENV=token``."""
    needle = f"{JOB_ENV}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _alive(pids: Sequence[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2] != "Z":  # a zombie has stopped: its parent reaps it
            out.append(pid)
    return out


def _wait_gone(pids: Sequence[int], timeout: float = GRACE_S) -> None:
    """Until the processes killed are gone (a SIGKILL is delivered, not waited for), at most
    ``timeout`` seconds: what runs next must not race their last writes."""
    end = time.monotonic() + timeout
    while (pids := _alive(pids)) and time.monotonic() < end:
        time.sleep(0.05)


def _kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def supervise(
    cmd: Sequence[str],
    what: str = "torchrun",
    grace: float = GRACE_S,
    env: Mapping[str, str] | None = None,
    cleanup: Callable[[str], object] | None = None,
) -> int:
    """Run ``cmd`` (no shell; ``env``: variables added to this environment) as a job this process
    answers for; its exit status.

    Raises :class:`Interrupted` (after every process of the job stopped) when SIGINT, SIGTERM or
    SIGHUP arrived meanwhile; the first one is forwarded to the command at once. ``cleanup``: called
    with the job's token (:func:`job_token`) once no process of the job is left, however it ended,
    to remove what the job's processes left behind under names carrying it."""
    token = f"{os.getpid()}:{start_time(os.getpid())}:{secrets.token_hex(8)}"
    got: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not got:
            got.append(signum)
            for proc in started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    with _handlers(forward):  # before the start: a signal meanwhile is forwarded once it runs
        proc = subprocess.Popen(list(cmd), env={**os.environ, **(env or {}), JOB_ENV: token}, start_new_session=True)
        started.append(proc)
        if got:
            os.kill(proc.pid, got[0])
        deadline = None
        while True:
            if got and deadline is None:
                deadline = time.monotonic() + grace
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    code = proc.wait()
                    break
        # Whatever of the job is left (ranks in their own sessions, orphans): the rest of the
        # grace period to stop, then SIGKILL.
        left = job_processes(token)
        end = (deadline or time.monotonic() + grace) if left else 0.0
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = _alive(left)
        _kill(left, signal.SIGKILL)
        _wait_gone(left)
        if cleanup is not None:
            cleanup(token.rpartition(":")[2])
    if got:
        killed = f", {len(left)} process(es) killed after {grace:.0f} s" if left else ""
        raise Interrupted(got[0], f"stopped {what} and its ranks{killed}")
    return code


@contextlib.contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """``handler`` for SIGINT, SIGTERM and SIGHUP meanwhile (in the main thread; elsewhere the
    process's own handlers stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# Code an exception must not be raised into at any point: numba's compiler and llvmlite under it.
# An ObjectRef interrupted in its __init__ is left half made, and its __del__ then fails with a
# traceback on stderr when it is collected (after the command's one line).
NOT_INTERRUPTIBLE = ("numba", "llvmlite")


def _raise(signum: int, frame: FrameType | None) -> None:
    if not _interruptible_depth:  # interruptible() is restoring the handlers: the command is over
        return
    if not _stopping:
        _stopping.append(signum)
    if _in_unraisable_hook or _inside(frame, NOT_INTERRUPTIBLE):  # later, from outside it
        _send_again(signum)
        return
    raise Interrupted(signum)


def _inside(frame: FrameType | None, packages: tuple[str, ...]) -> bool:
    """Whether ``frame`` or one of its callers runs code of ``packages``."""
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.split(".")[0] in packages:
            return True
        frame = frame.f_back
    return False


_in_unraisable_hook = False
_interruptible_depth = 0  # how many interruptible() blocks the main thread is in
_resending: set[int] = set()  # the threads of _send_again still to send


def _send_again(signum: int) -> None:
    """The signal to this process once more, shortly, from another thread: its handler then
    runs in the main thread's next bytecodes, not in the finalizer that dropped it nor in the
    compiler it deferred (a real signal, not ``_thread.interrupt_main``: it also ends a blocking
    wait of the main thread)."""
    token = object()
    _resending.add(id(token))

    def later() -> None:
        try:
            time.sleep(0.01)
            if _interruptible_depth:  # not once the command has left interruptible()
                os.kill(os.getpid(), signum)
        finally:
            _resending.discard(id(token))

    _thread.start_new_thread(later, ())


def _unraisable(hook: sys.UnraisableHookArgs) -> None:
    """An ``Interrupted`` raised while a finalizer (``__del__``) ran is printed and dropped by
    Python, and the command would go on as if never signalled: the signal is sent again, so that
    it is raised once more where it unwinds the command."""
    global _in_unraisable_hook
    if not isinstance(hook.exc_value, Interrupted):
        sys.__unraisablehook__(hook)
        return
    _in_unraisable_hook = True
    _send_again(hook.exc_value.signum)
    _in_unraisable_hook = False  # no signal check between this and the return


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` meanwhile (a KeyboardInterrupt): a
    command unwinds (locks released, partial outputs kept for the re-run) and exits 130 / 143 / 129."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _interruptible_depth
    _interruptible_depth += 1  # before the handlers: _raise lets go of a signal outside
    previous: dict[signal.Signals, Any] = {}  # the handlers replaced, to put back
    unraisable = sys.unraisablehook
    try:
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, _raise)
        sys.unraisablehook = _unraisable
        yield
    finally:
        _interruptible_depth -= 1  # first: from here on _raise lets a signal go (the command is over)
        sys.unraisablehook = unraisable
        while _resending:  # a signal sent again lands here, on _raise, not on the default action
            time.sleep(0.001)
        for s, h in previous.items():
            signal.signal(s, h)


def stopping() -> int | None:
    """The signal this process is stopping on (after :func:`guard` or :func:`interruptible`), or
    None: a rank that fails while stopping (a peer gone first) exits quietly."""
    return _stopping[0] if _stopping else None


def stopped(code: int, rank: bool) -> int:
    """``code``, for a process that stopped on a signal and has closed what it holds; a rank
    (``rank``) exits at once instead: the interpreter's teardown (collecting every object) can
    take seconds on a loaded machine, past the launcher's grace period."""
    if rank:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code


def guard() -> None:
    """For a rank (inside :func:`interruptible`): it stops by itself when the launcher that started
    its job is gone, or (under torchrun) its parent is: SIGTERM to itself, then, if it has not
    exited :data:`GRACE_S` later, ``os._exit``. Nothing to watch for a process started by hand."""
    launcher = os.environ.get(JOB_ENV)
    parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ or launcher else None
    if launcher is None and parent is None:
        return
    threading.Thread(target=_watch, args=(launcher, parent), name="moment-launcher-watch", daemon=True).start()


def _watch(launcher: str | None, parent: int | None) -> None:
    pidfd = None
    gone = False
    if launcher is not None:
        pid, started = int(launcher.split(":")[0]), launcher.split(":")[1]
        try:
            pidfd = os.pidfd_open(pid)
            gone = start_time(pid) != started  # the PID was reused: the launcher is gone
        except ProcessLookupError:
            gone = True
        except (AttributeError, OSError):  # no pidfd here: polled by PID and start time
            pidfd = None
            gone = start_time(pid) != started
        poller = select.poll()
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
    while not gone:
        if pidfd is not None:
            gone = bool(poller.poll(POLL_S * 1000))
        else:
            time.sleep(POLL_S)
            gone = launcher is not None and start_time(int(launcher.split(":")[0])) != launcher.split(":")[1]
        gone = gone or (parent is not None and os.getppid() != parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(128 + signal.SIGTERM)
