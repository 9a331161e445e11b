"""Checksums of placed files: each digest's algorithm recorded beside it (xxh3-128 now, SHA-256
honoured where an entry records it), a flipped byte caught with either. The placement written
by an older moment (``moment.placed/3``, SHA-256 unrecorded: tests/placed_fixtures/sha256) is
refused in one line, and ``moment place`` replaces it, removing only its own files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

from moment.contracts.placed import MANIFEST, PackSummary, PlacedManifest
from placement import pack as pk
from placement.dataset import open_dataset
from placement.digests import DIGESTS, PLACED_DIGEST, DigestError, check_digest, file_digest
from placement.place import PlaceOptions, place
from placement.placed import PlacedError, open_placed, pack_files, verify
from placement.writer import Written

FIXTURE = Path(__file__).parent / "placed_fixtures" / "sha256"  # written by moment place at e3bea9a (its README)
# Arrays written in a narrower type than the fixture's (the counts in dataset ids: int32, int64 there)
NARROWED = {"hotness_counts"}
LINKED = {"indptr", "indices", "labels", "train", "val", "test"}  # the dataset's own files now
PACKED = PlaceOptions(gpu_cache="3%", cpu_cache="4%", pack=True, pack_budget="1MiB")  # as the fixture was


def entries(root: Path) -> dict[str, tuple[Path, str, str]]:
    """Every checksummed file of a placement: name → (path, digest, algorithm), read from the
    manifest itself (bins, arrays and row maps, the budget's chunk and shared files)."""
    open_placed(root)  # a placement this moment reads
    return entries_of_manifest(root)


def entries_of_manifest(root: Path) -> dict[str, tuple[Path, str, str]]:
    """:func:`entries` from the manifest alone (a placement of an older format too)."""
    m = PlacedManifest.read(root / MANIFEST)
    out = {
        f"bin {b.name}": (Path(b.path) if Path(b.path).is_absolute() else root / b.path, b.digest, b.digest_algorithm)
        for b in m.bins
    }
    out |= {key: (root / f.path, f.digest, f.digest_algorithm) for key, f in m.files.items()}
    out |= {name: (path, f.digest, f.digest_algorithm) for path, f, name in pack_files(m, root)}
    return out


@pytest.fixture
def old(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the placement written with SHA-256 (placed, source)."""
    shutil.copytree(FIXTURE, tmp_path / "old")
    return tmp_path / "old" / "placed", tmp_path / "old" / "ds"


@pytest.fixture
def new(old: tuple[Path, Path], plan_file: Path, tmp_path: Path) -> Path:
    """The same source placed now, with the fixture's options."""
    out = tmp_path / "new"
    place(plan_file, old[1], out, PACKED)
    return out


def flip(path: Path, at: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x08
    path.write_bytes(bytes(data))


def test_an_older_placement_is_refused_then_replaced(old: tuple[Path, Path], plan_file: Path) -> None:
    """The fixture (moment.placed/3: graph and labels in row ids) is refused by open_placed and
    verify in one line naming placed.json; `moment place` into it replaces it: its files, those
    of /3 only (new_to_old, hotness_new) included, are gone, the source dataset untouched."""
    placed, source = old
    before = {p.name for p in placed.iterdir()}
    assert {"new_to_old.npy", "hotness_new.npy"} <= before
    for call in (lambda: open_placed(placed), lambda: verify(placed, source=source, sample=600)):
        with pytest.raises(PlacedError) as err:
            call()
        assert str(err.value) == (
            f"{placed / MANIFEST}: format 'moment.placed/3': placed by an older moment: run `moment place` again"
        )
    place(plan_file, source, placed, PACKED)
    after = {p.name for p in placed.iterdir()}
    assert not {"new_to_old.npy", "hotness_new.npy"} & after and not any("d50eaca7" in n for n in after)
    assert PlacedManifest.read(placed / MANIFEST).format == "moment.placed/4"
    assert verify(placed, source=source, sample=600)["sampled"] > 0


@pytest.fixture
def sha(new: Path) -> Path:
    """The new placement with every entry recorded as SHA-256 (what verify must honour)."""
    doc = json.loads((new / MANIFEST).read_text())
    placed = open_placed(new)
    for entry, path in [
        *zip(doc["bins"], [b.path for b in placed.bins]),
        *((f, new / f["path"]) for f in doc["files"].values()),
    ]:
        entry.update(digest=hashlib.sha256(path.read_bytes()).hexdigest(), digest_algorithm="sha256")
    (new / MANIFEST).write_text(json.dumps(doc))
    return new


def test_a_placement_recorded_with_sha256_verifies(sha: Path) -> None:
    found = entries(sha)
    assert {algorithm for k, (_, _, algorithm) in found.items() if "-chunks-" not in k and "-shared-" not in k} == {
        "sha256"
    }
    assert verify(sha, sample=600)["sampled"] > 0


@pytest.mark.parametrize("name", ["bin nvme1", "indices", "old_to_new", "chunkoff_nvme0", "samples_edges"])
def test_a_flipped_byte_in_a_sha256_placement_is_caught(sha: Path, name: str) -> None:
    path = entries(sha)[name][0]
    flip(path)
    with pytest.raises(PlacedError, match=rf"{path.name}: checksum mismatch \(sha256\)"):
        verify(sha, sample=0)


def test_place_records_xxh3_for_every_file_and_writes_the_same_bytes(old: tuple[Path, Path], new: Path) -> None:
    """Every entry of a new placement is xxh3-128 of its file (taken by the xxhash library here,
    not by moment's hashers). Against the placement written before (the same source, options and
    hotness): the same entries less the two the row ids needed (new_to_old, the counts in row
    ids); the same bins and row map; the topology, labels and splits are now the dataset's own
    files; the counts written narrower since (``NARROWED``) hold the same values."""
    assert PLACED_DIGEST == "xxh3-128"
    run_id = PlacedManifest.read(new / MANIFEST).run_id
    before = {k: v for k, v in entries_of_manifest(old[0]).items() if k not in ("new_to_old", "hotness")}
    now = entries(new)
    assert now.keys() == {k.replace("d50eaca7", run_id) for k in before}
    assert {algorithm for _, _, algorithm in now.values()} == {"xxh3-128"}
    source = open_dataset(old[1])
    for key, (path, digest, _) in now.items():
        data = path.read_bytes()
        assert xxhash.xxh3_128(data).hexdigest() == digest, key
        if key in NARROWED:
            was, got = np.load(before[key][0]), np.load(path)
            assert got.dtype.itemsize < was.dtype.itemsize and np.array_equal(got, was), key
        elif key in LINKED:
            assert data == source.path(key).read_bytes() and path.stat().st_ino == source.path(key).stat().st_ino, key
        elif key.startswith("bin ") or key == "old_to_new":
            assert hashlib.sha256(data).hexdigest() == before[key][1], key
    assert verify(new, sample=600)["sampled"] > 0


@pytest.mark.parametrize("name", ["bin nvme1", "indices", "chunkoff_nvme0", "samples_edges", "chunks"])
def test_a_flipped_byte_in_a_new_placement_is_caught(new: Path, name: str) -> None:
    found = entries(new)
    if name == "chunks":
        name = next(k for k in found if k.startswith("nvme0-chunks-"))
    path = found[name][0]
    flip(path, at=len(path.read_bytes()) // 2)
    with pytest.raises(PlacedError, match=rf"{path.name}: checksum mismatch \(xxh3-128\)"):
        verify(new, sample=0)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"digest_algorithm": "md5"}, "digest algorithm 'md5' is not one this moment knows \\(sha256, xxh3-128\\)"),
        ({"digest_algorithm": "sha256"}, "a sha256 digest has 64 hex digits, this one 32"),  # mislabelled
    ],
)
def test_an_unknown_or_mislabelled_algorithm_is_one_line(new: Path, edit: dict, message: str) -> None:
    doc = json.loads((new / MANIFEST).read_text())
    doc["files"]["labels"].update(edit)
    (new / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(PlacedError, match=rf"placed.json: the entry of .*labels.npy: {message}$"):
        open_placed(new)


def test_registry() -> None:
    for name in DIGESTS:
        h = DIGESTS[name]()
        h.update(b"moment")
        check_digest(name, h.hexdigest())
        assert file_digest(FIXTURE / "README.md", name) == _whole(name, (FIXTURE / "README.md").read_bytes())
    with pytest.raises(DigestError):
        check_digest("sha256", "0" * 32)


def _whole(name: str, data: bytes) -> str:
    return {"sha256": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}[name](data).hexdigest()


def test_a_pack_state_from_before_resumes_with_sha256(tmp_path: Path) -> None:
    """A killed `moment place --pack` of an earlier version left pack-state.json without the
    algorithm: its packed bins keep the SHA-256 digests they were written with, labelled so."""
    f = tmp_path / "nvme0.bin"
    f.write_bytes(b"rows" * 100)
    summary = PackSummary.model_validate(
        json.loads((FIXTURE / "placed" / MANIFEST).read_text())["pack"] | {"chunks": None, "samples": None}
    )
    pk.save_state(
        tmp_path, "k" * 16, [Written("nvme0", f, 400, hashlib.sha256(f.read_bytes()).hexdigest(), "sha256")], summary
    )
    state = json.loads((tmp_path / pk.STATE).read_text())
    assert state["written"][0].pop("algorithm") == "sha256"
    (tmp_path / pk.STATE).write_text(json.dumps(state))
    loaded = pk.load_state(tmp_path, "k" * 16)
    assert loaded is not None and loaded[0][0].algorithm == "sha256"
