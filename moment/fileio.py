"""Files users exchange: written atomically, read back with one-line errors; the durability and
free-space primitives every output uses.

Every file moment writes for someone else (profiles, plans, manifests, hotness, checkpoints, the
trainer's shared host-memory file) goes through ``atomic_file``: a temporary file beside the
target, fsync, rename (or link, to keep a file another process published first), fsync of the
directory — a reader sees the old file or the whole new one, never half, and a crash after the
call cannot undo it. Output directories (:mod:`moment.outputs`, which also holds the one
free-space check) are published with the same ``fsync_tree``/``fsync_dir``. ``read_json`` is the
one way such a JSON document is read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from moment.errors import MomentError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def drop_cached(paths: Iterable[str | Path]) -> None:
    """Evict the files' clean pages from the page cache (``posix_fadvise(DONTNEED)``), so that the
    next read comes from the disk: how the benchmarks measure cold reads without root."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bytes() -> int:
    """Bytes this process has had read from storage (``/proc/self/io`` read_bytes: page-cache
    hits not counted); 0 where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, before a rename publishes them."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def check_file_target(path: str | Path) -> Path:
    """``path`` as a file to write, refused if a directory stands there: checked by commands
    before their work as well as when they write (a long search is not wasted on it)."""
    path = Path(path)
    if path.is_dir():
        raise MomentError(f"{path}: a directory, expected a file name")
    return path


@contextlib.contextmanager
def atomic_file(path: str | Path, binary: bool = False, replace: bool = True) -> Iterator[IO[Any]]:
    """Write ``path`` through a temporary file that replaces it only once complete.

    ``replace=False``: an existing ``path`` is kept (another process published it first: the
    temporary file is linked into place, which fails rather than replaces)."""
    path = check_file_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # the CLI prints "path: reason"
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; these files are for sharing
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            os.unlink(tmp)
        fsync_dir(path.parent)
    except OSError as exc:  # disk full, read-only, a directory in the way: name the file meant
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as fh:
        fh.write(text)


def read_json(path: str | Path, fmt: str, what: str, error: type[MomentError] = MomentError) -> dict[str, Any]:
    """A JSON object whose ``format`` is ``fmt``; ``error`` names the file and what is wrong."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{p}: missing ({what})") from None
    except (OSError, ValueError) as exc:
        raise error(f"{p}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise error(f"{p}: format: expected {fmt!r}, got {got!r}")
    return doc


def reserve(path: str | Path) -> None:
    """Allocate every block of ``path`` (its current size) now: a file written through a memory
    map gets SIGBUS ("Bus error", no message) when a page has no room on a full file system,
    so the room is taken when the file is made, where a full disk is an OSError naming it. A file
    system that cannot preallocate keeps the file as it is."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    finally:
        os.close(fd)
