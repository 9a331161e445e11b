"""The out-of-core CSR builder: the same CSR whatever the chunk size and the number of windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moment.contracts.dataset import DatasetError
from placement.importers import csr


class Pairs:
    """An in-memory edge list served in chunks, counting how often it is read."""

    def __init__(self, edges: np.ndarray) -> None:
        self.edges, self.size, self.reads = edges, len(edges), 0

    def chunks(self, chunk: int) -> csr.Edges:
        for a in range(0, self.size, chunk):
            yield self.edges[a : a + chunk, 0], self.edges[a : a + chunk, 1]
        self.reads += 1  # a whole read


def reference(edges: np.ndarray, n: int, undirected: bool, self_loops: bool) -> tuple[list[int], list[int]]:
    """Row by row, straight from the definition: loop, given edges, reverses, each in input order."""
    rows: list[list[int]] = [[v] if self_loops else [] for v in range(n)]
    kept = [(s, d) for s, d in edges.tolist() if not (self_loops and s == d)]
    for s, d in kept:
        rows[d].append(s)
    if undirected:
        for s, d in kept:
            if s != d:
                rows[s].append(d)
    return [0, *np.cumsum([len(r) for r in rows]).tolist()], [x for r in rows for x in r]


def built(tmp: Path, edges: np.ndarray, n: int, layout: csr.Layout, **opts: bool) -> tuple[list[int], list[int]]:
    tmp.mkdir()
    e = csr.build(tmp, Pairs(edges), n, memory=0, layout=layout, **opts)
    indptr, indices = np.load(tmp / "indptr.npy"), np.load(tmp / "indices.npy")
    assert indptr.dtype == np.int64 and indices.dtype == np.int32 and indptr[-1] == e == len(indices)
    return indptr.tolist(), indices.tolist()


EDGES = np.array([[0, 1], [2, 1], [1, 0], [3, 4], [4, 4], [0, 1], [4, 3], [2, 2], [1, 3]], dtype=np.int64)


@pytest.mark.parametrize(("undirected", "self_loops"), [(False, False), (True, False), (False, True), (True, True)])
def test_every_chunk_size_and_window_gives_the_same_csr(tmp_path: Path, undirected: bool, self_loops: bool) -> None:
    n = 6  # vertex 5 has no edge at all
    want = reference(EDGES, n, undirected, self_loops)
    for chunk in range(1, len(EDGES) + 1):
        for window in (1, 2, 3, 5, 100):
            got = built(
                tmp_path / f"{chunk}-{window}",
                EDGES,
                n,
                csr.Layout(chunk, window),
                undirected=undirected,
                self_loops=self_loops,
            )
            assert got == want, (chunk, window)


def test_a_random_graph_matches_an_in_memory_csr_and_reads_the_edges_once(tmp_path: Path) -> None:
    n, e = 500, 20_000
    edges = np.random.default_rng(7).integers(0, n, (e, 2))
    order = np.argsort(edges[:, 1], kind="stable")
    want = ([0, *np.cumsum(np.bincount(edges[:, 1], minlength=n)).tolist()], edges[order, 0].tolist())
    for window, kept in ((10**9, True), (3000, False)):  # all records in RAM, or in scratch files per bucket
        assert csr.keeps(e, csr.Layout(1234, window)) == kept
        src = Pairs(edges)
        (tmp_path / str(window)).mkdir()
        csr.build(tmp_path / str(window), src, n, memory=0, layout=csr.Layout(1234, window))
        assert (
            np.load(tmp_path / str(window) / "indptr.npy").tolist(),
            np.load(tmp_path / str(window) / "indices.npy").tolist(),
        ) == want
        assert src.reads == 1 and sorted(p.name for p in (tmp_path / str(window)).iterdir()) == [
            "indices.npy",
            "indptr.npy",
        ]


def hubs(n: int, e: int, seed: int, share: float = 0.8) -> np.ndarray:
    """An edge list whose destinations are mostly the first 40 vertices (ids sorted by degree)."""
    rng = np.random.default_rng(seed)
    dst = np.where(rng.random(e) < share, rng.integers(0, 40, e), rng.integers(0, n, e))
    return np.stack([rng.integers(0, n, e), dst], axis=1).astype(np.int32)


def entries(edges: np.ndarray, buckets: csr.Buckets) -> np.ndarray:
    """Entries per bucket of an undirected build (both ends of every edge that is not a loop)."""
    loops = edges[:, 0] == edges[:, 1]
    ends = np.concatenate([edges[:, 1], edges[~loops, 0]])
    return np.bincount(np.searchsorted(buckets.starts, ends, side="right") - 1, minlength=buckets.count)


def test_the_first_chunk_cuts_the_hubs_finer() -> None:
    """Buckets planned from the first chunk of a skewed graph hold about as many entries each; an
    even cut would put most of the graph in the first one."""
    n, e = 1 << 16, 200_000
    edges = hubs(n, e, 2)
    layout = csr.Layout(1 << 14, 40_000)
    sampled = csr.Buckets.plan(n, 2 * e, layout, 2, (edges[: 1 << 14, 0], edges[: 1 << 14, 1]), undirected=True)
    even = csr.Buckets.plan(n, 2 * e, layout, 2, undirected=True)
    assert entries(edges, even).max() > layout.window  # the hubs' bucket: filled in windows
    assert entries(edges, sampled).max() <= 1.2 * csr.target(2 * e, layout) < layout.window
    assert sampled.starts[0] == 0 and sampled.starts[-1] == n and (np.diff(sampled.starts) > 0).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bucket_of_hubs_over_the_budget_is_filled_in_windows(tmp_path: Path, threads: int) -> None:
    """The hubs appear only after the first chunk, so the buckets are cut evenly and the first one
    holds more entries than a window: its rows are filled in windows, the others whole; same CSR."""
    import numba

    n, e = 4096, 30_000
    edges = np.concatenate([np.random.default_rng(6).integers(0, n, (999, 2)), hubs(n, e, 5)]).astype(np.int32)
    layout = csr.Layout(999, 4000)
    buckets = csr.Buckets.plan(n, 2 * len(edges) + n, layout, threads, (edges[:999, 0], edges[:999, 1]), True, True)
    assert entries(edges, buckets)[0] > layout.window and buckets.count > 1  # windowed, and not alone
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = built(tmp_path / "ds", edges, n, layout, undirected=True, self_loops=True)
    finally:
        numba.set_num_threads(before)
    assert got == reference(edges, n, True, True)


def test_windows_cover_the_vertices_within_the_cap() -> None:
    ends = np.cumsum([3, 0, 4, 1, 9, 0, 2])
    cuts = csr.windows(ends, 5)
    assert cuts == [(0, 2), (2, 4), (4, 5), (5, 7)]  # vertex 4 alone holds more than the cap


def test_the_budget_is_split_and_a_too_small_one_is_refused() -> None:
    layout = csr.Layout.plan(1000, 1 << 30)
    assert layout.chunk * csr.CHUNK_BYTES + layout.window * csr.entry_bytes(1000) <= 1 << 30
    assert layout.chunk == csr.MAX_CHUNK or layout.chunk * csr.CHUNK_BYTES * 4 >= (1 << 30) - 4 * 96
    csr.Layout.plan(100_000_000, 10**8)  # nothing in the budget grows with the vertices
    with pytest.raises(DatasetError, match=r"--memory 0.001 GB is too small: the CSR build needs at least"):
        csr.Layout.plan(1000, 10**6)


def test_buckets_fit_the_window_and_are_few() -> None:
    """Evenly spread edges: buckets of about the target each; never more than MAX_BUCKETS."""
    layout = csr.Layout.plan(20_000_000, 10**9)
    buckets = csr.Buckets.plan(20_000_000, 300_000_000, layout, 2)
    aim = csr.target(300_000_000, layout)
    assert aim == csr.FILL_TARGET and abs(buckets.count - 300_000_000 / aim) <= 2
    assert buckets.starts[-1] == 20_000_000 and len(buckets.table) == -(-20_000_000 >> buckets.fine)
    assert csr.Buckets.plan(269_000_000, 8 * 10**9, layout, 2).count <= csr.MAX_BUCKETS


@pytest.mark.parametrize("threads", [1, 2])
def test_one_or_two_threads_give_the_same_csr(tmp_path: Path, threads: int) -> None:
    """The scatter splits a window's rows between threads and a helper thread reads ahead: same bytes."""
    import numba

    n, e = 300, 5000
    edges = np.random.default_rng(3).integers(0, n, (e, 2)).astype(np.int32)
    want = reference(edges, n, True, True)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for window in (10**6, 800):
            got = built(tmp_path / f"w{window}", edges, n, csr.Layout(777, window), undirected=True, self_loops=True)
            assert got == want
    finally:
        numba.set_num_threads(before)


