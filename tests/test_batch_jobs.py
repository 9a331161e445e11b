"""Batch-job safety (issue #23; probe 2026-11-27 rows H1-H3, M1-M6): signals reach every process
``moment train`` / ``moment infer`` start and none outlives its launcher, one job per checkpoint
or output directory, damaged checkpoints are refused, the default placement infers and resumes,
full disks are one line naming the file."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moment import faults, procs
from moment.cli import main
from moment.errors import Interrupted, MomentError
from moment.outputs import DirLock, joined, live_members
from placement.place import PlaceOptions, place
from placement.synth import synthesize
from trainer import checkpoint, loop, preflight
from trainer.config import TrainConfig
from trainer.infer import InferenceError, InferOptions, infer
from trainer.launch import check_command

ROOT = Path(__file__).resolve().parent.parent
CPU = ["--device", "cpu"]
# the placement's fan-outs (no --fanouts: the default path, M2)
TINY = ["--batch-size", "64", "--hidden", "16", "--max-batches-per-epoch", "2", *CPU]


@pytest.fixture(scope="module")
def data(plan_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A placement (``default``: one made with the defaults, no GPU cache: an empty gpu bin, M1)
    and a checkpoint of one epoch trained with the placement's fan-outs."""
    root = tmp_path_factory.mktemp("jobs")
    synthesize(
        root / "ds",
        nodes=3000,
        avg_degree=6,
        dim=16,
        dtype="float32",
        seed=3,
        classes=4,
        train_fraction=0.2,
        val_fraction=0.05,
        test_fraction=0.05,
    )
    place(plan_file, root / "ds", root / "placed", PlaceOptions(gpu_cache="3%", cpu_cache="4%"))
    place(plan_file, root / "ds", root / "default", PlaceOptions())
    ck = root / "ck"
    assert loop.main(["--data", str(root / "placed"), *TINY, "--epochs", "1", "--checkpoint-dir", str(ck)]) == 0
    return {"placed": root / "placed", "default": root / "default", "plan": plan_file, "ck": ck}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(faults.ENV, None)
    return env


def _moment(args: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "moment", *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[arg-type]
    )


