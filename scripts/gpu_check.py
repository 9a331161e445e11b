"""The steps of scripts/gpu_check.sh and its report (OUT/report.json, OUT/report.md, OUT/steps.log).

``run`` runs :data:`STEPS` in order, each under ``timeout -k`` with a limit of its own and within
the check's deadline; a step that fails or times out is recorded and the next one runs. After
every step report.json and report.md are rewritten whole (atomically), so a check killed at any
point leaves a report of the steps done; SIGTERM records the running step as killed. ``record``
adds one step run by the shell (the install); ``finish`` marks the report finished.

The steps: moment demo (data, plan, placement, a first run); one CUDA rank training that data
with the graph on the GPU and CPU-cache rows gathered in place (uva), its memory budget from
``moment train --dry-run --json`` against the peaks it measured, inference on CUDA and on the CPU
(max relative difference, vertices/s), the same training with ``--sampling uva``, ``cpu`` and
``--host-gather stage`` and on one CPU rank (the ratio), the feature store with posix and kvikio
(compat mode) against raw random reads, the gpu tests, nccl ranks where there are two GPUs or
more, and the read engines. ``--self-test`` runs every command with the CPU device: steps that
need CUDA must then refuse in one line (no traceback), the others succeed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "moment.gpu-check/1"
LOG_CAP = 512 << 10  # bytes of one step's output kept in steps.log (its head and tail): 16 steps stay under 16 MiB
HEAD = 16 << 10


@dataclass
class Step:
    name: str
    argv: list[str]
    limit: int  # seconds on one GPU with 16 cores (the self-test scales it)
    cpu: str = "ok"  # in --self-test: "ok" (exit 0) or "refused" (one line, exit != 0)
    env: dict[str, str] = field(default_factory=dict)
    needs: list[str] = field(default_factory=list)  # paths an earlier step must have written
    when: str = ""  # a reason to skip it here ("" runs it)


def steps(work: Path, dev: str, ngpu: int, bench_dir: Path, small: bool = False) -> list[Step]:
    """The check's steps in order, cheap and decisive first. ``dev``: cuda, or cpu (self-test);
    ``small``: the self-test's sizes (a fifth of the demo's graph, one epoch, small reads), the
    same command lines otherwise."""
    py = sys.executable
    demo, placed, plan = work / "demo", work / "demo" / "placed", work / "demo" / "plan.json"
    epochs = "1" if small else "3"
    train = [py, "-m", "moment", "train", "--plan", str(plan), "--data", str(placed), "--epochs", epochs]
    model = ["--hidden", "128", "--device", dev]  # 3 epochs: the last one's figures are past warm-up

    def run(name: str, nproc: int, *extra: str, ck: bool = False, cpu: str = "ok", when: str = "") -> Step:
        out = ["--nproc", str(nproc), "--metrics-json", str(work / f"{name}.json")]
        out += ["--checkpoint-dir", str(work / "ck")] if ck else []
        return Step(name, [*train, *out, "--", *model, *extra], 60, cpu=cpu, needs=[str(placed)], when=when)

    infer = [py, "-m", "moment", "infer", "--plan", str(plan), "--data", str(placed), "--checkpoint", str(work / "ck")]
    bench = [py, "scripts/bench_features.py", str(placed), "--rounds", "1" if small else "3", "--seconds", "1"]
    demo_cmd = [py, "-m", "moment", "demo", "--workdir", str(demo), "--epochs", "1", "--nproc", "1"]
    demo_cmd += ["--nodes", "20000"] if small else []
    reads = ["--size-mb", "64", "--reads", "2000"] if small else ["--size-mb", "1024", "--reads", "20000"]
    gpu = ["--sampling", "gpu", "--host-gather", "uva"] if dev == "cuda" else []
    # The bin pass's CPU side over 1, 4 and 16 cores (tmpfs: no disk in it): what the place
    # estimate's BIN_CORES assumes and a 2-core CI machine cannot show.
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else bench_dir
    bins = [py, "scripts/bench_bin_pass.py", "--dir", str(shm / f"moment-bin-pass-{os.getpid()}"), "--runs", "1"]
    bins += ["--rows", "20000", "--dim", "256", "--threads", "1,2"] if small else ["--threads", "1,2,4,8,16"]
    return [
        Step("demo", demo_cmd, 90),
        run("train-gpu", 1, *gpu, ck=True),
        Step(
            "memory-budget",
            [*train, "--nproc", "1", "--dry-run", "--json", "--", *model, *gpu],
            30,
            needs=[str(placed)],
        ),
        Step("infer-cuda", [*infer, "--out", str(work / "infer-cuda"), "--device", dev], 45, needs=[str(work / "ck")]),
        Step("infer-cpu", [*infer, "--out", str(work / "infer-cpu"), "--device", "cpu"], 60, needs=[str(work / "ck")]),
        Step("pytest-gpu", [py, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", "-m", "gpu", "tests"], 120),
        Step(
            "features-posix",
            [*bench, "--device", dev, "--io", "posix", "--json", str(work / "features-posix.json")],
            30,
            needs=[str(placed)],
        ),
        Step(  # the real library's settings API, as the reader uses it (needs no GPU)
            "kvikio-config",
            [py, "-c", KVIKIO_CONFIG],
            30,
            env={"KVIKIO_COMPAT_MODE": "ON"},
        ),
        Step(
            "features-kvikio",
            [*bench, "--device", dev, "--io", "kvikio", "--json", str(work / "features-kvikio.json")],
            30,
            cpu="refused",
            env={"KVIKIO_COMPAT_MODE": "ON"},  # GPUDirect Storage is rare: say so, not "direct"
            needs=[str(placed)],
        ),
        run(
            "train-nccl",
            max(ngpu, 2),
            *gpu,
            "--backend",
            "nccl",
            cpu="refused",
            when="" if ngpu >= 2 or dev == "cpu" else f"{ngpu} GPU: nccl ranks need two",
        ),
        Step(
            "read-engines",
            [py, "scripts/bench_readers.py", "--dir", str(bench_dir), "--direct", *reads]
            + ["--threads", "16,64", "--rounds", "1"],
            45,
        ),
        Step("bin-pass-cores", bins, 40),
        # The training variants last: each is a full start of torchrun, torch and CUDA (30 s on the
        # first GPU run), worth less than the checks above when the budget runs short.
        # Every --sampling and every --host-gather at least once: gpu+uva above, uva+stage, cpu+uva.
        run("train-uva-sampling", 1, "--sampling", "uva", "--host-gather", "stage"),  # CPU: samples there, a note
        run("train-cpu-sampling", 1, "--sampling", "cpu"),
        Step(
            "train-cpu-rank",
            [*train, "--nproc", "1", "--metrics-json", str(work / "train-cpu-rank.json"), "--", "--hidden", "128"]
            + ["--device", "cpu"],
            90,
            needs=[str(placed)],
        ),
    ]


KVIKIO_CONFIG = (
    "from trainer.readers import configure_kvikio, import_kvikio, kvikio_mode; k = import_kvikio(); "
    "print(f'kvikio {k.__version__}: set {configure_kvikio(k, 16)}, files open as {kvikio_mode(k)}')"
)


# ---------------------------------------------------------------- the report


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def save(out: Path, doc: dict[str, Any]) -> None:
    """report.json and report.md, each replaced whole (a reader never sees half a file)."""
    doc["failed"] = sum(s["status"] not in ("ok", "skipped") for s in doc["steps"])
    for name, text in (("report.json", json.dumps(doc, indent=2) + "\n"), ("report.md", markdown(doc))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def append_log(out: Path, name: str, text: bytes) -> None:
    """One step's output into steps.log, its head and tail where it is longer than LOG_CAP."""
    if len(text) > LOG_CAP:
        cut = len(text) - LOG_CAP
        text = text[:HEAD] + f"\n[... {cut:,} bytes left out ...]\n".encode() + text[-(LOG_CAP - HEAD) :]
    with (out / "steps.log").open("ab") as f:
        f.write(f"\n===== {name} ({now()}) =====\n".encode() + text)


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# moment GPU check ({doc['mode']}), {doc['started']}", ""]
    state = "finished" if doc.get("finished") else "**not finished** (killed, or still running)"
    lines += [f"{state}; {doc.get('failed', 0)} step(s) not ok; logs: steps.log", "", "## Machine", "", "```"]
    lines += [f"{k}: {v}" for k, v in doc["machine"].items()] + ["```", "", "## Steps", ""]
    lines += ["| step | status | exit | seconds | figures |", "|---|---|---|---|---|"]
    for s in doc["steps"]:
        figs = "; ".join(f"{k} {_short(v)}" for k, v in s["figures"].items() if k != "lines")
        lines.append(f"| {s['name']} | {s['status']} | {s['exit']} | {s['seconds']} | {figs} |")
    lines += ["", "## Figures", ""]
    for s in doc["steps"]:
        for line in s["figures"].get("lines", []):
            lines.append(f"- {s['name']}: {line}")
    lines += ["", "## Commands", ""]
    lines += [f"- {s['name']}: `{s['command']}`" for s in doc["steps"] if s["command"]]
    return "\n".join(lines) + "\n"


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------- figures of each step


