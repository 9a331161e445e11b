"""``moment place``: a dataset + a plan → a placed dataset (GPU caches, CPU caches, SSD bins).

Steps, each reported: pre-sample hotness with the trainer's sampler (or load a saved one),
re-solve the plan's model for this dataset, its measured hotness and the cache sizes used
(``placement.predict``), place vertices with DDAK (or the hash baseline) against those per-bin
traffic targets, check free space on every target, link the dataset's topology, labels and
splits into the placed directory (copies where the file system refuses a link, found before any
work and counted in the free-space check; the check scan's checksums serve for the links, copies
are hashed beside the bin pass), write the bins in one sequential pass, save the row map (``old_to_new``: dataset
id → row in the bins' order), and commit: manifest last, then one rename. The placed dataset
numbers vertices as the dataset does: nothing of the graph is rewritten. Work happens in
``OUT.partial``; a killed run resumes from its last checkpoint when run again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moment import faults
from moment.contracts.placed import FORMAT, MANIFEST, Prediction
from moment.contracts.plan import PlanDoc, read_plan
from moment.cores import usable_cores
from moment.errors import MomentError, UsageError
from moment.host_memory import available_memory, release_freed_memory
from moment.outputs import Staging, check_free_space, check_out, write_inputs
from moment.planner.planfile import plan_profile
from moment.planner.workload import Workload, cap_cache_rows
from moment.progress import Progress, stage_update
from moment.sizes import Size, parse_size
from moment.topology.model import Machine
from placement import pack as pk
from placement.chunks import parse_budget
from placement.dataset import Dataset, check_dataset, open_dataset
from placement.ddak import BinSpec, Placement, hotness_order
from placement.digests import PLACED_DIGEST, file_digest
from placement.estimate import PROBE_BYTES, PlaceCost, cached_share, read_rate, write_rate
from placement.hotness import COUNT_TYPE, MIN_BATCHES, TOLERANCE, Hotness, presample
from placement.place_commit import (
    PLACED,
    commit,
    discard_build,
    file_size,
    inputs_key,
    intact,
    validate_placed,
)
from placement.place_pack import pack_bins, packed_prediction, remove_unpacked
from placement.place_write import (
    LINKED,
    Phases,
    PlaceRun,
    build_manifest,
    link_dataset_files,
    packed,
    refused_links,
    write_arrays,
    write_placed_bins,
)
from placement.policies import get_policy
from placement.predict import measured_workload, plan_prediction, predict
from placement.relabel import id_type
from placement.samples import bytes_bound
from placement.writer import read_ahead


@dataclass
class PlaceOptions:
    policy: str = "ddak"
    gpu_cache: str | None = None  # per GPU
    cpu_cache: str | None = None  # per socket (each holds one copy)
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
    # disk space for per-batch chunks and shared caches (placement.chunks): '20GB' or '2x' (the SSD
    # bins' bytes); None: the bins' rows ordered in place. Implies --pack.
    pack_budget: str | None = None


def _cache_sizes(opts: PlaceOptions) -> tuple[Size | None, Size | None]:
    """``--gpu-cache`` / ``--cpu-cache`` parsed (None: not given), before any work."""
    gpu = None if opts.gpu_cache is None else parse_size(opts.gpu_cache, "--gpu-cache")
    cpu = None if opts.cpu_cache is None else parse_size(opts.cpu_cache, "--cpu-cache")
    return gpu, cpu


def _cache_rows(plan: PlanDoc, ds: Dataset, opts: PlaceOptions) -> tuple[int, int]:
    """Rows of the GPU cache (each GPU) and the CPU cache (each socket), from ``--gpu-cache`` /
    ``--cpu-cache`` or else what the plan's workload recorded (its rows, or the GB / share of the
    vertices typed before the dataset was known, in this dataset's rows), capped by the vertices
    there are."""
    n, rb = ds.num_nodes, ds.row_bytes
    asked = plan.workload.asked_cache_rows(n, rb)
    given = _cache_sizes(opts)
    gpu, cpu = (rows if size is None else size.rows(n, rb) for rows, size in zip(asked, given))
    return cap_cache_rows(gpu, cpu, n)


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
    targets, place, check free space (and say what goes where), link the dataset's graph files,
    write the bins (hashing any copied files beside them), save the row map, stage the manifest
    and commit."""
    phases = Phases()
    run = _inputs(plan_path, dataset_path, Path(out), opts, phases)
    stage = _open_stage(run, log)
    if stage is None:
        return validate_placed(run.out).model_dump(mode="json")
    read_ahead(run.ds.features(), available_memory() // 4)  # while pre-sampling keeps the CPUs busy
    with phases("presample"):
        hot = _hotness(run, stage.data, progress, log)
    release_freed_memory()  # the sampler's freed blocks: not held through what follows
    with phases("predict"):
        workload, prediction, specs = _targets(run, hot, log)
    with phases("ddak"):
        placed = get_policy(run.opts.policy)(hot.counts, specs, hotness_order(hot.counts), run.opts)
    release_freed_memory()  # DDAK's order and the like: not held through the writes
    _preflight(run, specs, placed, hot, log)
    _begin(run, stage, hot, placed)
    hot, placed = _mapped(stage.data, hot, placed)
    packed = pk.load_state(stage.data, run.key) if run.opts.pack else None
    linked = link_dataset_files(run, stage.data, log)  # copies hashed in a thread beside the bin pass
    written = packed[0] if packed else write_placed_bins(run, stage, specs, placed, phases, progress)
    release_freed_memory()  # the bin pass's buffers, before the row map is built
    files = write_arrays(stage.data, placed, specs, workload, linked, phases)
    summary = None
    if run.opts.pack:
        written, summary = packed or pack_bins(run, stage, hot, specs, placed, written, phases, progress)
        remove_unpacked(run, stage, specs)
        prediction = packed_prediction(run, workload, prediction, summary, stage.data)
    manifest = build_manifest(run, stage, hot, prediction, specs, placed, written, files, phases, summary)
    manifest.write(stage.data / MANIFEST)
    faults.point("place:manifest-staged")
    return commit(stage, run.dirs, log).model_dump(mode="json")


def _inputs(plan_path: str | Path, dataset_path: str | Path, out: Path, opts: PlaceOptions, phases: Phases) -> PlaceRun:
    """Every input checked before any work (the dataset by a full scan, which also takes the
    checksums of its graph files: one read serves both), and the key naming them."""
    if opts.epochs is not None and opts.epochs < 1:
        raise UsageError(f"--epochs {opts.epochs}: pre-sampling needs at least 1 epoch")
    if opts.pool < 1:
        raise UsageError(f"--pool {opts.pool}: must be at least 1")
    if not 0 < opts.tolerance < 1:
        raise UsageError(f"--tolerance {opts.tolerance}: a share of reads, between 0 and 1")
    if opts.pack_epochs < 1 or (opts.pack_ranks is not None and opts.pack_ranks < 1):
        raise UsageError("--pack-epochs and --pack-ranks: must be at least 1")
    if opts.pack_budget is not None:
        parse_budget(opts.pack_budget, 1)  # its form, now; its bytes once the bins are known
        opts = replace(opts, pack=True)
    get_policy(opts.policy)
    _cache_sizes(opts)  # a mistyped size is refused before the dataset is scanned
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
    with phases("check"):
        # a full scan (a bad id must not wrap around or crash the trainer later), hashing as it reads
        scanned = check_dataset(ds, digest=PLACED_DIGEST)
    copies = refused_links({k: ds.path(k) for k in LINKED}, out)  # counted by the free-space check
    opts = replace(opts, ssd_dirs=dirs)
    if opts.pack and opts.pack_ranks is None:  # the trainer's world: one rank per planned GPU
        opts = replace(opts, pack_ranks=max(1, sum(s.kind == "gpu" for s in plan.layout.slots)))
    had_output = check_out(out, PLACED)
    caches = _cache_rows(plan, ds, opts)
    hot_given = (
        file_digest(opts.hotness, PLACED_DIGEST) if opts.hotness is not None and opts.hotness.is_file() else None
    )
    key = _key(
        FORMAT,  # a partial build of another format is started over, not resumed
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
        *([("pack_budget", opts.pack_budget)] if opts.pack_budget is not None else []),
    )
    run = PlaceRun(
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
        scanned,
        copies,
    )
    check_free_space(_space_needed(run, _least_rows(run)))  # what must fit whatever DDAK decides
    return run


def _open_stage(run: PlaceRun, log: Callable[[str], None]) -> Staging | None:
    """The staging directory: a killed run's commit finished, its partial build resumed or thrown
    away (other inputs); None when ``out`` already holds this very placement."""
    stage = Staging(run.out, PLACED)
    had_output = run.had_output
    if stage.resume():
        if stage.old.exists() or (stage.data / MANIFEST).exists():
            log(f"finishing the commit of an interrupted `moment place` into {run.out}")
            commit(stage, run.dirs, log)
            had_output = True
            stage = Staging(run.out, PLACED)
        elif stage.data.exists() and inputs_key(stage.data) != run.key:
            log(f"{stage.dir}: left by an interrupted run with other inputs: starting over")
            discard_build(stage)
        elif stage.data.exists():
            log(f"resuming the interrupted `moment place` in {stage.dir}")
    if had_output and not stage.data.exists():
        try:
            current = validate_placed(run.out)
        except MomentError:
            current = None
        if current is not None and current.key == run.key and intact(run.out):
            stage.release()
            log(f"{run.out} already holds this placement (same plan, dataset and options): nothing to do")
            return None
    return stage


def _hotness(run: PlaceRun, data: Path, progress: Progress | None, log: Callable[[str], None]) -> Hotness:
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


def _targets(run: PlaceRun, hot: Hotness, log: Callable[[str], None]) -> tuple[Workload, Prediction, list[BinSpec]]:
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


def _least_rows(run: PlaceRun) -> dict[str, int]:
    """Rows an SSD bin gets whatever the hotness: what the other SSD bins cannot hold of the
    vertices the caches leave (caches counted as empty, so a lower bound)."""
    specs = _bins(run.plan, run.ds, run.caches, {t.bin: 0.0 for t in run.plan.bin_targets})
    ssd = [s for s in specs if s.tier == "ssd"]
    held = sum(s.capacity for s in specs if s.tier != "ssd")
    left, room = max(0, run.ds.num_nodes - held), sum(s.capacity for s in ssd)
    return {s.name: max(0, left - (room - s.capacity)) for s in ssd}


def _space_needed(run: PlaceRun, bin_rows: dict[str, int], samples: int = 0) -> dict[Path, int]:
    """Bytes each target directory receives: its bins, and in ``out`` the topology and arrays
    (and ``samples``: the stored samples' bytes, :func:`_samples_bytes`)."""
    ds, opts = run.ds, run.opts
    needs: dict[Path, int] = {run.out: _arrays_bytes(run) + samples}
    ssd_bytes = sum(bin_rows.get(t.bin, 0) for t in run.plan.bin_targets if t.tier == "ssd") * ds.row_bytes
    budget = parse_budget(opts.pack_budget, ssd_bytes) if opts.pack_budget is not None else 0
    for t in run.plan.bin_targets:
        d = run.dirs.get(t.bin, run.out)
        size = bin_rows.get(t.bin, 0) * ds.row_bytes
        if opts.pack and t.tier == "ssd":  # packing writes from an unpacked copy, or chunks beside the bin
            size += size if opts.pack_budget is None else budget * size // max(ssd_bytes, 1)
        needs[d] = needs.get(d, 0) + size
    return needs


def _arrays_bytes(run: PlaceRun) -> int:
    """Bytes of a placed dataset besides its bins: the row map and the hotness (int32 unless N or
    a count passes 2^31 - 1), and those of the dataset's topology, labels and splits that must be
    copied (``run.copies``: the file system refused the link; hard links take no space)."""
    ds = run.ds
    n, ids, counts = ds.num_nodes, np.dtype(id_type(ds.num_nodes)).itemsize, np.dtype(COUNT_TYPE).itemsize
    return n * (ids + counts) + _copied_bytes(run)


def _copied_bytes(run: PlaceRun) -> int:
    """Bytes of the dataset's files that are copied, not linked."""
    return sum(file_size(run.ds.path(k)) for k in sorted(run.copies))


def _how_linked(run: PlaceRun) -> str:
    """How the dataset's topology, labels and splits reach ``out``, for the line ``place`` prints."""
    if not run.copies:
        return "linked"
    if len(run.copies) == len(LINKED):
        return "copied (the file system refuses hard links there)"
    return f"linked, but {', '.join(sorted(run.copies))} copied (the file system refused the link)"


def _samples_bytes(run: PlaceRun, hot: Hotness) -> int:
    """About the most ``--pack``'s stored samples take (:func:`placement.samples.bytes_bound`; 0
    without ``--pack``)."""
    if not run.opts.pack:
        return 0
    ranks, batch = run.opts.pack_ranks or 1, hot.batch_size
    batches = pk.replay_batches(len(run.ds.split("train")), batch, run.opts.pack_epochs, ranks)
    return bytes_bound(batches, batch, list(hot.fanouts), hot.mean_unique_per_batch, run.ds.num_nodes)


def _preflight(
    run: PlaceRun, specs: list[BinSpec], placed: Placement, hot: Hotness, log: Callable[[str], None]
) -> None:
    """Say what goes where and how long it should take; refuse (one line) where a target lacks
    the space. Nothing has been written yet."""
    samples = _samples_bytes(run, hot)
    needs = _space_needed(run, {s.name: int(placed.used[b]) for b, s in enumerate(specs)}, samples)
    for d, want in needs.items():
        names = [s.name for s in specs if run.dirs.get(s.name, run.out) == d]
        arrays = f"the row map, hotness, and the dataset's topology, labels and splits {_how_linked(run)}"
        what = ([arrays] if d == run.out else []) + ([f"bins {', '.join(names)}"] if names else [])
        what += [f"stored samples, at most {samples / 1e9:.2f} GB"] if samples and d == run.out else []
        log(f"will write {want / 1e9:.2f} GB to {d} ({'; '.join(what)})")
    check_free_space(needs)
    log(_cost(run, specs, placed, samples).line())


def _cost(run: PlaceRun, specs: list[BinSpec], placed: Placement, samples: int) -> PlaceCost:
    """What the rest of the run reads and writes, with the disks' rates measured now
    (:mod:`placement.estimate`): the time ``moment place`` announces before writing."""
    ds = run.ds
    features = ds.features()
    source = getattr(features, "filename", None)
    feature_bytes = ds.num_nodes * ds.row_bytes
    feature_read = (
        round(feature_bytes * (1 - cached_share(Path(source), int(getattr(features, "offset", 0))))) if source else 0
    )
    # links take the check scan's checksums: only copies are read again (by the copy, then hashed)
    topology_read = sum(round(file_size(ds.path(k)) * (1 - cached_share(ds.path(k)))) for k in sorted(run.copies))
    bins: dict[Path, int] = {}
    for b, s in enumerate(specs):  # a packed bin is written twice (unpacked, then packed)
        d = run.dirs.get(s.name, run.out)
        bins[d] = bins.get(d, 0) + int(placed.used[b]) * ds.row_bytes * (2 if packed(run, s) else 1)
    arrays = _arrays_bytes(run) + samples
    writes = {run.out: arrays, **{d: w + (arrays if d == run.out else 0) for d, w in bins.items()}}
    return PlaceCost(
        feature_bytes=feature_bytes,
        feature_read=feature_read,
        bin_bytes_by_dir=bins,
        out=run.out,
        array_bytes=arrays,
        topology_read=topology_read,
        copied_bytes=_copied_bytes(run),
        nodes=ds.num_nodes,
        read_rate=read_rate(Path(source)) if source and feature_read + topology_read else None,
        write_rates={d: write_rate(d, min(PROBE_BYTES, max(1 << 20, w))) for d, w in writes.items()},
        cores=usable_cores(),
        load=os.getloadavg()[0],
    )


def _mapped(data: Path, hot: Hotness, placed: Placement) -> tuple[Hotness, Placement]:
    """The counts and ``bin_of`` swapped for read-only maps of the files ``_begin`` saved (the
    same values): what follows reads them in order, once or twice, so they can live in the page
    cache instead of anonymous memory while the id maps are built (6 bytes per vertex less)."""
    counts = np.load(data / "hotness.npy", mmap_mode="r")
    return replace(hot, counts=counts), replace(placed, bin_of=np.load(data / "bin_of.npy", mmap_mode="r"))


def _begin(run: PlaceRun, stage: Staging, hot: Hotness, placed: Placement) -> None:
    """Create ``OUT.partial`` (locked) with what a resumed run must find: the inputs' key, the
    hotness and the placement (a resumed run must compute the same one)."""
    stage.create()  # OUT.partial, locked (when resuming it is ours already)
    data = stage.data
    data.mkdir(exist_ok=True)
    write_inputs(data, run.key, bin_dirs=sorted({str(d) for d in run.dirs.values()}))
    if not (data / "hotness.npy").exists():
        hot.save(data / "hotness.npy")
    bin_file = data / "bin_of.npy"
    if bin_file.exists() and not np.array_equal(np.load(bin_file), placed.bin_of):
        raise MomentError(
            f"{bin_file}: the resumed placement differs from the saved one (a bug): remove {stage.dir} to start over"
        )
    np.save(bin_file, placed.bin_of)
    faults.point("place:planned")