def _processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (a test's own tmp path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(f"{entry.name}: {cmd}")
    return found


@contextlib.contextmanager
def _no_orphans(tag: str) -> Iterator[None]:
    """Whatever the test leaves running that names ``tag`` is killed at the end (and fails it)."""
    try:
        yield
    finally:
        for line in _processes_naming(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)


def _wait_for(cond, proc: subprocess.Popen[str], what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before {what}: {err[-2000:]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _ranks_registered(directory: Path, n: int = 2) -> bool:
    return len(live_members(directory)) >= n


def _train_args(data: dict[str, Path], ck: Path, epochs: int = 1000) -> list[str]:
    """``moment train --nproc 2`` into ``ck``, its shared host files in ``ck``'s sibling ``shm``
    (never the machine's /dev/shm: a test that signals the job must not leave them there)."""
    shm = ck.with_name("shm")
    shm.mkdir(exist_ok=True)
    return ["train", "--plan", str(data["plan"]), "--data", str(data["placed"]), "--nproc", "2"] + [
        "--epochs",
        str(epochs),
        "--checkpoint-dir",
        str(ck),
        "--shm-dir",
        str(shm),
        "--",
        *TINY,
    ]


def _with(args: list[str], *more: str) -> list[str]:
    """``moment train`` arguments with ``more`` before the trainer's (after ``--``)."""
    cut = args.index("--")
    return [*args[:cut], *more, *args[cut:]]


def _infer_args(data: dict[str, Path], out: Path) -> list[str]:
    return ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["ck"]), "--out", str(out)] + [
        "--nproc",
        "2",
        "--batch-size",
        "16",
        *CPU,
    ]


# -- H1, H2, M3, M6: signals and locks of a running job ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM-to-pid", "SIGINT-to-group"])
def test_a_signalled_train_stops_every_rank_and_reports_one_line(
    data: dict[str, Path], tmp_path: Path, how: str
) -> None:
    """H1 / M3 / M6: ``moment train --nproc 2`` signalled as a supervisor (SIGTERM to its PID only)
    or a terminal's Ctrl-C (SIGINT to the process group) does: one line, 143 / 130, and no process
    of the job alive 10 s later; while it ran, a second training in its checkpoint directory
    (--overwrite included) was refused naming it."""
    ck = tmp_path / "ck"
    with _no_orphans(str(tmp_path)):
        proc = _moment(_train_args(data, ck), start_new_session=True)
        _wait_for(lambda: _ranks_registered(ck), proc, "two registered ranks")
        second = _moment(_with(_train_args(data, ck, epochs=2), "--overwrite"))
        _, err2 = second.communicate(timeout=240)
        assert second.returncode == 1, err2
        assert f"another moment train is using it (pid {proc.pid} on" in err2, err2
        if how == "SIGTERM-to-pid":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        time.sleep(10)
        left = _processes_naming(str(tmp_path))
    assert not left, left
    assert proc.returncode == (143 if how == "SIGTERM-to-pid" else 130), err
    assert "Traceback" not in err, err
    # (the test's --shm-dir is no tmpfs: one warning before the run)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("running:", "warning: --shm-dir"))]
    assert len(lines) == 1 and "moment train: interrupted (SIG" in lines[0], err
    assert not live_members(ck)
    assert list(ck.with_name("shm").iterdir()) == []  # no shared host file of the job left


@pytest.mark.slow
def test_a_signalled_infer_stops_every_rank_and_the_rerun_resumes(data: dict[str, Path], tmp_path: Path) -> None:
    """H2: ``moment infer --nproc 2`` stopped by SIGTERM to its PID: 143, one line, no rank alive
    10 s later; the same command again resumes in OUT.partial and finishes."""
    out = tmp_path / "emb"
    with _no_orphans(str(tmp_path)):
        proc = _moment(_infer_args(data, out), start_new_session=True)
        _wait_for(lambda: _ranks_registered(out.with_name("emb.partial")), proc, "two registered ranks")
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        time.sleep(10)
        left = _processes_naming(str(tmp_path))
    assert not left, left
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("moment infer: interrupted (SIGTERM)")
    again = _moment(_infer_args(data, out))
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "resuming the interrupted" in err and (out / "inference.json").is_file()


@pytest.mark.slow
def test_ranks_whose_launcher_was_killed_stop_by_themselves(data: dict[str, Path], tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot forward anything: its ranks (and torchrun) notice it
    is gone and stop within seconds, instead of training on."""
    ck = tmp_path / "ck"
    with _no_orphans(str(tmp_path)):
        proc = _moment(_train_args(data, ck), start_new_session=True)
        _wait_for(lambda: _ranks_registered(ck), proc, "two registered ranks")
        proc.kill()
        proc.communicate(timeout=60)
        time.sleep(10)
        left = _processes_naming(str(tmp_path))
    assert not left, left


def test_a_rerun_does_not_enter_a_directory_that_live_ranks_still_write(data: dict[str, Path], tmp_path: Path) -> None:
    """H2: the launcher's lock is gone (killed), but a rank of its job is still registered in
    OUT.partial: the rerun is refused, naming it, instead of writing beside it."""
    out = tmp_path / "emb"
    args = ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["ck"]), "--out", str(out), *CPU]
    env = _env() | {faults.ENV: "infer:layer1:chunk0"}
    killed = subprocess.run([sys.executable, "-m", "moment", *args], env=env, capture_output=True, text=True)
    assert killed.returncode == faults.FAULT_EXIT, killed.stderr
    opts = InferOptions(data=data["placed"], checkpoint=data["ck"], out=out, device="cpu")
    with (
        joined(out.with_name("emb.partial"), "moment infer"),
        pytest.raises(InferenceError, match=rf"still write it \(pid {os.getpid()} on "),
    ):
        infer(opts)
    infer(opts)  # once it is gone, the rerun resumes
    assert (out / "inference.json").is_file()


def test_one_training_per_checkpoint_directory(data: dict[str, Path], tmp_path: Path) -> None:
    """M6: while a job holds the checkpoint directory, another training there, --overwrite
    included, is one line naming the holder; so is one while ranks of an earlier job run."""
    ck = tmp_path / "ck"
    args = _train_args(data, ck, epochs=1)
    with DirLock(ck, "moment train"):
        assert main(_with(args, "--overwrite")) == 1
    with joined(ck, "moment train"), pytest.raises(MomentError, match="still write it"):
        DirLock(ck, "moment train").acquire()
    # a bare trainer (no launcher) takes the lock on rank 0
    with DirLock(ck, "moment train"):
        rc = loop.main(["--data", str(data["placed"]), *TINY, "--epochs", "1", "--checkpoint-dir", str(ck)])
    assert rc == 1


def test_the_cli_turns_sigterm_into_one_line_and_143(data: dict[str, Path], tmp_path: Path) -> None:
    """A signalled in-process infer (``--nproc 1``) unwinds: one line, exit 143, OUT.partial kept
    for the rerun."""
    out = tmp_path / "emb"
    # Small gather chunks (a progress record each): the run lasts seconds, not the few milliseconds
    # the broadcast engine needs for 3,000 vertices once its prediction is made, so the signal lands.
    slow = ["--engine", "gather", "--batch-size", "4"]
    proc = _moment(
        ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["ck"]), "--out", str(out)] + slow + CPU
    )
    _wait_for(lambda: out.with_name("emb.partial").exists(), proc, "emb.partial")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("finished before the signal")
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "moment infer: interrupted (SIGTERM)" in err


def test_a_signal_landing_in_a_finalizer_still_stops_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python prints and drops an exception raised inside ``__del__``; a SIGTERM whose handler ran
    there (llvmlite's finalizers, say) must still stop the command, not be lost."""
    monkeypatch.setattr(procs, "_stopping", [])
    finished = []

    class SignalledWhileCollected:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the handler runs here, inside the finalizer
                pass

    with pytest.raises(Interrupted) as info, procs.interruptible():
        SignalledWhileCollected()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pass
        finished.append(True)
    assert info.value.signum == signal.SIGTERM and not finished


def test_a_signal_landing_in_numba_or_llvmlite_is_raised_once_out_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM whose handler runs inside llvmlite (numba's compiler) is not raised there: an
    ObjectRef interrupted in its __init__ is left half made, and its __del__ prints a traceback
    after the command's one line. The signal comes back once the code is out of it."""
    monkeypatch.setattr(procs, "_stopping", [])
    done: list[str] = []
    compiler: dict[str, object] = {"__name__": "llvmlite.binding.ffi"}  # code of llvmlite, as frames see it
    exec(  # noqa: S102 - a function whose module is llvmlite, to be signalled inside
        "def build(kill, spin, done):\n"
        "    kill()\n"
        "    spin(0.3)\n"  # the handler runs here (and its resends), inside llvmlite
        "    done.append('built')\n",
        compiler,
    )

    def spin(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass

    with pytest.raises(Interrupted) as info, procs.interruptible():
        compiler["build"](lambda: os.kill(os.getpid(), signal.SIGTERM), spin, done)  # type: ignore[operator]
        spin(10)
        done.append("went on")
    assert info.value.signum == signal.SIGTERM and done == ["built"]


def test_a_half_made_llvmlite_object_is_what_the_deferral_avoids() -> None:
    """Why: llvmlite's ObjectRef without its __init__'s attributes (an exception raised at the
    start of __init__) fails in __del__, and Python prints that traceback."""
    done = subprocess.run(
        [sys.executable, "-c", "from llvmlite.binding.context import ContextRef\nContextRef.__new__(ContextRef)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" in done.stderr and "__del__" in done.stderr and "_as_parameter_" in done.stderr


# -- H3: damaged checkpoints ------------------------------------------------------------------


def _flip(src: Path, dst_dir: Path) -> Path:
    """The probe's damage: 8 bytes inside the first large weight tensor flipped."""
    body = torch.load(src, weights_only=True)
    w = next(v for v in body["model"].values() if v.numel() > 100)
    raw = bytearray(src.read_bytes())
    at = raw.find(w.numpy().tobytes()[:64])
    assert at > 0
    for k in range(at + 16, at + 24):
        raw[k] ^= 0x40
    dst_dir.mkdir()
    (dst_dir / checkpoint.FILENAME).write_bytes(bytes(raw))
    return dst_dir


def test_a_checkpoint_with_a_flipped_weight_is_refused_by_infer_and_resume(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _flip(checkpoint.path_in(data["ck"]), tmp_path / "bad")
    out = tmp_path / "out"
    assert main(["infer", "--data", str(data["placed"]), "--checkpoint", str(bad), "--out", str(out), *CPU]) == 1
    err = capsys.readouterr().err
    assert "fails its CRC-32 check" in err and str(bad) in err and not out.exists()
    assert main(_with(_train_args(data, bad, epochs=2), "--resume", "--dry-run")) == 1
    assert "fails its CRC-32 check" in capsys.readouterr().err
    # the ranks check too (a bare torchrun, a restarted worker group)
    rc = loop.main(["--data", str(data["placed"]), *TINY, "--epochs", "2", "--checkpoint-dir", str(bad), "--resume"])
    assert rc == 1 and "fails its CRC-32 check" in capsys.readouterr().err


def test_a_checkpoint_whose_tensors_changed_after_saving_is_refused(data: dict[str, Path], tmp_path: Path) -> None:
    """A well-formed zip (CRCs match) whose weights are not the ones saved: the digest recorded at
    save time says so."""
    body = torch.load(checkpoint.path_in(data["ck"]), weights_only=True)
    assert body["tensors_sha256"] == checkpoint.tensors_digest(body)
    w = next(v for v in body["model"].values() if v.numel() > 100)
    w.view(-1)[7] += 1.0
    (tmp_path / "ck").mkdir()
    torch.save(body, checkpoint.path_in(tmp_path / "ck"))
    checkpoint.check_zip(checkpoint.path_in(tmp_path / "ck"))  # the zip itself is sound
    placed = checkpoint.DataIdentity.of(
        data["placed"], __import__("placement.placed").placed.open_placed(data["placed"]).manifest
    )

    cfg = TrainConfig.from_dict(body["config"])
    with pytest.raises(checkpoint.CheckpointError, match="do not match the sha256 recorded"):
        checkpoint.load(tmp_path / "ck", cfg, placed)
    assert checkpoint.load(data["ck"], cfg, placed) is not None


# -- M1, M2: the default path -------------------------------------------------------------------


def test_infer_on_a_placement_without_gpu_cache(data: dict[str, Path], tmp_path: Path) -> None:
    """M1: the default placement has an empty GPU-cache bin; training and infer read around it."""
    ck = tmp_path / "ck"
    assert loop.main(["--data", str(data["default"]), *TINY, "--epochs", "1", "--checkpoint-dir", str(ck)]) == 0
    m = infer(InferOptions(data=data["default"], checkpoint=ck, out=tmp_path / "o", device="cpu"))
    assert m.arrays["predictions"].shape == [3000]


def test_resume_of_a_run_whose_fanouts_came_from_the_placement(data: dict[str, Path], tmp_path: Path) -> None:
    """M2: the checkpoint records the placement's fan-outs; a plain --resume resolves them the same."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / checkpoint.FILENAME).write_bytes(checkpoint.path_in(data["ck"]).read_bytes())
    argv = ["--data", str(data["placed"]), *TINY, "--epochs", "2", "--checkpoint-dir", str(ck), "--resume"]
    preflight.preflight(check_command(argv), 2)  # no "cannot resume: made with fanouts=[...], this run has None"
    assert main(_with(_train_args(data, ck, epochs=2), "--resume", "--dry-run")) == 0
    assert loop.main(argv) == 0
    assert torch.load(checkpoint.path_in(ck), weights_only=True)["epoch"] == 2


# -- M4, M5: full disks -------------------------------------------------------------------------


def test_a_read_only_checkpoint_target_mid_run_is_one_line_and_the_rerun_resumes(
    data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """M4 (read-only): the file system of the checkpoint turns read-only after epoch 1 (injected:
    the second save fails with EROFS): one line naming the file and what was kept, exit 1; the
    rerun with --resume continues from epoch 1 and finishes."""
    ck = tmp_path / "ck"
    real_save = checkpoint.save

    def save(directory: str | Path, **kw: object) -> Path:
        if kw["epoch"] == 2:
            raise OSError(errno.EROFS, "Read-only file system", str(checkpoint.path_in(directory)))
        return real_save(directory, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint, "save", save)
    argv = ["--data", str(data["placed"]), *TINY, "--epochs", "3", "--checkpoint-dir", str(ck)]
    assert loop.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"error: {ck / checkpoint.FILENAME}: Read-only file system (epoch 2's checkpoint not written; epoch 1's kept)"
    )
    assert torch.load(checkpoint.path_in(ck), weights_only=True)["epoch"] == 1
    monkeypatch.setattr(checkpoint, "save", real_save)
    assert loop.main([*argv, "--resume"]) == 0
    assert torch.load(checkpoint.path_in(ck), weights_only=True)["epoch"] == 3


@contextlib.contextmanager
def small_fs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``where`` (skips the test where mounting is not allowed)."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_full_disk_during_training_is_one_line_and_keeps_the_last_checkpoint(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """M4: the second epoch's checkpoint does not fit: one line naming the file, exit 1, epoch 1's
    checkpoint whole (a rerun resumes it), no temporary file left, no rank left running."""
    size = checkpoint.path_in(data["ck"]).stat().st_size
    with small_fs(tmp_path / "fs", int(size * 1.6) + 65536) as fs, _no_orphans(str(tmp_path)):
        ck = fs / "ck"
        proc = _moment(_with(_train_args(data, ck, epochs=3), "--metrics-json", str(fs / "m.json")))
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        assert "Traceback" not in err, err
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("running:")]
        assert len(lines) == 1, err
        full = re.search(r": No space left on device \(epoch (\d+)'s checkpoint not written; epoch (\d+)'s kept\)", err)
        assert full and f"{ck / checkpoint.FILENAME}: No space" in lines[0], lines[0]
        kept = torch.load(checkpoint.path_in(ck), weights_only=True)
        assert kept["epoch"] == int(full[2]) == int(full[1]) - 1
        checkpoint.check_zip(checkpoint.path_in(ck))
        assert sorted(p.name for p in ck.iterdir()) == [".moment-lock", checkpoint.FILENAME]


@pytest.mark.slow
def test_a_disk_that_fills_during_infer_is_one_line_not_a_bus_error(data: dict[str, Path], tmp_path: Path) -> None:
    """M5: the output's arrays are written through memory maps; on a file system that filled up
    after the start-up check (the check is skipped here to get there) a write into a hole was
    SIGBUS. Now the arrays are allocated when made: one line naming the file, exit 1, and the
    rerun with room resumes and finishes."""
    with small_fs(tmp_path / "fs", 96 * 1024) as fs:
        out = fs / "emb"
        script = (
            "import sys, trainer.infer as ti; ti.check_free_space = lambda *a, **k: None; "
            "from moment.cli import main; sys.exit(main(sys.argv[1:]))"
        )
        args = ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["ck"]), "--out", str(out), *CPU]
        done = subprocess.run([sys.executable, "-c", script, *args], env=_env(), capture_output=True, text=True)
        assert done.returncode == 1, (done.returncode, done.stderr)
        assert "No space left on device" in done.stderr and "emb.partial" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
        again = subprocess.run([sys.executable, "-c", script, *args], env=_env(), capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        assert (out / "inference.json").is_file()
