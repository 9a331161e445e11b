"""The one way moment publishes an output directory (a dataset, a placed dataset, a demo).

The rules (README, "Placement"):

* ``--out`` is absent, empty, or an output of the same kind — a directory whose manifest
  validates (format marker, complete). Anything else is refused, in one line, before any work.
* Work happens in ``OUT.partial``, the staging directory, under an exclusive ``flock`` held for
  the whole run: a second writer fails at once, naming the first. Its marker file says which
  command owns it and the run id that every file it writes outside (SSD bins) carries in its name.
* Publishing is a sequence of renames inside that locked directory, each step named for the
  fault-injection tests (:mod:`moment.faults`): the finished output waits in ``OUT.partial/data``;
  an old output at ``OUT`` moves to ``OUT.partial/old``; ``data`` becomes ``OUT``; the old one is
  removed file by file — only files its validated manifest lists, never anything else. A kill at
  any step is finished by the next run.

A partial build records what it is for in ``inputs.json`` (:func:`write_inputs`: the key of its
inputs and what a resumed run must reuse); a re-run resumes it only when :func:`read_inputs` gives
back the same key, and otherwise throws it away (``moment place`` and ``moment infer`` both).

Before any work, :func:`check_free_space` (the one free-space check; the trainer's shared host
memory uses :func:`short_of_space` under it) refuses a run that cannot fit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moment import faults
from moment.errors import MomentError
from moment.fileio import atomic_write_text, fsync_dir, fsync_tree

INPUTS = "inputs.json"  # in a partial build: the key of the inputs it is for (write_inputs)
MARKER = ".moment-staging.json"
LOCK = ".moment-lock"  # DirLock's file: flock'ed by the job's launcher, naming it
MEMBERS = ".moment-ranks"  # the processes of a job working in a locked directory (join)


@dataclass(frozen=True)
class Kind:
    """What kind of output a command writes, and how to tell one of its own."""

    name: str  # "placed dataset"
    manifest: str  # the file whose presence, validated, makes a directory an output of this kind
    command: str  # "moment place", for messages
    validate: Callable[[Path], object]  # raises MomentError unless the directory is a complete output
    owned_files: Callable[[Path], Iterable[Path]]  # an output's files (manifest included) it may remove
    error: type[MomentError] = MomentError  # what a refusal raises


def write_inputs(directory: Path, key: str, **more: Any) -> None:
    """Record in ``directory`` (a partial build) the key of the inputs it is for, and ``more``
    (JSON values a resumed run reads back: where it wrote, the budget it chose)."""
    atomic_write_text(Path(directory) / INPUTS, json.dumps({"key": key, **more}) + "\n")


def read_inputs(directory: Path) -> dict[str, Any]:
    """What :func:`write_inputs` recorded in ``directory``; empty when missing or unreadable (a
    build killed before it wrote the record is started over)."""
    try:
        doc = json.loads((Path(directory) / INPUTS).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def short_of_space(needs: dict[Path, int], headroom: bool = True) -> list[tuple[Path, Path, float, int]]:
    """The file systems without room for what is to be written there, as (first target, existing
    directory probed, bytes wanted, bytes free).

    ``needs`` maps target paths (existing or not) to bytes; targets on one file system are added
    up; ``headroom`` adds 2% + 64 MiB (file system overhead, manifests, scratch)."""
    by_fs: dict[int, tuple[Path, Path, int]] = {}
    for target, need in needs.items():
        probe = Path(target).absolute()
        while not probe.exists():
            probe = probe.parent
        dev = probe.stat().st_dev
        first, where, total = by_fs.get(dev, (Path(target), probe, 0))
        by_fs[dev] = (first, where, total + need)
    short = []
    for target, probe, need in by_fs.values():
        free = shutil.disk_usage(probe).free
        want = need * 1.02 + (64 << 20) if headroom else need
        if free < want:
            short.append((target, probe, want, free))
    return short


def check_free_space(needs: dict[Path, int], error: type[MomentError] = MomentError) -> None:
    """Enough free space on every file system the run writes to (:func:`short_of_space`, with
    headroom), before any byte is written; else ``error`` naming the target and the shortfall."""
    for target, probe, want, free in short_of_space(needs):
        raise error(
            f"{target}: needs {want / 1e9:.2f} GB but {probe} has {free / 1e9:.2f} GB free "
            f"({(want - free) / 1e9:.2f} GB short)"
        )


def check_out(out: Path, kind: Kind, replace: bool = True) -> bool:
    """Refuse an ``--out`` that is not absent, empty, or an output of ``kind``; True if it holds one."""
    if out.is_symlink():
        raise kind.error(f"{out}: a symbolic link: give the directory it points to")
    if not out.exists():
        parent = out.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise kind.error(f"{parent}: not a directory, so {out} cannot be created there")
        return False
    if not out.is_dir():
        raise kind.error(f"{out}: already exists and is not a directory: refusing to replace it with a {kind.name}")
    if not any(out.iterdir()):
        return False
    if not (out / kind.manifest).is_file():
        raise kind.error(
            f"{out}: already exists and is not empty, and is not a {kind.name} (no {kind.manifest}): "
            f"refusing to write there; choose another output directory"
        )
    try:
        kind.validate(out)
    except MomentError as exc:
        raise kind.error(f"{out}: not a complete {kind.name}, refusing to replace it ({exc})") from None
    if not replace:
        raise kind.error(f"{out}: already a {kind.name}: choose another output directory or remove it")
    return True


class Staging:
    """``OUT.partial``: the locked directory a run builds its output in (see the module doc)."""

    def __init__(self, out: Path, kind: Kind) -> None:
        self.out = out
        self.kind = kind
        self.dir = out.with_name(out.name + ".partial")
        self.data = self.dir / "data"
        self.old = self.dir / "old"
        self.run_id = ""
        self._fd: int | None = None

    # --- ownership ------------------------------------------------------------------------

    def _read_marker(self, where: Path) -> dict:
        try:
            marker = json.loads((where / MARKER).read_text())
        except (OSError, ValueError):
            marker = None
        if (
            not isinstance(marker, dict)
            or marker.get("kind") != self.kind.name
            or not isinstance(marker.get("run_id"), str)
        ):
            raise self.kind.error(
                f"{self.dir}: exists and was not left by {self.kind.command}: remove it or choose "
                f"another output directory"
            )
        return marker

    def _lock(self, where: Path) -> None:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                other = json.loads((where / MARKER).read_text())
            except (OSError, ValueError):
                other = {}
            raise self.kind.error(
                f"{self.out}: another {self.kind.command} is writing it{holder(other)}; wait for it to finish"
            ) from None
        if live := live_members(where):  # ranks of a run whose launcher is gone (see join)
            os.close(fd)
            raise self.kind.error(
                f"{self.out}: {len(live)} process(es) of an earlier {self.kind.command} still write it"
                f"{holder(live[0])}; wait for them to stop"
            )
        self._fd = fd

    def _write_marker(self, where: Path, run_id: str) -> None:
        body = {"kind": self.kind.name, "run_id": run_id, **_me(self.kind.command)}
        tmp = where / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(body) + "\n")
        os.replace(tmp, where / MARKER)

    def resume(self) -> bool:
        """Take an existing ``OUT.partial`` (a killed run's): lock it, adopt its run id. False if none."""
        if self.dir.is_symlink():
            raise self.kind.error(f"{self.dir}: a symbolic link: remove it")
        if not self.dir.exists():
            return False
        self._read_marker(self.dir)
        self._lock(self.dir)
        self.run_id = self._read_marker(self.dir)["run_id"]  # re-read under the lock
        self._write_marker(self.dir, self.run_id)
        return True

    def create(self) -> None:
        """Make ``OUT.partial`` locked from birth: built under a private name, renamed into place."""
        if self._fd is not None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
        run_id = secrets.token_hex(4)
        self._write_marker(tmp, run_id)
        self._lock(tmp)
        try:
            os.rename(tmp, self.dir)  # fails if another run made OUT.partial meanwhile
        except OSError:
            self.release(tmp)
            if self.resume():  # it was a killed run's after all: fine, ours now
                return
            raise
        self.run_id = run_id
        fsync_dir(self.dir.parent)

    def release(self, where: Path | None = None) -> None:
        """Remove the (empty) staging directory and drop the lock."""
        where = where or self.dir
        (where / MARKER).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the ranks' registrations, all gone (live_members)
            (where / MEMBERS).rmdir()
        with contextlib.suppress(OSError):  # not empty: someone else's files stay
            where.rmdir()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlock(self) -> None:
        """Drop the lock and keep ``OUT.partial`` as it is: a run that failed part-way leaves it
        for the next run to resume (what a killed process leaves, without waiting for its exit)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # --- publishing -----------------------------------------------------------------------

    def publish(self, step: str, keep: Iterable[Path] = (), external_dirs: Iterable[Path] = ()) -> list[str]:
        """``data`` → ``OUT``, replacing an old output of the same kind; returns notes for the user.

        ``keep``: files the new output uses (never removed with the old one); ``external_dirs``:
        directories outside ``OUT`` the run was given (the old output's files there may go)."""
        notes: list[str] = []
        if self.data.exists():
            faults.point(f"{step}:staged")
            # an old output moves aside (re-checked: nothing else moved in meanwhile); an empty
            # directory is simply replaced by the rename below
            if not self.old.exists() and check_out(self.out, self.kind):
                os.rename(self.out, self.old)
                fsync_dir(self.dir)
                faults.point(f"{step}:old-moved")
            fsync_tree(self.data)
            os.rename(self.data, self.out)
            fsync_dir(self.out.parent)
            faults.point(f"{step}:published")
        if self.old.exists():
            notes += self._remove_old(keep, external_dirs)
            faults.point(f"{step}:old-removed")
        self.release()
        return notes

    def _remove_old(self, keep: Iterable[Path], external_dirs: Iterable[Path]) -> list[str]:
        """Remove a replaced output: only the files its validated manifest lists, each inside the
        old directory or inside a directory this run was given, never one the new output uses."""
        try:
            self.kind.validate(self.old)
            files = list(self.kind.owned_files(self.old))
        except MomentError as exc:
            return self._set_aside(f"its manifest no longer validates ({exc})")
        kept = {_identity(p) for p in keep}
        given = [Path(d).resolve() for d in external_dirs]
        notes = []
        old_root = self.old.resolve()
        for path in files:
            real = path.resolve() if path.exists() else path
            inside = real.is_relative_to(old_root)
            if not inside and not any(real.parent == d for d in given):
                if path.exists():
                    notes.append(
                        f"{path}: left in place (the replaced {self.kind.name}'s file, in a directory this run was not given)"
                    )
                continue
            if _identity(path) in kept:
                continue
            path.unlink(missing_ok=True)
        _prune_empty_dirs(self.old)
        if self.old.exists():
            return notes + self._set_aside("it holds files moment did not write")
        return notes

    def _set_aside(self, why: str) -> list[str]:
        aside = self.out.with_name(f"{self.out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(self.old, aside)
        return [
            f"the replaced {self.kind.name} was kept at {aside}: {why}; remove it yourself when you no longer need it"
        ]


def _identity(path: Path) -> tuple[int, int] | str:
    try:
        st = path.stat()
        return (st.st_dev, st.st_ino)
    except OSError:
        return str(path.absolute())


def _prune_empty_dirs(root: Path) -> None:
    """Remove ``root`` and directories under it that are empty (after their files were removed)."""
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):  # not empty
            os.rmdir(dirpath)


# --- jobs of several processes ----------------------------------------------------------------
#
# A launcher (moment train, moment infer --nproc N) holds its directory's lock; the ranks it
# starts write there too. Each rank registers itself (join): a file in DIR/.moment-ranks that it
# holds an flock on until it exits, so the kernel, not a PID that may be reused, says whether it
# still runs. A new run takes the directory only when its lock is free *and* no registered
# process is alive: ranks whose launcher was killed keep the directory theirs until they stop
# (moment.procs.guard stops them within seconds).


def _me(command: str) -> dict:
    return {
        "command": command,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def holder(doc: dict) -> str:
    """`` (pid P on HOST, since T)`` from a lock's or registration's record ('' if unknown)."""
    if not isinstance(doc, dict) or "pid" not in doc:
        return ""
    return f" (pid {doc.get('pid')} on {doc.get('host')}, since {doc.get('since')})"


def live_members(directory: Path) -> list[dict]:
    """The records of the processes registered in ``directory`` (:func:`joined`) that still run;
    registrations of processes that have exited are removed."""
    where = Path(directory) / MEMBERS
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return []
    live = []
    for name in names:
        try:
            fd = os.open(where / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: that process still runs
            try:
                live.append(json.loads(os.pread(fd, 4096, 0)))
            except ValueError:
                live.append({})
        else:
            (where / name).unlink(missing_ok=True)
        finally:
            os.close(fd)
    return live


@contextlib.contextmanager
def joined(directory: Path, command: str) -> Iterator[None]:
    """Register this process as working in ``directory`` while the block runs (and, if it is
    killed, until the kernel drops its flock): see :func:`live_members`."""
    where = Path(directory) / MEMBERS
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{socket.gethostname()}-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(_me(command)).encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        with contextlib.suppress(OSError):  # others still registered
            where.rmdir()


class DirLock:
    """One job at a time in ``directory`` (a checkpoint directory): an flock on ``DIR/.moment-lock``
    whose file names the holder; refused, in one line naming it, while another job holds it or
    while processes registered by an earlier job still run (``members``: a rank taking the lock
    for its own job skips that check, its peers being registered already)."""

    def __init__(self, directory: Path, command: str, error: type[MomentError] = MomentError) -> None:
        self.dir, self.command, self.error = Path(directory), command, error
        self._fd: int | None = None

    def acquire(self, members: bool = True) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                other = json.loads(os.pread(fd, 4096, 0))
            except (OSError, ValueError):
                other = {}
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise self.error(
                f"{self.dir}: another {other.get('command', self.command)} is using it{holder(other)}; "
                "wait for it to finish or choose another directory"
            ) from None
        if members and (live := live_members(self.dir)):
            os.close(fd)
            raise self.error(
                f"{self.dir}: {len(live)} process(es) of an earlier {self.command} still write it{holder(live[0])}; "
                "wait for them to stop"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_me(self.command)) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
