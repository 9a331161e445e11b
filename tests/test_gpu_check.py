"""The GPU check's machinery, on the CPU: which bundle wheels an interpreter gets (only what it
lacks or has at a refused version), the torch gate, and the step runner's report (written after
every step, a timed-out step recorded and the next one run, the budget honoured). The whole check
runs in CI as ``scripts/gpu_check.sh --offline DIR --self-test`` (.ci/run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / "scripts" / "wheelhouse.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _bundle(
    tmp_path: Path, roots: list[str], packages: list[dict], python: str | None = None, skipped: list[str] | None = None
) -> Path:
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    moment = {"name": "moment", "version": "0.1.0", "file": "moment-0.1.0-py3-none-any.whl", "requires": roots}
    doc = {"format": "moment.wheelhouse/1", "python": python or mine, "roots": roots, "packages": [moment, *packages]}
    doc["skipped"] = skipped or []
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    return tmp_path


def _run_args(gc, out: Path, work: Path, seconds: float):
    """``gpu_check.py run``'s arguments: one GPU, a budget of ``seconds`` from now."""
    return gc.argparse.Namespace(
        out=str(out),
        work=str(work),
        ngpu=1,
        deadline=time.time() + seconds,
        scale=1.0,
        bench_dir=None,
        only=None,
        self_test=False,
    )


def _pkg(name: str, version: str, requires: list[str] | None = None) -> dict:
    return {"name": name, "version": version, "file": f"{name}-{version}.whl", "requires": requires or []}


def _select(bundle: Path) -> tuple[int, list[str], str]:
    done = subprocess.run([sys.executable, str(WHEELHOUSE), "select", str(bundle)], capture_output=True, text=True)
    return done.returncode, sorted(Path(p).name for p in done.stdout.split()), done.stderr


def test_select_installs_only_what_is_missing_or_refused(tmp_path: Path) -> None:
    numpy = metadata.version("numpy")
    pytest_version = metadata.version("pytest")
    packages = [_pkg("numpy", "99.0"), _pkg("pytest", "99.0"), _pkg("not-here-xyz", "1.0")]
    code, files, err = _select(
        _bundle(tmp_path, ["numpy>=1.24", "torch>=2.11", "pytest>=999", "not-here-xyz"], packages)
    )
    assert code == 0, err
    # numpy satisfies its bound here: kept; pytest is older than asked, not-here-xyz missing; torch is not bundled
    assert files == ["not-here-xyz-1.0.whl", "pytest-99.0.whl"]
    assert f"keep    numpy {numpy}" in err and f"install pytest 99.0 (has {pytest_version})" in err


def test_a_bundled_package_can_refuse_what_the_interpreter_has(tmp_path: Path) -> None:
    """Fixed point: a wheel taken from the bundle brings its own bounds, which the interpreter's
    copy of a dependency may not meet (pydantic pins pydantic-core exactly)."""
    packages = [_pkg("numpy", "99.0"), _pkg("not-here-xyz", "1.0", ["numpy>=999"])]
    code, files, _ = _select(_bundle(tmp_path, ["numpy>=1.24", "not-here-xyz"], packages))
    assert code == 0 and files == ["not-here-xyz-1.0.whl", "numpy-99.0.whl"]


def test_a_skipped_package_the_server_lacks_is_one_line(tmp_path: Path) -> None:
    """`make wheelhouse` skips numpy and numba (a CUDA PyTorch environment has them): where one is
    missing, or too old, the check stops before installing anything, naming it and the fix."""
    numpy = metadata.version("numpy")
    code, files, err = _select(_bundle(tmp_path, ["not-here-xyz>=1"], [], skipped=["not-here-xyz"]))
    assert code == 1 and not files and err.strip().count("\n") == 0
    assert "lacks not-here-xyz (moment needs not-here-xyz>=1)" in err and "without skipping not-here-xyz" in err
    code, files, err = _select(_bundle(tmp_path, ["numpy>=999"], [], skipped=["numpy"]))
    assert code == 1 and f"has numpy {numpy} (moment needs numpy>=999)" in err
    code, files, err = _select(_bundle(tmp_path, ["numpy>=1.24"], [], skipped=["numpy"]))
    assert code == 0 and not files and f"keep    numpy {numpy} (left out of the bundle)" in err


def test_a_bundle_for_another_python_is_one_line(tmp_path: Path) -> None:
    code, files, err = _select(_bundle(tmp_path, [], [], python="3.99"))
    assert code == 1 and not files and err.strip().count("\n") == 0 and "built for Python 3.99" in err


def test_the_torch_gate(tmp_path: Path) -> None:
    """Older than moment's bound, or without CUDA (but in the self-test): one line, exit 1."""

    def gate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(WHEELHOUSE), "torch", *args], capture_output=True, text=True)

    import torch

    old = gate("--bound", "torch>=999", "--cpu")
    assert old.returncode == 1 and old.stderr.strip() == (
        f"gpu_check: torch {torch.__version__} is not supported (moment needs torch>=999)"
    )
    ok = gate("--bound", "torch>=2.0", "--cpu")
    assert ok.returncode == 0 and ok.stdout.strip() == torch.__version__
    if not torch.cuda.is_available():
        cpu = gate("--bound", "torch>=2.0")
        assert cpu.returncode == 1 and "sees no CUDA device" in cpu.stderr and cpu.stderr.count("\n") == 1
    bundle = _bundle(tmp_path, ["torch>=999"], [])  # the bound comes from the bundle's moment wheel
    assert "moment needs torch>=999" in gate("--dir", str(bundle), "--cpu").stderr


