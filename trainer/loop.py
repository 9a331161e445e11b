"""The training loop: DDP over the placed dataset, one process per GPU (``torchrun -m trainer``).

The loop composes small parts: ``TrainConfig`` (what to run), ``NeighborSampler`` (which
vertices), ``TieredFeatureStore`` (their features, from GPU/CPU caches and SSD bins),
``build_model`` (the GNN), ``checkpoint`` (resume), ``metrics`` (what happened). Distributed
set-up is all in :func:`setup`:

* ranks come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``; ``env://``); without it the run is a single process and no
  process group is made;
* on CUDA, local rank r uses the GPU the plan gives rank r: the CUDA device whose PCI address is
  the plan's ``bdf`` (devices ordered by PCI bus id), else GPU ``LOCAL_RANK``; the process is
  pinned to the CPUs of that GPU's socket (NUMA node) when the plan names one and the machine
  has that node.

Per epoch every rank takes the same number of batches, of the same sizes (``epoch_batches``:
one shuffled permutation, strided over ranks, the uneven remainder dropped), so DDP's
collectives line up and each training vertex is a seed at most once per epoch. Each rank's
feature store holds its own GPU's cache bin on the GPU (the plan names bins after GPUs); the
other GPUs' bins are "peer" reads, served from host memory by this version of the store. A background thread samples
and fetches the features of the next ``prefetch`` batches while the current one trains.

Reproducibility: each epoch's neighbour samples depend only on (seed, epoch, rank), dropout on
the torch RNG, which checkpoints save; a resumed run therefore replays what an uninterrupted
run does (bit for bit on CPU).
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moment.contracts.checkpoint import DataIdentity
from moment.errors import MomentError
from moment.contracts.plan import PlanDoc, read_plan
from placement.placed import Placed, open_placed
from trainer import checkpoint
from trainer.config import TrainConfig, from_args
from trainer.featurestore import SharedMemoryFull, TieredFeatureStore
from trainer.metrics import Metrics, epoch_record, param_digest
from trainer.models import build_model
from trainer.preflight import train_split_problem
from placement.sampler import NeighborSampler, SampledBatch, derive_seed, num_batches

# How long a collective may wait. The longest wait is set-up: local rank 0 copies every cache bin
# held in host memory into --shm-dir while the node's other ranks wait at a barrier (tens of GB
# take minutes), longer than NCCL's default 10 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)

# derive_seed streams: the sampler's own (0, 1) are its permutation and its draws.
_TRAIN_STREAM, _EVAL_STREAM = 2, 3


# -- distributed set-up ----------------------------------------------------------------------


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


def _parse_bdf(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of '0000:1b:00.0' or '1b:00.0'; None for anything else."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?", text.strip())
    if not m:
        return None
    return int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16)


def _cuda_index_of(bdf: str | None) -> int | None:
    want = _parse_bdf(bdf) if bdf else None
    if want is None:
        return None
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        got = tuple(getattr(p, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))  # torch < 2.7 lacks them
        if got == want:
            return i
    return None


def _node_cpus(node: int) -> set[int]:
    """CPUs of NUMA node ``node`` (empty when the machine has no such node)."""
    try:
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _pin_to_socket(socket: Any) -> str | None:
    """Best effort: restrict this process to the CPUs of ``socket`` ('cpu1' or 1); what was done."""
    m = re.search(r"(\d+)$", str(socket))
    if m is None or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = _node_cpus(int(m.group(1))) & os.sched_getaffinity(0)
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return f"{len(cpus)} CPUs of node {m.group(1)}"


def select_device(cfg: TrainConfig, env: DistEnv, plan: PlanDoc | None) -> tuple[torch.device, str]:
    """This rank's device (and socket pinning on CUDA); a line saying what was chosen and why."""
    if not cfg.resolved_device().startswith("cuda"):
        return torch.device("cpu"), "cpu"
    if cfg.device.startswith("cuda:"):  # an explicit device wins over the plan
        device = torch.device(cfg.device)
        torch.cuda.set_device(device)
        return device, str(device)
    entry = plan.rank(env.local_rank) if plan else None
    # Pinned before CUDA starts its threads (they inherit the affinity).
    pinned = _pin_to_socket(entry.socket) if entry and entry.socket is not None else None
    index = _cuda_index_of(entry.bdf) if entry else None
    why = f"plan {entry.gpu} at {entry.bdf}" if entry and index is not None else "LOCAL_RANK"
    if index is None:
        index = env.local_rank % max(torch.cuda.device_count(), 1)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device, f"{device} ({why})" + (f", pinned to {pinned}" if pinned else "")