def figures(step: str, work: Path, log: str) -> dict[str, Any]:
    """What the step measured, from the files it wrote (and its log); {} where there is nothing."""
    try:
        if step.startswith("train-") or step == "demo":
            return train_figures(work / ("demo/metrics.json" if step == "demo" else f"{step}.json"), step, work)
        if step == "memory-budget":
            return budget_figures(log, work / "train-gpu.json")
        if step.startswith("infer-"):
            return infer_figures(work, step.removeprefix("infer-"))
        if step.startswith("features-"):
            return bench_figures(work / f"{step}.json")
        if step == "pytest-gpu":
            return pytest_figures(log)
        if step == "kvikio-config":
            return {"lines": [ln for ln in log.splitlines() if ln.startswith("kvikio ")][-1:]}
        if step == "bin-pass-cores":
            return {"lines": [ln.split("; grouping")[0] for ln in log.splitlines() if ln.startswith("run ")]}
        if step == "read-engines":
            return {
                "lines": [ln for ln in log.splitlines() if re.match(r"\s*(threads|\d+\s)", ln) or "random" in ln][:6]
            }
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:  # a figure is missing: say which
        return {"lines": [f"no figures: {type(exc).__name__}: {exc}"]}
    return {}


def train_figures(path: Path, step: str, work: Path) -> dict[str, Any]:
    from moment.contracts.metrics import MetricsDoc

    doc = MetricsDoc.read(path).model_dump(mode="json")
    last = doc["epochs"][-1]
    fig: dict[str, Any] = {
        "seeds_per_s": round(last["seeds_per_s"], 1),
        "data_wait_share": round(last["data_wait_s"] / last["epoch_s"], 3) if last["epoch_s"] else None,
        "sampling": (doc["sampling"] or {}).get("where"),
        "host_gather": "uva" if any("in place (uva)" in r for r in doc["ranks"]) else "stage",
        "on_plan_gpus": doc["on_plan_gpus"],
        "memory": doc.get("memory"),
    }
    lines = [
        f"{doc['world_size']} rank(s) ({'; '.join(doc['ranks'])}), last of {len(doc['epochs'])} epoch(s): "
        f"{last['seeds_per_s']:,.0f} seeds/s, data wait {last['data_wait_s']:.3f} of {last['epoch_s']:.3f} s"
    ]
    if doc["on_plan_gpus"]:
        lines.append(
            f"measured {doc['measured_iteration_s']} s/iteration vs predicted {doc['predicted_iteration_s']} s"
        )
    else:  # the prediction is for the plan's machine (moment-machine-b), not this one
        lines.append("no 'vs predicted': the ranks are not on the plan's GPUs (on_plan_gpus false)")
    # A uva run that silently ran another way (cudaHostRegister refused: the CPU path) still exits 0.
    cfg, cuda = doc["config"], doc["ranks"][0].startswith("cuda")
    if cuda and cfg.get("sampling") in ("gpu", "uva") and fig["sampling"] != cfg["sampling"]:
        fig["fell_back"] = (
            f"sampling.where {fig['sampling']}, asked {cfg['sampling']}: {(doc['sampling'] or {}).get('note')}"
        )
    elif cuda and cfg.get("host_gather") == "uva" and fig["host_gather"] != "uva":
        fig["fell_back"] = "--host-gather uva asked, CPU-cache rows staged instead (see the log's warning)"
    if "fell_back" in fig:
        lines.append(f"FELL BACK: {fig['fell_back']}")
    from trainer.metrics import read_share_rows

    rows = read_share_rows(doc["prediction"], doc["epochs"])
    if rows:
        worst = max(rows, key=lambda r: abs(r[2] - r[1]))
        fig["read_share_max_dev"] = round(abs(worst[2] - worst[1]), 4)
        lines.append(
            f"closed loop: worst read share {worst[0]} measured {worst[2]:.3f} vs predicted {worst[1]:.3f} "
            f"({'within' if fig['read_share_max_dev'] <= 0.03 else 'OUTSIDE'} 0.03)"
        )
    base = work / "train-gpu.json"
    if step == "train-cpu-rank" and base.exists():
        gpu = MetricsDoc.read(base).epochs[-1].seeds_per_s
        fig["gpu_over_cpu_rank"] = round(gpu / last["seeds_per_s"], 2) if last["seeds_per_s"] else None
        lines.append(f"train-gpu's seeds/s over this CPU rank's: {fig['gpu_over_cpu_rank']}")
    fig["lines"] = lines
    return fig