def test_a_timed_out_step_is_recorded_and_the_next_one_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gc = _gpu_check()
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    seen: list[list[str]] = []

    def fake_steps(*args, **kwargs):
        return [
            gc.Step("sleeps", ["sleep", "30"], 1),
            gc.Step("needs-missing", ["true"], 5, needs=[str(work / "nothing")]),
            gc.Step("fails", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 5),
            gc.Step("one-gpu", ["true"], 5, when="1 GPU: nccl ranks need two"),
            gc.Step("last", [sys.executable, "-c", "print('fine')"], 600),
        ]

    real_save = gc.save

    def save(out_dir: Path, doc: dict) -> None:
        real_save(out_dir, doc)
        seen.append([s["name"] for s in json.loads((out_dir / "report.json").read_text())["steps"]])

    monkeypatch.setattr(gc, "steps", fake_steps)
    monkeypatch.setattr(gc, "save", save)
    gc.start(gc.argparse.Namespace(out=str(out), self_test=False))
    start = time.monotonic()
    assert gc.run(_run_args(gc, out, work, seconds=20)) == 0
    assert time.monotonic() - start < 15  # the 30 s sleep was cut at its 1 s limit
    doc = json.loads((out / "report.json").read_text())
    got = {s["name"]: s for s in doc["steps"]}
    assert got["sleeps"]["status"] == "timed out (1 s)" and got["sleeps"]["exit"] == 124
    assert (
        got["needs-missing"]["status"] == "not run"
        and "an earlier step failed" in got["needs-missing"]["figures"]["lines"][0]
    )
    assert (
        got["fails"]["status"] == "failed"
        and got["fails"]["exit"] == 3
        and got["fails"]["figures"]["lines"] == ["boom"]
    )
    assert got["one-gpu"]["status"] == "skipped"
    # "last" asked for 600 s: it ran within what was left of the 20 s budget
    assert got["last"]["status"] == "ok" and got["last"]["seconds"] < 15
    assert doc["failed"] == 3 and seen[:2] == [[], ["sleeps"]] and seen[-1] == list(got)  # written after every step
    log = (out / "steps.log").read_text()
    assert "===== fails" in log and "boom" in log and "===== last" in log
    md = (out / "report.md").read_text()
    assert "**not finished**" in md and "| sleeps | timed out (1 s) | 124 |" in md
    assert gc.finish(gc.argparse.Namespace(out=str(out), seconds=7)) == 0
    doc = json.loads((out / "report.json").read_text())
    assert doc["finished"] and doc["failed"] == 3 and "**not finished**" not in (out / "report.md").read_text()


def test_a_step_past_the_budget_is_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gc = _gpu_check()
    monkeypatch.setattr(gc, "steps", lambda *a, **k: [gc.Step("late", ["true"], 60)])
    out = tmp_path / "out"
    gc.start(gc.argparse.Namespace(out=str(out), self_test=True))
    gc.run(_run_args(gc, out, tmp_path, seconds=3))
    step = json.loads((out / "report.json").read_text())["steps"][0]
    assert step["status"] == "not run" and step["figures"]["lines"][0].startswith("out of time")


def test_the_bin_pass_step_runs_the_benchmark_and_reports_each_thread_count(tmp_path: Path) -> None:
    """The many-core figure the place estimate's BIN_CORES waits for: the step's command runs the
    benchmark (small, here) and its figures are one line per thread count, as printed."""
    gc = _gpu_check()
    step = next(s for s in gc.steps(tmp_path, "cpu", 0, tmp_path, small=True) if s.name == "bin-pass-cores")
    run = subprocess.run(step.argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    lines = gc.figures(step.name, tmp_path, run.stdout)["lines"]
    assert [ln.split(":")[0] for ln in lines] == ["run 1, 1 grouping threads", "run 2, 2 grouping threads"]
    assert all("ns/byte" in ln and "; grouping" not in ln for ln in lines)
    scratch = Path(step.argv[step.argv.index("--dir") + 1])
    assert not scratch.exists()  # the benchmark removed what it wrote


def test_the_pytest_step_names_its_failures_in_the_report(tmp_path: Path) -> None:
    """The first GPU run's report said "1 failed" without naming the test: the step's pytest
    options must print failures, errors and skips in the short summary the figures are read from."""
    gc = _gpu_check()
    step = next(s for s in gc.steps(tmp_path, "cpu", 0, tmp_path, small=True) if s.name == "pytest-gpu")
    (tmp_path / "test_mini.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\ndef test_broken():\n    assert 1 == 2\n\n"
        "@pytest.mark.gpu\ndef test_absent():\n    pytest.skip('needs two GPUs')\n"
    )
    argv = [*step.argv[:-1], str(tmp_path / "test_mini.py"), "-W", "ignore"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    fig = gc.figures(step.name, tmp_path, run.stdout)
    assert fig["failed"] == 1 and fig["skipped"] == 1, run.stdout
    assert any(ln.startswith("FAILED") and "test_broken" in ln for ln in fig["lines"]), fig
    assert any(ln.startswith("SKIPPED") and "needs two GPUs" in ln for ln in fig["lines"]), fig
