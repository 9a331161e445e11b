"""`moment place` and the dataset's graph files: read once (the check scan's checksums serve the
links), and a link the file system refuses decided, and its copy counted, before any work."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

import placement.place as place_module
from moment.contracts.placed import MANIFEST
from moment.errors import MomentError
from placement.dataset import read_npy_header
from placement.digests import file_digest
from placement.place import PlaceOptions, place
from placement.place_write import LINK_PROBE_PREFIX, LINKED, PLACED_FILES
from placement.placed import open_placed, verify
from placement.synth import synthesize

OPTS = dict(gpu_cache="3%", cpu_cache="4%")


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    synthesize(out, nodes=30_000, avg_degree=8, dim=16, dtype="float32", seed=1, train_fraction=0.2)
    return out


class _Counted:
    """A file object whose reads past the .npy header are counted (by the file's inode)."""

    def __init__(self, fh: IO[bytes], spy: ReadSpy, key: tuple[int, int]) -> None:
        self._fh, self._spy, self._key = fh, spy, key

    def _count(self, pos: int, got: int) -> None:
        start = max(pos, self._spy.offsets[self._key])
        self._spy.data_bytes[self._key] += max(0, pos + got - start)

    def read(self, *args: Any) -> bytes:
        pos = self._fh.tell()
        data = self._fh.read(*args)
        self._count(pos, len(data))
        return data

    def readinto(self, buf: Any) -> int:
        pos = self._fh.tell()
        got = self._fh.readinto(buf)
        self._count(pos, got or 0)
        return got

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


class ReadSpy:
    """``open`` that counts the bytes read() from the data of the watched .npy files (any name of
    them: a hard link is the same inode). Memory-mapped reads (the check scan's) go uncounted."""

    def __init__(self, files: list[Path]) -> None:
        self.offsets = {}
        for f in files:
            st = f.stat()
            self.offsets[(st.st_dev, st.st_ino)] = read_npy_header(f, f.name).offset
        self.data_bytes: Counter[tuple[int, int]] = Counter()
        self.real = builtins.open

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = self.real(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and "b" in mode and "r" in mode:
            st = os.fstat(fh.fileno())
            if (st.st_dev, st.st_ino) in self.offsets:
                return _Counted(fh, self, (st.st_dev, st.st_ino))
        return fh


def test_the_graph_files_are_read_once(
    plan_file: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Place reads the topology, labels and splits in its check scan and takes their checksums
    there: no byte of their data is read again (it used to hash every linked file a second
    time), and placed.json's digests are those of the placed files."""
    sources = [dataset / f for f in ("indptr.npy", "indices.npy", "labels.npy", "train_idx.npy")]
    sources += [dataset / "val_idx.npy", dataset / "test_idx.npy"]
    spy = ReadSpy(sources)
    monkeypatch.setattr(builtins, "open", spy.open)
    out = tmp_path / "placed"
    place(plan_file, dataset, out, PlaceOptions(**OPTS))
    monkeypatch.undo()
    assert sum(spy.data_bytes.values()) == 0, spy.data_bytes
    files = json.loads((out / MANIFEST).read_text())["files"]
    for key in LINKED:
        placed_file = out / PLACED_FILES[key]
        assert files[key]["digest"] == file_digest(placed_file, "xxh3-128"), key
        assert placed_file.stat().st_ino == (dataset / PLACED_FILES[key]).stat().st_ino, key
    assert verify(out)["rows"] == 30_000


def test_a_file_replaced_after_the_scan_is_hashed_as_placed(
    plan_file: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan's digest serves only the file it read: labels.npy replaced (a new inode) between
    the scan and the link is hashed from what was linked, and the placement verifies."""
    real = place_module.link_dataset_files

    def replace_labels_then_link(run: Any, data: Path, log: Callable[[str], None]) -> Any:
        labels = dataset / "labels.npy"
        new = np.load(labels)
        new[:5] = (new[:5] + 1) % run.ds.num_classes
        np.save(dataset / "labels.new.npy", new)
        os.replace(dataset / "labels.new.npy", labels)
        return real(run, data, log)

    monkeypatch.setattr(place_module, "link_dataset_files", replace_labels_then_link)
    out = tmp_path / "placed"
    place(plan_file, dataset, out, PlaceOptions(**OPTS))
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert files["labels"]["digest"] == file_digest(out / "labels.npy", "xxh3-128")
    assert verify(out)["files"] > 0


def _tight_disk(monkeypatch: pytest.MonkeyPatch, dataset: Path) -> None:
    """Free space for the bins, row map and hotness with headroom, and half the graph files'
    bytes more: enough where they are linked, too little where they must be copied."""
    ds = _dataset_sizes(dataset)
    graph = sum((dataset / PLACED_FILES[k]).stat().st_size for k in LINKED)
    free = int((64 << 20) + 1.02 * (ds["nodes"] * (ds["row_bytes"] + 8)) + graph // 2)
    usage = shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free)  # type: ignore[attr-defined]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)


def _dataset_sizes(dataset: Path) -> dict[str, int]:
    meta = json.loads((dataset / "dataset.json").read_text())
    return {"nodes": meta["num_nodes"], "row_bytes": meta["feature_dim"] * 4}


def test_a_refused_link_is_counted_before_any_work(
    plan_file: Path, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Links refused on the same file system (EPERM: fs.protected_hardlinks) mean copies: place
    finds that before any work and refuses in one line naming OUT and the bytes where the disk
    lacks their room, writing nothing; the same disk holds the placement with links."""
    _tight_disk(monkeypatch, dataset)
    out = tmp_path / "placed"
    real_link = os.link

    def refuse(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    with pytest.raises(MomentError) as err:
        place(plan_file, dataset, out, PlaceOptions(**OPTS))
    msg = str(err.value)
    assert msg.startswith(f"{out}: needs ") and " GB free (" in msg and "GB short)" in msg and "\n" not in msg
    assert not out.exists() and not out.with_name("placed.partial").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(LINK_PROBE_PREFIX)]
    monkeypatch.setattr(os, "link", real_link)
    said: list[str] = []
    place(plan_file, dataset, out, PlaceOptions(**OPTS), log=said.append)
    assert any("topology, labels and splits linked" in line for line in said), said
    assert open_placed(out, checksums=True).file("indices").stat().st_nlink >= 2
