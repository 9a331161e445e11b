"""Every verb's typical mistakes exit as the README says: 1 for bad input or state (a file that
is missing, unreadable or invalid, an output in the way), 2 for bad usage (an unknown option,
name or choice, a value out of range, options that conflict), 130 on SIGINT and 143 on SIGTERM;
each with one line on stderr naming the verb, never a traceback. In-process where possible."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import logged
from moment.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mistakes")
    (d / "userdir").mkdir()
    (d / "userdir" / "notes.txt").write_text("mine\n")
    (d / "bad.json").write_text("{not json")
    (d / "badw.yaml").write_text("batchsize: 3\n")
    (d / "bad.yaml").write_text("sockets: [\n")
    (d / "data.bin").write_bytes(b"\0" * 4096)
    (d / "noslot.json").write_text('{"sw9-gpu0": "gpu0"}')
    assert (
        main(["plan", "--profile", "moment-machine-b", "--gpus", "1", "--ssds", "2", "--out", str(d / "plan.json")])
        == 0
    )
    assert main(["dataset", "synth", "--nodes", "2000", "--dim", "8", "--out", str(d / "ds")]) == 0
    return d


CASES = [
    # (verb, argv with {d} for the scratch directory, exit code)
    ("profile", ["profile", "--from", "{d}/missingdir"], 1),
    ("inspect", ["inspect", "no-such-profile"], 2),
    ("inspect", ["inspect", "{d}/missing.yaml"], 1),
    ("inspect", ["inspect", "{d}/bad.yaml"], 1),
    ("profiles", ["profiles", "extra"], 2),
    ("plan", ["plan", "--profile", "moment-machine-b", "--gpus", "two"], 2),
    ("plan", ["plan", "--profile", "moment-machine-b", "--gpus", "0"], 2),
    ("plan", ["plan", "--profile", "moment-machine-b", "--gpus", "11"], 2),
    ("plan", ["plan", "--profile", "moment-machine-b", "--top", "0"], 2),
    ("plan", ["plan", "--profile", "no-such-profile"], 2),
    ("plan", ["plan", "--profile", "{d}/missing.yaml"], 1),
    ("plan", ["plan", "--profile", "moment-machine-b", "--workload", "{d}/badw.yaml"], 1),
    ("plan", ["plan", "--profile", "moment-machine-b", "--workload", "{d}/missing.yaml"], 1),
    ("plan", ["plan", "--profile", "moment-machine-b", "--out", "{d}/userdir"], 1),
    ("plan", ["plan", "--profile", "moment-machine-b", "--gpus", "1..2", "--out", "{d}/x.json"], 2),
    ("score", ["score", "--profile", "moment-machine-a", "--layout", "classic-z"], 2),
    ("score", ["score", "--profile", "moment-machine-a", "--layout", "{d}/bad.json"], 1),
    ("score", ["score", "--profile", "moment-machine-a", "--layout", "{d}/missing.json"], 1),
    ("score", ["score", "--profile", "moment-machine-a", "--layout", "{d}/noslot.json"], 1),
    ("bench", ["bench", "--profile", "moment-machine-b", "--file", "{d}/missing.bin:nvme0"], 1),
    ("bench", ["bench", "--profile", "moment-machine-b", "--file", "{d}/data.bin:gpu0"], 2),
    ("dataset synth", ["dataset", "synth", "--nodes", "-5", "--out", "{d}/ds2"], 2),
    ("dataset synth", ["dataset", "synth", "--nodes", "100", "--out", "{d}/userdir"], 1),
    ("dataset import", ["dataset", "import", "--format", "ogb", "--root", "{d}/missingdir", "--out", "{d}/x"], 1),
    ("dataset import", ["dataset", "import", "--format", "nope", "--root", "{d}", "--out", "{d}/x"], 2),
    ("place", ["place", "--plan", "{d}/bad.json", "--dataset", "{d}/ds", "--out", "{d}/p"], 1),
    ("place", ["place", "--plan", "{d}/missing.json", "--dataset", "{d}/ds", "--out", "{d}/p"], 1),
    ("place", ["place", "--plan", "{d}/plan.json", "--dataset", "{d}/ds", "--out", "{d}/p", "--gpu-cache", "200%"], 2),
    (
        "place",
        ["place", "--plan", "{d}/plan.json", "--dataset", "{d}/ds", "--out", "{d}/p"]
        + ["--ssd-dir", "nvme0={d}/a", "--ssd-dir", "nvme0={d}/b"],
        2,
    ),
    ("place", ["place", "--plan", "{d}/plan.json", "--dataset", "{d}/ds", "--out", "{d}/userdir"], 1),
    ("verify", ["verify", "{d}/missingdir"], 1),
    ("verify", ["verify", "{d}/missingdir", "--sample", "-5"], 2),
    ("train", ["train", "--plan", "{d}/missing.json", "--data", "{d}/missingdir"], 1),
    ("train", ["train", "--plan", "{d}/plan.json", "--data", "{d}/missingdir", "--resume"], 2),
    (
        "infer",
        ["infer", "--plan", "{d}/missing.json", "--data", "{d}/x", "--checkpoint", "{d}/ck", "--out", "{d}/o"],
        1,
    ),
    (
        "infer",
        ["infer", "--plan", "{d}/plan.json", "--data", "{d}/x", "--checkpoint", "{d}/ck", "--out", "{d}/o"]
        + ["--batch-size", "0"],
        2,
    ),
    ("demo", ["demo", "--workdir", "{d}/userdir"], 1),
    ("", ["no-such-verb"], 2),
]


@pytest.mark.parametrize(("verb", "argv", "code"), CASES, ids=[" ".join(c[1])[:60] for c in CASES])
def test_each_verbs_typical_mistakes(verb: str, argv: list[str], code: int, files: Path, capsys) -> None:
    argv = [a.replace("{d}", str(files)) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    unrecognised = "error: unrecognized arguments" in lines[0]  # found by the top parser, after the verb's
    assert lines[0].startswith(f"moment {verb}: error: " if verb and not unrecognised else "moment: error: "), lines[0]
    assert "userdir" not in argv[-1] or (files / "userdir" / "notes.txt").read_text() == "mine\n"


def test_no_verb_is_usage(capsys) -> None:
    assert main([]) == 2
    assert "usage: moment" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        (signal.SIGINT, 130, "moment plan: interrupted (SIGINT)"),
        (signal.SIGTERM, 143, "moment plan: interrupted (SIGTERM)"),
    ],
)
def test_signals_exit_130_and_143_with_one_line(sig: int, code: int, line: str, tmp_path: Path) -> None:
    """A sweep long enough to be stopped half way, signalled once progress shows."""
    log = tmp_path / "err.log"
    proc = logged.start(["plan", "--profile", "example-8gpu-16ssd", "--gpus", "1..8", "--ssds", "1..16"], log)
    try:
        assert logged.seen_while_running(proc, log, "plan sweep: 1/"), log.read_text()
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == code, text
    assert text.strip().splitlines()[-1] == line and "Traceback" not in text, text