def test_a_damaged_scratch_file_is_refused_in_one_line(tmp_path: Path, monkeypatch) -> None:
    """A scratch file cut short between the read and the fill (someone writing into the staging
    directory) is refused naming it, not read as a shorter bucket."""
    close = csr._Scratch.close

    def cut(self: csr._Scratch) -> None:
        close(self)
        if not self.keep:
            victim = sorted(self.root.iterdir())[0]
            victim.write_bytes(victim.read_bytes()[:-8])

    monkeypatch.setattr(csr._Scratch, "close", cut)
    (tmp_path / "ds").mkdir()
    with pytest.raises(DatasetError, match=r"\.csr-buckets/.*ended early: was it changed"):
        csr.build(tmp_path / "ds", Pairs(EDGES), 6, memory=0, layout=csr.Layout(4, 3))


def test_after_read_is_called_once_the_edges_are_read_and_before_the_fill(tmp_path: Path) -> None:
    """The import starts reading the features then: the disk is no longer the edges' alone."""
    seen: list[tuple[int, bool]] = []
    src = Pairs(EDGES)
    (tmp_path / "ds").mkdir()
    csr.build(
        tmp_path / "ds",
        src,
        6,
        memory=0,
        layout=csr.Layout(2, 3),
        after_read=lambda: seen.append((src.reads, (tmp_path / "ds" / "indices.npy").exists())),
    )
    assert seen == [(1, False)]
