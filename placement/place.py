"""``moment place``: a dataset + a plan → a placed dataset (GPU caches, CPU caches, SSD bins).

Steps, each reported: pre-sample hotness with the trainer's sampler (or load a saved one),
re-solve the plan's model for this dataset, its measured hotness and the cache sizes used
(``placement.predict``), place vertices with DDAK (or the hash baseline) against those per-bin
traffic targets, relabel, check free space on every target, write the bins in one sequential
pass, rewrite topology, labels and splits in the new ids, and commit: manifest last, then one
rename. Work happens in ``OUT.partial``; a killed run resumes from its last checkpoint when run
again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moment import faults
from moment.contracts.placed import (
    MANIFEST,
    PHASES,
    PackSummary,
    PlacedError,
    PlacedManifest,
    Prediction,
    bin_file_name,
)
from moment.contracts.plan import PlanDoc, read_plan
from moment.errors import MomentError, UsageError
from moment.fileio import atomic_write_text
from moment.outputs import Kind, Staging, check_free_space, check_out
from moment.planner.planfile import plan_profile
from moment.planner.workload import Workload
from moment.progress import Progress, stage_update
from moment.topology.model import Machine
from placement import pack as pk
from placement import relabel as rl
from placement.dataset import Dataset, check_dataset, open_dataset
from placement.ddak import BinSpec, Placement, hotness_order
from placement.hotness import MIN_BATCHES, TOLERANCE, Hotness, presample
from placement.placed import open_placed
from placement.policies import get_policy
from placement.predict import measured_workload, plan_prediction, predict, write_workload
from placement.writer import STATE, BinFile, NpyWriter, Written, file_digest, save_npy, write_bins

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b|%|rows)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_rows(text: str, what: str, num_nodes: int, row_bytes: int) -> int:
    """Cache budget in rows from '2GB', '512MiB', '1%' (of the vertices) or '10000rows'."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"{what} {text!r}: expected a size like 2GB, 512MiB, 1% or 10000rows")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
        if value > 100:
            raise UsageError(f"{what} {text!r}: a share of the vertices is at most 100%")
        return int(num_nodes * value / 100)
    if unit == "rows":
        return int(value)
    return int(value * _UNITS[unit] // row_bytes)


@dataclass
class PlaceOptions:
    policy: str = "ddak"
    gpu_cache: str | None = None  # per GPU
    cpu_cache: str | None = None  # all sockets together
    ssd_dirs: dict[str, Path] = field(default_factory=dict)
    hotness: Path | None = None
    epochs: int | None = None  # None: pre-sample until the hotness estimate converges (at most one epoch)
    tolerance: float = TOLERANCE  # the split-half gap at which pre-sampling stops (epochs=None)
    pool: int = 100
    priority: str = "projected"  # DDAK priority: projected (matches targets) or paper
    seed: int = 0  # pre-sampling's, and with --pack the trainer's --seed whose batches are replayed
    profile: Machine | None = None  # the plan's profile where not bundled; another profile's plan is refused
    pack: bool = False  # lay SSD rows out in the order the trainer's first batches read them (placement.pack)
    pack_epochs: int = 1  # training epochs replayed for --pack
    pack_ranks: int | None = None  # training ranks replayed for --pack (None: the plan's GPUs)


def _cache_rows(plan: PlanDoc, ds: Dataset, opts: PlaceOptions) -> tuple[int, int]:
    """Rows of the GPU cache (each GPU) and the CPU cache (each socket), from ``--gpu-cache`` /
    ``--cpu-cache`` or else the plan's workload (``gpu_cache_gb``, ``cpu_cache_fraction``: one
    source of truth), capped by the vertices there are."""
    workload = plan.workload
    rb, n = ds.row_bytes, ds.num_nodes
    if opts.gpu_cache is not None:
        gpu_rows = parse_rows(opts.gpu_cache, "--gpu-cache", n, rb)
    else:
        gpu_rows = int(workload.gpu_cache_gb * 1e9 // rb)
    if opts.cpu_cache is not None:
        cpu_rows = parse_rows(opts.cpu_cache, "--cpu-cache", n, rb)
    else:
        cpu_rows = int(n * workload.cpu_cache_fraction)
    gpu_rows = min(gpu_rows, n)
    return gpu_rows, min(cpu_rows, n - gpu_rows)


def _bins(plan: PlanDoc, ds: Dataset, caches: tuple[int, int], shares: dict[str, float]) -> list[BinSpec]:
    """DDAK bins: the caches of ``caches`` rows, the SSDs as large as their capacity, each with
    its share of reads from ``shares`` (the prediction's)."""
    cap = {"gpu": caches[0], "cpu": caches[1]}
    rb, n = ds.row_bytes, ds.num_nodes
    return [
        BinSpec(
            t.bin,
            t.tier,
            cap[t.tier] if t.tier in cap else min(int((t.capacity_gb or 1e6) * 1e9 // rb), n),
            shares[t.bin],
        )
        for t in plan.bin_targets
    ]


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _validate_placed(root: Path) -> PlacedManifest:
    return PlacedManifest.read(root / MANIFEST)


def _placed_files(root: Path) -> list[Path]:
    """The files of a placed dataset that ``moment place`` wrote and may remove: each listed in
    its validated manifest, with the size the manifest records, bins under the run's own name."""
    m = PlacedManifest.read(root / MANIFEST)
    owned = []
    for b in m.bins:
        path = Path(b.path) if Path(b.path).is_absolute() else root / b.path
        if path.name == bin_file_name(b.name, m.run_id) and _size(path) == b.bytes:
            owned.append(path)
    owned += [root / f.path for f in m.files.values() if _size(root / f.path) == f.bytes]
    return [*owned, root / MANIFEST]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else -1
    except OSError:
        return -1


PLACED = Kind("placed dataset", MANIFEST, "moment place", _validate_placed, _placed_files, PlacedError)
INPUTS = "inputs.json"  # in the staging data dir: the key of the inputs a partial build is for
SCRATCH = (INPUTS, "bin_of.npy", STATE, pk.STATE)  # build state, removed before publishing
# Files of a placed directory besides the bins (manifest key -> name). hotness_new.npy: counts
# in new ids; hotness.npy + .json: the same in original ids, usable as `moment place --hotness`.
PLACED_FILES = {
    "indptr": "indptr.npy",
    "indices": "indices.npy",
    "labels": "labels.npy",
    "train": "train_idx.npy",
    "val": "val_idx.npy",
    "test": "test_idx.npy",
    "old_to_new": "old_to_new.npy",
    "new_to_old": "new_to_old.npy",
    "hotness": "hotness_new.npy",
    "hotness_counts": "hotness.npy",
    "hotness_meta": "hotness.json",
    "workload": "workload.yaml",
}


def _ssd_dirs(opts: PlaceOptions, out: Path) -> dict[str, Path]:
    """Absolute SSD directories (a relative one would later be resolved against the placed
    directory), none inside the output (publishing renames it)."""
    dirs = {}
    for name, d in opts.ssd_dirs.items():
        path = Path(d).absolute()
        if path.exists() and not path.is_dir():
            raise UsageError(f"--ssd-dir {name}={d}: not a directory")
        for inner in (out.absolute(), out.absolute().with_name(out.name + ".partial")):
            if path == inner or path.is_relative_to(inner):
                raise UsageError(
                    f"--ssd-dir {name}={d}: inside the output directory {out}; give a directory outside it"
                )
        dirs[name] = path
    return dirs


def _inputs_key(data: Path) -> str | None:
    try:
        return json.loads((data / INPUTS).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _intact(root: Path) -> bool:
    """Every file of a placed dataset present at its recorded size (cheap; no checksums)."""
    try:
        open_placed(root)
        return True
    except MomentError:
        return False


def _finish_bins(m: PlacedManifest, data: Path) -> None:
    """Give every bin its final name (idempotent: a killed run may have renamed some already)."""
    for b in m.bins:
        final = Path(b.path) if Path(b.path).is_absolute() else data / b.path
        partial = final.with_name(final.name + ".partial")
        if partial.exists():
            partial.replace(final)
        elif _size(final) != b.bytes:
            raise PlacedError(f"{final}: missing or truncated while committing; remove {data.parent} and run again")


def _commit(stage: Staging, dirs: dict[str, Path], log: Callable[[str], None]) -> PlacedManifest:
    """Finish a staged placement (manifest written in ``data``): bins renamed, scratch removed,
    published over the old placement. Every step is idempotent, so a killed commit is finished
    by the next run."""
    m = PlacedManifest.read(stage.data / MANIFEST) if stage.data.exists() else None
    if m is not None:
        _finish_bins(m, stage.data)
        faults.point("place:bins-renamed")
        for name in SCRATCH:
            (stage.data / name).unlink(missing_ok=True)
    keep = [Path(b.path) for b in m.bins if Path(b.path).is_absolute()] if m else []
    for note in stage.publish("place", keep=keep, external_dirs=dirs.values()):
        log(f"note: {note}")
    return _validate_placed(stage.out)


def _discard_build(stage: Staging) -> None:
    """Throw away a killed run's partial build made with other inputs: the staging directory is
    this command's (its marker and lock prove it), and outside it only ``.partial`` bins under
    this run's id, in the directories that build recorded."""
    try:
        recorded = json.loads((stage.data / INPUTS).read_text()).get("bin_dirs", [])
    except (OSError, ValueError, AttributeError):
        recorded = []
    for d in recorded:
        for f in Path(d).glob(f"*-{stage.run_id}.bin.partial"):
            f.unlink()
    shutil.rmtree(stage.data)


@dataclass
class _Run:
    """One ``moment place``: its validated inputs and the key naming them."""

    plan_path: Path
    dataset_path: Path
    out: Path
    opts: PlaceOptions
    plan: PlanDoc
    machine: Machine | None
    no_machine: str | None
    ds: Dataset
    dirs: dict[str, Path]
    caches: tuple[int, int]
    key: str
    had_output: bool
    read_rate: float  # bytes per second this run read the dataset's topology at (the time estimate's basis)


class Phases:
    """Seconds per phase of a run (placed.json ``timings_s``, keys of ``PHASES``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def written(self, files: list[NpyWriter], phase: str, wall: float) -> None:
        """``wall`` seconds spent writing ``files`` in ``phase``: their hashing and fsync apart."""
        hashing, syncing = sum(f.hash_s for f in files), sum(f.fsync_s for f in files)
        self.add(phase, wall - hashing - syncing)
        self.add("checksums", hashing)
        self.add("fsync", syncing)

    def rounded(self) -> dict[str, float]:
        """The seconds in ``PHASES`` order, with the total so far."""
        seconds = {**self.seconds, "total": time.perf_counter() - self.start}
        return {k: round(seconds[k], 3) for k in PHASES if k in seconds}


def place(
    plan_path: str | Path,
    dataset_path: str | Path,
    out: str | Path,
    opts: PlaceOptions,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Place a dataset per a plan; returns the manifest written (``placed.json``).

    The phases, each a function below and each timed (``timings_s``): check the inputs, open or
    resume the staging directory, pre-sample hotness, re-solve the plan's model for DDAK's
    targets, place, check free space (and say what goes where), write the bins, relabel and
    rewrite the arrays, stage the manifest and commit."""
    phases = Phases()
    run = _inputs(plan_path, dataset_path, Path(out), opts, phases)
    stage = _open_stage(run, log)
    if stage is None:
        return _validate_placed(run.out).model_dump(mode="json")
    with phases("presample"):
        hot = _hotness(run, stage.data, progress, log)
    with phases("predict"):
        workload, prediction, specs = _targets(run, hot, log)
    with phases("ddak"):
        placed = get_policy(run.opts.policy)(hot.counts, specs, hotness_order(hot.counts), run.opts)
    _preflight(run, specs, placed, log)
    _begin(run, stage, hot, placed)
    packed = pk.load_state(stage.data, run.key) if run.opts.pack else None
    written = packed[0] if packed else _write_bins(run, stage, specs, placed, phases, progress)
    files = _write_arrays(run, stage.data, hot, placed, specs, workload, phases, progress)
    summary = None
    if run.opts.pack:
        written, summary = packed or _pack(run, stage, hot, specs, placed, written, phases, progress)
        _remove_unpacked(run, stage, specs)
        prediction = _packed_prediction(run, workload, prediction, summary, stage.data)
    manifest = _manifest(run, stage, hot, prediction, specs, placed, written, files, phases, summary)
    manifest.write(stage.data / MANIFEST)
    faults.point("place:manifest-staged")
    return _commit(stage, run.dirs, log).model_dump(mode="json")


def _inputs(plan_path: str | Path, dataset_path: str | Path, out: Path, opts: PlaceOptions, phases: Phases) -> _Run:
    """Every input checked before any work (the dataset by a full scan), and the key naming them."""
    if opts.epochs is not None and opts.epochs < 1:
        raise UsageError(f"--epochs {opts.epochs}: pre-sampling needs at least 1 epoch")
    if opts.pool < 1:
        raise UsageError(f"--pool {opts.pool}: must be at least 1")
    if not 0 < opts.tolerance < 1:
        raise UsageError(f"--tolerance {opts.tolerance}: a share of reads, between 0 and 1")
    if opts.pack_epochs < 1 or (opts.pack_ranks is not None and opts.pack_ranks < 1):
        raise UsageError("--pack-epochs and --pack-ranks: must be at least 1")
    get_policy(opts.policy)
    plan = read_plan(plan_path)
    try:
        machine, no_machine = plan_profile(plan, opts.profile)
    except UsageError as exc:
        raise UsageError(f"{plan_path}: {exc}") from None
    unknown = set(opts.ssd_dirs) - {t.bin for t in plan.bin_targets if t.tier == "ssd"}
    if unknown:
        raise UsageError(f"--ssd-dir names {', '.join(sorted(unknown))}, which the plan has no SSD bin for")
    ds = open_dataset(dataset_path)
    dirs = _ssd_dirs(opts, out)
    check_out(out, PLACED)  # absent, empty or a placed dataset: anything else refused before any work
    t0 = time.perf_counter()
    with phases("check"):
        check_dataset(ds)  # a full scan: a bad id must not wrap around or crash the trainer later
    scanned = sum(_size(ds.path(k)) for k in ("indptr", "indices", "labels", "train", "val", "test"))
    opts = replace(opts, ssd_dirs=dirs)
    if opts.pack and opts.pack_ranks is None:  # the trainer's world: one rank per planned GPU
        opts = replace(opts, pack_ranks=max(1, sum(s.kind == "gpu" for s in plan.layout.slots)))
    had_output = check_out(out, PLACED)
    caches = _cache_rows(plan, ds, opts)
    hot_given = file_digest(opts.hotness) if opts.hotness is not None and opts.hotness.is_file() else None
    key = _key(
        plan.profile.model_dump(),
        plan.workload.model_dump(mode="json"),
        [t.model_dump() for t in plan.bin_targets],
        ds.meta,
        caches,
        machine is not None,
        opts.policy,
        opts.pool,
        opts.priority,
        opts.seed,
        opts.epochs,
        opts.tolerance if opts.epochs is None else None,
        tuple(plan.workload.fanouts),
        plan.workload.batch_size,
        hot_given,
        {k: str(v) for k, v in dirs.items()},
        str(Path(dataset_path).resolve()),
        *([("pack", opts.pack_epochs, opts.pack_ranks)] if opts.pack else []),
    )
    rate = scanned / max(time.perf_counter() - t0, 1e-6)
    run = _Run(
        Path(plan_path),
        Path(dataset_path),
        out,
        opts,
        plan,
        machine,
        no_machine,
        ds,
        dirs,
        caches,
        key,
        had_output,
        rate,
    )
    check_free_space(_space_needed(run, _least_rows(run)))  # what must fit whatever DDAK decides
    return run


def _open_stage(run: _Run, log: Callable[[str], None]) -> Staging | None:
    """The staging directory: a killed run's commit finished, its partial build resumed or thrown
    away (other inputs); None when ``out`` already holds this very placement."""
    stage = Staging(run.out, PLACED)
    had_output = run.had_output
    if stage.resume():
        if stage.old.exists() or (stage.data / MANIFEST).exists():
            log(f"finishing the commit of an interrupted `moment place` into {run.out}")
            _commit(stage, run.dirs, log)
            had_output = True
            stage = Staging(run.out, PLACED)
        elif stage.data.exists() and _inputs_key(stage.data) != run.key:
            log(f"{stage.dir}: left by an interrupted run with other inputs: starting over")
            _discard_build(stage)
        elif stage.data.exists():
            log(f"resuming the interrupted `moment place` in {stage.dir}")
    if had_output and not stage.data.exists():
        try:
            current = _validate_placed(run.out)
        except MomentError:
            current = None
        if current is not None and current.key == run.key and _intact(run.out):
            stage.release()
            log(f"{run.out} already holds this placement (same plan, dataset and options): nothing to do")
            return None
    return stage


def _hotness(run: _Run, data: Path, progress: Progress | None, log: Callable[[str], None]) -> Hotness:
    """The hotness a killed run already computed, a saved one, or pre-sampled now (until the
    estimate converges at the cache boundaries, or for ``--epochs``)."""
    ds, opts = run.ds, run.opts
    hot_file = data / "hotness.npy"
    if hot_file.exists():
        hot = Hotness.load(hot_file)
    elif opts.hotness is not None:
        hot = Hotness.load(opts.hotness, num_nodes=ds.num_nodes)
    else:
        gpu_rows, cpu_rows = run.caches
        hot = presample(
            ds,
            fanouts=tuple(run.plan.workload.fanouts),
            batch_size=run.plan.workload.batch_size,
            epochs=opts.epochs,
            seed=opts.seed,
            progress=stage_update(progress, "pre-sampling hotness"),
            boundaries=(gpu_rows, gpu_rows + cpu_rows),
            tolerance=opts.tolerance,
        )
    if hot.counts.shape != (ds.num_nodes,):
        raise UsageError(f"hotness has {hot.counts.shape[0]} vertices, the dataset {ds.num_nodes}")
    bound = "not measured" if hot.bound is None else f"split-half gap at the caches {hot.bound:.4f}"
    log(
        f"hotness: {hot.batches} batches ({bound}"
        + (f", sampling until {hot.tolerance}" if hot.tolerance is not None else f", {hot.epochs} epoch(s) as asked")
        + f"), {hot.mean_unique_per_batch:,.0f} unique vertices per batch; "
        f"top 1% of vertices catch {dict(hot.curve((0.01,)))[0.01]:.1%} of reads"
    )
    if hot.batches < MIN_BATCHES:
        log(
            f"warning: the hotness comes from only {hot.batches} pre-sampled batch(es) (fewer than {MIN_BATCHES}), "
            f"so its ranking of vertices is noisy: raise --epochs"
        )
    elif hot.tolerance is not None and (hot.bound is None or hot.bound > hot.tolerance):
        log(
            f"warning: the hotness estimate did not converge to {hot.tolerance} in {hot.batches} batches: the caches' "
            f"predicted share may be off by up to {hot.bound or 1:.3f} (--epochs 2 or more samples longer; "
            "--tolerance accepts a looser estimate)"
        )
    return hot


def _targets(run: _Run, hot: Hotness, log: Callable[[str], None]) -> tuple[Workload, Prediction, list[BinSpec]]:
    """The plan's model re-solved for this dataset and these caches: DDAK's per-bin targets."""
    workload = measured_workload(run.plan.workload, run.ds, hot, *run.caches)
    if run.machine is not None:
        prediction = predict(run.plan, run.machine, workload)
    else:
        prediction = plan_prediction(run.plan)
        log(
            f"warning: {run.no_machine}, so the targets and the prediction recorded are the plan's, made for its own "
            f"workload ({run.plan.workload.nodes:,} vertices), not re-solved for this dataset"
        )
    return workload, prediction, _bins(run.plan, run.ds, run.caches, prediction.bin_shares)


def _least_rows(run: _Run) -> dict[str, int]:
    """Rows an SSD bin gets whatever the hotness: what the other SSD bins cannot hold of the
    vertices the caches leave (caches counted as empty, so a lower bound)."""
    specs = _bins(run.plan, run.ds, run.caches, {t.bin: 0.0 for t in run.plan.bin_targets})
    ssd = [s for s in specs if s.tier == "ssd"]
    held = sum(s.capacity for s in specs if s.tier != "ssd")
    left, room = max(0, run.ds.num_nodes - held), sum(s.capacity for s in ssd)
    return {s.name: max(0, left - (room - s.capacity)) for s in ssd}


def _space_needed(run: _Run, bin_rows: dict[str, int]) -> dict[Path, int]:
    """Bytes each target directory receives: its bins, and in ``out`` the topology and arrays."""
    ds = run.ds
    needs: dict[Path, int] = {run.out: _arrays_bytes(ds)}
    for t in run.plan.bin_targets:
        d = run.dirs.get(t.bin, run.out)
        copies = 2 if run.opts.pack and t.tier == "ssd" else 1  # packing writes from an unpacked copy
        needs[d] = needs.get(d, 0) + copies * bin_rows.get(t.bin, 0) * ds.row_bytes
    return needs


def _arrays_bytes(ds: Dataset) -> int:
    """Topology, labels, id maps and hotness of a placed dataset (splits: at most N ids)."""
    return ds.num_edges * ds.indices().dtype.itemsize + (ds.num_nodes + 1) * 8 + 5 * ds.num_nodes * 8


def _preflight(run: _Run, specs: list[BinSpec], placed: Placement, log: Callable[[str], None]) -> None:
    """Say what goes where and how long it should take; refuse (one line) where a target lacks
    the space. Nothing has been written yet."""
    needs = _space_needed(run, {s.name: int(placed.used[b]) for b, s in enumerate(specs)})
    for d, want in needs.items():
        names = [s.name for s in specs if run.dirs.get(s.name, run.out) == d]
        what = (["topology, labels, id maps"] if d == run.out else []) + ([f"bins {', '.join(names)}"] if names else [])
        log(f"will write {want / 1e9:.2f} GB to {d} ({'; '.join(what)})")
    features = run.ds.num_nodes * run.ds.row_bytes
    moved = features + sum(needs.values()) + run.ds.num_edges * run.ds.indices().dtype.itemsize
    log(
        f"expected: about {moved / run.read_rate:.0f} s to read {features / 1e9:.2f} GB of features and the topology "
        f"and write {sum(needs.values()) / 1e9:.2f} GB (at the {run.read_rate / 1e9:.2f} GB/s this run read the "
        "topology at; a plain copy's speed)"
    )
    check_free_space(needs)


def _begin(run: _Run, stage: Staging, hot: Hotness, placed: Placement) -> None:
    """Create ``OUT.partial`` (locked) with what a resumed run must find: the inputs' key, the
    hotness and the placement (a resumed run must compute the same one)."""
    stage.create()  # OUT.partial, locked (when resuming it is ours already)
    data = stage.data
    data.mkdir(exist_ok=True)
    atomic_write_text(
        data / INPUTS, json.dumps({"key": run.key, "bin_dirs": sorted({str(d) for d in run.dirs.values()})})
    )
    if not (data / "hotness.npy").exists():
        hot.save(data / "hotness.npy")
    bin_file = data / "bin_of.npy"
    if bin_file.exists() and not np.array_equal(np.load(bin_file), placed.bin_of):
        raise MomentError(
            f"{bin_file}: the resumed placement differs from the saved one (a bug): remove {stage.dir} to start over"
        )
    np.save(bin_file, placed.bin_of)
    faults.point("place:planned")


def _bin_path(run: _Run, stage: Staging, spec: BinSpec) -> Path:
    """Where a bin's file goes: its --ssd-dir, else inside the placed directory."""
    where = run.dirs.get(spec.name) or (
        stage.data / ("cache" if spec.tier != "ssd" else f"bins/{spec.name.replace(':', '-')}")
    )
    return where / bin_file_name(spec.name, stage.run_id)


def _write_bins(
    run: _Run, stage: Staging, specs: list[BinSpec], placed: Placement, phases: Phases, progress: Progress | None
) -> list[Written]:
    """The bins, one sequential pass over the source features (.partial names until the commit)."""
    files = []
    for b, s in enumerate(specs):
        path = _unpacked_path(run, stage, s) if _packed(run, s) else _partial(_bin_path(run, stage, s))
        files.append(BinFile(s.name, path, int(placed.used[b])))
    t0 = time.perf_counter()
    result = write_bins(
        run.ds.features(), placed.bin_of, files, stage.data, run.key, progress=stage_update(progress, "writing bins")
    )
    phases.add("write_bins", time.perf_counter() - t0 - result.wait)
    phases.add("checksums", result.hash)
    phases.add("fsync", result.fsync)
    faults.point("place:bins-written")
    return result.files


def _packed(run: _Run, spec: BinSpec) -> bool:
    return run.opts.pack and spec.tier == "ssd"


def _partial(final: Path) -> Path:
    return final.with_name(final.name + ".partial")


def _unpacked_path(run: _Run, stage: Staging, spec: BinSpec) -> Path:
    """Where the bin writer puts a bin that is then packed (beside it, under this run's id, so
    that a run with other inputs finds and removes it: ``_discard_build``)."""
    return _partial(_bin_path(run, stage, spec).with_name(bin_file_name(f"{spec.name}-unpacked", stage.run_id)))


def _slot_file(name: str) -> str:
    return f"pack_{name.replace(':', '-')}.npy"


def _pack(
    run: _Run,
    stage: Staging,
    hot: Hotness,
    specs: list[BinSpec],
    placed: Placement,
    written: list[Written],
    phases: Phases,
    progress: Progress | None,
) -> tuple[list[Written], PackSummary]:
    """Replay the trainer's first batches over the relabelled graph, save each SSD bin's slot
    map, write the packed bins from their unpacked copies, and record that all of it is done."""
    data, opts = stage.data, run.opts
    with phases("pack"):
        order = rl.bin_order([s.tier for s in specs])
        starts = dict(zip(order, np.cumsum([0] + [int(placed.used[b]) for b in order]).tolist()))
        ssd = [b for b in order if specs[b].tier == "ssd"]
        arrays = {k: np.load(data / PLACED_FILES[k], mmap_mode="r") for k in ("indptr", "indices", "train")}
        ranks, epochs = opts.pack_ranks or 1, opts.pack_epochs
        fanouts, batch = list(hot.fanouts), hot.batch_size
        plan = pk.plan_pack(
            lambda: pk.replay(
                arrays["indptr"], arrays["indices"], arrays["train"], fanouts, batch, opts.seed, epochs, ranks
            ),
            [starts[b] for b in ssd],
            [int(placed.used[b]) for b in ssd],
            run.ds.row_bytes,
            stage_update(progress, "replaying the training batches"),
            pk.replay_batches(len(arrays["train"]), batch, epochs, ranks),
        )
        slots = {}
        for b, slot in zip(ssd, plan.slots):
            save_npy(data / _slot_file(specs[b].name), slot, rl.id_type(max(slot.size, 1))).close()
            slots[specs[b].name] = _slot_file(specs[b].name).removesuffix(".npy")
        faults.point("place:pack-planned")
        summary = PackSummary(
            epochs=epochs,
            ranks=ranks,
            seed=opts.seed,
            batch_size=batch,
            fanouts=fanouts,
            batches=plan.batches,
            slots=slots,
            useful_bytes=plan.useful_bytes,
            unpacked_bytes=plan.unpacked_bytes,
            packed_bytes=plan.packed_bytes,
            reads=plan.reads,
        )
        done = list(written)
        for b, slot in zip(ssd, plan.slots):
            final = _partial(_bin_path(run, stage, specs[b]))
            done[b] = pk.write_packed(written[b].path, final, specs[b].name, slot, run.ds.row_bytes)
        pk.save_state(data, run.key, done, summary)
    faults.point("place:packed")
    return done, summary


def _remove_unpacked(run: _Run, stage: Staging, specs: list[BinSpec]) -> None:
    """The unpacked copies, once the packed bins and the state recording them are on disk."""
    for s in specs:
        if _packed(run, s):
            _unpacked_path(run, stage, s).unlink(missing_ok=True)


def _packed_prediction(
    run: _Run, workload: Workload, prediction: Prediction, summary: PackSummary, data: Path
) -> Prediction:
    """The prediction for the packed layout: the workload's SSD reads are the replay's (mean
    bytes moved per read, pages per feature byte), the model re-solved with them for the
    iteration time. DDAK's targets (``bin_shares``) stay those it placed by: packing comes after."""
    amp = summary.amplification
    if amp is None or summary.reads == 0:  # the replayed batches read no SSD row: nothing to pack for
        return prediction
    packed = workload.model_copy(
        update={"ssd_pack_bytes": max(1, round(summary.packed_bytes / summary.reads)), "ssd_pack_amplification": amp}
    )
    write_workload(data / PLACED_FILES["workload"], packed)
    update: dict[str, Any] = {"ssd_amplification": amp}
    if run.machine is not None:
        update["iteration_s"] = predict(run.plan, run.machine, packed).iteration_s
    return prediction.model_copy(update=update)


def _write_arrays(
    run: _Run,
    data: Path,
    hot: Hotness,
    placed: Placement,
    specs: list[BinSpec],
    workload: Workload,
    phases: Phases,
    progress: Progress | None,
) -> dict[str, NpyWriter]:
    """Topology, labels, splits, id maps and hotness in the new ids, each written front to back
    and checksummed on the way; returns them by manifest key."""
    ds = run.ds
    t0 = time.perf_counter()
    r = rl.relabel(placed.bin_of, [s.tier for s in specs])
    n = ds.num_nodes
    files = {
        "indptr": NpyWriter(data / PLACED_FILES["indptr"], np.int64, (n + 1,)),
        "indices": NpyWriter(data / PLACED_FILES["indices"], ds.indices().dtype, (ds.num_edges,)),
    }
    rl.rewrite_csr(
        ds.indptr(),
        ds.indices(),
        r,
        files["indptr"],
        files["indices"],
        progress=stage_update(progress, "rewriting topology"),
    )
    for key, values, dtype in (("labels", ds.labels(), ds.labels().dtype), ("hotness", hot.counts, np.int64)):
        files[key] = NpyWriter(data / PLACED_FILES[key], dtype, (n,))
        rl.permute(values, r.new_to_old, files[key])
    for split in ("train", "val", "test"):
        ids = r.old_to_new[np.asarray(ds.split(split))]
        ids.sort()
        files[split] = save_npy(data / PLACED_FILES[split], ids, np.int64)
    files["old_to_new"] = save_npy(data / PLACED_FILES["old_to_new"], r.old_to_new, np.int64)
    files["new_to_old"] = save_npy(data / PLACED_FILES["new_to_old"], r.new_to_old, np.int64)
    for f in files.values():
        f.close()
    write_workload(data / PLACED_FILES["workload"], workload)
    phases.written(list(files.values()), "relabel", time.perf_counter() - t0)
    faults.point("place:arrays-written")
    return files


def _manifest(
    run: _Run,
    stage: Staging,
    hot: Hotness,
    prediction: Prediction,
    specs: list[BinSpec],
    placed: Placement,
    written: list[Written],
    files: dict[str, NpyWriter],
    phases: Phases,
    pack: PackSummary | None = None,
) -> PlacedManifest:
    """placed.json: final bin names, sizes and checksums (taken while writing), the prediction."""
    data, ds, opts = stage.data, run.ds, run.opts
    r_order = rl.bin_order([s.tier for s in specs])
    starts = np.concatenate(([0], np.cumsum([int(placed.used[b]) for b in r_order])))
    shares = placed.shares()
    bins_meta = []
    for i, idx in enumerate(r_order):
        spec, w, final = specs[idx], written[idx], _bin_path(run, stage, specs[idx])
        bins_meta.append(
            {
                "name": spec.name,
                "tier": spec.tier,
                "start": int(starts[i]),
                "count": int(placed.used[idx]),
                "path": str(final.relative_to(data)) if final.is_relative_to(data) else str(final),
                "bytes": w.bytes,
                "digest": w.digest,
                "target": spec.target,
                "achieved": float(shares[idx]),
                "capacity": spec.capacity,
            }
        )
    entries = {k: {"path": PLACED_FILES[k], "bytes": f.bytes, "digest": f.digest} for k, f in files.items()}
    written_apart = {k: PLACED_FILES[k] for k in ("hotness_counts", "hotness_meta", "workload")}  # by their modules
    written_apart.update({key: f"{key}.npy" for key in (pack.slots.values() if pack else ())})  # slot maps
    for k, name in written_apart.items():
        path = data / name
        entries[k] = {"path": name, "bytes": path.stat().st_size, "digest": file_digest(path)}
    doc = {
        "format": PlacedManifest.FORMAT,
        "run_id": stage.run_id,
        "key": run.key,
        "source": {"path": str(run.dataset_path.resolve()), "name": ds.meta.get("name")},
        "plan": {
            "path": str(run.plan_path.resolve()),
            "profile": run.plan.profile.model_dump(),
            "layout": run.plan.layout.name,
        },
        "policy": opts.policy,
        "pool": opts.pool,
        "priority": opts.priority if "priority" in get_policy(opts.policy).reads else None,
        "num_nodes": ds.num_nodes,
        "num_edges": ds.num_edges,
        "feature_dim": ds.feature_dim,
        "feature_dtype": ds.meta["feature_dtype"],
        "num_classes": ds.num_classes,
        "hotness": {
            "batches": hot.batches,
            "epochs": hot.epochs,
            "fanouts": list(hot.fanouts),
            "batch_size": hot.batch_size,
            "mean_unique_per_batch": hot.mean_unique_per_batch,
            "curve": hot.curve(),
            "bound": hot.bound,
            "tolerance": hot.tolerance,
        },
        "prediction": prediction.model_dump(),
        "bins": bins_meta,
        "files": entries,
        "timings_s": phases.rounded(),
        "pack": pack.model_dump() if pack else None,
    }
    return PlacedManifest.parse(doc, data / MANIFEST)  # a bug here is one line naming the field, not a traceback
