"""One configuration object for a training run (torchtitan style).

Everything a run depends on lives in :class:`TrainConfig`: the loop reads it, rank 0 prints it at
start, and every checkpoint stores it (as a dict of primitives, so ``torch.load(weights_only=True)``
can read it back). ``from_args`` is the command line of ``python -m trainer``; a bad value exits 2
with argparse's one-line message. ``moment train`` parses the same command line with
``from_args(..., raising=True)`` before it starts torchrun, so a bad trainer argument is one
usage line there, not one per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moment.errors import UsageError
from trainer.defaults import EPOCHS
from trainer.models import LAYERS, default_hidden
from trainer.readers import IO_CHOICES, io_help, io_refusal

SAMPLING_CHOICES = ("auto", "gpu", "uva", "cpu")  # --sampling: what each means is trainer.sampling's docstring


@dataclass
class TrainConfig:
    data: str  # placed dataset directory (`moment place` output)
    plan: str | None = None  # plan.json: rank → GPU/socket map and the predicted iteration time
    model: str = "sage"
    hidden: int | None = None  # None: 256 for sage, 64 (per head) for gat
    heads: int = 8  # gat only
    # Sampling: None takes what the placement pre-sampled with (placed.json ``hotness``), so
    # the run reads the tiers as the placement was balanced for (see ``with_sampling``).
    fanouts: tuple[int, ...] | None = None  # first hop first; the model has one layer per hop
    batch_size: int | None = None  # seeds per rank per step
    epochs: int = EPOCHS  # total epochs, counting those a resumed checkpoint already did
    lr: float = 3e-3
    dropout: float = 0.5
    seed: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False  # continue from checkpoint_dir's checkpoint when there is one
    overwrite: bool = False  # start over although checkpoint_dir holds a checkpoint (else refused)
    metrics_json: str | None = None
    prefetch: int = 2  # batches sampled and fetched ahead of the one training
    device: str = "auto"  # auto: cuda when available, else cpu
    backend: str = "auto"  # auto: nccl on cuda, gloo otherwise
    max_batches_per_epoch: int | None = None  # cap for smoke runs and tests
    # A packed placement (moment place --pack) lays SSD rows out for its K replayed epochs: epoch e
    # then trains on epoch e mod K's batches again (the same seeds and neighbours) instead of new ones.
    reuse_samples: bool = False
    eval_every: int = 1  # epochs between validation passes (the last epoch is always evaluated)
    deterministic: bool = False  # torch.use_deterministic_algorithms (reproducible, slower)
    shm_dir: str = "/dev/shm"  # memory file system for the node-shared host-memory cache bins; "": a copy per rank
    sampling: str = "auto"  # where sampling runs: auto, gpu, uva (CSR in pinned host memory), cpu (trainer.sampling)
    host_gather: str = "auto"  # CPU-tier rows on CUDA: auto/uva (a GPU gather reading them in place), stage
    io: str = "auto"  # SSD reads: auto (whichever a short probe measured faster on CUDA; else posix), posix, kvikio

    def __post_init__(self) -> None:
        if self.fanouts is not None:
            self.fanouts = tuple(int(f) for f in self.fanouts)
        if self.hidden is None:
            self.hidden = default_hidden(self.model)

    @property
    def layers(self) -> int:
        if self.fanouts is None:
            raise ValueError("fanouts not resolved yet (with_sampling)")
        return len(self.fanouts)

    def with_sampling(self, fanouts: Sequence[int], batch_size: int) -> TrainConfig:
        """This config with unset fan-outs and batch size taken from the placement's pre-sampling."""
        return dataclasses.replace(
            self, fanouts=tuple(self.fanouts or fanouts), batch_size=self.batch_size or batch_size
        )

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "nccl" if self.resolved_device().startswith("cuda") else "gloo"
        return self.backend

    def to_dict(self) -> dict[str, Any]:
        """Primitives only (lists for tuples): safe for JSON and for weights_only checkpoints."""
        out = dataclasses.asdict(self)
        out["fanouts"] = None if self.fanouts is None else list(self.fanouts)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``convert`` the text, accept it if ``ok``; else the one-line message."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive = _checked(int, lambda v: v > 0, "a positive integer")
_fraction = _checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
_positive_float = _checked(float, lambda v: v > 0, "a positive number")


def _fanouts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.replace(" ", "").split(",") if p)
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 25,10, got {text!r}")
    return values


