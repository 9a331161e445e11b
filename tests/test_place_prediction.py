"""`moment place` re-solves the plan's model for the dataset it places: the measured workload,
the cache sizes it fills, DDAK balanced to those shares, the prediction recorded and reproducible."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from moment.contracts.placed import MANIFEST, PlacedError, PlacedManifest
from moment.contracts.plan import read_plan
from moment.errors import MomentError
from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import Workload, load_workload
from moment.topology.profile_io import resolve_profile
from placement.dataset import open_dataset
from placement.hotness import Hotness
from placement.place import PlaceOptions, place
from placement.placed import open_placed
from placement.predict import measured_workload
from placement.synth import synthesize

TIERS = ("gpu", "cpu", "ssd")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    synthesize(out, nodes=20_000, avg_degree=10, dim=16, dtype="float16", seed=0, train_fraction=0.2)
    return out


@pytest.fixture(scope="module")
def placed(plan_file: Path, dataset: Path, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("placed") / "placed"
    return place(plan_file, dataset, out, PlaceOptions(gpu_cache="2%", cpu_cache="3%", epochs=2)), out


def _moment(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moment", *argv], capture_output=True, text=True, timeout=120)


def _tiers(bins: list[dict], key: str) -> dict[str, float]:
    return {t: sum(b[key] for b in bins if b["tier"] == t) for t in TIERS}


def test_caches_placed_are_the_workloads(placed) -> None:
    manifest, out = placed
    workload = load_workload(None, str(out / "workload.yaml"))
    rows = {b.tier: b.count for b in open_placed(out).bins if b.tier != "ssd"}
    assert rows == {"gpu": 400, "cpu": 600}  # 2% and 3% of 20,000
    # workload.yaml holds the caches in rows, the unit placement and the trainer use: no GB to round
    assert (workload.gpu_cache_rows, workload.cpu_cache_rows) == (rows["gpu"], rows["cpu"]) == workload.cache_rows()
    assert workload.gpu_cache_gb is None and workload.cpu_cache_fraction is None
    brief = manifest["prediction"]["workload"]
    assert (brief["gpu_cache_rows"], brief["cpu_cache_rows"]) == (None, None)  # the bins' capacity says it, once
    assert {b["tier"]: b["capacity"] for b in manifest["bins"] if b["tier"] != "ssd"} == rows
    assert workload.nodes == 20_000 and workload.feature_dim == 16 and workload.feature_dtype == "float16"
    assert workload.unique_per_batch == pytest.approx(manifest["hotness"]["mean_unique_per_batch"])
    assert brief["fanouts"] == workload.fanouts == manifest["hotness"]["fanouts"]
    assert brief["hotness"] == workload.hotness.source and workload.hotness.source.startswith("measured")
    assert all(0 < x < 1 for x, _ in workload.hotness.curve)


def test_prediction_is_the_measured_curve_at_the_caches(placed) -> None:
    manifest, out = placed
    pred = manifest["prediction"]
    workload = load_workload(None, str(out / "workload.yaml"))
    n, curve = workload.nodes, workload.hotness
    f_gpu, f_cpu = (rows / n for rows in workload.cache_rows())
    expect = {"gpu": curve.share(f_gpu), "cpu": curve.share(f_gpu + f_cpu) - curve.share(f_gpu)}
    expect["ssd"] = 1 - expect["gpu"] - expect["cpu"]
    assert pred["source"] == "dataset" and pred["profile"] == "moment-machine-b"
    assert pred["tier_shares"] == pytest.approx(expect, abs=1e-9)
    # The curve has points at the cache boundaries: the caches serve exactly what was predicted.
    assert _tiers(manifest["bins"], "achieved") == pytest.approx(pred["tier_shares"], abs=1e-9)
    assert _tiers(manifest["bins"], "target") == pytest.approx(pred["tier_shares"], abs=1e-6)


def test_ddak_balances_to_the_new_targets(plan_file: Path, placed) -> None:
    manifest, _ = placed
    shares = manifest["prediction"]["bin_shares"]
    assert {b["name"]: b["target"] for b in manifest["bins"]} == shares
    for b in manifest["bins"]:
        assert abs(b["achieved"] - shares[b["name"]]) < 0.03, b
    # Not the plan's targets: those were for 269M vertices and a guessed hotness, no GPU cache.
    old = {t.bin: t.share for t in read_plan(plan_file).bin_targets}
    assert old["gpu-cache"] == 0 < shares["gpu-cache"]
    assert abs(old["cpu-cache"] - shares["cpu-cache"]) > 0.1


def test_replan_with_the_workload_reproduces_the_prediction(plan_file: Path, placed) -> None:
    manifest, out = placed
    pred = manifest["prediction"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moment",
            "score",
            "--profile",
            "moment-machine-b",
            "--layout",
            str(plan_file),
            "--workload",
            str(out / "workload.yaml"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)
    assert again["tier_shares"] == pytest.approx(pred["tier_shares"], abs=1e-6)
    assert {t["bin"]: t["share"] for t in again["bin_targets"]} == pytest.approx(pred["bin_shares"], abs=1e-6)
    assert again["predicted_iteration_s"] == pytest.approx(pred["iteration_s"], rel=1e-9)


def test_manifest_is_read_strictly(placed) -> None:
    _, out = placed
    doc = json.loads((out / MANIFEST).read_text())
    assert PlacedManifest.parse(doc, "placed.json").prediction.source == "dataset"
    for bad, match in [
        ({**doc, "format": "moment.placed/2"}, "format"),
        ({k: v for k, v in doc.items() if k != "prediction"}, "prediction"),
        ({**doc, "prediction": {**doc["prediction"], "bin_shares": {"nvme0": 1.0}}}, "bin_shares"),
        ({**doc, "prediction": {**doc["prediction"], "source": "guess"}}, "source"),
    ]:
        with pytest.raises(PlacedError, match=match):
            PlacedManifest.parse(bad, "placed.json")


def test_the_measured_workload_carries_the_rows_placed() -> None:
    """Rows placed go into the workload as rows and come back as the same rows, through YAML too
    (in GB they need not: rows × bytes / 1e9 × 1e9 // bytes may be one row short)."""
    base = Workload()
    gb_misses = 0
    for n, dim in [(100, 7), (10_007, 3), (999_983, 129), (1_000, 1)]:
        ds = SimpleNamespace(
            num_nodes=n, num_edges=0, feature_dim=dim, row_bytes=dim * 2, meta={"feature_dtype": "float16"}
        )
        hot = Hotness(
            counts=np.ones(n, dtype=np.int64),
            batches=10,
            mean_unique_per_batch=50.0,
            epochs=1,
            fanouts=(5, 5),
            batch_size=8,
        )
        for gpu in range(0, min(n, 60)):
            cpu = (gpu * 7) % (n - gpu + 1)
            in_gb = Workload(nodes=n, feature_dim=dim, feature_dtype="float16", gpu_cache_gb=gpu * dim * 2 / 1e9)
            gb_misses += in_gb.cache_rows()[0] != gpu
            w = measured_workload(base, ds, hot, gpu, cpu)
            assert (w.gpu_cache_rows, w.cpu_cache_rows) == w.cache_rows() == (gpu, cpu), (n, dim, gpu, cpu)
            assert w.gpu_cache_gb is None and w.cpu_cache_fraction is None
            again = Workload.model_validate(yaml.safe_load(yaml.safe_dump(w.model_dump(mode="json"))))
            assert again.cache_rows() == (gpu, cpu)
    assert gb_misses > 0  # why rows: GB would not give them back


def _as_earlier_versions_wrote(workload: dict) -> dict:
    """A workload.yaml of `moment place` before the caches were rows: GB per GPU and a share of
    the vertices, nudged up one float at a time until the planner's rounding gave the rows back."""
    old = dict(workload)
    gpu, cpu = old.pop("gpu_cache_rows"), old.pop("cpu_cache_rows")
    w = Workload.model_validate(old)
    gb, share = gpu * w.row_bytes / 1e9, cpu / w.nodes
    while int(gb * 1e9 // w.row_bytes) < gpu:
        gb = math.nextafter(gb, math.inf)
    while int(w.nodes * share) < cpu:
        share = math.nextafter(share, math.inf)
    return {**old, "gpu_cache_gb": gb, "cpu_cache_fraction": share}


def test_a_workload_of_an_earlier_version_still_reads(plan_file: Path, placed, tmp_path: Path) -> None:
    """An earlier `moment place`'s workload.yaml (caches in GB and a share) gives the same rows,
    and `moment score` the same prediction, as this version's (caches in rows)."""
    _, out = placed
    now = yaml.safe_load((out / "workload.yaml").read_text())
    old = tmp_path / "workload.yaml"
    old.write_text(yaml.safe_dump(_as_earlier_versions_wrote(now)))
    assert load_workload(None, str(old)).cache_rows() == load_workload(None, str(out / "workload.yaml")).cache_rows()
    argv = ["score", "--profile", "moment-machine-b", "--layout", str(plan_file), "--json", "--workload"]
    scored = [_moment(*argv, str(path)) for path in (out / "workload.yaml", old)]
    assert all(done.returncode == 0 for done in scored), [done.stderr for done in scored]
    new, earlier = (json.loads(done.stdout) for done in scored)
    assert earlier["tier_shares"] == new["tier_shares"] and earlier["bin_targets"] == new["bin_targets"]


def test_a_cache_in_two_units_is_refused(tmp_path: Path) -> None:
    both = tmp_path / "w.yaml"
    both.write_text("nodes: 1000\ngpu_cache_rows: 10\ngpu_cache_gb: 0.5\n")
    with pytest.raises(MomentError, match=r"w.yaml: gpu_cache_rows and gpu_cache_gb give one cache twice"):
        load_workload(None, str(both))
    # a layer giving a cache in one unit replaces it in the other: a measured workload over a profile's
    one = tmp_path / "one.yaml"
    one.write_text("nodes: 1000\ncpu_cache_rows: 30\n")
    w = load_workload({"cpu_cache_fraction": 0.5, "gpu_cache_gb": 0.001}, str(one))
    assert (w.gpu_cache_gb, w.cpu_cache_fraction, w.cpu_cache_rows) == (0.001, None, 30) and w.cache_rows()[1] == 30


def test_place_defaults_to_the_caches_the_plan_recorded(small_dataset: Path, tmp_path: Path) -> None:
    """Without --gpu-cache/--cpu-cache, place fills the caches the plan's workload recorded: its
    rows where it has them (a plan made with a measured workload.yaml); its GB and share in this
    dataset's rows where it has those (a plan of an earlier version: both keys, no rows)."""
    machine = resolve_profile("moment-machine-b")
    assert open_dataset(small_dataset).row_bytes == 64 and open_dataset(small_dataset).num_nodes == 6_000
    for given, caches in (
        ({"gpu_cache_rows": 123, "cpu_cache_rows": 45}, (123, 45)),
        ({"gpu_cache_gb": 64.0001e-6, "cpu_cache_fraction": 0.025}, (1000, 150)),  # 64 kB of 64 B rows; 2.5%
    ):
        workload = load_workload(machine.workload, **given)
        plan_path = tmp_path / "plan.json"
        save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), plan_path)
        if "gpu_cache_gb" in given:  # as earlier versions wrote plan.json: no rows keys
            doc = json.loads(plan_path.read_text())
            for key in ("gpu_cache_rows", "cpu_cache_rows"):
                del doc["workload"][key]
            plan_path.write_text(json.dumps(doc))
        out = tmp_path / f"placed-{caches[0]}"
        m = place(plan_path, small_dataset, out, PlaceOptions(epochs=1))
        assert {b["tier"]: b["capacity"] for b in m["bins"] if b["tier"] != "ssd"} == dict(zip(("gpu", "cpu"), caches))
        assert load_workload(None, str(out / "workload.yaml")).cache_rows() == caches


