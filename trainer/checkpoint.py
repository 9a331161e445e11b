"""Checkpoints: everything a resumed run needs to end where an uninterrupted one ends.

One file, ``checkpoint.pt`` in the checkpoint directory, replaced atomically after every epoch
(temporary file, fsync, rename: ``moment.fileio.atomic_file``): a crash leaves the previous epoch's
checkpoint whole. It holds the model and optimizer state, the number of epochs done, every rank's
RNG states (torch CPU and CUDA, numpy, python: ranks draw different amounts, e.g. dropout over
batches of different sizes, so their generators part ways) and the config, plus the metrics of
the epochs done so the metrics file of a resumed run covers the whole run.

Only tensors and primitive containers are stored, so loading uses
``torch.load(weights_only=True)`` and a checkpoint can never run code.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moment.errors import MomentError
from moment.fileio import atomic_file
from trainer.config import TrainConfig

FORMAT = "moment.checkpoint/2"
FILENAME = "checkpoint.pt"
# Config fields that shape the parameters: a checkpoint made with other values cannot be loaded.
SHAPING = ("model", "hidden", "heads", "fanouts")


class CheckpointError(MomentError):
    """A checkpoint that cannot be read or does not fit this run."""


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as tensors and lists (weights_only-loadable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: the one this rank draws on
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def path_in(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def save(directory: str | Path, *, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         cfg: TrainConfig, history: list[dict[str, Any]], rng: list[dict[str, Any]] | None = None) -> Path:
    """Write the state after ``epoch`` epochs atomically; returns the checkpoint path. ``rng``:
    every rank's :func:`rng_state`, in rank order (default: this process's alone)."""
    target = path_in(directory)
    body = {
        "format": FORMAT,
        "epoch": int(epoch),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng if rng is not None else [rng_state()],
        "config": cfg.to_dict(),
        "history": history,
    }
    with atomic_file(target, binary=True) as fh:
        torch.save(body, fh)
    return target


def load(directory: str | Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The checkpoint in ``directory`` (None when there is none), refused if it does not fit ``cfg``."""
    path = path_in(directory)
    if not path.exists():
        return None
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:  # damaged or foreign
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: unreadable checkpoint ({reason})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint")
    mine = cfg.to_dict()
    for key in SHAPING:
        if body["config"].get(key) != mine[key]:
            raise CheckpointError(f"{path}: made with {key}={body['config'].get(key)!r}, this run has {mine[key]!r}")
    return body


def restore(body: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, rank: int = 0) -> int:
    """Load model, optimizer and ``rank``'s RNG states; returns the number of epochs already done.
    (A run resumed with another number of ranks cannot replay the uninterrupted one anyway: its
    ranks get the saved states round-robin.)"""
    model.load_state_dict(body["model"])
    optimizer.load_state_dict(body["optimizer"])
    states = body["rng"]
    set_rng_state(states[rank % len(states)])
    return int(body["epoch"])
