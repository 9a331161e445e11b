"""metrics.json has one typed model (moment.contracts.metrics.MetricsDoc): the trainer writes it
through the model, every reader reads it through the model, the keys stay the ones users read,
and a damaged file is one line naming the file and the field."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from moment.contracts.metrics import MetricsDoc, MetricsError
from prediction_fixture import prediction
from trainer.config import TrainConfig
from trainer.metrics import Metrics, epoch_record
from trainer.readers import FileReader

PREDICTION = prediction({"gpu-cache": 0.2, "nvme0": 0.7})
STATS = {
    "asked": 1000,
    "seconds": 0.25,
    "tiers": {
        "gpu": {"rows": 200, "bytes": 25_600, "seconds": 0.01},
        "cpu": {"rows": 100, "bytes": 12_800, "seconds": 0.02},
        "ssd": {"rows": 700, "bytes": 89_600, "seconds": 0.2},
    },
    # 700 rows of 128 B, each alone in its 4 KiB page: 32× the feature bytes read from the SSD
    "ssd_bins": {"nvme0": {"rows": 700, "bytes": 89_600, "read_bytes": 700 * 4096, "seconds": 0.2}},
    "bin_rows": {"gpu-cache": 200, "cpu-cache": 100, "nvme0": 700},
}
KEYS = [
    "format",
    "complete",
    "config",
    "world_size",
    "ranks",
    "sampling",
    "epochs",
    "measured_iteration_s",
    "predicted_iteration_s",
    "measured_feature_read_s",
    "on_plan_gpus",
    "prediction",
    "test_acc",
    "rank_param_digests",
    "memory",
    "nodes",
]


def _run(path: Path, epochs: int = 2, test_acc: float = 0.75) -> Metrics:
    cfg = TrainConfig(data="d", fanouts=(10, 5), batch_size=512, device="cpu", metrics_json=str(path))
    m = Metrics(cfg, PREDICTION, [], enabled=True, console=Console(file=io.StringIO()))
    m.sampling = {"where": "cpu", "threads": 2}
    m.print_config(["cpu, pinned to nothing"])
    with FileReader(threads=1) as reader:
        m.note_ssd_route("host", reader)
    for e in range(epochs):
        m.add_epoch(
            epoch_record(
                e + 1,
                train_s=1.5,
                iterations=3,
                seeds=1536,
                loss=2.0 - e,
                val_acc=None if e == 0 else 0.5,
                data_wait_s=0.1,
                stats=[STATS],
            )
        )
    m.finish(test_acc=test_acc, rank_param_digests=["ab" * 32])
    return m


def test_the_written_file_round_trips_with_the_keys_users_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    _run(path)
    raw = json.loads(path.read_text())
    assert list(raw) == KEYS
    assert list(raw["epochs"][0]) == [
        "epoch",
        "epoch_s",
        "iterations",
        "iteration_s",
        "seeds",
        "seeds_per_s",
        "loss",
        "val_acc",
        "data_wait_s",
        "feature_read_s",
        "feature_read_s_per_iteration",
        "feature_cpu_s_per_iteration",
        "rows_per_tier",
        "bytes_per_tier",
        "bytes_per_ssd",
        "read_bytes_per_ssd",
        "ssd_read_amplification",
        "placed_read_bytes",
        "disk_read_amplification",
        "chunks",
        "gbps_per_tier",
        "gbps_per_ssd",
        "hit_rate",
        "read_share_per_tier",
        "read_share_per_bin",
        "nodes",
        "straggler",
    ]
    doc = MetricsDoc.read(path)
    assert doc.model_dump(mode="json") == raw and doc.to_json() == path.read_text()
    assert doc.complete and doc.test_acc == 0.75 and doc.epochs[1].val_acc == 0.5 and doc.sampling.where == "cpu"
    assert doc.prediction.ssd_route is not None and doc.prediction.ssd_route.run == "host"
    assert doc.epochs[0].read_bytes_per_ssd == {"nvme0": 2_867_200} and doc.epochs[0].ssd_read_amplification == 32.0


def test_the_placed_directory_s_reads_are_summed_over_ranks_beside_the_ssd_pages() -> None:
    """Each rank's pages of the placed directory's files (stored samples, chunk row maps) are
    summed per file; every byte read per feature byte adds them to the SSD pages."""
    ranks = [
        {**STATS, "placed_read_bytes": {"samples_nodes": 8192}},
        {**STATS, "placed_read_bytes": {"samples_nodes": 4096, "chunkrows_nvme0": 4096}},
    ]
    r = epoch_record(1, train_s=1.0, iterations=3, seeds=1536, loss=1.0, val_acc=None, data_wait_s=0.0, stats=ranks)
    assert r["placed_read_bytes"] == {"samples_nodes": 12_288, "chunkrows_nvme0": 4096}
    assert r["ssd_read_amplification"] == 32.0
    assert r["disk_read_amplification"] == (2 * 700 * 4096 + 16_384) / (2 * 89_600)


def test_a_file_from_before_the_placed_directory_s_reads_were_counted_loads(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    _run(path)
    doc = json.loads(path.read_text())
    for e in doc["epochs"]:
        del e["placed_read_bytes"], e["disk_read_amplification"]
    del doc["prediction"]["disk_amplification"]
    path.write_text(json.dumps(doc))
    old = MetricsDoc.read(path)
    assert old.epochs[0].placed_read_bytes == {} and old.epochs[0].disk_read_amplification is None
    assert old.prediction.disk_amplification is None and old.epochs[0].ssd_read_amplification == 32.0


def test_an_accuracy_of_nan_is_written_and_read_back(tmp_path: Path) -> None:
    """An empty test split gives NaN: JSON's NaN on disk, NaN when read, not null or an error."""
    path = tmp_path / "metrics.json"
    _run(path, epochs=1, test_acc=float("nan"))
    assert '"test_acc": NaN' in path.read_text()
    assert math.isnan(MetricsDoc.read(path).test_acc)


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda d: d["epochs"][1].update(loss="low"), "epochs.1.loss"),
        (lambda d: d["epochs"][0].pop("epoch_s"), "epochs.0.epoch_s"),
        (lambda d: d["prediction"].update(source="guess"), "prediction.source"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(test_acc=None), "complete is true but test_acc"),
        (lambda d: d.update(format="moment.metrics/1"), "format"),
    ],
)
def test_a_damaged_metrics_file_is_one_line_naming_file_and_field(tmp_path: Path, damage, field: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "metrics.json"
    _run(path)
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(MetricsError) as caught:
        MetricsDoc.read(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: {field}"), message


def test_a_missing_metrics_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(MetricsError, match=r"nope\.json: missing \(a training metrics file\)$"):
        MetricsDoc.read(tmp_path / "nope.json")
