"""Node-shared host memory: one copy per socket of the cache bins held in host memory.

The ranks of a socket share the CPU cache (and on CPU ranks the GPU cache), as the planner models
it: the bins are concatenated into one file in a memory file system (``--shm-dir``, e.g.
/dev/shm) that every rank of the socket maps. torchrun's workers are not children of each other,
so a named file is what they can share. The protocol, all of it here:

* naming (:func:`shm_path`): after the placement (its manifest), the torchrun job and the socket,
  so runs of other placements or jobs never map it; under a launcher (``moment train``) the name
  ends in the job's random token (:func:`moment.procs.job_token`), which no other job carries,
  and torchrun's restart count;
* who writes (:func:`socket_writer`): the socket's first local rank, pinned to the socket's cores
  so the pages land in the socket's memory;
* writing (:func:`publish`): under a temporary name, then linked into place, so nobody maps a
  half-written file; refused (:class:`SharedMemoryFullError`) without room, and the ranks fall back
  to private copies;
* mapping (:func:`map_shared`) and the barriers around it (:func:`per_socket`): the others wait
  while the writer writes; once all have mapped the file the writer unlinks it (the memory lives
  while mapped, and a crash after that leaves nothing behind);
* leftovers: a job stopped between the writing and the second barrier would leave the file (all
  of the socket's host tiers, held in memory until someone deletes it). A writer that unwinds
  there (SIGTERM, SIGINT: :func:`moment.procs.interruptible`; a peer gone: the barrier fails)
  unlinks the file it made. A writer killed outright cannot: its launcher, once no process of the
  job is left (:func:`moment.procs.supervise`, whether torchrun exited 0, failed or was signalled),
  removes the files in ``--shm-dir`` whose names end in its job's token (:func:`remove_job_files`),
  and only those: another job's files, on another placement or the same one, even another
  launcher's on this host, carry another token or none, and stay. Ranks started by a bare torchrun
  have no token (the name is the one without it) and no launcher to sweep after them. When
  torchrun restarts the ranks (``--max-restarts``), each writer first removes its job's files of
  the earlier attempts (the name ends in the restart count; torchrun stopped those ranks before
  it restarted), so a killed attempt's copy does not hold memory beside the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from moment import faults
from moment.contracts.plan import PlanDoc
from moment.fileio import atomic_file
from moment.outputs import short_of_space
from moment.procs import job_token
from placement.placed import Placed, PlacedError
from trainer.dist import DistEnv, attempt

T = TypeVar("T")


class SharedMemoryFullError(PlacedError):
    """The memory file system has no room for the host tiers (the caller may fall back to
    private copies)."""


# File systems whose pages live in memory: a GPU may pin and map them in place (cudaHostRegister).
# Linux refuses a long-term pin of the pages of a file on disk (mm/gup.c: FOLL_LONGTERM on a
# file mapping that needs write-back), so a --shm-dir there would be staged, and written back too.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "hugetlbfs", "ramfs"})


def file_system(path: str | Path, mounts: str | None = None) -> str | None:
    """The type of the file system holding ``path``: the longest mount point above it in
    ``mounts`` (the text of /proc/self/mounts, read when None); None when it cannot be told."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    where = os.path.realpath(path)
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def not_in_memory(shm_dir: str | Path) -> str | None:
    """Why ``shm_dir`` is a poor place for shared host tiers (a phrase), or None when it is a
    memory file system (or its type cannot be told)."""
    kind = file_system(shm_dir)
    if kind is None or kind in MEMORY_FILE_SYSTEMS:
        return None
    return (
        f"--shm-dir {shm_dir} is on {kind}, not a memory file system: its pages are written back to disk "
        "and a GPU cannot map them in place (Linux pins no file pages on disk); use a tmpfs such as /dev/shm"
    )


def socket_of(plan: PlanDoc | None, local_rank: int) -> str:
    """The socket the plan puts ``local_rank``'s GPU on ("node" without one): host-memory tiers
    are shared per socket, so each GPU reads the copy in its own socket's memory."""
    entry = plan.rank(local_rank) if plan else None
    return entry.socket if entry and entry.socket else "node"


def socket_writer(plan: PlanDoc | None, env: DistEnv) -> bool:
    """Whether this rank is the first local rank of its socket (it writes the socket's copy)."""
    mine = socket_of(plan, env.local_rank)
    return all(socket_of(plan, r) != mine for r in range(env.local_rank))


def shm_path(shm_dir: str | Path, placed: Placed, socket: str, kind: str = "host") -> Path:
    """The socket-shared file of this run holding ``kind`` (``host``: the host tiers; ``csr``: the
    graph, :mod:`trainer.sampling`): named after the placement (its manifest), the torchrun job
    and the socket, so runs of other placements or jobs never map it; ``-TOKEN-RESTART`` after it
    under a launcher (its job's token: the launcher removes what a killed rank left,
    :func:`remove_job_files`; torchrun's restart count: a restarted writer removes what the
    earlier attempts left)."""
    manifest = (placed.root / "placed.json").read_bytes()
    env = os.environ  # GROUP_RANK: two "nodes" on one machine sharing a --shm-dir never meet
    job = f"{attempt()}:{env.get('MASTER_PORT', '')}:{env.get('GROUP_RANK', '')}:{socket}"
    key = hashlib.sha256(manifest + job.encode()).hexdigest()[:16]
    token = job_token()
    return Path(shm_dir) / (f"moment-{kind}-{key}-{token}-{restart()}" if token else f"moment-{kind}-{key}")