def budget_figures(log: str, measured: Path) -> dict[str, Any]:
    from moment.contracts.metrics import MetricsDoc

    start = log.index("{")
    mem = json.JSONDecoder().raw_decode(log[start:])[0]["memory"]
    fig: dict[str, Any] = {
        "gpu_bytes_per_rank": mem["gpu_bytes_per_rank"],
        "host_bytes_per_node": mem["host_bytes_per_node"],
    }
    got = MetricsDoc.read(measured).memory if measured.exists() else None
    lines = [
        f"budget: GPU {mem['gpu_bytes_per_rank'] / 2**20:,.1f} MiB/rank, host {mem['host_bytes_per_node'] / 2**20:,.1f} MiB/node"
    ]
    if got is not None:
        if got.gpu_peak_allocated_bytes and mem["gpu_bytes_per_rank"]:
            fig["gpu_peak_over_budget"] = round(got.gpu_peak_allocated_bytes / mem["gpu_bytes_per_rank"], 3)
        fig["rss_peak_over_budget"] = round(got.host_peak_rss_bytes / mem["host_bytes_per_node"], 3)
        base = got.host_base_rss_bytes
        grown = "" if base is None else f", {(got.host_peak_rss_bytes - base) / 2**20:,.1f} MiB above the base "
        if base is not None:  # the base: torch and CUDA up, before the data (the budget's "runtime" holds it)
            fig["rss_growth_over_budget"] = round((got.host_peak_rss_bytes - base) / mem["host_bytes_per_node"], 3)
            grown += f"(ratio {fig['rss_growth_over_budget']}) of {base / 2**20:,.1f} MiB with torch and the device up"
        lines.append(
            f"train-gpu measured: GPU peak allocated {(got.gpu_peak_allocated_bytes or 0) / 2**20:,.1f} MiB "
            f"(ratio {fig.get('gpu_peak_over_budget')}), peak RSS {got.host_peak_rss_bytes / 2**20:,.1f} MiB{grown}"
        )
    fig["lines"] = lines
    return fig