def setup(cfg: TrainConfig, env: DistEnv, plan: PlanDoc | None) -> tuple[torch.device, str]:
    """Device per rank, then the process group (env:// from torchrun); none for a lone process."""
    device, where = select_device(cfg, env, plan)
    if env.launched and not dist.is_initialized():
        backend = cfg.resolved_backend()
        kwargs: dict[str, Any] = {"timeout": COLLECTIVE_TIMEOUT}
        if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = device  # binds the communicator to this GPU at once (torch >= 2.3)
        store, rank, world = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
        prefix = _attempt_prefix(env)
        if prefix is not None:
            store = dist.PrefixStore(prefix, store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kwargs)
    return device, where


def _attempt() -> str:
    """This node's torchrun attempt: run id and restart count (the same for all ranks of a node)."""
    env = os.environ
    return f"{env.get('TORCHELASTIC_RUN_ID', '')}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _attempt_prefix(env: DistEnv) -> str | None:
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
        return f"moment/{_attempt()}"
    if int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.rank == 0:
        print("warning: torchrun keeps one store across restarts on several nodes: a restarted group may "
              "fail to connect; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (moment train does)", file=sys.stderr)
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


# -- batches and prefetching -----------------------------------------------------------------


def epoch_batches(sampler: NeighborSampler, ids: np.ndarray, cfg: TrainConfig, epoch: int, rank: int,
                  world_size: int) -> Iterator[torch.Tensor]:
    """Seed batches of ``rank`` for one training epoch: all ranks run the same number of steps,
    each id is a seed at most once per epoch across ranks (all but ``len(ids) % world_size``)."""
    batches = sampler.batches(ids, cfg.batch_size, shuffle=True, epoch=epoch, rank=rank, world_size=world_size,
                              drop_last_uneven=True)
    return islice(batches, cfg.max_batches_per_epoch)


def epoch_sampler(base: NeighborSampler, seed: int) -> NeighborSampler:
    """A sampler sharing ``base``'s CSR (wherever it lives) with its own seed and call count."""
    on_gpu = isinstance(base.indptr, torch.Tensor) and base.indptr.is_cuda
    return NeighborSampler(base.indptr, base.indices, base.fanouts, base.device, seed=seed, csr_on_device=on_gpu)


@dataclass
class Prepared:
    """A batch ready to train on: blocks, features of ``batch.nodes``, labels of the seeds."""

    batch: SampledBatch
    x: torch.Tensor
    y: torch.Tensor
    ready: torch.cuda.Event | None = None  # recorded on the copy stream (CUDA)


