"""Checksums of placed files: each digest's algorithm recorded beside it (xxh3-128 now), and
placements written with SHA-256 before still load and verify, a flipped byte caught in both."""

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
from placement.digests import DIGESTS, PLACED_DIGEST, UNRECORDED_DIGEST, DigestError, check_digest, file_digest
from placement.place import PlaceOptions, place
from placement.placed import PlacedError, open_placed, pack_files, verify
from placement.writer import Written

FIXTURE = Path(__file__).parent / "placed_fixtures" / "sha256"  # written by moment place at e3bea9a (its README)
# Arrays written in a narrower type than the fixture's (labels: int8 for its 16 classes; the
# counts in original ids: int32; both int64 there)
NARROWED = {"labels", "hotness_counts"}
PACKED = PlaceOptions(gpu_cache="3%", cpu_cache="4%", pack=True, pack_budget="1MiB")  # as the fixture was


def entries(root: Path) -> dict[str, tuple[Path, str, str]]:
    """Every checksummed file of a placement: name → (path, digest, algorithm), read from the
    manifest itself (bins, arrays and row maps, the budget's chunk and shared files)."""
    m = PlacedManifest.read(root / MANIFEST)
    placed = open_placed(root)
    out = {f"bin {b.name}": (p.path, b.digest, b.digest_algorithm) for b, p in zip(m.bins, placed.bins)}
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


def test_a_placement_written_with_sha256_loads_and_verifies(old: tuple[Path, Path]) -> None:
    placed, source = old
    assert "digest_algorithm" not in (placed / MANIFEST).read_text()  # written before the field
    found = entries(placed)
    kinds = {"bin nvme0", "indices", "chunkrows_nvme0", "samples_nodes", "nvme0-chunks-d50eaca7.bin"}
    assert kinds <= set(found) and len(found) == 10 + 39 + 2 * 8  # bins, files, 8 SSD bins' chunks and shared
    assert {algorithm for _, _, algorithm in found.values()} == {UNRECORDED_DIGEST} == {"sha256"}
    for path, digest, _ in found.values():  # the recorded digests are SHA-256 of the files, as hashlib takes it
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    report = verify(placed, source=source, sample=600)
    assert report["rows"] == 600 and report["sampled"] > 0


@pytest.mark.parametrize(
    "name", ["bin nvme1", "indices", "chunkoff_nvme0", "samples_edges", "nvme0-chunks-d50eaca7.bin"]
)
def test_a_flipped_byte_in_a_sha256_placement_is_caught(old: tuple[Path, Path], name: str) -> None:
    placed, source = old
    path = entries(placed)[name][0]
    flip(path)
    with pytest.raises(PlacedError, match=rf"{path.name}: checksum mismatch \(sha256\)"):
        verify(placed, source=source, sample=0)


def test_place_records_xxh3_for_every_file_and_writes_the_same_bytes(old: tuple[Path, Path], new: Path) -> None:
    """Every entry of a new placement is xxh3-128 of its file (taken by the xxhash library here,
    not by moment's hashers), and the files are the bytes the placement written before holds:
    only the checksum changed (names carry each run's id, so files are matched by entry), and
    the arrays written narrower since (``NARROWED``) hold the same values in fewer bytes."""
    assert PLACED_DIGEST == "xxh3-128"
    now, before = entries(new), entries(old[0])
    assert now.keys() == {k.replace("d50eaca7", PlacedManifest.read(new / MANIFEST).run_id) for k in before}
    assert {algorithm for _, _, algorithm in now.values()} == {"xxh3-128"}
    by_run = {k.replace(PlacedManifest.read(new / MANIFEST).run_id, "d50eaca7"): v for k, v in now.items()}
    for key, (path, digest, _) in by_run.items():
        data = path.read_bytes()
        assert xxhash.xxh3_128(data).hexdigest() == digest, key
        if key in NARROWED:
            was, got = np.load(before[key][0]), np.load(path)
            assert got.dtype.itemsize < was.dtype.itemsize and np.array_equal(got, was), key
        elif key not in ("hotness_meta", "workload"):  # the two text files record where they were made
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
        ({"digest_algorithm": "xxh3-128"}, "a xxh3-128 digest has 32 hex digits, this one 64"),  # mislabelled
    ],
)
def test_an_unknown_or_mislabelled_algorithm_is_one_line(old: tuple[Path, Path], edit: dict, message: str) -> None:
    placed = old[0]
    doc = json.loads((placed / MANIFEST).read_text())
    doc["files"]["labels"].update(edit)
    (placed / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(PlacedError, match=rf"placed.json: the entry of .*labels.npy: {message}$"):
        open_placed(placed)


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
