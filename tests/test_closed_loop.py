"""The closed loop: a run trained with the placement's own settings reads each tier and each
SSD bin in the shares ``moment place`` predicted (placed.json ``prediction``), within 0.03."""

from __future__ import annotations

import os

import pytest

from moment.contracts.metrics import MetricsDoc
from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile
from placement.place import PlaceOptions, place
from placement.synth import synthesize
from trainer.loop import main as train_main
from trainer.metrics import read_share_rows


@pytest.fixture(
    scope="module",
    params=[
        ("cpu", 2, None),
        ("cpu", None, None),
        ("cpu", 2, "3x"),
        pytest.param(("cuda", 2, None), marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cpu-adaptive", "cpu-packed", "cuda"],
)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two epochs on the CPU, and on a GPU where there is one (``gpu``): the same shares either way;
    on the CPU also with pre-sampling's default (until the estimate converges, at most an epoch),
    which the training epochs then do not simply replay; and packed within a budget (both epochs
    replayed: each batch loads its stored sample and reads its chunks)."""
    device, presample_epochs, budget = request.param
    affinity = os.sched_getaffinity(0)
    request.addfinalizer(lambda: os.sched_setaffinity(0, affinity))  # a CUDA rank pins this process to its socket
    root = tmp_path_factory.mktemp("loop")
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload, fanouts=[10, 5], batch_size=256)
    save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), root / "plan.json")
    synthesize(root / "ds", nodes=20_000, avg_degree=8, dim=16, dtype="float32", seed=3, train_fraction=0.2)
    place(
        root / "plan.json",
        root / "ds",
        root / "placed",
        PlaceOptions(
            gpu_cache="3%",
            cpu_cache="5%",
            epochs=presample_epochs,
            pack=budget is not None,
            pack_budget=budget,
            pack_epochs=2,
            pack_ranks=1,  # the one rank trained (default: one per planned GPU)
        ),
    )
    metrics = root / "metrics.json"
    # No --fanouts/--batch-size: the trainer takes the placement's (its pre-sampling's) settings.
    assert (
        train_main(
            [
                "--data",
                str(root / "placed"),
                "--plan",
                str(root / "plan.json"),
                "--device",
                device,
                "--epochs",
                "2",
                "--hidden",
                "16",
                "--eval-every",
                "2",
                "--metrics-json",
                str(metrics),
            ]
        )
        == 0
    )
    return MetricsDoc.read(metrics).model_dump(mode="json")


def test_training_takes_the_placements_sampling_settings(run: dict) -> None:
    assert run["config"]["fanouts"] == [10, 5] and run["config"]["batch_size"] == 256
    assert "(this run" not in run["prediction"]["note"]  # nothing differs (but the device, on the CPU)


def test_measured_read_shares_match_the_prediction(run: dict) -> None:
    rows = read_share_rows(run["prediction"], run["epochs"])
    names = [name for name, _, _ in rows]
    assert names[:3] == ["gpu", "cpu", "ssd"] and "gpu-cache" in names and sum(n.startswith("nvme") for n in names) == 8
    assert run["prediction"]["tier_shares"]["gpu"] > 0.05 and run["prediction"]["tier_shares"]["ssd"] > 0.3
    for name, predicted, measured in rows:
        assert measured == pytest.approx(predicted, abs=0.03), (name, predicted, measured)
    for e in run["epochs"]:
        assert sum(e["read_share_per_tier"].values()) == pytest.approx(1.0)
        assert sum(e["read_share_per_bin"].values()) == pytest.approx(1.0)


def test_measured_read_amplification_matches_the_prediction(run: dict) -> None:
    """The shares above are of feature rows; what the SSDs move for them is compared apart: the
    pages read per feature byte (64 B rows, 64 to a page, a batch reading ~14 % of the SSD rows
    so that many share a page) against the prediction's, which takes each row as read
    independently with the batch's density (moment/ssd_reads.py)."""
    predicted = run["prediction"]["ssd_amplification"]
    assert 1 <= predicted < 64
    for e in run["epochs"]:
        assert e["ssd_read_amplification"] == pytest.approx(predicted, rel=0.05)


def test_every_byte_read_from_disk_matches_the_prediction(run: dict) -> None:
    """With the pages of the placed directory's files the batches read (a packed placement's
    stored samples and chunk row maps) too: the two epochs replayed read, in all, exactly what
    the replay counted (each epoch its own batches: their ratios differ a little)."""
    predicted = run["prediction"]["disk_amplification"]
    if predicted is None:  # not packed: nothing read but the SSD bins
        assert all(not e["placed_read_bytes"] for e in run["epochs"])
        assert all(e["disk_read_amplification"] == e["ssd_read_amplification"] for e in run["epochs"])
        return
    assert predicted > run["prediction"]["ssd_amplification"]
    useful = sum(sum(e["bytes_per_ssd"].values()) for e in run["epochs"])
    ssd = sum(sum(e["read_bytes_per_ssd"].values()) for e in run["epochs"])
    placed = sum(sum(e["placed_read_bytes"].values()) for e in run["epochs"])
    assert placed > 0 and ssd / useful == pytest.approx(run["prediction"]["ssd_amplification"], rel=1e-12)
    assert (ssd + placed) / useful == pytest.approx(predicted, rel=1e-12)
