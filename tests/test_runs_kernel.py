"""The compiled planning of a read request (trainer/runs_kernel.py): the same runs, page count
and errors as numpy's (coalesce, then pages_read), on random rows and at the edges."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moment.ssd_reads import PAGE_BYTES
from trainer import read_base, runs_kernel
from trainer.read_base import DIRECT_ALIGN, _plan_runs_numpy, plan_runs
from trainer.readers import FileReader, ReadRequest, _aligned_rows

PLAN = runs_kernel.planner()
pytestmark = pytest.mark.skipif(PLAN is None, reason="numba cannot build the planner here")


def _compiled(rows: np.ndarray, row_bytes: int, max_run_bytes: int, base: int = 0) -> tuple:
    offsets, dests, sizes, pages, status = PLAN(rows, row_bytes, max(1, max_run_bytes // row_bytes), base, PAGE_BYTES)
    assert status == runs_kernel.OK
    return offsets, dests, sizes, pages


def _numpy(rows: np.ndarray, row_bytes: int, max_run_bytes: int, base: int = 0) -> tuple:
    return _plan_runs_numpy(rows, row_bytes, max(1, max_run_bytes // row_bytes), base)


def _pages_by_hand(offsets: np.ndarray, sizes: np.ndarray) -> int:
    """Distinct pages the runs touch, one page at a time (no shortcut shared with either planner)."""
    pages: set[int] = set()
    for offset, size in zip(offsets.tolist(), sizes.tolist()):
        pages.update(range(offset // PAGE_BYTES, (offset + size - 1) // PAGE_BYTES + 1))
    return len(pages) * PAGE_BYTES


def _assert_same(got: tuple, want: tuple) -> None:
    for g, w in zip(got[:3], want[:3]):
        assert g.dtype == np.int64 and np.array_equal(g, w)
    assert got[3] == want[3]


@pytest.mark.parametrize("seed", range(40))
def test_random_rows_plan_as_numpy_does(seed: int) -> None:
    """Rows in runs of random lengths with random gaps, any row size (aligned or not), a run
    limit from one row up to a few pages, a base byte or none."""
    rng = np.random.default_rng(seed)
    pieces, at = [], int(rng.integers(0, 20))
    for _ in range(int(rng.integers(1, 60))):
        n = int(rng.integers(1, 40))
        pieces.append(at + np.arange(n))
        at += n + int(rng.integers(1, 30))
    rows = np.concatenate(pieces)
    row_bytes = int(rng.choice([4, 100, 512, 1536, 4096, 6000]))
    max_run_bytes = int(rng.choice([1, row_bytes, 3 * row_bytes + 7, 8192, 4 << 20]))
    base = int(rng.choice([0, 4096, 12345]))
    got = _compiled(rows, row_bytes, max_run_bytes, base)
    _assert_same(got, _numpy(rows, row_bytes, max_run_bytes, base))
    assert got[3] == _pages_by_hand(got[0], got[2])
    assert got[2].sum() == rows.size * row_bytes


def test_empty_rows_and_one_row() -> None:
    empty = np.zeros(0, dtype=np.int64)
    got = _compiled(empty, 512, 4 << 20)
    assert [a.size for a in got[:3]] == [0, 0, 0] and got[3] == 0
    _assert_same(got, _numpy(empty, 512, 4 << 20))
    got = _compiled(np.array([9]), 512, 4 << 20, base=4096)
    assert got[0].tolist() == [4096 + 9 * 512] and got[1].tolist() == [0] and got[2].tolist() == [512]
    assert got[3] == PAGE_BYTES


def test_runs_split_at_max_run_bytes_and_pages_shared_across_the_cut() -> None:
    """A run of exactly the limit is one read, one row more is two; the cut may fall inside a
    page, which is then counted once."""
    limit = 4 * 1000  # four 1000-byte rows: the cut at 4000 is inside the first page
    _assert_same(_compiled(np.arange(4), 1000, limit), (np.array([0]), np.array([0]), np.array([4000]), PAGE_BYTES))
    got = _compiled(np.arange(5), 1000, limit)
    assert got[0].tolist() == [0, 4000] and got[1].tolist() == [0, 4000] and got[2].tolist() == [4000, 1000]
    assert got[3] == 2 * PAGE_BYTES  # bytes 0-4999: pages 0 and 1, page 0 shared by both reads
    _assert_same(got, _numpy(np.arange(5), 1000, limit))
    got = _compiled(np.arange(3), 1000, 1)  # a limit below one row: a read per row
    assert got[2].tolist() == [1000, 1000, 1000] and got[3] == PAGE_BYTES


def test_aligned_rows_give_o_direct_aligned_reads() -> None:
    """512-byte multiples from an aligned base: every offset, destination and size is a
    multiple of the logical block, as O_DIRECT needs."""
    rows = np.unique(np.random.default_rng(3).integers(0, 5000, 900))
    for row_bytes, base in ((512, 0), (1536, 4096), (4096, 512 * 7)):
        offsets, dests, sizes, _ = _compiled(rows, row_bytes, 64 * 1024, base)
        assert (
            not (offsets % DIRECT_ALIGN).any() and not (dests % DIRECT_ALIGN).any() and not (sizes % DIRECT_ALIGN).any()
        )


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ([3, 2], "rows must be sorted ascending and unique"),
        ([1, 2, 2, 3], "rows must be sorted ascending and unique"),
        ([-1, 0, 5], "row -1 is negative"),
        ([-1, -2], "rows must be sorted ascending and unique"),  # the order numpy's check reports in
    ],
)
def test_bad_rows_are_the_same_errors(rows: list[int], error: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=f"^{error}$"):
        plan_runs(np.array(rows), 512, 4 << 20)
    monkeypatch.setattr(read_base, "_planner", lambda: None)
    with pytest.raises(ValueError, match=f"^{error}$"):
        plan_runs(np.array(rows), 512, 4 << 20)


def test_plan_runs_takes_any_int64_view_and_other_integer_rows() -> None:
    """Rows as the callers hand them: a strided, read-only view (a mapping), or int32."""
    rows = np.arange(0, 400, dtype=np.int64)[::3]
    rows.setflags(write=False)
    want = _numpy(np.ascontiguousarray(rows), 512, 8192)
    _assert_same(plan_runs(rows, 512, 8192), want)
    _assert_same(plan_runs(rows.astype(np.int32), 512, 8192), want)


def test_the_reader_counts_and_reads_the_same_with_either_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch through the file reader with the compiled planner and with numpy's: the same
    bytes in, reads issued and pages counted. The buffer is aligned on purpose: whether a read
    goes O_DIRECT depends on its address, and a heap address differs from one allocation to the
    next (the comparison failed once in a full run when one of the two happened to be aligned)."""
    data = np.random.default_rng(0).integers(0, 256, (4000, 1536), dtype=np.uint8)
    path = tmp_path / "bin"
    data.tofile(path)
    rows = np.unique(np.random.default_rng(1).integers(0, 4000, 1500))
    seen = []
    for planner in (read_base._planner, lambda: None):
        monkeypatch.setattr(read_base, "_planner", planner)
        with FileReader(threads=3, max_run_bytes=8 * 1536) as reader:
            out = _aligned_rows(rows.size, 1536)
            reader.read_batch([ReadRequest(path, rows, out), ReadRequest(path, rows[:0], out[:0])])
            assert np.array_equal(out, data[rows])
            seen.append((reader.preads, dict(reader.read_bytes), dict(reader.modes)))
    assert seen[0] == seen[1]


def test_an_empty_request_plans_no_read(tmp_path: Path) -> None:
    """A request with no rows (a bin the batch does not touch) issues nothing: it is done at the
    batch's start, and its file gets no mode and no pages (the one page the other reads)."""
    paths = [tmp_path / "empty", tmp_path / "full"]
    for path in paths:
        np.zeros((16, 512), dtype=np.uint8).tofile(path)
    with FileReader(threads=2) as reader:
        out = np.empty((4, 512), dtype=np.uint8)
        seconds = reader.read_batch(
            [ReadRequest(paths[0], np.arange(0), out[:0]), ReadRequest(paths[1], np.arange(4), out)]
        )
        assert seconds[0] == 0.0 and seconds[1] > 0
        assert set(reader.modes) == {str(paths[1])} and reader.read_bytes == {str(paths[0]): 0, str(paths[1]): 4096}
        assert reader.preads == 1