class Prefetcher:
    """Prepares up to ``depth`` batches ahead in a background thread (bounded queue).

    On CUDA the thread works on its own stream, so sampling and host→GPU copies overlap the
    training kernels; the consumer's stream waits on each batch's event before using it. An
    exception in the thread is re-raised in the consumer."""

    _DONE = object()

    def __init__(self, seeds: Iterator[torch.Tensor], prepare: Callable[[torch.Tensor], Prepared], depth: int,
                 device: torch.device) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._device = device
        self._thread = threading.Thread(target=self._work, args=(seeds, prepare), name="moment-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, seeds: Iterator[torch.Tensor], prepare: Callable[[torch.Tensor], Prepared]) -> None:
        try:
            stream = None
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # the current device is per thread
                stream = torch.cuda.Stream(self._device)
            for s in seeds:
                if stream is None:
                    item = prepare(s)
                else:
                    with torch.cuda.stream(stream):
                        item = prepare(s)
                        item.ready = torch.cuda.Event()
                        item.ready.record(stream)
                if not self._put(item):
                    return
            self._put(self._DONE)
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            self._put(exc)

    def __iter__(self) -> Iterator[Prepared]:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            if item.ready is not None:
                current = torch.cuda.current_stream(self._device)
                current.wait_event(item.ready)
                for t in (item.x, item.y, *(b.edge_index for b in item.batch.blocks)):
                    t.record_stream(current)  # the allocator must not reuse them early
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def make_prepare(sampler: NeighborSampler, store: TieredFeatureStore, labels: np.ndarray,
                 device: torch.device) -> Callable[[torch.Tensor], Prepared]:
    """Seeds → sampled blocks, their features (float32) and the seeds' labels, on ``device``."""
    def prepare(seeds: torch.Tensor) -> Prepared:
        batch = sampler.sample(seeds)
        x = store.get(batch.nodes).to(device, torch.float32, non_blocking=True)
        y = torch.from_numpy(np.asarray(labels[seeds.numpy()], dtype=np.int64)).to(device, non_blocking=True)
        return Prepared(batch, x, y)
    return prepare


# -- one epoch -------------------------------------------------------------------------------


@dataclass
class EpochResult:
    train_s: float
    iterations: int
    seeds: int
    loss_sum: float
    data_wait_s: float


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Prepared],
                device: torch.device, on_step: Callable[[], None]) -> EpochResult:
    """Forward, backward and step per batch; time per iteration includes waiting for data."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    iterations = seeds = 0
    wait = 0.0
    start = time.perf_counter()
    it = iter(batches)
    while True:
        t = time.perf_counter()
        item = next(it, None)
        wait += time.perf_counter() - t
        if item is None:
            break
        loss = F.cross_entropy(model(item.x, item.batch.blocks), item.y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        iterations += 1
        seeds += int(item.y.numel())
        on_step()
    total = float(loss_sum)  # waits for the last step's kernels
    return EpochResult(time.perf_counter() - start, iterations, seeds, total, wait)


@torch.no_grad()
def evaluate(module: nn.Module, batches: Iterator[Prepared]) -> tuple[int, int]:
    """(correct, total) on this rank's share of a split."""
    module.eval()
    correct = total = 0
    for item in batches:
        pred = module(item.x, item.batch.blocks).argmax(dim=-1)
        correct += int((pred == item.y).sum())
        total += int(item.y.numel())
    return correct, total


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Data:
    placed: Placed
    labels: np.ndarray
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    num_classes: int
    identity: DataIdentity  # what a checkpoint records, and a resumed run must match


def load_data(cfg: TrainConfig) -> Data:
    """Open the placed dataset (one-line PlacedError when missing or damaged)."""
    placed = open_placed(cfg.data)
    return Data(placed, placed.array("labels"), np.asarray(placed.array("train")), np.asarray(placed.array("val")),
                np.asarray(placed.array("test")), int(placed.meta["num_classes"]),
                DataIdentity.of(placed.root, placed.manifest))


def check_run(cfg: TrainConfig, env: DistEnv, data: Data) -> None:
    """The launcher's checks that guard this run's state, again in the rank (a bare ``torchrun -m
    trainer`` skips the launcher): enough training ids for the ranks, and an existing checkpoint
    either resumed (when it fits) or replaced on purpose."""
    if (why := train_split_problem(data.placed, env.world_size)) is not None:
        raise MomentError(why)
    if not cfg.checkpoint_dir or not checkpoint.path_in(cfg.checkpoint_dir).exists() or cfg.overwrite:
        return
    if not cfg.resume:
        raise checkpoint.CheckpointError(f"{checkpoint.path_in(cfg.checkpoint_dir)}: holds a checkpoint of an earlier "
                                         "run: pass --resume to continue it or --overwrite to start over")
    meta = checkpoint.read_meta(cfg.checkpoint_dir)
    why = meta.refusal(cfg.to_dict(), data.identity) if meta else None
    if why is not None:
        raise checkpoint.CheckpointError(f"{checkpoint.path_in(cfg.checkpoint_dir)}: cannot resume: {why}")


def socket_of(plan: PlanDoc | None, local_rank: int) -> str:
    """The socket the plan puts ``local_rank``'s GPU on ("node" without one): host-memory tiers
    are shared per socket, so each GPU reads the copy in its own socket's memory."""
    entry = plan.rank(local_rank) if plan else None
    return entry.socket if entry and entry.socket else "node"


def socket_writer(plan: PlanDoc | None, env: DistEnv) -> bool:
    """Whether this rank is the first local rank of its socket (it writes the socket's copy)."""
    mine = socket_of(plan, env.local_rank)
    return all(socket_of(plan, r) != mine for r in range(env.local_rank))


