"""Fixtures shared by the placement and trainer tests; how gpu tests are skipped; runs name their device."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile


@pytest.fixture(scope="session")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """plan.json of the paper's Machine B (4 GPUs, 8 SSDs), as `moment plan --out` writes it."""
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload)
    outcome = plan(machine, workload, 4, 8, top=1)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    save_plan(machine, workload, outcome, path)
    return path


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic dataset (6,000 vertices, 16 float32 features, a 20% train split): what a
    test runs a stage on when the graph's size does not matter. Read only: copy it to change it."""
    from placement.synth import synthesize

    out = tmp_path_factory.mktemp("small") / "ds"
    synthesize(out, nodes=6_000, avg_degree=8, dim=16, dtype="float32", seed=1, train_fraction=0.2)
    return out


@pytest.fixture(scope="session")
def small_placed(plan_file: Path, small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`small_dataset` placed per :func:`plan_file` (GPU cache 3%, CPU cache 4%, DDAK): what
    a trainer or inference test runs on when the placement's details do not matter. Read only."""
    from placement.place import PlaceOptions, place

    out = tmp_path_factory.mktemp("small-placed") / "placed"
    place(plan_file, small_dataset, out, PlaceOptions(gpu_cache="3%", cpu_cache="4%"))
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need CUDA: skipped, in this one place, where torch sees none (a test adds its
    own skipif only for more than that, e.g. two GPUs)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in gpu:
        item.add_marker(pytest.mark.skip(reason="needs CUDA (gpu marker)"))


# Runs a test can start in this process: (module, function, which positional argument holds the device).
_RUNS = (
    ("trainer.loop", "train", 0),  # train(cfg, env, plan, data)
    ("trainer.infer", "run_in_process", 1),  # run_in_process(prepared, opts, ...)
)


@pytest.fixture(scope="session", autouse=True)
def runs_name_their_device() -> Iterator[None]:
    """Every training or inference run a test starts names its device (``--device cpu``,
    ``device="cpu"``; ``cuda`` in a ``gpu`` test). With ``auto`` the same test would run on the GPU
    of a machine that has one: NCCL instead of gloo, CUDA kernels whose sums are not reproducible
    bit for bit, two ranks refused on one GPU, the process pinned to the plan's socket. This makes
    such a run fail on every machine, CPU-only CI included, instead of only on a GPU server: runs
    in this process (``_RUNS``; only modules the collected tests imported are watched, so a session
    that does not use them imports no torch for this) and processes started for one (torchrun,
    ``python -m moment train|infer``: :class:`_RunPopen`)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, attr, at in _RUNS:
            module = sys.modules.get(name)
            if module is not None:
                mp.setattr(module, attr, _device_named(getattr(module, attr), at))
        mp.setattr(subprocess, "Popen", _RunPopen)
        yield


def _device_named(run: Callable[..., Any], at: int) -> Callable[..., Any]:
    """``run``, refusing a config or options (its positional argument ``at``) whose device is auto."""

    @functools.wraps(run)
    def checked(*args: Any, **kwargs: Any) -> Any:
        assert args[at].device != "auto", (
            f"a test ran {run.__module__}.{run.__name__} with device 'auto': name it (--device cpu / "
            'device="cpu", or cuda in a test marked gpu)'
        )
        return run(*args, **kwargs)

    return checked


class _RunPopen(subprocess.Popen):
    """``subprocess.Popen`` refusing a command that starts training or inference ranks without
    ``--device`` or with ``--device auto``: torchrun (``-m torch.distributed.run`` or ``-m trainer.torchrun``) or ``-m moment
    train|infer`` (``--help`` aside)."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else []
        verb = next((argv[i + 2] for i in range(len(argv) - 2) if argv[i : i + 2] == ["-m", "moment"]), None)
        if (
            ("torch.distributed.run" in argv or "trainer.torchrun" in argv) or verb in ("train", "infer")
        ) and "--help" not in argv:
            device = argv[argv.index("--device") + 1] if "--device" in argv[:-1] else "auto"
            assert device != "auto", (
                f"a test started {' '.join(argv[:6])} ... with device 'auto': pass --device (cpu, or cuda in a "
                "test marked gpu)"
            )
        super().__init__(args, *rest, **kwargs)