def infer_figures(work: Path, dev: str) -> dict[str, Any]:
    import numpy as np

    from moment.contracts.inference import InferenceManifest

    out = work / f"infer-{dev}"
    doc = InferenceManifest.read(out / "inference.json")
    layers = [t for t in doc.throughput if t.stage != "export"]
    vps = sum(t.vertices for t in layers) / max(sum(t.seconds for t in layers), 1e-9)
    fig: dict[str, Any] = {"vertices_per_s": round(vps, 1), "test_acc": doc.accuracy.get("test")}
    lines = [f"{vps:,.0f} vertices/s over {len(layers)} layer(s), test accuracy {doc.accuracy.get('test')}"]
    other = work / "infer-cuda"
    if dev == "cpu" and (other / "inference.json").exists():
        a = np.load(other / "embeddings.npy").astype(np.float64)
        b = np.load(out / "embeddings.npy").astype(np.float64)
        scale = float(np.abs(b).max()) or 1.0
        fig["max_rel_diff_vs_cuda"] = float(np.abs(a - b).max() / scale)
        lines.append(f"embeddings: max |cuda - cpu| / max |cpu| = {fig['max_rel_diff_vs_cuda']:.3g}")
    fig["lines"] = lines
    return fig


def bench_figures(path: Path) -> dict[str, Any]:
    b = json.loads(path.read_text())
    fig = {k: b.get(k) for k in ("store_gbps", "raw_gbps", "ratio", "reader", "engine", "modes", "routes", "per_call")}
    fig["lines"] = [
        f"store {b['store_gbps']:.3f} GB/s vs raw {b['raw_gbps']:.3f} GB/s (ratio {b['ratio']:.2f}), {b['reader']} "
        f"(engine {b.get('engine')}), modes {b.get('modes')}; demo rows are 128 B, the bins a few MB: "
        "the page cache serves them (a functional check, not an SSD figure)"
    ]
    if b.get("per_call"):  # where a call's time goes: a store slower than raw reads shows it here
        fig["lines"].append("per get: " + ", ".join(f"{k} {v}" for k, v in b["per_call"].items()))
    return fig


