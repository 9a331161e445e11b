"""Workload and layout files are schema-checked: unknown or repeated keys, and documents that are
not workloads, are refused in one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from moment.cli import main
from moment.contracts.plan import PlanDoc
from moment.errors import MomentError
from moment.planner.workload import Workload, load_workload
from moment.topology.profile_io import bundled_profiles
from moment.yamlio import load_yaml


def one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_an_unknown_workload_key_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "w.yaml").write_text("batchsize: 1024\n")
    err = one_line_error(["plan", "--profile", "moment-machine-b", "--workload", str(tmp_path / "w.yaml")], capsys)
    assert "w.yaml: batchsize: Extra inputs are not permitted" in err


def test_a_duplicate_workload_key_is_refused_with_its_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "w.yaml").write_text("batch_size: 1024\nfanouts: [10, 5]\nbatch_size: 2048\n")
    err = one_line_error(["score", "--profile", "moment-machine-b", "--workload", str(tmp_path / "w.yaml")], capsys)
    assert "w.yaml: cannot read workload: line 3: duplicate key 'batch_size'" in err


def test_a_duplicate_layout_key_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "l.yaml").write_text("rc0-31: gpu0\nrc0-31: gpu1\n")
    err = one_line_error(["score", "--profile", "moment-machine-b", "--layout", str(tmp_path / "l.yaml")], capsys)
    assert "l.yaml: cannot read layout: line 2: duplicate key 'rc0-31'" in err


def test_a_duplicate_profile_key_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "p.yaml").write_text("schema: moment.topology/1\nname: a\nname: b\n")
    err = one_line_error(["inspect", str(tmp_path / "p.yaml")], capsys)
    assert "p.yaml:3: YAML syntax error: duplicate key 'name'" in err


def test_a_plan_file_is_not_a_workload(plan_file: Path, capsys) -> None:
    err = one_line_error(["plan", "--profile", "moment-machine-b", "--workload", str(plan_file)], capsys)
    assert f"{plan_file}: a moment.plan/2 document, not a workload file" in err


def test_plan_json_embedded_workload_still_reads(plan_file: Path) -> None:
    doc = PlanDoc.read(plan_file)
    assert isinstance(doc.workload, Workload)
    assert Workload.model_validate(doc.workload.model_dump()) == doc.workload


def test_a_profile_workload_with_an_unknown_key_is_refused() -> None:
    with pytest.raises(MomentError, match="foo: Extra inputs are not permitted"):
        load_workload({"foo": "bar"})


@pytest.mark.parametrize("verb", [["inspect"], ["plan", "--profile"]])
def test_a_profile_workload_typo_names_the_profile_file(tmp_path: Path, verb: list[str], capsys) -> None:
    text = (bundled_profiles()["moment-machine-b"]).read_text()
    (tmp_path / "wl.yaml").write_text(text.replace("workload:\n", "workload:\n  batchsize: 8\n", 1))
    err = one_line_error([*verb, str(tmp_path / "wl.yaml")], capsys)
    assert "wl.yaml: workload.batchsize: Extra inputs are not permitted" in err


def test_yaml_loader_is_safe_and_keeps_ordinary_documents() -> None:
    assert load_yaml("a: 1\nb: {c: [1, 2]}\n") == {"a": 1, "b": {"c": [1, 2]}}
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do: what matters is that nothing runs
        load_yaml("!!python/object/apply:os.system ['true']")


@pytest.mark.parametrize("out", [[], ["--out", "never.yaml"]])
def test_bench_refuses_a_gpu_as_the_ssd_of_a_file_with_or_without_out(tmp_path: Path, out: list[str], capsys) -> None:
    (tmp_path / "big.bin").write_bytes(b"\0" * 8192)
    argv = ["bench", "--profile", "moment-machine-b", "--file", f"{tmp_path / 'big.bin'}:gpu0", "--no-dram", *out]
    err = one_line_error(argv, capsys)
    assert "gpu0 is not an NVMe SSD of moment-machine-b" in err


def test_bench_refuses_a_directory(tmp_path: Path, capsys) -> None:
    err = one_line_error(["bench", "--file", str(tmp_path), "--no-dram"], capsys)
    assert f"{tmp_path}: a directory, not a file or block device" in err


def test_inspect_help_points_to_moment_profiles(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    text = capsys.readouterr().out
    assert "moment profiles" in text and "--list" not in text
