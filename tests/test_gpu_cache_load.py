"""A GPU cache bin is loaded through a bounded host buffer, not a bin-sized pageable copy, and
from the socket's shared mapping rather than the disk again (GPU review #11)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from placement.placed import PlacedError
from trainer import featurestore
from trainer.featurestore import copy_in_chunks, read_in_chunks


def test_a_bin_is_read_in_bounded_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.random.default_rng(2).standard_normal((300, 7)).astype(np.float32)  # 8,400 bytes
    path = tmp_path / "gpu.bin"
    data.tofile(path)
    monkeypatch.setattr(featurestore, "LOAD_CHUNK", 1000)
    sizes: list[int] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = real_empty(*args, **kwargs)
        sizes.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(featurestore.torch, "empty", empty)
    dst = real_empty((300, 7), dtype=torch.float32)
    read_in_chunks(path, dst)
    assert np.array_equal(dst.numpy(), data)
    assert sizes == [1000]  # one host buffer of LOAD_CHUNK bytes, not 8,400
    with pytest.raises(PlacedError, match="gpu.bin: shorter"):
        read_in_chunks(path, real_empty((301, 7), dtype=torch.float32))


def test_a_copy_from_the_mapping_goes_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(featurestore, "LOAD_CHUNK", 256)  # 256 bytes: 8 rows of 8 float32
    src = torch.arange(100 * 8, dtype=torch.float32).view(100, 8)
    dst = torch.empty_like(src)
    copies: list[int] = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda self, other, *a, **kw: (copies.append(other.shape[0]), real(self, other, *a, **kw))[1],
    )
    copy_in_chunks(src, dst)
    assert torch.equal(dst, src) and max(copies) == 8 and sum(copies) == 100