def pytest_figures(log: str) -> dict[str, Any]:
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log)}
    skips = [ln.strip() for ln in log.splitlines() if ln.startswith("SKIPPED")]
    fails = [ln.strip() for ln in log.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {**counts, "lines": [*fails, *skips][:30]}


def error_lines(log: str) -> list[str]:
    """What a failed step said: its error lines (a MomentError's one line, argparse's, a
    traceback's last), else its last three lines."""
    lines = log.strip().splitlines()
    errors = [ln.strip() for ln in lines if re.search(r"(^|\s|:)error\b|^\w*(Error|Exception)\b", ln)]
    return errors[-3:] or lines[-3:]


# ---------------------------------------------------------------- running


class KilledError(Exception):
    """The check was sent SIGTERM or SIGHUP."""


def _term(signum: int, frame: Any) -> None:
    raise KilledError(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    doc = load(out)
    dev = "cpu" if args.self_test else "cuda"
    handlers = {sig: signal.signal(sig, _term) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run_steps(args, out, work, doc, dev)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _run_steps(args: argparse.Namespace, out: Path, work: Path, doc: dict[str, Any], dev: str) -> int:
    for st in steps(work, dev, args.ngpu, Path(args.bench_dir or work), small=args.self_test):
        if args.only and st.name not in args.only.split(","):
            continue
        record: dict[str, Any] = {"name": st.name, "command": " ".join(st.argv), "exit": None, "seconds": 0}
        left = args.deadline - time.time() - 5
        limit = int(st.limit * args.scale)
        missing = [p for p in st.needs if not Path(p).exists()]
        why = st.when or (f"needs {', '.join(missing)} (an earlier step failed)" if missing else "")
        if not why and left < min(limit, 10):
            why = f"out of time ({left:.0f} s left of the check's budget)"
        if why:
            doc["steps"].append({**record, "status": "skipped" if st.when else "not run", "figures": {"lines": [why]}})
            save(out, doc)
            continue
        limit = int(min(limit, left))
        env = {**os.environ, **st.env}
        start = time.monotonic()
        proc = subprocess.Popen(
            ["timeout", "-k", "10", str(limit), *st.argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        try:
            text, _ = proc.communicate()
            rc = proc.returncode
        except KilledError as exc:
            proc.terminate()
            text, _ = proc.communicate()
            record.update(exit=None, seconds=round(time.monotonic() - start, 1), status=f"killed ({exc})")
            record["figures"] = {"lines": ["the check was killed during this step"]}
            append_log(out, st.name, text or b"")
            doc["steps"].append(record)
            save(out, doc)
            return 1
        log = text.decode(errors="replace")
        append_log(out, st.name, text)
        record.update(exit=rc, seconds=round(time.monotonic() - start, 1))
        if rc in (124, 137):
            status = f"timed out ({limit} s)"
        elif args.self_test and st.cpu == "refused":
            status = "ok" if rc != 0 and "Traceback" not in log else "failed (expected a one-line refusal on the CPU)"
        else:
            status = "ok" if rc == 0 else "failed"
        record["figures"] = figures(st.name, work, log) if rc == 0 else {"lines": error_lines(log)}
        if status == "ok" and record["figures"].get("fell_back") and not args.self_test:
            status = "fell back"
        record["status"] = status
        doc["steps"].append(record)
        save(out, doc)
        print(f"gpu_check: {st.name}: {status} ({record['seconds']} s)", file=sys.stderr)
    return 0


def start(args: argparse.Namespace) -> int:
    """A new report: the machine block, no steps yet."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.log").write_bytes(b"")
    doc = {
        "format": FORMAT,
        "mode": "self-test (CPU)" if args.self_test else "gpu",
        "started": now(),
        "finished": None,
        "machine": {},
        "steps": [],
    }
    save(out, doc)
    return 0


def machine(args: argparse.Namespace) -> int:
    """The report's machine block: what the figures depend on (a sandbox's kernel, the engines)."""
    import platform
    import shutil

    info: dict[str, Any] = {"python": f"{platform.python_version()} ({sys.executable})", "torch": args.torch}
    try:
        import torch

        info["cuda (torch)"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001 (the block says what failed; the steps will too)
        info["torch error"] = f"{type(exc).__name__}: {exc}"
    if shutil.which("nvidia-smi"):  # optional: a sandbox may not mount it
        q = "--query-gpu=index,name,memory.total,pci.bus_id,driver_version"
        done = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia-smi"] = done.stdout.strip().splitlines() or done.stderr.strip()[:200]
    else:
        info["nvidia-smi"] = "not found (optional)"
    info["kernel"] = platform.release()
    try:  # gVisor and Firecracker say so here: their I/O figures are the virtual disk's
        info["/proc/version"] = Path("/proc/version").read_text().strip()
    except OSError:
        info["/proc/version"] = "unreadable"
    info["cpus"] = len(os.sched_getaffinity(0))
    try:
        import numba

        info["numba"] = numba.__version__
    except Exception as exc:  # noqa: BLE001 (without numba the python read engine runs)
        info["numba"] = f"not importable ({type(exc).__name__}: {exc})"
    from moment.uring import uring_reads
    from trainer.readers import ENGINE_ENV, import_kvikio, pick_engine

    info["read engine (auto)"] = pick_engine("auto") + (f" ({ENGINE_ENV})" if os.environ.get(ENGINE_ENV) else "")
    info["io_uring"] = uring_reads()[1] or "usable"
    try:
        kvikio = import_kvikio()
        d = kvikio.defaults
        info["kvikio"] = (
            f"{kvikio.__version__}: compat mode preferred {d.is_compat_mode_preferred()}, "
            f"gds_threshold {d.get('gds_threshold')}, num_threads {d.get('num_threads')}"
        )
    except Exception as exc:  # noqa: BLE001 (import_kvikio's ImportError, or the settings of another version)
        info["kvikio"] = f"not usable ({exc})"
    doc = load(Path(args.out))
    doc["machine"] = info
    save(Path(args.out), doc)
    return 0


def record(args: argparse.Namespace) -> int:
    """One step the shell ran (the install): its log goes in steps.log."""
    out = Path(args.out)
    doc = load(out)
    text = Path(args.log).read_bytes() if args.log and Path(args.log).exists() else b""
    append_log(out, args.name, text)
    status = "ok" if args.exit == 0 else ("timed out" if args.exit in (124, 137) else "failed")
    lines = [ln for ln in text.decode(errors="replace").splitlines() if ln.startswith(("install", "keep"))]
    doc["steps"].append(
        {
            "name": args.name,
            "command": args.command,
            "exit": args.exit,
            "seconds": args.seconds,
            "status": status,
            "figures": {"lines": lines if status == "ok" else text.decode(errors="replace").splitlines()[-3:]},
        }
    )
    save(out, doc)
    return 0


def finish(args: argparse.Namespace) -> int:
    out = Path(args.out)
    doc = load(out)
    doc["finished"] = now()
    doc["seconds"] = args.seconds
    save(out, doc)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("out")
    s.add_argument("--self-test", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--work", required=True)
    r.add_argument("--ngpu", type=int, default=0)
    r.add_argument("--deadline", type=float, required=True, help="epoch seconds the last step must end by")
    r.add_argument("--scale", type=float, default=1.0, help="times each step's limit")
    r.add_argument("--bench-dir")
    r.add_argument("--only", help="comma-separated step names")
    r.add_argument("--self-test", action="store_true")
    c = sub.add_parser("record")
    c.add_argument("out")
    c.add_argument("--name", required=True)
    c.add_argument("--exit", type=int, required=True)
    c.add_argument("--seconds", type=int, required=True)
    c.add_argument("--command", default="")
    c.add_argument("--log")
    m = sub.add_parser("machine")
    m.add_argument("out")
    m.add_argument("--torch", default="")
    f = sub.add_parser("finish")
    f.add_argument("out")
    f.add_argument("--seconds", type=int, default=None)
    args = ap.parse_args()
    return {"start": start, "run": run, "record": record, "machine": machine, "finish": finish}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
