"""What ``moment train`` checks before it starts torchrun.

A mistake found inside the ranks costs a usage message or traceback per rank, torchrun's own
report, and sometimes a whole run (metrics written only at the end). So the launcher parses the
trainer's command line as the ranks will, opens the plan and the placed dataset, refuses a
train split too small for the ranks, probes that --metrics-json and --checkpoint-dir can be
written (creating nothing), and decides what an existing checkpoint means: refused unless
--resume (then it must come from this data and model) or --overwrite. Each refusal is one line.
The ranks repeat the checks that guard their own state (train split, checkpoint fit) as a
safety net for a bare ``torchrun -m trainer``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from moment.contracts.checkpoint import DataIdentity
from moment.contracts.plan import PlanDoc, read_plan
from moment.errors import MomentError
from moment.topology.profile_io import resolve_profile
from placement.placed import Placed, open_placed
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.memory import MemoryBudget, budget, gpu_capacity, host_capacity, refusal, shape_of_placed


@dataclass
class Checked:
    """The trainer's config as the ranks will parse it, and warnings to print before launching."""

    cfg: TrainConfig
    warnings: list[str] = field(default_factory=list)
    memory: MemoryBudget | None = None


def train_split_problem(placed: Placed, world_size: int) -> str | None:
    """Why the train split cannot feed ``world_size`` ranks (None: it can). Every rank takes the
    same number of ids per epoch (the remainder of the even split is dropped), so with fewer ids
    than ranks no rank would get one and the run would train on nothing."""
    n = len(placed.array("train"))
    where = placed.file("train")
    if n == 0:
        return f"{where}: train split is empty: nothing to train on"
    if n < world_size:
        return (
            f"{where}: train split has {n} id(s), fewer than the {world_size} ranks: no rank would get one "
            f"(every rank takes the same share): use fewer ranks (--nproc) or a larger train split"
        )
    return None


