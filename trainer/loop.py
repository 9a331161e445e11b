"""The training loop: DDP over the placed dataset, one process per GPU (``torchrun -m trainer``).

The loop composes small parts: ``TrainConfig`` (what to run), ``NeighborSampler`` (which
vertices), ``TieredFeatureStore`` (their features, from GPU/CPU caches and SSD bins),
``build_model`` (the GNN), ``checkpoint`` (resume), ``metrics`` (what happened). Distributed
set-up (ranks, devices, the process group) is :mod:`trainer.dist`; the node-shared host memory
is :mod:`trainer.shm`; prefetching is :mod:`trainer.prefetch`.

Per epoch every rank takes the same number of batches, of the same sizes (:mod:`trainer.epoch`:
its batches, steps and evaluation), so DDP's collectives line up and each training vertex is a
seed at most once per epoch. Each rank's feature store holds the GPU cache bin (the same
hottest rows on every GPU) on its GPU, the CPU cache bin in host memory shared by the ranks of a
socket, and reads the rest from the SSD bins. A background thread samples and fetches the
features of the next ``prefetch`` batches while the current one trains.

Reproducibility: each epoch's neighbour samples depend only on (seed, epoch, rank), dropout on
the torch RNG, which checkpoints save; a resumed run therefore replays what an uninterrupted
run does (bit for bit on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moment import hw, procs
from moment.contracts.checkpoint import DataIdentity
from moment.contracts.placed import PackSummary
from moment.contracts.plan import PlanDoc, read_plan
from moment.cores import usable_cores
from moment.errors import MomentError
from moment.outputs import DirLock, joined
from placement.placed import Placed, open_placed
from placement.sampler import EVAL_STREAM, NeighborSampler, derive_seed, num_batches, train_draw_seed
from placement.samples import StoredSamples
from trainer import checkpoint, launch, memory, sampling
from trainer.config import TrainConfig, from_args
from trainer.dist import DistEnv, PeerFailedError, all_gather, all_reduce_sum, lost_peer, setup, together
from trainer.epoch import epoch_batches, epoch_sampler, eval_batches, evaluate, make_prepare, train_epoch
from trainer.featurestore import TieredFeatureStore
from trainer.metrics import Metrics, epoch_record, param_digest
from trainer.models import build_model
from trainer.nodes import check_same_data, per_node, resumed
from trainer.prefetch import Prefetcher, compute_stream
from trainer.preflight import train_split_problem
from trainer.shm import per_socket, socket_of


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
    return Data(
        placed,
        placed.array("labels"),
        # in memory, int64 (the dataset's files: int32 where the ids fit, or int64, read-only maps)
        np.array(placed.array("train"), dtype=np.int64),
        np.array(placed.array("val"), dtype=np.int64),
        np.array(placed.array("test"), dtype=np.int64),
        int(placed.meta["num_classes"]),
        DataIdentity.of(placed.root, placed.manifest),
    )


def check_run(cfg: TrainConfig, env: DistEnv, data: Data) -> None:
    """The launcher's checks that guard this run's state, again in the rank (a bare ``torchrun -m
    trainer`` skips the launcher): enough training ids for the ranks, and an existing checkpoint
    either resumed (when it fits) or replaced on purpose."""
    if (why := train_split_problem(data.placed, env.world_size)) is not None:
        raise MomentError(why)
    if cfg.reuse_samples and data.placed.manifest.pack is None:
        raise MomentError(f"--reuse-samples: {data.placed.root} is not a packed placement (moment place --pack)")
    if not cfg.checkpoint_dir or not checkpoint.path_in(cfg.checkpoint_dir).exists() or cfg.overwrite:
        return
    if not cfg.resume:
        raise checkpoint.CheckpointError(
            f"{checkpoint.path_in(cfg.checkpoint_dir)}: holds a checkpoint of an earlier "
            "run: pass --resume to continue it or --overwrite to start over"
        )
    meta = checkpoint.read_meta(cfg.checkpoint_dir)
    why = meta.refusal(cfg.to_dict(), data.identity, placement=env.node_rank == 0) if meta else None
    if why is not None:
        raise checkpoint.CheckpointError(f"{checkpoint.path_in(cfg.checkpoint_dir)}: cannot resume: {why}")


def open_store(
    placed: Placed,
    device: torch.device,
    io: str,
    shm_dir: str,
    env: DistEnv,
    plan: PlanDoc | None,
    stage: int = 0,
    host_gather: str = "auto",
) -> tuple[TieredFeatureStore, str]:
    """This rank's feature store (SSD reads by ``io``, ``stage`` bytes of staging allocated up
    front, CPU-tier rows gathered as ``host_gather`` says), and how it holds the host-memory
    tiers: with several ranks one copy per socket in ``shm_dir`` (:func:`trainer.shm.per_socket`),
    else (or without room there) a private copy."""
    uva = device.type == "cuda" and host_gather != "stage"
    store = per_socket(
        lambda path: TieredFeatureStore(placed, device=device, host_shm=path, io=io, stage_reserve=stage, uva=uva),
        shm_dir,
        placed,
        plan,
        env,
    )
    host = store.cpu.numel() * store.cpu.element_size()
    if device.type == "cpu":
        host += store.gpu.numel() * store.gpu.element_size()
    share = "one copy per socket" if store.host_shm else "a private copy"
    if store.host_gather_note:
        print(f"warning: rank {env.rank}: {store.host_gather_note}", file=sys.stderr)
    gather = ", its rows gathered on the GPU in place (uva)" if store.host_gather == "uva" else ""
    return store, f"{host / 2**20:.1f} MiB, {share}{gather}"


def sampling_setup(
    sampler: NeighborSampler, plan: PlanDoc | None, env: DistEnv, csr: sampling.Csr | None = None
) -> dict[str, Any]:
    """Where neighbour sampling runs, for the metrics: ``csr.where`` (:mod:`trainer.sampling`;
    without it, gpu when the sampler's CSR is on the GPU), and on the CPU this rank's share of its
    CPUs as torch threads — torchrun sets ``OMP_NUM_THREADS=1`` for several ranks, which would
    leave sampling (vectorised torch ops) on one core. ``note``: why it is not what was asked."""
    if csr is not None:
        where = csr.where
    else:
        where = "gpu" if isinstance(sampler.indptr, torch.Tensor) and sampler.indptr.is_cuda else "cpu"
    out: dict[str, Any] = {"where": where, "threads": None}
    if where == "cpu":
        sharing = sum(socket_of(plan, r) == socket_of(plan, env.local_rank) for r in range(local_world_size(env)))
        threads = max(1, usable_cores() // max(sharing, 1))
        if threads > torch.get_num_threads():
            torch.set_num_threads(threads)
        out["threads"] = torch.get_num_threads()
    if csr is not None and csr.note:
        out["note"] = csr.note
    return out


def open_csr(
    placed: Placed, mode: str, device: torch.device, shm_dir: str, env: DistEnv, plan: PlanDoc | None
) -> sampling.Csr:
    """The graph where ``--sampling mode`` puts it (:mod:`trainer.sampling`), the ranks agreeing;
    a uva CSR is one copy per socket in ``shm_dir`` (:func:`trainer.shm.per_socket`)."""
    indptr, indices = placed.array("indptr"), placed.array("indices")
    gpu_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    nbytes = sampling.csr_bytes(indptr, indices)
    choice = sampling.agree(sampling.choose(mode, device, nbytes, gpu_free, sampling.host_available()))
    csr = sampling.open_csr(
        indptr, indices, choice, device, lambda open_: per_socket(open_, shm_dir, placed, plan, env, kind="csr")
    )
    if csr.note:
        print(f"warning: rank {env.rank}: sampling: {csr.note}", file=sys.stderr)
    return csr


def pack_mismatch(pack: PackSummary | None, cfg: TrainConfig, world: int, where: str) -> str | None:
    """Why this run's batches are not the ones a packed placement laid its SSD rows out for
    (None: they are, or the placement is not packed)."""
    if pack is None:
        return None
    runs = (
        ("--seed", cfg.seed, pack.seed),
        ("ranks", world, pack.ranks),
        ("batch size", cfg.batch_size, pack.batch_size),
    )
    diffs = [f"{name} {run} (packed for {packed})" for name, run, packed in runs if run != packed]
    if list(cfg.fanouts or ()) != pack.fanouts:
        diffs.append(f"fan-outs {list(cfg.fanouts or ())} (packed for {pack.fanouts})")
    if where != "cpu" and (pack.samples is None or cfg.live_sampling):  # stored samples: the CPU's draws
        diffs.append(f"sampling with the graph on the {where} (packed for CPU sampling: other draws)")
    if not diffs:
        return None
    return (
        f"the placement's SSD rows are packed for other batches than this run's ({', '.join(diffs)}): they are "
        "read correctly, with fewer shared pages (metrics.json ssd_read_amplification says how many)"
    )


def stored_samples(placed: Placed, cfg: TrainConfig) -> StoredSamples | None:
    """The placement's stored samples where this run's batches may be the replayed ones (the
    fan-outs replayed; each batch's seeds are compared when it is loaded), unless
    ``--live-sampling``."""
    pack = placed.manifest.pack
    if cfg.live_sampling or pack is None or list(cfg.fanouts or ()) != pack.fanouts:
        return None
    return StoredSamples.of(placed)


def local_world_size(env: DistEnv) -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 for a lone process)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), env.local_rank + 1)


def _seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Run:
    """Everything one rank holds for a run; ``fit`` trains, evaluates, checkpoints, reports."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, data: Data, plan: PlanDoc | None, device: torch.device) -> None:
        self.cfg, self.data, self.device, self.env = cfg, data, device, env
        self.host = socket.gethostname()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        _seed_everything(cfg.seed)  # same initial parameters on every rank
        if device.type == "cuda":
            torch.zeros(1, device=device)  # the CUDA context's host memory belongs to the base, not the budget
        self.base_rss = memory.resident_bytes()
        shape = memory.shape_of_placed(data.placed, cfg, local_world_size(env), 1)
        stage = memory.stage_reserve(shape)  # the figure the budget counts, allocated once
        self.store, self.host_tiers = open_store(
            data.placed, device, cfg.io, cfg.shm_dir, env, plan, stage, cfg.host_gather
        )
        self.module = build_model(cfg, data.placed.feature_dim, data.num_classes).to(device)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=cfg.lr)
        self.csr = open_csr(data.placed, cfg.sampling, device, cfg.shm_dir, env, plan)
        self.base = NeighborSampler(
            self.csr.indptr,
            self.csr.indices,
            cfg.resolved_fanouts,
            device=device,
            seed=cfg.seed,
            csr_on_device=self.csr.where != "cpu",
        )
        self.sampling = sampling_setup(self.base, plan, env, self.csr)
        self.samples = stored_samples(data.placed, cfg)
        if env.rank == 0 and (why := pack_mismatch(data.placed.manifest.pack, cfg, self.world, self.csr.where)):
            print(f"warning: {why}", file=sys.stderr)
        if device.type == "cuda":  # the launcher's check used nvidia-smi or the profile; now the real free memory
            budget = memory.budget(shape)
            if (why := memory.live_refusal(budget, torch.cuda.mem_get_info(device)[0], str(device))) is not None:
                raise MomentError(why)
        self.start_epoch, history = 0, []
        if cfg.resume and cfg.checkpoint_dir:
            body = resumed(cfg, data.identity, env, device)
            if body is not None:
                self.start_epoch = checkpoint.restore(body, self.module, self.optimizer, self.rank)
                history = list(body["history"])
        self.model: nn.Module = self.module
        # One compute stream for the run: DDP makes the gradient accumulators on it, and every
        # epoch's backward runs on it too (no cross-stream synchronisation, no autograd warning).
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if dist.is_initialized():
            ids = [device.index] if device.type == "cuda" else None
            with compute_stream(device, self.stream):
                self.model = DistributedDataParallel(self.module, device_ids=ids)
        self.metrics = Metrics(cfg, data.placed.manifest.prediction, history, enabled=self.rank == 0)
        self.metrics.sampling = self.sampling

    def close(self) -> None:
        """The feature store, then the sampler and the CSR's host registration (uva)."""
        try:
            self.store.close()
        finally:
            del self.base  # the sampler's views of the CSR go before its registration does
            self.csr.close()

    def _batches(self, seeds: Iterator[torch.Tensor], sampler_seed: int, first_batch: int | None = None) -> Prefetcher:
        sampler = epoch_sampler(self.base, sampler_seed)
        prepare = make_prepare(sampler, self.store, self.data.labels, self.device, first_batch, self.samples)
        return Prefetcher(seeds, prepare, self.cfg.prefetch, self.device)

    def accuracy(self, ids: np.ndarray, epoch: int, split: int) -> float:
        """Accuracy on a split, sharded over ranks and summed."""
        seeds = eval_batches(self.base, ids, self.cfg, self.rank, self.world)
        batches = self._batches(seeds, derive_seed(self.cfg.seed, EVAL_STREAM, epoch, split, self.rank))
        try:
            with compute_stream(self.device, self.stream):
                correct, total = evaluate(self.module, iter(batches))
        finally:
            batches.close()
        right, asked = all_reduce_sum([correct, total], self.device)
        return right / asked if asked else float("nan")

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        pack = self.data.placed.manifest.pack
        for epoch in range(self.start_epoch, cfg.epochs):
            drawn = epoch % pack.epochs if cfg.reuse_samples and pack is not None else epoch  # the batches' epoch
            seeds = epoch_batches(self.base, self.data.train, cfg, drawn, self.rank, self.world)
            steps = min(
                num_batches(
                    len(self.data.train), cfg.resolved_batch_size, self.world, self.rank, drop_last_uneven=True
                ),
                cfg.max_batches_per_epoch or sys.maxsize,
            )
            self.store.reset_stats()
            loaded0 = dict(self.samples.read_bytes) if self.samples is not None else {}
            first = self.store.chunks.first_batch(drawn, self.rank, self.world)  # packed: chunks, stored samples
            batches = self._batches(seeds, train_draw_seed(cfg.seed, drawn, self.rank), first)
            try:
                with self.metrics.progress(epoch, steps) as step, compute_stream(self.device, self.stream):
                    result = train_epoch(self.model, self.optimizer, iter(batches), self.device, step)
            finally:
                batches.close()
            local = self.store.stats()
            if self.samples is not None:  # the stored samples' pages the epoch's batches read, beside the row maps'
                local["placed_read_bytes"].update({k: n - loaded0[k] for k, n in self.samples.read_bytes.items()})
            stats = all_gather(local)
            loss_sum, iterations, seeds_done, wait = all_reduce_sum(
                [result.loss_sum, result.iterations, result.seeds, result.data_wait_s], self.device
            )
            timing = all_gather((self.env.node_rank, self.host, result.train_s, result.seeds, result.data_wait_s))
            train_s = max(t[2] for t in timing)
            evaluate_now = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs
            val_acc = self.accuracy(self.data.val, epoch, 0) if evaluate_now else None
            record = epoch_record(
                epoch + 1,
                train_s=train_s,
                iterations=result.iterations,
                seeds=int(seeds_done),
                loss=loss_sum / max(iterations, 1),
                val_acc=val_acc,
                data_wait_s=wait / self.world,
                stats=stats,
                replayed=first is not None,
            )
            if self.env.nodes > 1:
                record.update(per_node(timing, stats, train_s))
            self.metrics.memory = memory.measured(self.device, self.base_rss)
            together(functools.partial(self.metrics.add_epoch, record), f"epoch {epoch + 1}'s metrics not written")
            if cfg.checkpoint_dir:
                rng = all_gather(checkpoint.rng_state())
                kept = f"epoch {epoch}'s kept" if epoch > 0 else "none kept"
                together(
                    functools.partial(self._save, epoch + 1, rng), f"epoch {epoch + 1}'s checkpoint not written; {kept}"
                )
            if dist.is_initialized():
                dist.barrier()  # nobody starts the next epoch before the checkpoint is whole
        test_acc = self.accuracy(self.data.test, cfg.epochs, 1)
        if self.samples is not None:  # the batches loaded instead of sampled
            self.metrics.sampling = {**self.sampling, "stored_batches": self.samples.loaded}
        digests = all_gather(param_digest(self.module))
        done: list[dict[str, Any]] = []
        together(lambda: done.append(self.metrics.finish(test_acc=test_acc, rank_param_digests=digests)))
        return done[0]

    def _save(self, epochs: int, rng: list[dict[str, Any]]) -> None:
        """The checkpoint after ``epochs`` epochs (rank 0 writes it)."""
        if self.rank == 0:
            checkpoint.save(
                self.cfg.checkpoint_dir or "",
                epoch=epochs,
                model=self.module,
                optimizer=self.optimizer,
                cfg=self.cfg,
                data=self.data.identity,
                history=self.metrics.history,
                rng=rng,
            )


def train(cfg: TrainConfig, env: DistEnv, plan: PlanDoc | None, data: Data) -> dict[str, Any]:
    """Run training as this process's rank; the metrics document (complete on rank 0)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn where a kernel has no such mode
    run = group = None
    try:
        device, where = setup(cfg.resolved_device(), cfg.resolved_backend(), env, plan)
        group = dist.group.WORLD if dist.is_initialized() else None
        nodes = check_same_data(env, data.placed, cfg)  # several nodes: one placement each, one dataset
        run = Run(cfg, env, data, plan, device)
        run.metrics.nodes = nodes.predictions
        entry = plan.rank(env.local_rank) if plan else None
        on_plan_gpu = device.type == "cuda" and entry is not None and hw.cuda_index_of(entry.bdf) == device.index
        placed = all_gather((f"{where}; cache bins in host memory: {run.host_tiers}", on_plan_gpu))
        run.metrics.print_config([line for line, _ in placed], on_plan_gpus=all(ok for _, ok in placed))
        run.metrics.note_ssd_route(plan.workload.ssd_reads if plan else None, run.store.reader)
        return run.fit()
    finally:
        if run is not None:
            run.close()
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
    """The ``python -m trainer`` / torchrun entry point; exit status 0, 1 (MomentError), 2 (usage)
    or 128 + a signal (stopped by SIGINT / SIGTERM / SIGHUP, or by its launcher's death: quietly,
    the launcher reports it).

    A MomentError is one line on stderr, no traceback. Errors in the inputs (plan, placed
    dataset) are the same on every rank, so only rank 0 reports them; an error while training
    is reported by the rank that hit it."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before anything initialises CUDA
    env = DistEnv.from_environ()
    cfg = from_args(argv)
    try:
        with procs.interruptible():
            procs.guard()
            return _main(cfg, env)
    except KeyboardInterrupt as exc:
        return procs.stopped(getattr(exc, "exit_code", 130), env.launched)
    except Exception:
        if (signum := procs.stopping()) is not None:  # a peer stopped first: its failure is not news
            return procs.stopped(128 + signum, env.launched)
        raise


def _main(cfg: TrainConfig, env: DistEnv) -> int:
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
        with checkpoint_lock(cfg, env):
            train(cfg, env, plan, data)
    except PeerFailedError as exc:  # rank 0 reported it
        return exc.exit_code
    except dist.DistError as exc:  # a peer is gone (it failed and said why, or was killed)
        print(f"error: rank {env.rank}: stopped: {lost_peer(exc)}", file=sys.stderr)
        return 1
    except MomentError as exc:
        prefix = f"rank {env.rank}: " if env.world_size > 1 else ""
        print(f"error: {prefix}{exc}", file=sys.stderr)
        return exc.exit_code
    return 0


@contextlib.contextmanager
def checkpoint_lock(cfg: TrainConfig, env: DistEnv) -> Iterator[None]:
    """One training per checkpoint directory: ``moment train`` holds its lock for the whole job
    (:class:`moment.outputs.DirLock`); otherwise (``torchrun -m trainer``, several nodes, the
    demo) rank 0 takes it. Every rank registers there while it runs, so a new run waits for
    ranks that outlive their launcher."""
    if not cfg.checkpoint_dir:
        yield
        return
    directory = Path(cfg.checkpoint_dir)
    lock = DirLock(directory, "moment train", checkpoint.CheckpointError)
    if launch.CHECKPOINT_LOCKED not in os.environ and env.rank == 0:
        lock.acquire(members=False)
    try:
        with joined(directory, "moment train"):
            yield
    finally:
        lock.release()
