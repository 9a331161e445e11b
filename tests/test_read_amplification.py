"""Read amplification measured: on the demo's data (100k vertices, 64 float16 = 128 B rows), a
run reads whole 4 KiB pages from the SSD bins, and metrics.json says how many, beside the
feature bytes and the prediction (moment/ssd_reads.py)."""

from __future__ import annotations

import pytest

from moment.contracts.metrics import MetricsDoc
from moment.contracts.placed import PlacedManifest
from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile
from placement.place import PlaceOptions, place
from placement.synth import synthesize
from trainer.loop import main as train_main

ROW = 128  # the demo's rows: 64 float16


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[MetricsDoc, PlacedManifest]:
    """One epoch of small batches (16 seeds, fan-out 2): each batch reads a few dozen rows, so
    two of them rarely share a page."""
    root = tmp_path_factory.mktemp("amplification")
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload, fanouts=[2], batch_size=16)
    save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), root / "plan.json")
    synthesize(root / "ds", nodes=100_000, avg_degree=10, dim=64, dtype="float16", seed=0, train_fraction=0.01)
    place(root / "plan.json", root / "ds", root / "placed", PlaceOptions(gpu_cache="3%", cpu_cache="5%", epochs=1))
    metrics = root / "metrics.json"
    args = ["--data", str(root / "placed"), "--plan", str(root / "plan.json"), "--device", "cpu", "--epochs", "1"]
    assert train_main([*args, "--hidden", "8", "--eval-every", "2", "--metrics-json", str(metrics)]) == 0
    return MetricsDoc.read(metrics), PlacedManifest.read(root / "placed" / "placed.json")


def test_each_row_read_moves_a_page(run: tuple[MetricsDoc, PlacedManifest]) -> None:
    """By hand: a 4 KiB page holds 32 rows of 128 B; a batch reading each SSD row with
    probability f moves a page with probability 1 - (1 - f)^32, so it reads (1 - (1 - f)^32) / f
    bytes per feature byte: 32 for lone rows, a little less as f grows. f is the run's own: SSD
    rows read per batch over the rows the SSD bins hold."""
    doc, placed = run
    epoch = doc.epochs[0]
    useful, read = sum(epoch.bytes_per_ssd.values()), sum(epoch.read_bytes_per_ssd.values())
    assert useful > 0 and set(epoch.read_bytes_per_ssd) == set(epoch.bytes_per_ssd)
    assert all(n % 4096 == 0 for n in epoch.read_bytes_per_ssd.values())
    f = useful / ROW / epoch.iterations / sum(b.count for b in placed.bins if b.tier == "ssd")
    by_hand = (1 - (1 - f) ** 32) / f
    assert 31 < by_hand < 32
    assert epoch.ssd_read_amplification == pytest.approx(read / useful)
    assert epoch.ssd_read_amplification == pytest.approx(by_hand, rel=0.02)
    for name, n in epoch.read_bytes_per_ssd.items():  # no bin reads more than a page per row
        assert epoch.bytes_per_ssd[name] <= n <= epoch.bytes_per_ssd[name] // ROW * 4096


def test_the_prediction_says_the_same(run: tuple[MetricsDoc, PlacedManifest]) -> None:
    doc, placed = run
    assert placed.prediction.ssd_amplification == doc.prediction.ssd_amplification
    assert doc.prediction.ssd_amplification == pytest.approx(doc.epochs[0].ssd_read_amplification, rel=0.02)