def _writable(path: Path, flag: str, is_file: bool) -> None:
    """Whether moment could create ``path`` (a file, or a directory and files in it) without
    creating anything now: a probe file in the nearest existing directory, removed at once."""
    if is_file and path.is_dir():
        raise MomentError(f"{flag} {path}: a directory, expected a file name")
    if not is_file and path.exists() and not path.is_dir():
        raise MomentError(f"{flag} {path}: not a directory")
    where = path.parent if is_file else path
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise MomentError(f"{flag} {path}: {where} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".moment-probe-", dir=where)
    except OSError as exc:
        raise MomentError(f"{flag} {path}: {where} is not writable ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def _checkpoint(cfg: TrainConfig, placed: Placed, resume: bool, overwrite: bool, node_rank: int = 0) -> None:
    """An existing checkpoint is continued (--resume, when it fits) or replaced (--overwrite),
    never replaced silently. On a node past 0 (``node_rank``) it may come from node 0's
    placement of the same data (a shared --checkpoint-dir)."""
    path = checkpoint.path_in(cfg.checkpoint_dir or "")
    if overwrite or not path.exists():
        return
    if not resume:
        raise MomentError(
            f"{path}: holds a checkpoint of an earlier run: pass --resume to continue it or --overwrite to start over"
        )
    checkpoint.check_zip(path)  # a damaged checkpoint is refused here, once, not by every rank
    meta = checkpoint.read_meta(cfg.checkpoint_dir or "")
    identity = DataIdentity.of(placed.root, placed.manifest)
    why = meta.refusal(cfg.to_dict(), identity, placement=node_rank == 0) if meta else None
    if why is not None:
        raise MomentError(f"{path}: cannot resume: {why}")


def plan_warnings(plan: PlanDoc, plan_path: str, placed: Placed) -> list[str]:
    """Where the plan does not describe the placed data: its rank map or its prediction may not apply."""
    out = []
    ref = placed.manifest.plan
    if plan.profile.sha256 != ref.profile.get("sha256") or plan.layout.name != ref.layout:
        out.append(
            f"{plan_path} (profile {plan.profile.name}, layout {plan.layout.name}) is not the plan "
            f"{placed.root} was placed with ({ref.path}: profile {ref.profile.get('name')}, layout {ref.layout})"
        )
    if placed.manifest.prediction.source == "plan":
        out.append(
            f"{placed.root} carries the plan's prediction (its profile was not found when placing), made for "
            f"other data: measured / predicted will not be comparable"
        )
    return out


def preflight(cfg: TrainConfig, world_size: int, ranks_per_node: int | None = None, node_rank: int = 0) -> Checked:
    """Check a training run before torchrun starts; the first problem is one MomentError line.

    ``cfg``: the trainer's options as the ranks will parse them (``cfg.resume``/``cfg.overwrite``:
    what the user asked for an existing checkpoint; ``--max-restarts`` adds ``--resume`` for the
    ranks on its own, which does not count as asking); ``ranks_per_node``: torchrun's processes
    per node (default ``world_size``); ``node_rank``: this node's (several nodes: a checkpoint it sees
    may be node 0's placement of the same data). A run whose memory budget does not fit is refused too."""
    if cfg.resolved_backend() == "nccl" and not cfg.resolved_device().startswith("cuda"):  # torch: a traceback per rank
        raise MomentError(
            f"--backend nccl needs CUDA ranks, not --device {cfg.resolved_device()} (gloo runs on the CPU)"
        )
    plan = read_plan(cfg.plan) if cfg.plan else None
    placed = open_placed(cfg.data)
    hot = placed.manifest.hotness  # unset fan-outs and batch size: the placement's, as the ranks resolve them
    cfg = cfg.with_sampling(hot.fanouts, hot.batch_size)
    if (why := train_split_problem(placed, world_size)) is not None:
        raise MomentError(why)
    if cfg.metrics_json:
        _writable(Path(cfg.metrics_json), "--metrics-json", is_file=True)
    if cfg.checkpoint_dir:
        _writable(Path(cfg.checkpoint_dir), "--checkpoint-dir", is_file=False)
        _checkpoint(cfg, placed, cfg.resume, cfg.overwrite, node_rank)
    memory = memory_budget(cfg, plan, placed, ranks_per_node or world_size)
    if (why := refusal(memory)) is not None:
        raise MomentError(why)
    return Checked(cfg, plan_warnings(plan, cfg.plan or "", placed) if plan else [], memory)


def memory_budget(cfg: TrainConfig, plan: PlanDoc | None, placed: Placed, ranks_per_node: int) -> MemoryBudget:
    """The run's peak GPU bytes per rank and host bytes per node (:mod:`trainer.memory`), with
    the capacities to hold them against: the live GPU when CUDA is here, else the plan's profile."""
    ranks = plan.ranks[:ranks_per_node] if plan else []
    sockets = len({r.socket for r in ranks}) or 1
    try:
        machine = resolve_profile(plan.profile.name) if plan else None
    except MomentError:
        machine = None  # a profile this installation does not have: capacities from this machine
    gpu, gpu_source = gpu_capacity(machine)
    shape = shape_of_placed(placed, cfg, ranks_per_node, sockets, gpu_free=gpu)  # where the graph goes: gpu or uva
    b = budget(shape, cuda=cfg.resolved_device().startswith("cuda"))
    b.gpu_capacity, b.gpu_capacity_source = gpu, gpu_source
    b.host_capacity, b.host_capacity_source = host_capacity(machine)
    return b


def start_over(checkpoint_dir: str | Path | None) -> None:
    """Remove the checkpoint --overwrite replaces, so no rank (nor a restarted one) resumes it;
    only a file that reads as a moment checkpoint (else a CheckpointError names it: not ours to
    delete)."""
    if checkpoint_dir is not None and checkpoint.read_meta(checkpoint_dir) is not None:
        checkpoint.path_in(checkpoint_dir).unlink()


def world_size(nproc: int, nnodes: str | int | None) -> int:
    """Ranks of the run: processes per node times nodes (the minimum of an elastic ``a:b``)."""
    try:
        nodes = int(str(nnodes or 1).split(":")[0])
    except ValueError:
        nodes = 1
    return nproc * max(nodes, 1)