def _shm_path(cfg: TrainConfig, placed: Placed, socket: str) -> Path:
    """The socket-shared host-tier file of this run: named after the placement (its manifest),
    the torchrun job and the socket, so runs of other placements or jobs never map it."""
    manifest = (placed.root / "placed.json").read_bytes()
    job = f"{_attempt()}:{os.environ.get('MASTER_PORT', '')}:{socket}"
    key = hashlib.sha256(manifest + job.encode()).hexdigest()[:16]
    return Path(cfg.shm_dir) / f"moment-host-{key}"


def open_store(cfg: TrainConfig, env: DistEnv, placed: Placed, plan: PlanDoc | None,
               device: torch.device) -> tuple[TieredFeatureStore, str]:
    """This rank's feature store, and how it holds the host-memory tiers.

    With several ranks the CPU cache (and on CPU ranks the GPU cache) is one copy per socket, as
    the planner models it: the socket's first local rank (pinned to the socket's cores, so its
    pages land in the socket's memory) writes it to a file in ``cfg.shm_dir`` (a memory file
    system) while the others wait, the socket's ranks map the same file, and once all have
    mapped it the writer unlinks it (the memory lives while mapped, and a crash leaves nothing
    behind). Without room there, or with ``shm_dir`` empty, each rank loads its own copy."""
    writer = socket_writer(plan, env)
    path = _shm_path(cfg, placed, socket_of(plan, env.local_rank)) if dist.is_initialized() and cfg.shm_dir else None
    if path is not None and not path.parent.is_dir():
        if env.rank == 0:
            print(f"warning: --shm-dir {path.parent}: no such directory: each rank loads its own copy", file=sys.stderr)
        path = None
    store = None
    if path is not None and writer:
        try:
            store = TieredFeatureStore(cfg.data, device=device, host_shm=path, io=cfg.io)
        except SharedMemoryFull as exc:
            print(f"warning: {exc}: each rank loads its own copy", file=sys.stderr)
    if path is not None:
        dist.barrier()  # the file is whole (or was not made) before the other ranks look
    if store is None:
        shared = path is not None and path.exists()
        store = TieredFeatureStore(cfg.data, device=device, host_shm=path if shared else None, io=cfg.io)
    if path is not None:
        dist.barrier()  # every local rank has mapped it
        if writer:
            path.unlink(missing_ok=True)
    host = store.cpu.numel() * store.cpu.element_size()
    if device.type == "cpu":
        host += store.gpu.numel() * store.gpu.element_size()
    share = "one copy per socket" if store.host_shm else "a private copy"
    return store, f"{host / 2**20:.1f} MiB, {share}"


