"""Outputs are safe: moment writes only where it may, deletes only what it wrote, one writer at a
time, and a kill at any step of a commit is finished by the next run (issue #11; the rows of the
safety probe are named in each test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moment import faults, outputs
from moment.cli import main
from moment.errors import MomentError
from placement import place as place_module
from placement.dataset import DATASET, open_dataset
from placement.place import PLACED, PlaceOptions, place
from placement.placed import PlacedError, open_placed, verify
from placement.synth import synthesize

OPTS = dict(gpu_cache="2%", cpu_cache="2%", epochs=1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    synthesize(out, nodes=4000, avg_degree=6, dim=8, dtype="float32", seed=3, train_fraction=0.3)
    return out


def _tree(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its size: what a test compares before and after."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


def _one_line(err: str) -> str:
    """The one error line of a refused command (progress and notes may come before it)."""
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- rule 2: --out is absent, empty, or an output of the same kind ---------------------------------


def test_place_refuses_a_directory_of_user_files(plan_file: Path, dataset: Path, tmp_path: Path, capsys) -> None:
    """#1: `--out mydocs` used to delete mydocs/ whole."""
    docs = tmp_path / "mydocs"
    docs.mkdir()
    (docs / "thesis.txt").write_text("thesis")
    code, err = _cli(
        capsys, "place", "--plan", str(plan_file), "--dataset", str(dataset), "--out", str(docs), "--gpu-cache", "1%"
    )
    assert code == 1 and "is not a placed dataset" in _one_line(err)
    assert (docs / "thesis.txt").read_text() == "thesis" and sorted(p.name for p in tmp_path.iterdir()) == ["mydocs"]


