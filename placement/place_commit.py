"""``moment place``'s staging, resume and commit protocol for a placed directory.

Work happens in ``OUT.partial`` (:class:`moment.outputs.Staging`); ``inputs.json`` there names the
inputs a partial build is for, so a killed run with the same inputs resumes and one with other
inputs is thrown away (only what this command can prove it wrote). The commit is idempotent:
bins renamed from their ``.partial`` names, scratch removed, the directory published by a rename.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from moment import faults
from moment.contracts.placed import MANIFEST, PlacedError, PlacedManifest, bin_file_name
from moment.errors import MomentError
from moment.outputs import INPUTS, Kind, Staging, read_inputs
from placement import pack as pk
from placement.placed import open_placed, pack_files
from placement.writer import STATE


def _placed_files(root: Path) -> list[Path]:
    """The files of a placed dataset that ``moment place`` wrote and may remove: each listed in
    its validated manifest, with the size the manifest records, bins under the run's own name."""
    m = PlacedManifest.read(root / MANIFEST)
    owned = []
    for b in m.bins:
        path = Path(b.path) if Path(b.path).is_absolute() else root / b.path
        if path.name == bin_file_name(b.name, m.run_id) and file_size(path) == b.bytes:
            owned.append(path)
    owned += [root / f.path for f in m.files.values() if file_size(root / f.path) == f.bytes]
    owned += [path for path, f, name in pack_files(m, root) if path.name == name and file_size(path) == f.bytes]
    return [*owned, root / MANIFEST]


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else -1
    except OSError:
        return -1


def validate_placed(root: Path) -> PlacedManifest:
    return PlacedManifest.read(root / MANIFEST)


PLACED = Kind("placed dataset", MANIFEST, "moment place", validate_placed, _placed_files, PlacedError)


SCRATCH = (INPUTS, "bin_of.npy", STATE, pk.STATE)  # build state, removed before publishing


def inputs_key(data: Path) -> str | None:
    """The key of the inputs the partial build in ``data`` is for (None: none recorded)."""
    return read_inputs(data).get("key")


def intact(root: Path) -> bool:
    """Every file of a placed dataset present at its recorded size (cheap; no checksums)."""
    try:
        open_placed(root)
        return True
    except MomentError:
        return False


def _finish_bins(m: PlacedManifest, data: Path) -> None:
    """Give every bin and pack file its final name (idempotent: a killed run may have renamed
    some already)."""
    files = [(Path(b.path) if Path(b.path).is_absolute() else data / b.path, b.bytes) for b in m.bins]
    for final, size in files + [(path, f.bytes) for path, f, _ in pack_files(m, data)]:
        partial = final.with_name(final.name + ".partial")
        if partial.exists():
            partial.replace(final)
        elif file_size(final) != size:
            raise PlacedError(f"{final}: missing or truncated while committing; remove {data.parent} and run again")


def commit(stage: Staging, dirs: dict[str, Path], log: Callable[[str], None]) -> PlacedManifest:
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
    keep += [path for path, _, _ in pack_files(m, stage.data)] if m else []
    for note in stage.publish("place", keep=keep, external_dirs=dirs.values()):
        log(f"note: {note}")
    return validate_placed(stage.out)


def discard_build(stage: Staging) -> None:
    """Throw away a killed run's partial build made with other inputs: the staging directory is
    this command's (its marker and lock prove it), and outside it only ``.partial`` bins under
    this run's id, in the directories that build recorded."""
    for d in read_inputs(stage.data).get("bin_dirs", []):
        for f in Path(d).glob(f"*-{stage.run_id}.bin.partial"):
            f.unlink()
    shutil.rmtree(stage.data)