def restart() -> int:
    """How many times torchrun has restarted this node's ranks (0: the first attempt)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def remove_job_files(shm_dir: str | Path, token: str, before: int | None = None) -> list[Path]:
    """Remove the files of the job ``token`` from ``shm_dir``, once its processes are gone: the
    socket files :func:`shm_path` names under that token, and their temporaries (a writer killed
    while writing, :func:`moment.fileio.atomic_file`); ``before``: only those of torchrun's
    attempts before that restart count (stopped, all of them, before it restarted the ranks).
    Only names carrying the token, which no other job's files carry; the paths removed. A
    directory that cannot be read: nothing (said)."""
    if not shm_dir or job_token(token) != token:
        return []
    ours = re.compile(rf"\.?moment-[a-z]+-[0-9a-f]{{16}}-{token}-([0-9]+)(\.[^/]*\.tmp)?")
    removed = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return []
    except OSError as exc:
        print(
            f"warning: --shm-dir {shm_dir}: {exc.strerror}: the job's shared files there were not looked for",
            file=sys.stderr,
        )
        return []
    for entry in entries:
        match = ours.fullmatch(entry.name)
        if match is None or (before is not None and int(match[1]) >= before):
            continue
        if entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def per_socket(
    open_store: Callable[[Path | None], T],
    shm_dir: str,
    placed: Placed,
    plan: PlanDoc | None,
    env: DistEnv,
    kind: str = "host",
) -> T:
    """``open_store(path)`` on every rank with one shared file per socket (``open_store(None)``:
    a private copy). With a process group and ``shm_dir`` set, the socket's writer opens first
    (writing the file) while the others wait at a barrier; then the others open (mapping it); a
    second barrier, and the writer unlinks it. Without room there, each rank loads its own copy.
    A writer that unwinds before the second barrier (a signal, a peer gone) unlinks the file it
    made: nobody would, and it holds the socket's tiers in memory."""
    writer = socket_writer(plan, env)
    path = (
        shm_path(shm_dir, placed, socket_of(plan, env.local_rank), kind) if dist.is_initialized() and shm_dir else None
    )
    if path is not None and not path.parent.is_dir():
        if env.rank == 0:
            print(f"warning: --shm-dir {path.parent}: no such directory: each rank loads its own copy", file=sys.stderr)
        path = None
    if path is not None and env.rank == 0 and (why := not_in_memory(path.parent)):
        print(f"warning: {why}", file=sys.stderr)
    store = None
    made = False  # the writer made the file (one there before is not its own to remove on failure)
    try:
        if path is not None and writer:
            if (token := job_token()) and restart():  # what a writer of an earlier attempt, killed, left
                remove_job_files(path.parent, token, before=restart())
            made = not path.exists()
            try:
                store = open_store(path)
            except SharedMemoryFullError as exc:
                print(f"warning: {exc}: each rank loads its own copy", file=sys.stderr)
            faults.point(f"shm:{kind}:published")
        if path is not None:
            dist.barrier()  # the file is whole (or was not made) before the other ranks look
        if store is None:
            shared = path is not None and path.exists()
            store = open_store(path if shared else None)
        if path is not None:
            faults.point(f"shm:{kind}:mapped:{'writer' if writer else 'reader'}")
            dist.barrier()  # every local rank has mapped it
            if writer:
                path.unlink(missing_ok=True)
    except BaseException:
        if made and path is not None:
            path.unlink(missing_ok=True)
        raise
    return store


def map_shared(
    path: Path, sources: Sequence[Path], rows: int, dim: int, dtype: torch.dtype, owner: Path
) -> torch.Tensor:
    """A (rows, dim) tensor on a shared mapping of ``path``, which holds ``sources`` back to back
    (the bins of ``owner``, a placed dataset); written there first if nobody has yet."""
    nbytes = rows * dim * torch.empty(0, dtype=dtype).element_size()
    if not path.exists():
        publish(path, sources, nbytes)
    size = path.stat().st_size
    if size != nbytes:
        raise PlacedError(
            f"{path}: holds {size} bytes, but the GPU and CPU bins of {owner} are "
            f"{nbytes} bytes: a file of another placement; remove it"
        )
    return torch.from_file(str(path), shared=True, size=rows * dim, dtype=dtype).view(rows, dim)


def publish(path: Path, sources: Sequence[Path], nbytes: int) -> None:
    """Concatenate ``sources`` into ``path`` atomically (``moment.fileio.atomic_file``: when
    another process won the race, its file is kept). A memory file system has no overhead to
    allow for: the check is for ``nbytes`` exactly."""
    for _, _, _, free in short_of_space({path.parent: nbytes}, headroom=False):
        raise SharedMemoryFullError(
            f"{path.parent}: {free / 2**30:.2f} GiB free, the GPU and CPU cache bins need {nbytes / 2**30:.2f} GiB"
        )
    with atomic_file(path, binary=True, replace=False) as out:
        for src in sources:
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out, length=16 << 20)
        if out.tell() != nbytes:
            raise PlacedError(f"{', '.join(map(str, sources))}: shorter than the manifest says: truncated while in use")