def test_place_refuses_the_dataset_itself_and_a_file(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """#1: `--out DATASET` deleted the source; `--out ds/features.npy` replaced a file with a directory."""
    before = _tree(dataset)
    for out in (dataset, dataset / "features.npy", tmp_path / ".."):
        with pytest.raises(PlacedError, match="refusing"):
            place(plan_file, dataset, out, PlaceOptions(**OPTS))
    assert _tree(dataset) == before and not dataset.with_name("ds.partial").exists()


def test_a_foreign_manifest_never_names_what_is_deleted(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """#2: a placed.json found in --out was trusted: its absolute bin paths were unlinked."""
    precious = tmp_path / "elsewhere" / "p.txt"
    precious.parent.mkdir()
    precious.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "placed.json").write_text(json.dumps({"bins": [{"path": str(precious)}]}))
    with pytest.raises(PlacedError, match="not a complete placed dataset"):
        place(plan_file, dataset, out, PlaceOptions(**OPTS))
    assert precious.read_text() == "precious"
    (out / "placed.json").unlink()

    # A real placement whose manifest is edited to list an outside file under a bin's name and
    # size: replacing that placement removes only what moment wrote in the directories it was given.
    ssd = tmp_path / "ssd"
    place(plan_file, dataset, out, PlaceOptions(ssd_dirs={"nvme0": ssd}, **OPTS))
    doc = json.loads((out / "placed.json").read_text())
    victim = tmp_path / "elsewhere" / Path(doc["bins"][-1]["path"]).name
    victim.write_bytes(b"x" * doc["bins"][-1]["bytes"])
    doc["bins"][-1]["path"] = str(victim)
    (out / "placed.json").write_text(json.dumps(doc))
    place(plan_file, dataset, out, PlaceOptions(policy="hash", ssd_dirs={"nvme0": ssd}, **OPTS))
    assert victim.exists() and precious.exists()
    assert verify(out)["rows"] == 4000


def test_an_identical_rerun_with_ssd_dirs_is_idempotent(plan_file: Path, dataset: Path, tmp_path: Path, capsys) -> None:
    """#3: re-running the same command deleted the bins it had just written."""
    args = [
        "place",
        "--plan",
        str(plan_file),
        "--dataset",
        str(dataset),
        "--out",
        str(tmp_path / "placed"),
        "--gpu-cache",
        "2%",
        "--cpu-cache",
        "2%",
        "--ssd-dir",
        f"nvme0={tmp_path / 'ssdA'}",
    ]
    assert main(args) == 0
    first = _tree(tmp_path)
    assert main(args) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert _tree(tmp_path) == first
    assert main([*args, "--policy", "hash"]) == 0  # a different placement replaces it ...
    assert verify(tmp_path / "placed")["rows"] == 4000
    assert len(list((tmp_path / "ssdA").iterdir())) == 1  # ... and the old SSD bin is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placed", "ssdA"]


def test_a_relative_ssd_dir_gives_a_placement_that_opens(
    plan_file: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#4: a relative --ssd-dir was stored relative to the cwd and resolved against the placed dir."""
    monkeypatch.chdir(tmp_path)
    place(plan_file, dataset, "p3", PlaceOptions(ssd_dirs={"nvme0": Path("ssdrel")}, **OPTS))
    monkeypatch.chdir("/")
    assert verify(tmp_path / "p3")["rows"] == 4000
    with pytest.raises(MomentError, match="inside the output"):
        place(plan_file, dataset, tmp_path / "p4", PlaceOptions(ssd_dirs={"nvme0": tmp_path / "p4" / "bins"}, **OPTS))


# --- rule 3: one writer per output -------------------------------------------------------------


def test_a_second_writer_fails_at_once_naming_the_first(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """#6, #7: two runs into one --out produced a corrupt output that train accepted."""
    out = tmp_path / "pk"
    holder = outputs.Staging(out, PLACED)
    holder.create()
    try:
        with pytest.raises(PlacedError, match=rf"another moment place is writing it \(pid {os.getpid()}"):
            place(plan_file, dataset, out, PlaceOptions(**OPTS))
    finally:
        holder.release()
    synth_holder = outputs.Staging(tmp_path / "csyn", DATASET)
    synth_holder.create()
    try:
        with pytest.raises(MomentError, match="another moment dataset is writing it"):
            synthesize(tmp_path / "csyn", 500, 4, 4)
    finally:
        synth_holder.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_foreign_partial_directory_is_not_taken_over(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    (tmp_path / "p.partial").mkdir()
    (tmp_path / "p.partial" / "notes.txt").write_text("mine")
    with pytest.raises(PlacedError, match="was not left by moment place"):
        place(plan_file, dataset, tmp_path / "p", PlaceOptions(**OPTS))
    assert (tmp_path / "p.partial" / "notes.txt").read_text() == "mine"


# --- rule 4: a kill at any point resumes --------------------------------------------------------


def _killed_at(point: str, call: str) -> int:
    """Run ``call`` (Python source) in a fresh interpreter that dies (os._exit) at the named fault
    point, as a kill -9 there would leave things; its exit code. (A fork of the test process could
    inherit a lock held by one of its threads.)"""
    env = {**os.environ, faults.ENV: point}
    done = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, faults.FAULT_EXIT), done.stderr
    return done.returncode


PLACE_POINTS = [
    "place:planned",
    "place:bins-written",
    "place:arrays-written",
    "place:manifest-staged",
    "place:bins-renamed",
    "place:staged",
    "place:old-moved",
    "place:published",
    "place:old-removed",
]


@pytest.mark.parametrize("point", PLACE_POINTS)
def test_place_killed_at_each_commit_step_resumes(point: str, plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """#5: a kill during the commit made every re-run crash. Now each step is finished by the re-run,
    which verifies, and leaves no staging directory, no stray bin and no old placement behind."""
    out, ssd = tmp_path / "pk", tmp_path / "ssd"
    place(plan_file, dataset, out, PlaceOptions(ssd_dirs={"nvme0": ssd}, **OPTS))  # an old placement to replace
    opts = PlaceOptions(policy="hash", ssd_dirs={"nvme0": ssd}, **OPTS)
    call = (
        f"from placement.place import PlaceOptions, place; from pathlib import Path; "
        f"place({str(plan_file)!r}, {str(dataset)!r}, {str(out)!r}, PlaceOptions(policy='hash', "
        f"ssd_dirs={{'nvme0': Path({str(ssd)!r})}}, **{OPTS!r}))"
    )
    assert _killed_at(point, call) == faults.FAULT_EXIT
    place(plan_file, dataset, out, opts)
    assert verify(out)["rows"] == 4000
    assert json.loads((out / "placed.json").read_text())["policy"] == "hash"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pk", "ssd"]
    assert [p.name for p in ssd.iterdir()] == [Path(b.path).name for b in open_placed(out).bins if b.name == "nvme0"]


@pytest.mark.parametrize(
    "point", ["dataset:written", "dataset:staged", "dataset:old-moved", "dataset:published", "dataset:old-removed"]
)
def test_synth_killed_at_each_commit_step_resumes(point: str, tmp_path: Path) -> None:
    """#7: the fixed temporary name of synth was cleared under a running writer. Each commit step of
    `dataset synth` (replacing an older dataset) is finished or redone by the next run."""
    out = tmp_path / "g"
    synthesize(out, 500, 4, 4)
    call = f"from placement.synth import synthesize; synthesize({str(out)!r}, 700, 4, 4, replace=True)"
    assert _killed_at(point, call) == faults.FAULT_EXIT
    ds = synthesize(out, 700, 4, 4, replace=True)
    assert ds.num_nodes == 700 and open_dataset(out).num_nodes == 700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]


# --- rule 8 and the small ones --------------------------------------------------------------------


def test_a_preflight_refusal_leaves_nothing(
    plan_file: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#34: a refused preflight left an empty OUT.partial behind."""
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    monkeypatch.setattr(place_module, "presample", lambda *a, **k: pytest.fail("pre-sampled before refusing"))
    with pytest.raises(MomentError, match=r"GB short"):
        place(plan_file, dataset, tmp_path / "small" / "p", PlaceOptions(**OPTS))
    assert list(tmp_path.iterdir()) == []


def test_os_errors_are_one_line(plan_file: Path, dataset: Path, tmp_path: Path, capsys) -> None:
    """#19, #24: read-only targets, a directory given as a file: one line naming the path."""
    (tmp_path / "afile").write_text("x")
    code, err = _cli(capsys, "plan", "--profile", "moment-machine-b", "--out", str(tmp_path))
    assert code == 1 and str(tmp_path) in _one_line(err)
    code, err = _cli(
        capsys,
        "place",
        "--plan",
        str(plan_file),
        "--dataset",
        str(dataset),
        "--out",
        str(tmp_path / "afile" / "p"),
        "--gpu-cache",
        "1%",
    )
    assert code == 1 and "afile" in _one_line(err)
    code, err = _cli(capsys, "dataset", "synth", "--nodes", "100", "--out", str(tmp_path / "afile" / "d"))
    assert code == 1 and "afile" in _one_line(err)


def test_usage_mistakes_of_place_and_verify(plan_file: Path, dataset: Path, tmp_path: Path, capsys) -> None:
    """#23 (verify --sample -5), #26 (place --epochs 0)."""
    with pytest.raises(SystemExit) as stop:
        main(["verify", str(tmp_path), "--sample", "-5"])
    assert stop.value.code == 2 and "--sample" in _one_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "place",
                "--plan",
                str(plan_file),
                "--dataset",
                str(dataset),
                "--out",
                str(tmp_path / "p"),
                "--epochs",
                "0",
            ]
        )
    assert stop.value.code == 2 and "--epochs" in _one_line(capsys.readouterr().err)


def test_the_placed_hotness_can_be_reused(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """#25: nothing `place` wrote could be passed to --hotness."""
    first = place(plan_file, dataset, tmp_path / "a", PlaceOptions(**OPTS))
    again = place(plan_file, dataset, tmp_path / "b", PlaceOptions(hotness=tmp_path / "a" / "hotness.npy", **OPTS))
    assert [b["count"] for b in again["bins"]] == [b["count"] for b in first["bins"]]
    for name in ("hotness.npy", "old_to_new.npy"):
        assert np.array_equal(np.load(tmp_path / "a" / name), np.load(tmp_path / "b" / name)), name


def test_verify_compares_bytes_so_nan_features_verify(plan_file: Path, tmp_path: Path) -> None:
    """#9: NaN != NaN made verify report a false corruption."""
    ds = tmp_path / "dn"
    synthesize(ds, 600, 4, 4, dtype="float32")
    feats = np.load(ds / "features.npy", mmap_mode="r+")
    feats[5, 3] = np.nan
    feats.flush()
    del feats
    place(plan_file, ds, tmp_path / "pn", PlaceOptions(**OPTS))
    assert verify(tmp_path / "pn", sample=600)["sampled"] > 0
    bins = open_placed(tmp_path / "pn").bins
    with open(bins[0].path, "r+b") as fh:  # a flipped byte is still found (the checksum aside)
        fh.write(b"\x01")
    with pytest.raises(PlacedError, match="checksum mismatch"):
        verify(tmp_path / "pn")


@pytest.mark.parametrize("edit", ["del bins", "del feature_dim", "list", "del digest", "del indptr", "absolute file"])
def test_a_damaged_manifest_is_one_line(edit: str, plan_file: Path, dataset: Path, tmp_path: Path, capsys) -> None:
    """#15: KeyError/AttributeError tracebacks, and `verify` passing a manifest the trainer cannot use."""
    out = tmp_path / "ph"
    place(plan_file, dataset, out, PlaceOptions(**OPTS))
    doc = json.loads((out / "placed.json").read_text())
    if edit == "del bins":
        del doc["bins"]
    elif edit == "del feature_dim":
        del doc["feature_dim"]
    elif edit == "list":
        doc = [1, 2]
    elif edit == "del digest":
        del doc["bins"][0]["digest"]
    elif edit == "del indptr":
        del doc["files"]["indptr"]
    else:
        doc["files"]["labels"]["path"] = "/etc/passwd"
    (out / "placed.json").write_text(json.dumps(doc))
    code, err = _cli(capsys, "verify", str(out))
    assert code == 1 and "placed.json" in _one_line(err)


def test_demo_refuses_a_workdir_of_user_files(tmp_path: Path, capsys) -> None:
    """#18: `demo --workdir` deleted dataset/ and placed/ of user files."""
    work = tmp_path / "work"
    (work / "dataset").mkdir(parents=True)
    (work / "dataset" / "mydata.csv").write_text("x")
    code, err = _cli(capsys, "demo", "--workdir", str(work), "--nodes", "2000", "--epochs", "1")
    assert code == 1 and "not a moment demo directory" in _one_line(err)
    assert _tree(work) == {"dataset/mydata.csv": 1}


def test_demo_goes_on_without_a_live_profile(tmp_path: Path, capsys, monkeypatch) -> None:
    """A sandbox with no sysfs, lspci or nvidia-smi: the live profile (only informative) is a
    note and the demo goes on to plan the bundled profile (stopped there by a stand-in)."""
    from moment.planner import workload
    from moment.topology import profiler

    def no_sources(*args, **kwargs):
        raise MomentError("no PCI devices found in any capture")

    def stop(*args, **kwargs):
        raise MomentError("stopped after the live profile")

    monkeypatch.setattr(profiler, "build_profile", no_sources)
    monkeypatch.setattr(workload, "load_workload", stop)
    code = main(["demo", "--workdir", str(tmp_path / "work"), "--nodes", "2000", "--epochs", "1"])
    said = capsys.readouterr()
    assert code == 1 and "stopped after the live profile" in said.err
    assert "no live profile of this machine (no PCI devices found in any capture)" in " ".join(said.out.split())
    assert not (tmp_path / "work" / "this-machine.yaml").exists()
