"""``moment place``'s outputs: the bins in one sequential pass, the dataset's topology, labels and
splits linked into the placed directory (hard links; copies where the file system cannot link,
decided before any work by :func:`refused_links`), the row map (``old_to_new``), and placed.json
built from what was written (sizes and checksums taken on the way), with the seconds each phase
took.

A linked file's checksum is the one the check scan took while reading it
(:func:`placement.dataset.check_dataset`): the link is another name for the same inode, and the
placed name's identity (device, inode, size, mtime) is compared with the scanned file's, so the
graph is read once. A copy, or a file that changed since the scan, is hashed from the placed name
in a thread beside the bin pass (a copy's digest must also equal the scan's of its source).

A hard link is another name for the dataset's file: nothing of the placed dataset depends on the
dataset's directory afterwards. moment never writes into a published dataset's file (imports and
``moment dataset`` build a new dataset in a staging directory and rename it into place; removing
or replacing one unlinks its names), so the placed name keeps the bytes its digest was taken of,
and ``moment verify`` checks them like any other file."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moment import faults
from moment.contracts.placed import MANIFEST, PHASES, PackSummary, PlacedManifest, Prediction, bin_file_name
from moment.contracts.plan import PlanDoc
from moment.errors import MomentError
from moment.outputs import Staging
from moment.planner.workload import Workload
from moment.progress import Progress, stage_update
from moment.topology.model import Machine
from placement import relabel as rl
from placement.dataset import Dataset, ScannedFile, file_identity
from placement.ddak import BinSpec, Placement
from placement.digests import PLACED_DIGEST, file_digest
from placement.hotness import Hotness
from placement.policies import get_policy
from placement.predict import write_workload
from placement.samples import FILES as SAMPLE_FILES
from placement.writer import BinFile, NpyWriter, Written, save_npy, write_bins

if TYPE_CHECKING:
    from placement.place import PlaceOptions

# Files of a placed directory besides the bins (manifest key -> name). hotness.npy + .json: the
# counts place was placed by (dataset ids), usable as `moment place --hotness`.
PLACED_FILES = {
    "indptr": "indptr.npy",
    "indices": "indices.npy",
    "labels": "labels.npy",
    "train": "train_idx.npy",
    "val": "val_idx.npy",
    "test": "test_idx.npy",
    "old_to_new": "old_to_new.npy",
    "hotness_counts": "hotness.npy",
    "hotness_meta": "hotness.json",
    "workload": "workload.yaml",
}

# The dataset's own files a placed directory holds, by manifest key (links, or copies).
LINKED = ("indptr", "indices", "labels", "train", "val", "test")
# Why a hard link fails where a copy works: another file system, links refused (EPERM: a
# protected_hardlinks policy or a file system without links), too many links, unsupported.
NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EACCES}
LINK_PROBE_PREFIX = ".moment-link-probe-"  # mkdtemp's: a directory only this process created


@dataclass
class PlaceRun:
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
    scanned: dict[str, ScannedFile] = field(default_factory=dict)  # the check scan's digests (LINKED keys)
    copies: frozenset[str] = frozenset()  # LINKED keys the file system refused to link: copied


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
        """``wall`` seconds spent writing ``files`` in ``phase``, less what it waited for their
        hashing and fsync; those ran in threads beside it and are their own phases (busy time)."""
        self.add(phase, wall - sum(f.wait_s for f in files))
        self.add("checksums", sum(f.hash_s for f in files))
        self.add("fsync", sum(f.fsync_s for f in files))

    def rounded(self) -> dict[str, float]:
        """The seconds in ``PHASES`` order, with the total so far."""
        seconds = {**self.seconds, "total": time.perf_counter() - self.start}
        return {k: round(seconds[k], 3) for k in PHASES if k in seconds}


def bin_path(run: PlaceRun, stage: Staging, spec: BinSpec) -> Path:
    """Where a bin's file goes: its --ssd-dir, else inside the placed directory."""
    where = run.dirs.get(spec.name) or (
        stage.data / ("cache" if spec.tier != "ssd" else f"bins/{spec.name.replace(':', '-')}")
    )
    return where / bin_file_name(spec.name, stage.run_id)


