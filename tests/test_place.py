"""`moment place` end to end: every feature where the plan says, nothing lost, crash-safe."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moment.contracts.placed import MANIFEST, PHASES
from moment.errors import MomentError, UsageError
from moment.topology.profile_io import resolve_profile
from placement.dataset import open_dataset
from placement.place import PlaceOptions, place
from placement.placed import PlacedError, open_placed, verify
from placement.synth import synthesize


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    synthesize(out, nodes=30_000, avg_degree=8, dim=16, dtype="float32", seed=1, train_fraction=0.2)
    return out


OPTS = dict(gpu_cache="3%", cpu_cache="4%")


def test_every_feature_reads_back(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "placed"
    manifest = place(plan_file, dataset, out, PlaceOptions(**OPTS))
    ds, placed = open_dataset(dataset), open_placed(out, checksums=True)
    n = ds.num_nodes
    # Every vertex, through the row map, equals its source row.
    new = np.asarray(placed.array("old_to_new"))
    assert np.array_equal(np.sort(new), np.arange(n))
    assert np.array_equal(placed.read_rows(new), np.asarray(ds.features()))
    # Bins: tier order in row space, the dataset's order inside each bin, capacities kept.
    tiers = [b.tier for b in placed.bins]
    assert tiers == sorted(tiers, key=["gpu", "cpu", "ssd"].index)
    old = np.argsort(new)  # the vertex at each row
    for b in placed.bins:
        assert (np.diff(old[b.start : b.start + b.count]) > 0).all()
    caps = {b["name"]: b["capacity"] for b in manifest["bins"]}
    assert all(b.count <= caps[b.name] for b in placed.bins)
    # Topology, labels and splits are the dataset's own files: the same inode (hard links on one
    # file system), nothing rewritten.
    for key in ("indptr", "indices", "labels", "train", "val", "test"):
        src, mine = ds.path(key).stat(), placed.file(key).stat()
        assert (src.st_dev, src.st_ino) == (mine.st_dev, mine.st_ino), key
        assert mine.st_nlink >= 2
    assert "new_to_old" not in manifest["files"] and "hotness" not in manifest["files"]
    # Hotter tiers hold hotter vertices (the counts in dataset ids).
    hot = np.load(out / "hotness.npy")[old]
    gpu_end = sum(b.count for b in placed.bins if b.tier == "gpu")
    ssd_start = sum(b.count for b in placed.bins if b.tier != "ssd")
    assert hot[:gpu_end].min() >= hot[ssd_start:].max()
    assert placed.array("old_to_new").dtype == np.int32  # int32 where the ids fit
    assert verify(out)["rows"] == n


def test_the_placement_outlives_its_dataset(plan_file: Path, tmp_path: Path) -> None:
    """Linked files are names of their own: the dataset replaced (a new import into its
    directory) or removed leaves the placed dataset's bytes as they were, and it verifies."""
    ds_dir = tmp_path / "ds"
    synthesize(ds_dir, nodes=3_000, avg_degree=4, dim=8, dtype="float32", seed=2, train_fraction=0.2)
    out = tmp_path / "placed"
    place(plan_file, ds_dir, out, PlaceOptions(**OPTS))
    before = {k: open_placed(out).file(k).read_bytes() for k in ("indptr", "indices", "labels", "train")}
    synthesize(ds_dir, nodes=3_000, avg_degree=6, dim=8, dtype="float32", seed=3, train_fraction=0.3, replace=True)
    assert open_dataset(ds_dir).path("indices").read_bytes() != before["indices"]  # the dataset did change
    placed = open_placed(out, checksums=True)
    assert {k: placed.file(k).read_bytes() for k in before} == before
    shutil.rmtree(ds_dir)
    assert verify(out, sample=0)["files"] > 0 and open_placed(out).file("indices").read_bytes() == before["indices"]


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.EPERM, errno.EMLINK])
def test_where_links_fail_the_files_are_copied(
    plan_file: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    """Another file system (EXDEV) or links refused (EPERM: fs.protected_hardlinks; EMLINK): the
    files are copied, the same bytes (checked against the check scan's digests), and place says
    so before writing and when copying."""

    def refuse(src: object, dst: object) -> None:
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "link", refuse)
    said: list[str] = []
    out = tmp_path / "placed"
    place(plan_file, dataset, out, PlaceOptions(**OPTS), log=said.append)
    assert any("topology, labels and splits: copies of" in line and "refused a hard link" in line for line in said)
    assert any("splits copied (the file system refuses hard links there)" in line for line in said), said
    ds, placed = open_dataset(dataset), open_placed(out, checksums=True)
    for key in ("indptr", "indices", "labels", "train", "val", "test"):
        assert placed.file(key).stat().st_ino != ds.path(key).stat().st_ino, key
        assert placed.file(key).read_bytes() == ds.path(key).read_bytes(), key
    assert verify(out)["rows"] == ds.num_nodes


