"""One configuration object for a training run (torchtitan style), declared once.

Everything a run depends on lives in :class:`TrainConfig`: the loop reads it, rank 0 prints it at
start, and every checkpoint stores it (as a dict of primitives, so ``torch.load(weights_only=True)``
can read it back). Each field is also its command-line option (:mod:`moment.options`): the
parser of ``python -m trainer`` (:func:`parser`), the options of ``moment train`` and the argv
``moment train`` hands the ranks (:func:`moment.options.to_argv`) are generated from the fields,
so an option's name, default and help are written here only. ``from_args`` is the command line
of ``python -m trainer``; a bad value exits 2 with argparse's one-line message. ``moment train``
parses the same command line with ``from_args(..., raising=True)`` before it starts torchrun, so
a bad trainer argument is one usage line there, not one per rank. Importing this module loads no
torch (``moment``'s parser is built from it); the checks that need torch import it when they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from moment.errors import UsageError
from moment.options import OptionParser, Registry, add_arguments, ints, option, values

SAMPLING_CHOICES = ("auto", "gpu", "uva", "cpu")  # --sampling: what each means is trainer.sampling's docstring


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


@dataclass
class TrainConfig:
    data: str = option(metavar="DIR", help="placed dataset directory (`moment place` output)")
    plan: str | None = option(
        None, metavar="plan.json", help="the plan: rank → GPU/socket map, predicted iteration time"
    )
    model: str = option("sage", choices=Registry("trainer.models", "LAYERS"), help="the GNN (trainer.models.LAYERS)")
    hidden: int | None = option(
        None,
        type=_positive,
        help="hidden width (default: the model's registered one, 256 for sage, 64 per head for gat)",
    )
    heads: int = option(8, type=_positive, help="attention heads (gat)")
    # Sampling: None takes what the placement pre-sampled with (placed.json ``hotness``), so
    # the run reads the tiers as the placement was balanced for (see ``with_sampling``).
    fanouts: tuple[int, ...] | None = option(
        None,
        type=_fanouts,
        to_text=ints,
        help="neighbours per hop, first hop first; the model has one layer per hop (default: those the placement "
        "pre-sampled with, placed.json hotness.fanouts)",
    )
    batch_size: int | None = option(
        None, type=_positive, help="seeds per rank per step (default: the placement's pre-sampling batch size)"
    )
    epochs: int = option(
        3, type=_positive, help="total epochs, counting those a resumed checkpoint did (default %(default)s)"
    )
    lr: float = option(3e-3, type=_positive_float, help="learning rate (Adam)")
    dropout: float = option(0.5, type=_fraction, help="dropout between layers")
    seed: int = option(0, type=int, help="seed of the model, the batches and the sampling")
    checkpoint_dir: str | None = option(None, metavar="DIR", help="save a checkpoint there after every epoch")
    resume: bool = option(
        False, help="continue from --checkpoint-dir's checkpoint if there is one (same data and model)"
    )
    overwrite: bool = option(
        False,
        help="start over and replace --checkpoint-dir's checkpoint (without it or --resume, an existing one is refused)",
    )
    metrics_json: str | None = option(
        None, metavar="FILE", help="write per-epoch and summary metrics there, measured vs predicted (JSON)"
    )
    prefetch: int = option(
        2, type=_positive, help="batches sampled and fetched ahead of the one training (default %(default)s)"
    )
    device: str = option("auto", help="auto (cuda when available, else cpu), cpu, cuda (default auto)")
    backend: str = option("auto", choices=("auto", "nccl", "gloo"), help="auto: nccl on cuda, gloo otherwise")
    max_batches_per_epoch: int | None = option(
        None, type=_positive, help="stop each epoch after this many steps (smoke runs)"
    )
    # A packed placement (moment place --pack) lays SSD rows out for its K replayed epochs: epoch e
    # then trains on epoch e mod K's batches again (the same seeds and neighbours) instead of new ones.
    reuse_samples: bool = option(
        False,
        help="on a packed placement (moment place --pack --pack-epochs K), train epoch e on epoch e mod K's batches, "
        "the ones its SSD rows are laid out for (default: sample new batches every epoch)",
    )
    # A packed placement stores its replayed batches' samples (placement.samples): those batches are
    # loaded, not sampled (the same draws), unless this asks for sampling every batch.
    live_sampling: bool = option(
        False,
        help="sample every training batch, even those a packed placement stored (default: a replayed batch's "
        "stored sample is loaded instead of sampling it again)",
    )
    eval_every: int = option(1, type=_positive, help="epochs between validation passes (the last is always evaluated)")
    deterministic: bool = option(
        False, help="deterministic kernels (torch.use_deterministic_algorithms: reproducible, slower)"
    )
    shm_dir: str = option(
        "/dev/shm",
        metavar="DIR",
        help="memory file system where the ranks of a node share one copy of the cache bins held in host memory "
        "(default /dev/shm; '' for a copy per rank)",
    )
    sampling: str = option(
        "auto",
        choices=SAMPLING_CHOICES,
        help="where neighbour sampling runs: gpu (the graph in GPU memory), uva (on the GPU, the graph in pinned "
        "host memory read zero-copy), cpu; auto (default): gpu when the graph takes at most a quarter of the "
        "free GPU memory, else uva on CUDA when the host has room, else cpu",
    )
    host_gather: str = option(
        "auto",
        choices=("auto", "uva", "stage"),
        help="how rows of the CPU cache reach the GPU: uva (a GPU gather reading the cache in place, registered "
        "with CUDA), stage (gathered on the host into a pinned buffer, then one copy); auto (default): uva on CUDA, "
        "stage when registration fails",
    )
    io: str = option(
        "auto",
        choices=Registry("trainer.readers", "READERS", about="io_help", also=("auto",)),
        help="how SSD bins are read",
    )

    def __post_init__(self) -> None:
        if self.fanouts is not None:
            self.fanouts = tuple(int(f) for f in self.fanouts)
        if self.hidden is None:
            from trainer.models import default_hidden

            self.hidden = default_hidden(self.model)

    @property
    def layers(self) -> int:
        return len(self.resolved_fanouts)

    @property
    def resolved_fanouts(self) -> tuple[int, ...]:
        """The fan-outs, once given or taken from the placement (:meth:`with_sampling`)."""
        if self.fanouts is None:
            raise ValueError("fanouts not resolved yet (with_sampling)")
        return self.fanouts

    @property
    def resolved_batch_size(self) -> int:
        """The batch size, once given or taken from the placement (:meth:`with_sampling`)."""
        if self.batch_size is None:
            raise ValueError("batch size not resolved yet (with_sampling)")
        return self.batch_size

    @property
    def resolved_hidden(self) -> int:
        """The hidden width: given, or the model's registered one (set when the config is made)."""
        if self.hidden is None:
            raise ValueError("hidden width not resolved")
        return self.hidden

    def with_sampling(self, fanouts: Sequence[int], batch_size: int) -> TrainConfig:
        """This config with unset fan-outs and batch size taken from the placement's pre-sampling."""
        return dataclasses.replace(
            self, fanouts=tuple(self.fanouts or fanouts), batch_size=self.batch_size or batch_size
        )

    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

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