class _RaisingParser(argparse.ArgumentParser):
    """The trainer's parser as ``moment train`` uses it: a bad value raises a UsageError (one
    line, exit 2, printed once by the CLI) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"trainer argument: {message}")


def parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = TrainConfig(data="")
    p = cls(
        prog="python -m trainer",
        description="Train a GNN on a placed dataset (run under torchrun for several GPUs/processes).",
    )
    p.add_argument("--data", required=True, metavar="DIR", help="placed dataset directory (`moment place` output)")
    p.add_argument("--plan", metavar="plan.json", help="the plan: rank → GPU/socket map, predicted iteration time")
    p.add_argument("--model", choices=tuple(LAYERS), default=d.model)
    p.add_argument("--hidden", type=_positive, help="hidden width (default 256 for sage, 64 per head for gat)")
    p.add_argument("--heads", type=_positive, default=d.heads, help="attention heads (gat)")
    p.add_argument(
        "--fanouts",
        type=_fanouts,
        help="neighbours per hop, first hop first (default: those the placement "
        "pre-sampled with, placed.json hotness.fanouts)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive,
        help="seeds per rank per step (default: the placement's pre-sampling batch size)",
    )
    p.add_argument(
        "--epochs", type=_positive, default=d.epochs, help="total epochs (a resumed run counts the done ones)"
    )
    p.add_argument("--lr", type=_positive_float, default=d.lr)
    p.add_argument("--dropout", type=_fraction, default=d.dropout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save a checkpoint there after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's checkpoint if there is one")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over and replace --checkpoint-dir's checkpoint (without it or --resume, an existing one is refused)",
    )
    p.add_argument("--metrics-json", metavar="FILE", help="write per-epoch and summary metrics there")
    p.add_argument("--prefetch", type=_positive, default=d.prefetch, help="batches prepared ahead (default 2)")
    p.add_argument(
        "--reuse-samples",
        action="store_true",
        help="on a packed placement (moment place --pack --pack-epochs K), train epoch e on epoch e mod K's batches, "
        "the ones its SSD rows are laid out for (default: sample new batches every epoch)",
    )
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda (default auto)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default=d.backend)
    p.add_argument("--max-batches-per-epoch", type=_positive, help="stop each epoch after this many steps (smoke runs)")
    p.add_argument("--eval-every", type=_positive, default=d.eval_every, help="epochs between validation passes")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (reproducible, slower)")
    p.add_argument(
        "--shm-dir",
        default=d.shm_dir,
        metavar="DIR",
        help="memory file system where the ranks of a node share one copy of the cache bins held in host memory "
        "(default /dev/shm; '' for a copy per rank)",
    )
    p.add_argument(
        "--sampling",
        choices=SAMPLING_CHOICES,
        default=d.sampling,
        help="where neighbour sampling runs: gpu (the graph in GPU memory), uva (on the GPU, the graph in pinned "
        "host memory read zero-copy), cpu; auto (default): gpu when the graph takes at most a quarter of the "
        "free GPU memory, else uva on CUDA when the host has room, else cpu",
    )
    p.add_argument(
        "--host-gather",
        choices=("auto", "uva", "stage"),
        default=d.host_gather,
        help="how rows of the CPU cache reach the GPU: uva (a GPU gather reading the cache in place, registered "
        "with CUDA), stage (gathered on the host into a pinned buffer, then one copy); auto (default): uva on CUDA, "
        "stage when registration fails",
    )
    p.add_argument("--io", choices=IO_CHOICES, default=d.io, help=io_help())
    return p


def from_args(argv: Sequence[str] | None = None, raising: bool = False) -> TrainConfig:
    """Parse the command line; argparse exits 2 with a one-line message on a bad value
    (``raising``: a UsageError instead, for ``moment train`` to report before torchrun)."""
    p = parser(_RaisingParser if raising else argparse.ArgumentParser)
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite exclude each other: continue the checkpoint, or replace it")
    if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
        p.error(f"--device {args.device!r}: expected auto, cpu or cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine")
    if args.device.startswith("cuda:") and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        p.error(
            f"--device {args.device}: every rank of the node would use that one GPU; "
            "use --device cuda (each rank takes the GPU the plan gives it)"
        )
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if (why := io_refusal(args.io, cuda)) is not None:
        p.error(f"--io {why}")
    values = {k: v for k, v in vars(args).items() if v is not None}
    return TrainConfig(**values)