def packed(run: PlaceRun, spec: BinSpec) -> bool:
    """Whether ``spec``'s bin is packed (``--pack`` without ``--pack-budget``: SSD bins), i.e.
    first written unpacked."""
    return run.opts.pack and run.opts.pack_budget is None and spec.tier == "ssd"


def partial(final: Path) -> Path:
    """A bin's name until the commit."""
    return final.with_name(final.name + ".partial")


def unpacked_path(run: PlaceRun, stage: Staging, spec: BinSpec) -> Path:
    """Where the bin writer puts a bin that is then packed (beside it, under this run's id, so
    that a run with other inputs finds and removes it: ``discard_build``)."""
    return partial(bin_path(run, stage, spec).with_name(bin_file_name(f"{spec.name}-unpacked", stage.run_id)))


def write_placed_bins(
    run: PlaceRun, stage: Staging, specs: list[BinSpec], placed: Placement, phases: Phases, progress: Progress | None
) -> list[Written]:
    """The bins, one sequential pass over the source features (.partial names until the commit)."""
    files = []
    for b, s in enumerate(specs):
        path = unpacked_path(run, stage, s) if packed(run, s) else partial(bin_path(run, stage, s))
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


def refused_links(sources: dict[str, Path], out: Path) -> frozenset[str]:
    """The keys of ``sources`` the file system refuses to hard-link where ``out``'s staging
    directory goes (:data:`NO_LINK`: another file system, a protected_hardlinks policy, too many
    links): those are copied, and the free-space check counts them. Tried now, before any work,
    in a directory this process creates exclusively beside ``OUT.partial`` and removes (its
    links, then itself)."""
    where = out.absolute().parent
    while not where.exists():
        where = where.parent
    try:
        probe = Path(tempfile.mkdtemp(prefix=LINK_PROBE_PREFIX, dir=where))
    except OSError as exc:
        raise MomentError(f"{where}: cannot create a directory there for {out} ({exc.strerror})") from None
    refused = set()
    try:
        for key, src in sources.items():
            try:
                os.link(src, probe / key)
            except OSError as exc:
                if exc.errno not in NO_LINK:
                    raise MomentError(f"{src}: cannot link it into {where} ({exc.strerror})") from None
                refused.add(key)
            else:
                (probe / key).unlink()
    finally:
        probe.rmdir()
    return frozenset(refused)


def link_file(src: Path, dst: Path, copy: bool = False) -> bool:
    """``dst`` a hard link of ``src`` (True), else, with ``copy`` or where the file system refuses
    the link (:data:`NO_LINK`), a copy made in the kernel and synced (False). A name already at
    ``dst`` (an interrupted run's) is replaced: unlinked, never written into."""
    dst.unlink(missing_ok=True)
    if not copy:
        try:
            os.link(src, dst)
            return True
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
    shutil.copyfile(src, dst)  # copy_file_range/sendfile: no bytes through this process
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return False


@dataclass
class LinkedFiles:
    """The dataset's files in the placed directory, the entries of copies (and of files changed
    since the scan) being hashed in a thread (:meth:`entries` waits for them)."""

    seconds: float  # spent linking or copying
    _hashed: Future[tuple[dict[str, Written], float]]

    def entries(self) -> tuple[dict[str, Written], float, float]:
        """Each file's entry, once hashed; the hashing's busy seconds, and how long this waited."""
        t0 = time.perf_counter()
        done, busy = self._hashed.result()
        return done, busy, time.perf_counter() - t0


def _entries(paths: dict[str, Path], scanned: dict[str, ScannedFile]) -> tuple[dict[str, Written], float]:
    """Each placed file's entry: the scan's digest where the placed name is the scanned file
    (same identity: a link), else hashed from the placed name, which for a copy of an unchanged
    source must give the scan's digest too; and the seconds spent hashing."""
    t0 = time.perf_counter()
    out = {}
    for k, p in paths.items():
        seen, now = scanned.get(k), file_identity(p)
        if seen is not None and seen.identity == now and seen.algorithm == PLACED_DIGEST:
            out[k] = Written(k, p, now[2], seen.digest, seen.algorithm)
            continue
        digest = file_digest(p, PLACED_DIGEST)
        if seen is not None and seen.algorithm == PLACED_DIGEST and digest != seen.digest and _unchanged(seen):
            raise MomentError(f"{p}: the copy of {seen.path} differs from it (checksum): the copy is damaged")
        out[k] = Written(k, p, now[2], digest, PLACED_DIGEST)
    return out, time.perf_counter() - t0


