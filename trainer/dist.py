"""Distributed set-up of a rank: who it is (torchrun's environment), which device it uses, the
process group, and the few collectives the loop needs.

* ranks come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``; ``env://``); without it the run is a single process and no
  process group is made;
* on CUDA, local rank r uses the GPU the plan gives rank r: the CUDA device whose PCI address is
  the plan's ``bdf`` (devices ordered by PCI bus id), else GPU ``LOCAL_RANK`` — or the first
  free one when another rank's plan GPU is that one (:func:`moment.hw.distinct_devices`: one
  device per rank of the node); the process is pinned to its socket's CPUs (every NUMA node of
  it; socket N is not node N under SNC/NPS).
"""

from __future__ import annotations

import inspect
import os
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


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launched: bool  # started by torchrun (a process group is expected)

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        launched = "RANK" in env and "WORLD_SIZE" in env
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)), launched)


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
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kwargs)
    return device, where


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
