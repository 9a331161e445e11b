"""Distributed set-up of a rank: who it is (torchrun's environment), which device it uses, the
process group, and the few collectives the loop needs.

* ranks come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``; ``env://``); without it the run is a single process and no
  process group is made;
* on several nodes started by ``moment train --node-rank R`` (``MOMENT_NODE_RANK``), the global
  rank is ``R × ranks per node + LOCAL_RANK``: torchrun's c10d rendezvous ignores ``--node-rank``
  and orders nodes by host name and agent pid, so without this "node 0" (the checkpoint's and
  the metrics' writer) would be whichever node torchrun ranked first. The store it rendezvoused
  on checks the numbering before the process group is made (:func:`check_numbering`);
* on CUDA, local rank r uses the GPU the plan gives rank r: the CUDA device whose PCI address is
  the plan's ``bdf`` (devices ordered by PCI bus id), else GPU ``LOCAL_RANK`` — or the first
  free one when another rank's plan GPU is that one (:func:`moment.hw.distinct_devices`: one
  device per rank of the node); the process is pinned to its socket's CPUs (every NUMA node of
  it; socket N is not node N under SNC/NPS).
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moment import hw
from moment.contracts.plan import PlanDoc
from moment.errors import MomentError

# How long a collective may wait. The longest wait is set-up: local rank 0 copies every cache bin
# held in host memory into --shm-dir while the node's other ranks wait at a barrier (tens of GB
# take minutes), longer than NCCL's default 10 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)
NODE_RANK = "MOMENT_NODE_RANK"  # moment train --node-rank: this node's place in the global rank order
# How long a rank leaving a job that succeeded waits for the others to be done with the group.
LEAVE_TIMEOUT = timedelta(seconds=30)
_rendezvous: list[dist.Store] = []  # the store this process's group was made from (setup)


@dataclass
class DistEnv:
    rank: int  # the global rank this process trains as
    world_size: int
    local_rank: int
    launched: bool  # started by torchrun (a process group is expected)
    node_rank: int = 0  # --node-rank (else torchrun's GROUP_RANK)
    nodes: int = 1  # torchrun's GROUP_WORLD_SIZE
    launch_rank: int | None = None  # torchrun's RANK, where it differs from ``rank``

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        launched = "RANK" in env and "WORLD_SIZE" in env
        rank, local = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
        nodes, node = int(env.get("GROUP_WORLD_SIZE", 1)), int(env.get("GROUP_RANK", 0))
        out = cls(rank, int(env.get("WORLD_SIZE", 1)), local, launched, node, nodes)
        if launched and nodes > 1 and env.get(NODE_RANK, "").isdigit():
            out.node_rank = int(env[NODE_RANK])
            out.rank = out.node_rank * int(env.get("LOCAL_WORLD_SIZE", 1)) + local
            out.launch_rank = rank if out.rank != rank else None
        return out


def select_device(requested: str, env: DistEnv, plan: PlanDoc | None) -> tuple[torch.device, str]:
    """This rank's device (and socket pinning on CUDA); a line saying what was chosen and why.

    ``requested``: the configured device, resolved ("cpu", "cuda" or an explicit "cuda:N")."""
    if not requested.startswith("cuda"):
        return torch.device("cpu"), "cpu"
    if requested.startswith("cuda:"):  # an explicit device wins over the plan
        device = torch.device(requested)
        torch.cuda.set_device(device)
        return device, str(device)
    entry = plan.rank(env.local_rank) if plan else None
    # Pinned before CUDA starts its threads (they inherit the affinity).
    pinned = hw.pin_to_socket(entry.socket) if entry and entry.socket is not None else None
    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local > count:
        raise MomentError(
            f"{local} ranks on this node, {count} CUDA devices visible: ranks would share a GPU "
            f"(use --nproc {count}, or make the other GPUs visible)"
        )
    entries = [plan.rank(r) if plan else None for r in range(max(local, env.local_rank + 1))]
    matched = [hw.cuda_index_of(e.bdf) if e else None for e in entries]
    index, why = hw.distinct_devices(matched, count)[env.local_rank]
    if why == "plan" and entry is not None:
        why = f"plan {entry.gpu} at {entry.bdf}"
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device, f"{device} ({why})" + (f", pinned to {pinned}" if pinned else "")


def setup(requested: str, backend: str, env: DistEnv, plan: PlanDoc | None) -> tuple[torch.device, str]:
    """Device per rank, then the process group (env:// from torchrun); none for a lone process.
    ``requested``/``backend``: the configured device and backend, resolved."""
    device, where = select_device(requested, env, plan)
    if env.launched and not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": COLLECTIVE_TIMEOUT}
        if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = device  # binds the communicator to this GPU at once (torch >= 2.3)
        store, rank, world = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
        prefix = attempt_prefix(env)
        if prefix is not None:
            store = dist.PrefixStore(prefix, store)
        if env.nodes > 1 and os.environ.get(NODE_RANK):
            check_numbering(store, env, rank, world)
            rank = env.rank
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kwargs)
        _rendezvous[:] = [store]
    return device, where


def leave() -> None:
    """Destroy the process group once every rank is done with it (a job that succeeded).

    gloo may tear a pair down while the peer is still finishing its last collective on it
    (gloo#155); a rank of the two-node test once died so (SIGABRT, "terminate called without an
    active exception") right after the start-up check, its only collective. So each rank marks
    itself done in the rendezvous store and waits, at most :data:`LEAVE_TIMEOUT`, for the other
    marks before it closes its sockets. Not on a failure: the peers would wait for nothing."""
    if not dist.is_initialized():
        return
    if _rendezvous:
        all_done(_rendezvous[0], dist.get_rank(), dist.get_world_size(), LEAVE_TIMEOUT)
    dist.destroy_process_group()


def all_done(store: dist.Store, rank: int, world: int, timeout: timedelta) -> bool:
    """Mark ``rank`` done in ``store`` and wait for every rank's mark; False after ``timeout``
    (a peer gone: leave anyway). Keys of an earlier attempt in a shared store only end the wait
    early, as before this existed."""
    store.set(f"moment/left/{rank}", "1")
    try:
        store.wait([f"moment/left/{r}" for r in range(world)], timeout)
    except RuntimeError:  # DistStoreError: timed out
        return False
    return True


def check_numbering(store: dist.Store, env: DistEnv, launch_rank: int, world: int) -> None:
    """Every process's global rank from ``--node-rank``, checked to be a numbering of the world
    before any process group uses it: two nodes given one ``--node-rank``, or nodes running
    different ``--nproc``, would make two processes claim one rank (a hang, not an error).
    One key per process in the rendezvous store, then every process reads all of them (not
    scoped to the attempt: nodes count their restarts differently, pytorch#108158, and across
    nodes ``moment train`` gives every attempt a store of its own)."""
    key = "moment/numbering/"
    host = socket.gethostname()
    store.set(key + str(launch_rank), json.dumps([env.rank, env.node_rank, host, env.world_size]))
    claims = [json.loads(store.get(key + str(r))) for r in range(world)]
    seen: dict[int, tuple[int, str]] = {}
    # One line per node (its local rank 0 says it); the node's other ranks stop quietly.
    error = MomentError if env.local_rank == 0 else PeerFailedError
    for rank, node, where, _ in claims:
        if rank in seen and seen[rank][0] == node:
            raise error(
                f"--node-rank {node} is given to two nodes ({seen[rank][1]} and {where}): "
                "give each node its own, 0 to --nnodes - 1"
            )
        if rank in seen or not 0 <= rank < world:
            raise error(
                f"the nodes run different numbers of ranks ({world} in all over {env.nodes} nodes): "
                "give every node the same --nproc"
            )
        seen[rank] = (node, where)


def attempt() -> str:
    """This node's torchrun attempt: run id and restart count (the same for all ranks of a node)."""
    env = os.environ
    return f"{env.get('TORCHELASTIC_RUN_ID', '')}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def attempt_prefix(env: DistEnv) -> str | None:
    """Store keys of this attempt, where torchrun keeps one store across restarts.

    torchrun (c10d rendezvous) shares its agent's store with the workers and keeps it across
    restarts, so a restarted group rendezvousing on plain keys can read the killed group's
    addresses before its peers overwrite them (gloo: connection refused; nccl: a stale unique
    id; pytorch#135712). On one node the restart count names the attempt; across nodes the
    counts differ (pytorch#108158), so there ``moment train`` gives each attempt a store of its
    own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and a bare torchrun is warned."""
    environ = os.environ
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # each attempt has a fresh store
    if environ.get("GROUP_WORLD_SIZE", "1") == "1":
        return f"moment/{attempt()}"
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.rank == 0:
        print(
            "warning: torchrun keeps one store across restarts on several nodes: a restarted group may "
            "fail to connect; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (moment train does)",
            file=sys.stderr,
        )
    return None


def _comm_device(device: torch.device) -> torch.device:
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (the values themselves for a lone process)."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=_comm_device(device))
    dist.all_reduce(t)
    return t.tolist()


def broadcast_bytes(data: bytes | None, device: torch.device) -> bytes | None:
    """Rank 0's ``data`` on every rank (None: rank 0 has none); large things, unlike
    :func:`all_gather`: a length, then the bytes as one tensor."""
    comm = _comm_device(device)
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=comm)
    dist.broadcast(size, 0)
    n = int(size.item())
    if n < 0:
        return None
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(comm)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=comm)
    dist.broadcast(buf, 0)
    return data if data is not None else buf.cpu().numpy().tobytes()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (pickled; small things only), in rank order."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class PeerFailedError(MomentError):
    """Another rank failed a step all ranks take together and reported it; this one stops quietly."""


def together(step: Callable[[], object], lost: str = "") -> None:
    """Run ``step`` on every rank (rank 0 writing a checkpoint or the metrics file, say) and stop
    every rank if it failed on one: a full disk or a read-only target (OSError) is one MomentError
    line on the rank that hit it, naming the file and ``lost`` (what was not written, what was
    kept), and :class:`PeerFailedError` on the others — instead of a traceback and ranks left waiting
    at the next collective for one that is gone."""
    failure = None
    try:
        step()
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        failure = f"{where}{exc.strerror or exc}" + (f" ({lost})" if lost else "")
    except MomentError as exc:
        failure = str(exc)
    failures = all_gather(failure)
    if failure is not None:
        raise MomentError(failure)
    if any(f is not None for f in failures):
        raise PeerFailedError(next(f for f in failures if f is not None))


def lost_peer(exc: Exception) -> str:
    """One line for a collective that failed because another rank is gone (it reported its own
    error, or was killed): what this rank says instead of a traceback."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"another rank stopped first ({first[:160]})"
