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
        self.reads += 1
        for a in range(0, self.size, chunk):
            yield self.edges[a : a + chunk, 0], self.edges[a : a + chunk, 1]


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


def test_a_random_graph_matches_an_in_memory_csr_and_reads_once_or_twice(tmp_path: Path) -> None:
    n, e = 500, 20_000
    edges = np.random.default_rng(7).integers(0, n, (e, 2))
    order = np.argsort(edges[:, 1], kind="stable")
    want = ([0, *np.cumsum(np.bincount(edges[:, 1], minlength=n)).tolist()], edges[order, 0].tolist())
    for window, reads in ((10**9, 1), (3000, 2)):  # all in RAM: the count keeps the edges; else count + spread
        src = Pairs(edges)
        (tmp_path / str(window)).mkdir()
        csr.build(tmp_path / str(window), src, n, memory=0, layout=csr.Layout(1234, window))
        assert (
            np.load(tmp_path / str(window) / "indptr.npy").tolist(),
            np.load(tmp_path / str(window) / "indices.npy").tolist(),
        ) == want
        assert src.reads == reads and not (tmp_path / str(window) / ".csr-windows").exists()


def test_windows_cover_the_vertices_within_the_cap() -> None:
    ends = np.cumsum([3, 0, 4, 1, 9, 0, 2])
    cuts = csr.windows(ends, 5)
    assert cuts == [(0, 2), (2, 4), (4, 5), (5, 7)]  # vertex 4 alone holds more than the cap


def test_the_budget_is_split_and_a_too_small_one_is_refused() -> None:
    layout = csr.Layout.plan(1000, 1 << 30)
    assert layout.chunk * csr.CHUNK_BYTES + layout.window * csr.entry_bytes(1000) + 8 * 1001 <= 1 << 30
    assert layout.chunk == csr.MAX_CHUNK or layout.chunk * csr.CHUNK_BYTES * 4 >= (1 << 30) - 8 * 1001 - 4 * 96
    with pytest.raises(DatasetError, match=r"--memory 0.1 GB is too small for 100,000,000 vertices"):
        csr.Layout.plan(100_000_000, 10**8)


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


def test_edges_that_change_between_reads_are_refused(tmp_path: Path) -> None:
    class Growing(Pairs):
        def chunks(self, chunk: int) -> csr.Edges:
            yield from super().chunks(chunk)
            if self.reads > 1:  # the fill's read sees one more edge than the count's
                yield np.array([0]), np.array([1])

    (tmp_path / "ds").mkdir()
    with pytest.raises(DatasetError, match=r"the edges changed between two reads"):
        csr.build(tmp_path / "ds", Growing(EDGES), 6, memory=0, layout=csr.Layout(4, 3))  # windows: two reads
