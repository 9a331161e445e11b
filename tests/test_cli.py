"""The `moment` command as a user runs it: verbs, --json, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moment.cli import main

FIXTURES = Path(__file__).parent / "fixtures"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a subprocess, as a user would (checks the exit code and streams)."""
    return subprocess.run([sys.executable, "-m", "moment", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("name", ["moment-machine-a", "moment-machine-b"])
def test_inspect_json_has_the_counts(name: str) -> None:
    done = run("inspect", name, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    for key in ("sockets", "switches", "slots", "gpus", "nvme", "nics", "nvlinks"):
        assert isinstance(data[key], int)
    assert (data["gpus"], data["nvme"], data["switches"]) == (4, 8, 2)


def test_inspect_prints_a_tree(capsys) -> None:
    assert main(["inspect", "moment-machine-b"]) == 0
    text = capsys.readouterr().out
    assert "switch sw1" in text and "gpu3" in text and "classic-d" in text


def test_profile_from_dir_writes_yaml_and_picture(tmp_path: Path) -> None:
    out, pic = tmp_path / "sm.yaml", tmp_path / "sm.svg"
    done = run(
        "profile", "--from", str(FIXTURES / "supermicro-sys-4029gp-trt"), "--out", str(out), "--picture", str(pic)
    )
    assert done.returncode == 0, done.stderr
    again = run("inspect", str(out), "--json")
    assert json.loads(again.stdout)["gpus"] == 8
    root = ET.fromstring(pic.read_text())
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "gpu7" in texts and "sw3" in texts
    assert any(t and "Gen3 x16" in t for t in texts)


def test_profile_without_out_prints_yaml(tmp_path: Path) -> None:
    done = run("profile", "--from", str(FIXTURES / "switchtec-8x3090"))
    assert done.returncode == 0
    assert done.stdout.startswith("schema: moment.topology/1")
    assert "warning:" in done.stderr  # the inferred slots are said, on stderr


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["inspect", "no-such-machine"], 2, "unknown profile 'no-such-machine'"),
        (["inspect"], 2, "the following arguments are required"),
        (["frobnicate"], 2, "invalid choice"),
        (["profile", "--from", "/nonexistent/dir"], 1, "/nonexistent/dir: not a directory"),
        (["inspect", "moment-machine-a", "--picture", "x.png"], 2, "only .svg"),
    ],
)
def test_user_errors_are_one_line(args: list[str], code: int, needle: str, tmp_path: Path) -> None:
    done = run(*args, cwd=tmp_path)
    assert done.returncode == code
    assert needle in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_bad_profile_file_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: moment.topology/1\nname: x\nsockets:\n- id: cpu0\n  cores: many\n")
    done = run("inspect", str(bad))
    assert done.returncode == 1
    assert "bad.yaml: sockets.0.cores" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00\x01\x02garbage" * 100, b"-+-[0000:00]-+-00.0  Intel Corp", None],
    ids=["empty", "binary", "truncated", "wrong-kind"],
)
def test_profile_of_malformed_captures_never_tracebacks(tmp_path: Path, content: bytes | None) -> None:
    cap = tmp_path / "caps"
    cap.mkdir()
    if content is None:  # a dmidecode capture saved under the lspci name
        content = (FIXTURES / "supermicro-sys-4029gp-trt" / "dmidecode.txt").read_bytes()
    (cap / "lspci-tv.txt").write_bytes(content)
    done = run("profile", "--from", str(cap), "--out", str(tmp_path / "p.yaml"))
    assert "Traceback" not in done.stderr
    if done.returncode != 0:
        assert done.returncode == 1
        assert not (tmp_path / "p.yaml").exists()  # no half-written output
        assert "lspci-tv.txt" in done.stderr


def test_empty_capture_dir(tmp_path: Path) -> None:
    done = run("profile", "--from", str(tmp_path))
    assert done.returncode == 1
    assert "no capture files found" in done.stderr


def test_profiles_lists_bundled() -> None:
    done = run("profiles")
    assert done.returncode == 0
    assert "moment-machine-a" in done.stdout and "moment-machine-b" in done.stdout


def test_help_reads_well() -> None:
    done = run("--help")
    assert done.returncode == 0
    for verb in ("profile", "inspect", "demo"):
        assert verb in done.stdout
