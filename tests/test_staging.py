"""The host staging buffer is allocated once from a bound, never grown by doubling, and host
rows are gathered into it byte for byte (review findings 10 and 17 of the GPU path); on a CPU
device rows are put straight into the output instead, each copied once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import featurestore, staging
from trainer.featurestore import gather_rows, put_rows, unique_inverse
from trainer.staging import PAGE, Staging, stage_bytes


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of every staging allocation, in order."""
    sizes: list[int] = []
    real = staging.allocate

    def spy(nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
        sizes.append(nbytes)
        return real(nbytes, device, pin)

    monkeypatch.setattr(staging, "allocate", spy)
    return sizes


def test_growing_batches_allocate_once_within_the_bound(allocations: list[int]) -> None:
    row = 512
    s = Staging(torch.device("cpu"), False, None, reserve=stage_bytes(1000, row))
    for rows in (10, 100, 400, 999, 1000, 3):
        assert s.take(rows * row).numel() == rows * row
    assert allocations == [1000 * row + PAGE]
    assert s.stats() == {"bytes": 1000 * row + PAGE, "reserved": 1000 * row + PAGE, "grown": 0}
    s.take(1500 * row)  # beyond the bound: once, to exactly what it needs
    s.take(1200 * row)
    assert allocations == [1000 * row + PAGE, 1500 * row + PAGE]
    assert s.stats()["grown"] == 1


def test_without_a_bound_growth_is_exact_not_doubled(allocations: list[int]) -> None:
    s = Staging(torch.device("cpu"), False, None)
    for rows in (1, 2, 3, 5, 8):
        s.take(rows * 100)
    assert allocations == [rows * 100 + PAGE for rows in (1, 2, 3, 5, 8)]
    assert s.stats()["grown"] == 4


def test_the_stage_is_page_aligned_and_reused(allocations: list[int]) -> None:
    s = Staging(torch.device("cpu"), False, None, reserve=stage_bytes(64, 4096))
    a = s.take(10 * 4096)
    b = s.take(64 * 4096)
    assert a.data_ptr() % PAGE == 0 and a.data_ptr() == b.data_ptr() and len(allocations) == 1


def test_gather_rows_copies_bytes_for_any_ids() -> None:
    """Random ids with repeats, unsorted, empty; NaN payloads and -0.0 survive (bytes, not values)."""
    rng = np.random.default_rng(3)
    src = torch.from_numpy(rng.standard_normal((500, 24)).astype(np.float32))
    bits = src.view(torch.int32)
    bits[7, 3] = 0x7FC01234  # a NaN with a payload
    bits[9, 0] = np.int32(-(2**31))  # -0.0
    for ids in (rng.integers(0, 500, 2000), np.array([9, 7, 7, 499, 0, 9]), np.zeros(0, dtype=np.int64)):
        buf = torch.full((len(ids) + 3, 24 * 4), 0xAB, dtype=torch.uint8)
        out = buf[1 : 1 + len(ids)]
        ptr = out.data_ptr()
        gather_rows(src, ids, out)
        assert out.data_ptr() == ptr  # written in place, into the stage
        assert np.array_equal(out.numpy(), src.numpy().view(np.uint8)[ids])
        assert (buf[0] == 0xAB).all() and (buf[1 + len(ids) :] == 0xAB).all()  # nothing outside


@pytest.mark.parametrize("width", [96, 12])  # 8-byte words, and bytes
@pytest.mark.parametrize("compiled", [True, False])
def test_put_rows_puts_each_row_where_asked_byte_for_byte(
    width: int, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dst[at] = src[rows]`` for rows in any order with repeats, from a read-only source (a
    mapped tier); the output's other rows untouched; the kernel and numpy's fallback alike; an
    index outside either array is refused before anything is copied."""
    if not compiled:
        monkeypatch.setattr(featurestore, "_COPY", [None])
    rng = np.random.default_rng(width)
    src = rng.integers(0, 256, (300, width), dtype=np.uint8)
    src.flags.writeable = False
    dst = np.full((50, width), 0xAB, dtype=np.uint8)
    at, rows = rng.permutation(50)[:40], rng.integers(0, 300, 40)
    put_rows(dst, at, src, rows)
    assert np.array_equal(dst[at], src[rows])
    assert (np.delete(dst, at, axis=0) == 0xAB).all()
    for bad_at, bad_rows in (([50], [0]), ([0], [300]), ([-1], [0])):
        with pytest.raises(IndexError):
            put_rows(dst, np.array(bad_at), src, np.array(bad_rows))
    with pytest.raises(ValueError):
        put_rows(dst, at, src, rows[:-1])


@pytest.mark.parametrize("seed", range(6))
def test_unique_inverse_equals_numpys(seed: int) -> None:
    """The store's dedup of a batch's SSD ids is ``np.unique``'s, on ids in random order with
    repeats, on a sampler's ascending runs, on one id and on none."""
    rng = np.random.default_rng(seed)
    runs = [np.sort(rng.choice(10_000, int(rng.integers(1, 500)), replace=False)) for _ in range(3)]
    cases = [rng.integers(0, 300, 2_000), np.concatenate(runs), np.array([7]), np.zeros(0, dtype=np.int64)]
    for ids in cases:
        uniq, inverse = unique_inverse(ids)
        want_uniq, want_inverse = np.unique(ids, return_inverse=True)
        assert np.array_equal(uniq, want_uniq) and uniq.dtype == want_uniq.dtype
        assert np.array_equal(inverse, want_inverse) and inverse.dtype == want_inverse.dtype
