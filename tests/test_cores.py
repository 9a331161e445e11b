"""CPU-bound passes take their thread counts from the cores this process may run on (its
affinity, which containers and ``taskset`` narrow), each capped by its own limit: pre-sampling's
batches drawn at once, the row map's ranges, the bin pass's hashing and grouping threads."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from moment.cores import usable_cores
from placement import relabel as rl
from placement import writer
from placement.count_sampler import THREADS, CountSampler


@pytest.mark.parametrize("cores", [1, 3, 64])
def test_threads_follow_the_usable_cores_and_their_caps(
    cores: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert usable_cores() == cores and usable_cores(2) == min(cores, 2) and usable_cores(0) == 1
    indptr, indices = np.array([0, 1, 2], dtype=np.int64), np.array([1, 0], dtype=np.int32)
    assert CountSampler(indptr, indices, (2,), 1).threads == min(cores, THREADS)
    assert CountSampler(indptr, indices, (2,), 1, threads=2).threads == 2  # asked for: taken as is
    assert writer.hash_threads(8) == min(cores, 8) and writer.hash_threads(1) == 1
    assert writer.group_threads() == min(cores, writer.GROUP_THREADS) == min(cores, 4)  # the measured knee

    pools: list[int] = []

    class Recorded(ThreadPoolExecutor):
        def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
            pools.append(max_workers)
            super().__init__(max_workers, thread_name_prefix)

    monkeypatch.setattr(rl, "ThreadPoolExecutor", Recorded)
    n = 1 << 20  # enough vertices for a range per thread
    r = rl.relabel(np.zeros(n, dtype=np.int16), ["ssd"])
    assert pools == [min(cores, rl.GATHER_THREADS)]  # the row map's ranges
    assert np.array_equal(r.old_to_new, np.arange(n))  # one bin: every vertex's row is its id