def test_an_older_placement_is_refused_in_one_line(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """A moment.placed/3 placement (graph in row ids) is refused by everything that reads it,
    naming placed.json and the fix; `moment place` replaces it."""
    out = tmp_path / "placed"
    place(plan_file, dataset, out, PlaceOptions(**OPTS))
    m = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**m, "format": "moment.placed/3"}))
    with pytest.raises(PlacedError) as err:
        open_placed(out)
    assert str(err.value) == (
        f"{out / MANIFEST}: format 'moment.placed/3': placed by an older moment: run `moment place` again"
    )
    done = subprocess.run(
        [sys.executable, "-m", "moment", "verify", str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0 and "placed by an older moment" in done.stderr
    assert place(plan_file, dataset, out, PlaceOptions(**OPTS))["format"] == "moment.placed/4"
    assert open_placed(out).manifest.format == "moment.placed/4"


def test_timings_name_every_phase(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """placed.json says where the time went, phase by phase, and what the hotness sample was."""
    m = place(plan_file, dataset, tmp_path / "p", PlaceOptions(**OPTS))
    t = m["timings_s"]
    assert list(t) == [k for k in PHASES if k in t] and set(PHASES) - set(t) == {
        "pack"
    }  # only with --pack (tests/test_pack.py)
    assert all(v >= 0 for v in t.values())
    parts = sum(v for k, v in t.items() if k not in ("total", "checksums", "fsync"))
    assert parts <= t["total"] + 0.05  # the phases of the main thread fit inside the run
    hot = m["hotness"]
    # 6,000 training vertices in batches of 8,000: one batch, the whole (default) budget, too few to split
    assert (hot["tolerance"], hot["batches"], hot["bound"]) == (0.005, 1, None)


def test_ddak_matches_ssd_targets_better_than_hash(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    err = {}
    for policy in ("ddak", "hash"):
        m = place(plan_file, dataset, tmp_path / policy, PlaceOptions(policy=policy, epochs=3, **OPTS))
        ssd = [b for b in m["bins"] if b["tier"] == "ssd"]
        target = np.array([b["target"] for b in ssd])
        got = np.array([b["achieved"] for b in ssd])
        err[policy] = np.abs(got / got.sum() - target / target.sum()).sum()
    assert err["ddak"] < 0.02
    assert err["ddak"] < err["hash"]


def test_damaged_placement_is_refused(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "placed"
    m = place(plan_file, dataset, out, PlaceOptions(**OPTS))
    ssd_bin = out / m["bins"][-1]["path"]
    data = bytearray(ssd_bin.read_bytes())
    data[100] ^= 0xFF
    ssd_bin.write_bytes(bytes(data))
    open_placed(out)  # sizes are fine ...
    with pytest.raises(PlacedError, match="checksum mismatch"):
        open_placed(out, checksums=True)  # ... the checksum is not
    ssd_bin.write_bytes(bytes(data[:-8]))
    with pytest.raises(PlacedError, match="truncated"):
        open_placed(out)
    ssd_bin.unlink()
    with pytest.raises(PlacedError, match="missing"):
        open_placed(out)


def test_killed_run_is_refused_then_resumed(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """Kill -9 in the middle of writing the bins: the output is refused, a re-run completes it."""
    out = tmp_path / "placed"
    script = f"""
import os, signal, pathlib, placement.writer as w
w.CHECKPOINT_BYTES = 64 << 10
w.CHUNK_BYTES = 32 << 10
state = pathlib.Path({str(out.with_name("placed.partial"))!r}) / "data" / w.STATE
def progress(stage, done, total):  # kill -9 once a checkpoint is on disk, before the last row
    if stage == "writing bins" and 0 < done < total and state.exists():
        os.kill(os.getpid(), signal.SIGKILL)
from placement.place import PlaceOptions, place
place({str(plan_file)!r}, {str(dataset)!r}, {str(out)!r}, PlaceOptions(gpu_cache="3%", cpu_cache="4%"),
      progress=progress)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL
    partial = out.with_name("placed.partial")
    state = json.loads((partial / "data" / "write-state.json").read_text())
    assert 0 < state["next_row"] < 30_000
    with pytest.raises(PlacedError, match="interrupted"):
        open_placed(out)
    seen: list[int] = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "writing bins":
            seen.append(done)

    place(plan_file, dataset, out, PlaceOptions(**OPTS), progress=progress)  # the re-run resumes ...
    assert seen[0] == state["next_row"]  # ... from the checkpoint, not from row 0
    assert not partial.exists()
    assert verify(out, sample=30_000)["sampled"] > 0
    ds, placed = open_dataset(dataset), open_placed(out, checksums=True)
    assert np.array_equal(placed.read_rows(np.asarray(placed.array("old_to_new"))), np.asarray(ds.features()))


def test_replacing_a_placement_keeps_only_the_new_one(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "placed"
    place(plan_file, dataset, out, PlaceOptions(**OPTS))
    place(plan_file, dataset, out, PlaceOptions(policy="hash", **OPTS))
    assert json.loads((out / "placed.json").read_text())["policy"] == "hash"
    assert [p.name for p in tmp_path.iterdir()] == ["placed"]
    ds = open_dataset(dataset)  # the old placement's names of the dataset's files went, not the files
    assert all(ds.path(k).is_file() for k in ("indptr", "indices", "labels", "train", "val", "test"))
    assert verify(out)["rows"] == ds.num_nodes


def test_bad_input(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="expected a size"):
        place(plan_file, dataset, tmp_path / "x", PlaceOptions(gpu_cache="lots"))
    with pytest.raises(UsageError, match="another profile"):
        place(plan_file, dataset, tmp_path / "x", PlaceOptions(profile=resolve_profile("moment-machine-a"), **OPTS))
    with pytest.raises(MomentError, match="dataset.json"):
        place(plan_file, tmp_path, tmp_path / "x", PlaceOptions(**OPTS))
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text('{"format": "something else"}')
    with pytest.raises(MomentError, match="format"):
        place(bad_plan, dataset, tmp_path / "x", PlaceOptions(**OPTS))
    with pytest.raises(UsageError, match="nvme9"):
        place(plan_file, dataset, tmp_path / "x", PlaceOptions(ssd_dirs={"nvme9": tmp_path}, **OPTS))
    for tolerance in (0.0, 1.5):
        with pytest.raises(UsageError, match="--tolerance .*between 0 and 1"):
            place(plan_file, dataset, tmp_path / "x", PlaceOptions(tolerance=tolerance, **OPTS))
    assert not (tmp_path / "x").exists()


def test_cli_place_and_verify(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "placed"
    run = lambda *a: subprocess.run([sys.executable, "-m", "moment", *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    done = run(
        "place",
        "--plan",
        str(plan_file),
        "--dataset",
        str(dataset),
        "--out",
        str(out),
        "--gpu-cache",
        "3%",
        "--cpu-cache",
        "4%",
        "--ssd-dir",
        f"nvme0={tmp_path / 'ssd0'}",
    )
    assert done.returncode == 0, done.stderr
    assert "achieved" in done.stdout
    # Before writing: what goes where and how long it should take; after: where the time went.
    said = " ".join(done.stderr.split())
    assert (
        f"to {tmp_path / 'ssd0'} (bins nvme0)" in said
        and f"to {out} (the row map, hotness, and the dataset's topology" in said
    )
    assert "expected: about" in said and "from here" in said and "if the machine stays as loaded as now" in said
    assert "where the time went" in done.stdout and "pre-sampling hotness" in done.stdout
    assert "split-half gap at the caches" in done.stdout
    assert any((tmp_path / "ssd0").glob("nvme0-*.bin"))  # the SSD bin went to its directory
    assert run("verify", str(out)).returncode == 0
    bad = run("verify", str(tmp_path / "nowhere"))
    assert bad.returncode == 1 and "not a placed dataset" in bad.stderr and "Traceback" not in bad.stderr


def test_placed_json_records_each_cache_size_once(small_placed: Path, tmp_path: Path) -> None:
    """A cache's size is its bin's capacity; the prediction re-solved for those caches does not
    repeat it. placed.json of earlier versions repeated it in the prediction's workload: such a
    file still loads where the two agree, and is refused where they differ."""
    from moment.contracts.placed import PlacedManifest

    doc = json.loads((small_placed / "placed.json").read_text())
    w = doc["prediction"]["workload"]
    assert doc["prediction"]["source"] == "dataset" and (w["gpu_cache_rows"], w["cpu_cache_rows"]) == (None, None)
    caps = {t: sum(b["capacity"] for b in doc["bins"] if b["tier"] == t) for t in ("gpu", "cpu")}
    assert caps == {"gpu": 180, "cpu": 240}  # --gpu-cache 3%, --cpu-cache 4% of 6,000 vertices
    old = tmp_path / "old.json"  # as earlier versions wrote it: the sizes twice
    w.update(gpu_cache_rows=caps["gpu"], cpu_cache_rows=caps["cpu"])
    old.write_text(json.dumps(doc))
    assert PlacedManifest.read(old).prediction.workload.gpu_cache_rows == caps["gpu"]
    w["gpu_cache_rows"] += 1
    bad = tmp_path / "placed.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(PlacedError, match="gpu_cache_rows: .* the gpu bins' capacity is .* must agree"):
        PlacedManifest.read(bad)


def test_place_imports_no_torch(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """``moment place`` (without ``--pack``) needs numpy and numba, not torch: its import is
    seconds of a placement's start (12 s on a loaded machine here)."""
    code = (
        "import sys; from moment.cli import main; "
        f"rc = main(['place', '--plan', {str(plan_file)!r}, '--dataset', {str(dataset)!r}, "
        f"'--out', {str(tmp_path / 'placed')!r}, '--gpu-cache', '3%']); "
        "print('TORCH', 'torch' in sys.modules, rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.stdout.strip().splitlines()[-1] == "TORCH False 0", out.stderr[-2000:]
