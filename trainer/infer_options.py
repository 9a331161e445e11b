"""``moment infer``'s options, declared once (:mod:`moment.options`): the ``moment infer`` parser,
the ranks' parser (``python -m trainer.infer``) and the argv the launcher hands the ranks are
generated from :class:`InferOptions`. Kept apart from :mod:`trainer.infer` (which loads torch)
so that building ``moment``'s parser loads none."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moment.errors import UsageError
from moment.options import Registry, non_negative, option, path, positive
from moment.sizes import SizeError, parse_bytes

if TYPE_CHECKING:
    from trainer.infer_predict import Rates

DTYPES = ("float32", "float16")
LAYER_CHOICES = ("last", "all")
INFER_ENGINES = ("broadcast", "gather")  # broadcast: where the layer has a scatter form, else gather
UNRECORDED_ENGINE = "gather"  # of an inference.json written before it recorded the engine: the only one then
DEVICES = ("auto", "cpu", "cuda")  # auto: CUDA when available (each rank the GPU the plan gives it), else the CPU
DEFAULT_BATCH = 8192  # destination vertices per chunk
# What each rank is handed (the rest is the launcher's: the output, the ranks, the nodes, the
# memory budget the ranks read from the work directory).
RANK_OPTIONS = ("data", "checkpoint", "plan", "layers", "dtype", "batch_size", "device", "engine")


def _memory(text: str) -> int:
    """argparse type of ``--memory``: a size in bytes (``4GB``)."""
    try:
        return parse_bytes(text, "--memory")
    except SizeError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None


def _choices(name: str) -> Registry:
    return Registry(__name__, name)


@dataclass(frozen=True)
class InferOptions:
    data: Path = option(type=path, help="placed dataset directory (the one the checkpoint was trained on)")
    checkpoint: Path = option(
        type=path, metavar="CK", help="checkpoint directory of `moment train` (or its checkpoint.pt)"
    )
    out: Path = option(None, type=path, metavar="DIR", help="output directory (required unless --dry-run)")
    plan: Path | None = option(
        None, type=path, help="plan.json: the rank → GPU map, by PCI address (checked; the rank count defaults to 1)"
    )
    nproc: int = option(
        1,
        type=positive,
        help="ranks, each taking a contiguous range of vertices (torchrun processes when more than 1; default 1)",
    )
    layers: str = option(
        "last",
        choices=_choices("LAYER_CHOICES"),
        help="last: embeddings and predictions; all: also logits.npy and every earlier hidden layer",
    )
    dtype: str = option("float32", choices=_choices("DTYPES"), help="of the hidden-layer arrays")
    batch_size: int = option(DEFAULT_BATCH, type=positive, help="destination vertices per chunk (default %(default)s)")
    device: str = option(
        "auto",
        choices=_choices("DEVICES"),
        help="where the ranks run: cpu, cuda (each rank on the GPU the plan gives it) or auto (default: cuda "
        "where there is CUDA, else cpu)",
    )
    engine: str = option(
        "broadcast",
        choices=_choices("INFER_ENGINES"),
        help="broadcast (default): each layer's input streamed once in placed order, messages scattered into "
        "the destinations (layers with a scatter form: sage; others run on gather); gather: each chunk of "
        "destinations gathers its in-neighbours' rows (the reference)",
    )
    memory: int | None = option(
        None,
        type=_memory,
        to_text=str,
        help="memory the broadcast passes may hold, e.g. 4GB, shared by this node's ranks: the destinations' "
        "partial sums, then their edges (the rest spilled to disk); when the sums do not fit, the destinations are cut into "
        "partitions, the first streaming the input, the others the messages it relayed (default: three quarters "
        "of the memory available, within its memory cgroup)",
    )
    dry_run: bool = option(
        False,
        help="write nothing: print per layer the engine, passes over its input, bytes read, memory and the "
        "predicted time (reads at the sequential rates of the plan's machine, compute timed here)",
    )
    nnodes: int | None = option(
        None,
        type=positive,
        help="several nodes: how many (the same command on each, with its own --node-rank; torchrun --nnodes)",
    )
    node_rank: int | None = option(
        None,
        type=non_negative,
        help="several nodes: this node's number, 0 to --nnodes - 1; node 0 writes --out and inference.json, "
        "the others keep only scratch beside their own --out (OUT.nodeR.partial, removed at the end); every "
        "node reads its own --data and --checkpoint, layers' rows cross the network: no shared storage needed",
    )
    rdzv_endpoint: str | None = option(None, help="several nodes: HOST:PORT where they meet (on node 0)")
    rdzv_id: str | None = option(None, help="several nodes: a job id, the same on every node")
    rates: Rates | None = field(default=None, compare=False)  # the plan's machine (the CLI reads its profile)

    def check(self) -> None:
        """What the parser cannot see (options built in code are checked too)."""
        import torch

        if self.out is None and not self.dry_run:
            raise UsageError("--out: required (the output directory), unless --dry-run")
        if self.nproc < 1:
            raise UsageError(f"--nproc {self.nproc}: expected a positive number of ranks")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size {self.batch_size}: expected a positive number of vertices")
        if self.layers not in LAYER_CHOICES:
            raise UsageError(f"--layers {self.layers!r}: expected one of {', '.join(LAYER_CHOICES)}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.engine not in INFER_ENGINES:
            raise UsageError(f"--engine {self.engine!r}: expected one of {', '.join(INFER_ENGINES)}")
        if self.memory is not None and self.memory <= 0:
            raise UsageError(f"--memory {self.memory}: expected a positive number of bytes")
        if self.device not in DEVICES:
            raise UsageError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine")
        from trainer.launch import check_nodes

        check_nodes(self)
        if self.nnodes is None and self.rdzv_endpoint is not None:
            raise UsageError("--rdzv-endpoint needs --nnodes (several nodes)")
        if self.nodes > 1 and self.node_rank is None:
            raise UsageError(f"--nnodes {self.nnodes} needs --node-rank (node 0 writes --out)")

    @property
    def nodes(self) -> int:
        """Nodes of the job (1 without --nnodes)."""
        return self.nnodes or 1

    @property
    def node(self) -> int:
        """This node's number (0 without --node-rank)."""
        return self.node_rank or 0

    @property
    def world(self) -> int:
        """Ranks of the job: every node runs --nproc."""
        return self.nodes * self.nproc
