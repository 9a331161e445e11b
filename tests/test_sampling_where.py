"""Sampling on the GPU when the CSR fits there, on the CPU with several threads otherwise; the
metrics say which ran (GPU review #16)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moment.contracts.metrics import MetricsDoc
from placement.sampler import NeighborSampler
from trainer import loop
from trainer.dist import DistEnv


def test_cpu_sampling_takes_this_ranks_share_of_its_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun leaves one thread per rank; the rank takes its CPUs divided by the ranks on them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        sampler = NeighborSampler(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), [2])
        got = loop.sampling_setup(sampler, None, DistEnv(1, 4, 1, True))
        assert got == {"where": "cpu", "threads": 4} and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)


class _CudaLooking(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_a_csr_on_the_gpu_is_reported_as_gpu_sampling() -> None:
    sampler = SimpleNamespace(indptr=torch.zeros(3).as_subclass(_CudaLooking))
    assert loop.sampling_setup(sampler, None, DistEnv(0, 1, 0, False)) == {"where": "gpu", "threads": None}


def test_the_metrics_say_where_sampling_ran(plan_file: Path, tmp_path: Path) -> None:
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    synthesize(
        tmp_path / "ds",
        nodes=1500,
        avg_degree=5,
        dim=8,
        dtype="float32",
        seed=1,
        classes=3,
        train_fraction=0.2,
        val_fraction=0.1,
        test_fraction=0.1,
    )
    place(plan_file, tmp_path / "ds", tmp_path / "placed", PlaceOptions(gpu_cache="5%", cpu_cache="5%"))
    metrics = tmp_path / "m.json"
    assert (
        loop.main(
            [
                "--data",
                str(tmp_path / "placed"),
                "--device",
                "cpu",
                "--fanouts",
                "3,3",
                "--batch-size",
                "64",
                "--hidden",
                "8",
                "--epochs",
                "1",
                "--max-batches-per-epoch",
                "2",
                "--metrics-json",
                str(metrics),
            ]
        )
        == 0
    )
    sampling = MetricsDoc.read(metrics).model_dump(mode="json")["sampling"]
    assert sampling["where"] == "cpu" and sampling["threads"] >= 1