def test_unknown_profile_falls_back_to_the_plans_prediction(dataset: Path, tmp_path: Path) -> None:
    machine = resolve_profile("moment-machine-b").model_copy(update={"name": "my-box"})
    workload = load_workload(machine.workload)
    plan_path = tmp_path / "plan.json"
    doc = save_plan(machine, workload, plan(machine, workload, 4, 8, top=1), plan_path)
    said: list[str] = []
    m = place(plan_path, dataset, tmp_path / "a", PlaceOptions(gpu_cache="1%", cpu_cache="1%"), log=said.append)
    warnings = [s for s in said if s.startswith("warning:") and "my-box" in s]
    assert len(warnings) == 1 and "plan's" in warnings[0] and "\n" not in warnings[0]
    pred = m["prediction"]
    assert pred["source"] == "plan" and pred["iteration_s"] == doc.predicted.predicted_iteration_s
    # the plan's prediction is for the plan's caches, which the brief records (the bins hold the placement's)
    assert (pred["workload"]["gpu_cache_rows"], pred["workload"]["cpu_cache_rows"]) == workload.cache_rows()
    assert [b["capacity"] for b in m["bins"] if b["tier"] != "ssd"] == [200, 200]
    assert pred["tier_shares"] == doc.tier_shares.model_dump()
    assert {b["name"]: b["target"] for b in m["bins"]} == {t.bin: t.share for t in doc.bin_targets}
    # Given the profile (as `--profile FILE` does), the plan is re-solved for the dataset.
    m = place(plan_path, dataset, tmp_path / "b", PlaceOptions(gpu_cache="1%", cpu_cache="1%", profile=machine))
    assert m["prediction"]["source"] == "dataset" and m["prediction"]["profile"] == "my-box"
    assert m["prediction"]["workload"]["gpu_cache_rows"] is None  # the placement's caches: the bins'
    assert [b["capacity"] for b in m["bins"] if b["tier"] != "ssd"] == [200, 200]