def _unchanged(seen: ScannedFile) -> bool:
    """Whether the scanned file is still what the scan read."""
    try:
        return file_identity(seen.path) == seen.identity
    except OSError:
        return False


def link_dataset_files(run: PlaceRun, data: Path, log: Callable[[str], None]) -> LinkedFiles:
    """The dataset's topology, labels and splits into ``data`` (:data:`LINKED`), as hard links
    except those :func:`refused_links` found refused (``run.copies``), which are copied (the
    line logged says which). A link's entry is the check scan's digest; copies are hashed in a
    thread beside the bin pass, which waits on the disk."""
    t0 = time.perf_counter()
    paths = {k: data / PLACED_FILES[k] for k in LINKED}
    linked = {k: link_file(run.ds.path(k), p, copy=k in run.copies) for k, p in paths.items()}
    how = " and ".join(sorted({"hard links" if v else "copies" for v in linked.values()}))
    refused = "" if all(linked.values()) else " (the file system refused a hard link)"
    log(f"topology, labels and splits: {how} of {run.ds.root}'s files{refused}")
    pool = ThreadPoolExecutor(1, thread_name_prefix="moment-link-hash")
    hashed = pool.submit(_entries, paths, run.scanned)
    pool.shutdown(wait=False)  # the thread ends with its one job
    return LinkedFiles(time.perf_counter() - t0, hashed)


def write_arrays(
    data: Path,
    placed: Placement,
    specs: list[BinSpec],
    workload: Workload,
    linked: LinkedFiles,
    phases: Phases,
) -> dict[str, Written]:
    """The row map (``old_to_new``: each dataset vertex's row in the bins' order, int32 where the
    ids fit) and the workload, and the linked files' entries; returns every entry by manifest key."""
    t0 = time.perf_counter()
    r = rl.relabel(placed.bin_of, [s.tier for s in specs])
    out = save_npy(data / PLACED_FILES["old_to_new"], r.old_to_new)
    write_workload(data / PLACED_FILES["workload"], workload)
    files, busy, waited = linked.entries()
    files["old_to_new"] = Written("old_to_new", out.path, out.bytes, out.digest, out.algorithm)
    phases.add("checksums", busy)  # in its thread, beside the bin pass: like the bins' hashing, busy time
    phases.written([out], "arrays", time.perf_counter() - t0 - waited + linked.seconds)
    faults.point("place:arrays-written")
    return files


def build_manifest(
    run: PlaceRun,
    stage: Staging,
    hot: Hotness,
    prediction: Prediction,
    specs: list[BinSpec],
    placed: Placement,
    written: list[Written],
    files: dict[str, Written],
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
        spec, w, final = specs[idx], written[idx], bin_path(run, stage, specs[idx])
        bins_meta.append(
            {
                "name": spec.name,
                "tier": spec.tier,
                "start": int(starts[i]),
                "count": int(placed.used[idx]),
                "path": str(final.relative_to(data)) if final.is_relative_to(data) else str(final),
                "bytes": w.bytes,
                "digest": w.digest,
                "digest_algorithm": w.algorithm,
                "target": spec.target,
                "achieved": float(shares[idx]),
                "capacity": spec.capacity,
            }
        )
    entries = {
        k: {"path": PLACED_FILES[k], "bytes": f.bytes, "digest": f.digest, "digest_algorithm": f.algorithm}
        for k, f in files.items()
    }
    written_apart = {k: PLACED_FILES[k] for k in ("hotness_counts", "hotness_meta", "workload")}  # by their modules
    written_apart.update({key: f"{key}.npy" for key in (pack.map_keys if pack else ())})  # row maps
    written_apart.update({key: SAMPLE_FILES[key] for key in (pack.samples.keys if pack and pack.samples else ())})
    for k, name in written_apart.items():
        path = data / name
        digest = file_digest(path, PLACED_DIGEST)
        entries[k] = {"path": name, "bytes": path.stat().st_size, "digest": digest, "digest_algorithm": PLACED_DIGEST}
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
