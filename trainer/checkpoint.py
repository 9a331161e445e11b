"""Checkpoints: everything a resumed run needs to end where an uninterrupted one ends.

One file, ``checkpoint.pt`` in the checkpoint directory, replaced atomically after every epoch
(temporary file, fsync, rename: ``moment.fileio.atomic_file``): a crash leaves the previous epoch's
checkpoint whole. It holds the model and optimizer state, every rank's RNG states (torch CPU and
CUDA, numpy, python: ranks draw different amounts, e.g. dropout over batches of different sizes,
so their generators part ways) and the metadata of ``moment.contracts.checkpoint``: the number of
epochs done, the config, the identity of the placed dataset trained on (a resume on other data
is refused), and the metrics of the epochs done so the metrics file of a resumed run covers the
whole run.

Only tensors and primitive containers are stored, so loading uses
``torch.load(weights_only=True)`` and a checkpoint can never run code.

Nothing damaged is used silently: ``torch.load`` checks no CRC, so :func:`load` (``--resume``,
a restarted worker group, ``moment infer``) first checks the zip's CRC-32 of every record
(:func:`check_zip`, also what ``moment train --resume`` checks before it launches), then the
sha256 over the tensors that :func:`save` recorded in the metadata (:func:`tensors_digest`).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from moment.contracts.checkpoint import FORMAT, SHAPING, CheckpointError, CheckpointMeta, DataIdentity
from moment.fileio import atomic_file
from trainer.config import TrainConfig

__all__ = [
    "FILENAME",
    "FORMAT",
    "SHAPING",
    "CheckpointError",
    "DataIdentity",
    "check_zip",
    "load",
    "read_meta",
    "restore",
    "save",
    "tensors_digest",
]

FILENAME = "checkpoint.pt"
META_KEYS = ("format", "epoch", "config", "data", "history", "tensors_sha256")  # the CheckpointMeta part of the file


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as tensors and lists (weights_only-loadable)."""
    # numpy's legacy state (the default form): its stubs also allow the dict of legacy=False
    kind, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
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


def save(
    directory: str | Path,
    *,
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    data: DataIdentity,
    history: list[dict[str, Any]],
    rng: list[dict[str, Any]] | None = None,
) -> Path:
    """Write the state after ``epoch`` epochs atomically; returns the checkpoint path. ``rng``:
    every rank's :func:`rng_state`, in rank order (default: this process's alone)."""
    target = path_in(directory)
    tensors = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng if rng is not None else [rng_state()],
    }
    meta = CheckpointMeta(
        epoch=int(epoch), config=cfg.to_dict(), data=data, history=history, tensors_sha256=tensors_digest(tensors)
    )
    buf = io.BytesIO()  # serialised first: a full disk is then an OSError naming the file, not torch's
    torch.save({**meta.model_dump(mode="json"), **tensors}, buf)  # writer's "unexpected pos" error
    with atomic_file(target, binary=True) as fh:
        fh.write(buf.getbuffer())
    return target


def tensors_digest(body: dict[str, Any]) -> str:
    """sha256 over the model, optimizer and RNG states: every tensor's name, dtype, shape and bytes,
    every other value's repr, in the order the file stores them."""
    h = hashlib.sha256()

    def walk(key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            h.update(f"{key}:{flat.dtype}:{tuple(value.shape)}\n".encode())
            h.update(memoryview(flat.view(torch.uint8).numpy()))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{key}/{i}", v)
        else:
            h.update(f"{key}={value!r}\n".encode())

    for key in ("model", "optimizer", "rng"):
        walk(key, body[key])
    return h.hexdigest()


def check_zip(path: Path) -> None:
    """Every record of the checkpoint's zip matches its CRC-32 (a flipped byte anywhere: the
    pickle, a weight, an optimizer state); else one CheckpointError line naming the record."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({str(exc).splitlines()[0] or type(exc).__name__})"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"{path}: damaged: record {bad} fails its CRC-32 check (changed after it was written): "
            "use another checkpoint or train again"
        )


def _read(path: Path, mmap: bool) -> tuple[dict[str, Any], CheckpointMeta]:
    """The file's contents and its validated metadata; one line naming the file if either fails.
    ``mmap``: map the tensors instead of reading them (enough to look at the metadata)."""
    try:
        body = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:  # damaged or foreign
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: unreadable checkpoint ({reason})") from None
    if not isinstance(body, dict):
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint")
    meta = CheckpointMeta.parse({k: body[k] for k in META_KEYS if k in body}, path)
    missing = [k for k in ("model", "optimizer", "rng") if k not in body]
    if missing:
        raise CheckpointError(f"{path}: {', '.join(missing)}: missing (a damaged checkpoint)")
    return body, meta


def read_meta(directory: str | Path) -> CheckpointMeta | None:
    """The metadata of the checkpoint in ``directory`` (None when there is none), without
    reading its tensors: what ``moment train`` checks before it launches torchrun."""
    path = path_in(directory)
    return _read(path, mmap=True)[1] if path.exists() else None


def load(directory: str | Path, cfg: TrainConfig, data: DataIdentity, placement: bool = True) -> dict[str, Any] | None:
    """The checkpoint in ``directory`` (None when there is none), refused if it does not fit ``cfg``
    or was trained on other data than ``data`` (with ``placement``: on another placement of it)."""
    path = path_in(directory)
    if not path.exists():
        return None
    check_zip(path)
    body, meta = _read(path, mmap=False)
    if meta.tensors_sha256 is not None and tensors_digest(body) != meta.tensors_sha256:
        raise CheckpointError(
            f"{path}: damaged: its tensors do not match the sha256 recorded when it was saved: "
            "use another checkpoint or train again"
        )
    why = meta.refusal(cfg.to_dict(), data, placement=placement)
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
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