class _RaisingParser(OptionParser):
    """The trainer's parser as ``moment train`` uses it: a bad value raises a UsageError (one
    line, exit 2, printed once by the CLI) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"trainer argument: {message}")


def parser(cls: type[argparse.ArgumentParser] = OptionParser) -> argparse.ArgumentParser:
    """``python -m trainer``'s command line: every option of :class:`TrainConfig`."""
    p = cls(
        prog="python -m trainer",
        description="Train a GNN on a placed dataset (run under torchrun for several GPUs/processes).",
    )
    add_arguments(p, TrainConfig)
    return p


def from_args(argv: Sequence[str] | None = None, raising: bool = False) -> TrainConfig:
    """Parse the command line; argparse exits 2 with a one-line message on a bad value
    (``raising``: a UsageError instead, for ``moment train`` to report before torchrun)."""
    p = parser(_RaisingParser if raising else OptionParser)
    args = p.parse_args(argv)
    if (why := refusal(args)) is not None:
        p.error(why)
    return TrainConfig(**{k: v for k, v in values(TrainConfig, args).items() if v is not None})


def refusal(args: Any) -> str | None:
    """Why these options cannot run here (one line), or None: what argparse's types cannot see."""
    import torch

    from trainer.readers import io_refusal

    if args.resume and not args.checkpoint_dir:
        return "--resume needs --checkpoint-dir"
    if args.overwrite and not args.checkpoint_dir:
        return "--overwrite needs --checkpoint-dir"
    if args.resume and args.overwrite:
        return "--resume and --overwrite exclude each other: continue the checkpoint, or replace it"
    if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
        return f"--device {args.device!r}: expected auto, cpu or cuda"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {args.device}: CUDA is not available on this machine"
    if args.device.startswith("cuda:") and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        return (
            f"--device {args.device}: every rank of the node would use that one GPU; "
            "use --device cuda (each rank takes the GPU the plan gives it)"
        )
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if (why := io_refusal(args.io, cuda)) is not None:
        return f"--io {why}"
    return None