def _seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Run:
    """Everything one rank holds for a run; ``fit`` trains, evaluates, checkpoints, reports."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, data: Data, plan: PlanDoc | None,
                 device: torch.device) -> None:
        self.cfg, self.data, self.device = cfg, data, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        _seed_everything(cfg.seed)  # same initial parameters on every rank
        self.store, self.host_tiers = open_store(cfg, env, data.placed, plan, device)
        self.module = build_model(cfg, data.placed.feature_dim, data.num_classes).to(device)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=cfg.lr)
        self.base = NeighborSampler(data.placed.array("indptr"), data.placed.array("indices"), cfg.fanouts,
                                    device=device, seed=cfg.seed)
        self.start_epoch, history = 0, []
        if cfg.resume and cfg.checkpoint_dir:
            body = checkpoint.load(cfg.checkpoint_dir, cfg, data.identity)
            if body is not None:
                self.start_epoch = checkpoint.restore(body, self.module, self.optimizer, self.rank)
                history = list(body["history"])
        self.model: nn.Module = self.module
        if dist.is_initialized():
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=ids)
        self.metrics = Metrics(cfg, data.placed.manifest.prediction, history, enabled=self.rank == 0)

    def _batches(self, seeds: Iterator[torch.Tensor], sampler_seed: int) -> Prefetcher:
        prepare = make_prepare(epoch_sampler(self.base, sampler_seed), self.store, self.data.labels, self.device)
        return Prefetcher(seeds, prepare, self.cfg.prefetch, self.device)

    def accuracy(self, ids: np.ndarray, epoch: int, split: int) -> float:
        """Accuracy on a split, sharded over ranks and summed."""
        seeds = self.base.batches(ids, self.cfg.batch_size, shuffle=False, rank=self.rank, world_size=self.world)
        batches = self._batches(seeds, derive_seed(self.cfg.seed, _EVAL_STREAM, epoch, split, self.rank))
        try:
            correct, total = evaluate(self.module, iter(batches))
        finally:
            batches.close()
        correct, total = all_reduce_sum([correct, total], self.device)
        return correct / total if total else float("nan")

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        for epoch in range(self.start_epoch, cfg.epochs):
            seeds = epoch_batches(self.base, self.data.train, cfg, epoch, self.rank, self.world)
            steps = min(num_batches(len(self.data.train), cfg.batch_size, self.world, self.rank, drop_last_uneven=True),
                        cfg.max_batches_per_epoch or sys.maxsize)
            self.store.reset_stats()
            batches = self._batches(seeds, derive_seed(cfg.seed, _TRAIN_STREAM, epoch, self.rank))
            try:
                with self.metrics.progress(epoch, steps) as step:
                    result = train_epoch(self.model, self.optimizer, iter(batches), self.device, step)
            finally:
                batches.close()
            stats = all_gather(self.store.stats())
            loss_sum, iterations, seeds_done, wait = all_reduce_sum(
                [result.loss_sum, result.iterations, result.seeds, result.data_wait_s], self.device)
            train_s = max(all_gather(result.train_s))
            evaluate_now = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs
            val_acc = self.accuracy(self.data.val, epoch, 0) if evaluate_now else None
            record = epoch_record(epoch + 1, train_s=train_s, iterations=result.iterations, seeds=int(seeds_done),
                                  loss=loss_sum / max(iterations, 1), val_acc=val_acc,
                                  data_wait_s=wait / self.world, stats=stats)
            self.metrics.add_epoch(record)
            if cfg.checkpoint_dir:
                rng = all_gather(checkpoint.rng_state())
                if self.rank == 0:
                    checkpoint.save(cfg.checkpoint_dir, epoch=epoch + 1, model=self.module, optimizer=self.optimizer,
                                    cfg=cfg, data=self.data.identity, history=self.metrics.history, rng=rng)
            if dist.is_initialized():
                dist.barrier()  # nobody starts the next epoch before the checkpoint is whole
        test_acc = self.accuracy(self.data.test, cfg.epochs, 1)
        digests = all_gather(param_digest(self.module))
        return self.metrics.finish(test_acc=test_acc, rank_param_digests=digests)


def train(cfg: TrainConfig, env: DistEnv, plan: PlanDoc | None, data: Data) -> dict[str, Any]:
    """Run training as this process's rank; the metrics document (complete on rank 0)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn where a kernel has no such mode
    run = group = None
    try:
        device, where = setup(cfg, env, plan)
        group = dist.group.WORLD if dist.is_initialized() else None
        run = Run(cfg, env, data, plan, device)
        run.metrics.print_config(all_gather(f"{where}; cache bins in host memory: {run.host_tiers}"))
        return run.fit()
    finally:
        if run is not None:
            run.store.close()
        # Teardown order, against a deadlock at exit: the process group must not die with DDP's
        # reducer, whose release keeps the GIL while gloo's threads, finishing their last work,
        # wait for it (pytorch#56297). So DDP goes first, while `group` still holds the group,
        # and the group last, through its Python binding, which releases the GIL meanwhile.
        run = None
        gc.collect()  # DDP in a reference cycle goes now, not at some later collection
        if dist.is_initialized():
            dist.destroy_process_group()
        del group
        torch.use_deterministic_algorithms(was_deterministic)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m trainer`` / torchrun entry point; exit status 0, 1 (MomentError) or 2 (usage).

    A MomentError is one line on stderr, no traceback. Errors in the inputs (plan, placed
    dataset) are the same on every rank, so only rank 0 reports them; an error while training
    is reported by the rank that hit it."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before anything initialises CUDA
    env = DistEnv.from_environ()
    cfg = from_args(argv)
    try:
        plan = read_plan(cfg.plan) if cfg.plan else None
        data = load_data(cfg)
        hot = data.placed.manifest.hotness
        cfg = cfg.with_sampling(hot.fanouts, hot.batch_size)
        check_run(cfg, env, data)
    except MomentError as exc:
        if env.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        train(cfg, env, plan, data)
    except MomentError as exc:
        prefix = f"rank {env.rank}: " if env.world_size > 1 else ""
        print(f"error: {prefix}{exc}", file=sys.stderr)
        return exc.exit_code
    return 0
