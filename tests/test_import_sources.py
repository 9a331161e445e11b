"""Features read in place from the import's source (identity checked on every open, a moved or
changed source refused by name, the placement independent of it), and damaged importer inputs
(gzip CRC, count files, a 1-D IGB feature file, a damaged .npz member) refused in one line."""

from __future__ import annotations

import gzip
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from moment.cli import main
from placement.dataset import DatasetError, check_dataset, open_dataset
from placement.importers import publish, run
from placement.importers.arrays import import_arrays
from placement.place import PlaceOptions, place
from placement.placed import PlacedError, open_placed, verify

N, E, D = 400, 3000, 16
QUIET = {"log": lambda _: None}


def _igb(root: Path, raw: bool, n: int = N, dim: int = D, seed: int = 3) -> Path:
    """IGB's layout; ``raw``: headerless float32 features with 1024 values a row (IGB large/full)."""
    rng = np.random.default_rng(seed)
    base = root / "tiny" / "processed"
    (base / "paper").mkdir(parents=True)
    (base / "paper__cites__paper").mkdir()
    feats = rng.standard_normal((n, 1024 if raw else dim)).astype(np.float32)
    if raw:
        feats.tofile(base / "paper" / "node_feat.npy")
    else:
        np.save(base / "paper" / "node_feat.npy", feats)
    np.save(base / "paper" / "node_label_19.npy", rng.integers(0, 19, n).astype(np.float32))
    np.save(base / "paper__cites__paper" / "edge_index.npy", rng.integers(0, n, (E, 2)))
    return base / "paper" / "node_feat.npy"


@pytest.mark.parametrize("raw", [False, True])
def test_features_are_read_in_place_not_copied(tmp_path: Path, raw: bool) -> None:
    src = _igb(tmp_path / "igb", raw)
    ds = run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, **QUIET)
    check_dataset(ds)
    assert not (tmp_path / "ds" / "features.npy").exists()
    at = ds.manifest.features_at
    assert at is not None and at.path == str(src.absolute()) and at.size == src.stat().st_size
    assert at.offset == (0 if raw else 128) and ds.meta["files"].get("features") is None
    want = np.fromfile(src, np.float32) if raw else np.load(src).ravel()
    assert np.array_equal(np.asarray(ds.features()).ravel(), want)
    # --copy-features and a conversion copy: the dataset no longer names the source
    for given, dtype in (({"copy_features": True}, np.float32), ({"feature_dtype": "float16"}, np.float16)):
        out = tmp_path / f"copy-{dtype.__name__}"
        copied = run("igb", out, {"root": str(tmp_path / "igb"), "size": "tiny", **given}, **QUIET)
        assert copied.manifest.features_at is None and (out / "features.npy").is_file()
        assert np.array_equal(np.asarray(copied.features()).ravel(), want.astype(dtype))


def test_a_changed_or_moved_source_is_refused_by_name_with_the_fix(tmp_path: Path) -> None:
    src = _igb(tmp_path / "igb", raw=False)
    run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, **QUIET)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched
    with pytest.raises(DatasetError, match=rf"{src}: changed \(modified since the import\).*--copy-features"):
        open_dataset(tmp_path / "ds")
    data = bytearray(src.read_bytes())
    data[-7] ^= 0x10  # the last row rewritten in place, size and mtime kept: the sampled digest sees it
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DatasetError, match=rf"{src}: changed \(its content differs from the import's\)"):
        open_dataset(tmp_path / "ds")
    data[-7] ^= 0x10
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert open_dataset(tmp_path / "ds").num_nodes == N  # put back as it was: accepted again
    with open(src, "ab") as fh:
        fh.write(b"\0" * 8)
    with pytest.raises(DatasetError, match=r"changed \(\d[\d,]* bytes, was [\d,]+\)"):
        open_dataset(tmp_path / "ds")
    src.unlink()
    with pytest.raises(DatasetError, match=rf"{src}: missing: .*dataset\.json reads its features from this file"):
        open_dataset(tmp_path / "ds")


def test_npy_import_reads_features_in_place_too(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((N, D)).astype(np.float32)
    np.save(tmp_path / "f.npy", feats)
    np.save(tmp_path / "l.npy", rng.integers(0, 3, N))
    np.save(tmp_path / "e.npy", rng.integers(0, N, (E, 2)))
    files = {"features": tmp_path / "f.npy", "labels": tmp_path / "l.npy", "edges": tmp_path / "e.npy"}
    ds = import_arrays(tmp_path / "ds", **files)
    assert ds.manifest.features_at is not None and not (tmp_path / "ds" / "features.npy").exists()
    assert np.array_equal(ds.features(), feats)
    copied = import_arrays(tmp_path / "ds2", **files, copy_features=True)
    assert copied.manifest.features_at is None and np.array_equal(copied.features(), feats)


def test_the_placement_does_not_depend_on_the_source(plan_file: Path, tmp_path: Path, capfd) -> None:
    """place reads the source once; after that the placement opens and reads every row without it,
    and verify's comparison with the source refuses by name, with the fix, once it is gone."""
    src = _igb(tmp_path / "igb", raw=False, n=3000)
    run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, **QUIET)
    want = np.load(src)
    place(plan_file, tmp_path / "ds", tmp_path / "placed", PlaceOptions(gpu_cache="3%", cpu_cache="4%"))
    assert verify(tmp_path / "placed")["sampled"] > 0
    moved = tmp_path / "elsewhere.npy"
    shutil.move(src, moved)
    placed = open_placed(tmp_path / "placed", checksums=True)
    new = np.asarray(placed.array("old_to_new"))
    assert np.array_equal(placed.read_rows(new), want)
    with pytest.raises(PlacedError, match=rf"{src}: missing: .*--copy-features.*--sample 0"):
        verify(tmp_path / "placed")
    assert verify(tmp_path / "placed", sample=0)["rows"] == 3000
    assert main(["verify", str(tmp_path / "placed")]) == 1
    err = capfd.readouterr().err
    assert f"{src}: missing" in " ".join(err.split()) and len(err.strip().splitlines()) <= 3  # rich may wrap


# Damaged inputs (probe 2026-11-27 H4, H5, M7, M8) ##############################################


def _ogb_csv(root: Path, n: int = 2000, e: int = 10_000) -> Path:
    """ogbn-arxiv's CSV layout, large enough that the gzip streams span many read buffers."""
    rng = np.random.default_rng(7)
    raw = root / "raw"
    raw.mkdir(parents=True)

    def gz(name: str, rows: list[str]) -> None:
        with gzip.open(raw / name, "wt") as fh:
            fh.write("".join(rows))

    gz("edge.csv.gz", [f"{s},{d}\n" for s, d in rng.integers(0, n - 20, (e, 2))])  # the last 20: no edges
    gz("node-feat.csv.gz", [",".join(f"{v:.6f}" for v in row) + "\n" for row in rng.standard_normal((n, 32))])
    gz("node-label.csv.gz", [f"{v}\n" for v in rng.integers(0, 40, n)])
    gz("num-node-list.csv.gz", [f"{n}\n"])
    gz("num-edge-list.csv.gz", [f"{e}\n"])
    split = root / "split" / "time"
    split.mkdir(parents=True)
    for name, ids in (("train", range(0, 100)), ("valid", range(100, 150)), ("test", range(150, 200))):
        with gzip.open(split / f"{name}.csv.gz", "wt") as fh:
            fh.write("".join(f"{i}\n" for i in ids))
    return raw


@pytest.mark.parametrize("name", ["node-feat.csv.gz", "edge.csv.gz", "node-label.csv.gz"])
def test_a_gzip_member_with_a_bad_crc_is_refused(tmp_path: Path, name: str) -> None:
    """Valid DEFLATE data, a wrong CRC-32 in the trailer: the stream is read to its end, where gzip checks it."""
    raw = _ogb_csv(tmp_path / "o")
    data = bytearray((raw / name).read_bytes())
    data[-8] ^= 0x01  # the trailer: CRC-32 (4 bytes), then the size
    (raw / name).write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=rf"{name}: damaged or not a gzip text file \(CRC check failed"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **QUIET)
    assert not list(tmp_path.glob("ds*"))


@pytest.mark.parametrize(
    ("count", "value", "data", "extra"),
    [("num-edge-list.csv.gz", 9000, "edge.csv.gz", 1000), ("num-node-list.csv.gz", 1990, "node-feat.csv.gz", 10)],
)
def test_counts_that_disagree_with_the_files_name_both(
    tmp_path: Path, count: str, value: int, data: str, extra: int
) -> None:
    raw = _ogb_csv(tmp_path / "o")
    with gzip.open(raw / count, "wt") as fh:
        fh.write(f"{value}\n")
    with pytest.raises(
        DatasetError, match=rf"{data}: {extra:,} more line\(s\) than the {value:,} expected \(.*{count} says"
    ):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **QUIET)
    with gzip.open(raw / count, "wt") as fh:
        fh.write(f"{value + extra + 20}\n")
    more = value + extra + 20
    with pytest.raises(DatasetError, match=rf"{data}: line \d+: the file ends early \(.*{count} says {more:,}\)"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **QUIET)


def test_a_one_dimensional_igb_feature_file_is_one_line(tmp_path: Path) -> None:
    src = _igb(tmp_path / "igb", raw=False)
    np.save(src, np.zeros(N * 1024, np.float32))
    with pytest.raises(
        DatasetError, match=r"node_feat\.npy: features must be a row-major N×d float array.*\(409600,\)"
    ):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, **QUIET)


def test_a_damaged_npz_member_is_one_line(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    raw = tmp_path / "o" / "raw"
    raw.mkdir(parents=True)
    np.savez(  # stored, not DEFLATEd: a flip in the data is only seen by the member's CRC-32
        raw / "data.npz",
        edge_index=rng.integers(0, N, (2, E)),
        node_feat=rng.standard_normal((N, 4)).astype(np.float32),
        num_nodes_list=np.array([N]),
    )
    np.savez(raw / "node-label.npz", node_label=rng.integers(0, 3, (N, 1)).astype(np.float64))
    (tmp_path / "o" / "split" / "time").mkdir(parents=True)
    for name in ("train", "valid", "test"):
        with gzip.open(tmp_path / "o" / "split" / "time" / f"{name}.csv.gz", "wt") as fh:
            fh.write({"train": "0\n1\n", "valid": "2\n", "test": "3\n"}[name])
    with zipfile.ZipFile(raw / "data.npz") as zf:
        info = zf.getinfo("edge_index.npy")
    data = bytearray((raw / "data.npz").read_bytes())
    middle = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    (raw / "data.npz").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"data\.npz:edge_index: damaged \(Bad CRC-32.*\): download it again"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **QUIET)


def test_an_unlabelled_igb_split_vertex_names_the_label_file(tmp_path: Path) -> None:
    _igb(tmp_path / "igb", raw=False)
    labels = tmp_path / "igb" / "tiny" / "processed" / "paper" / "node_label_19.npy"
    values = np.load(labels)
    values[5] = np.nan
    np.save(labels, values)
    with pytest.raises(
        DatasetError, match=r"split: vertex 5 is unlabelled \(.*node_label_19\.npy gives it no class\).*--labelled"
    ):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, **QUIET)


def _cli(tmp_path: Path) -> list[str]:
    """``moment dataset import`` of the IGB fixture under ``tmp_path`` (without --out)."""
    return ["dataset", "import", "--format", "igb", "--root", str(tmp_path / "igb"), "--size", "tiny"]


def test_dry_run_says_what_it_reads_writes_and_how_long_and_refuses_without_space(
    tmp_path: Path, monkeypatch, capfd
) -> None:
    _igb(tmp_path / "igb", raw=False)
    args = _cli(tmp_path)
    monkeypatch.setattr(publish, "read_rate", lambda path: 100e6)  # the fixture is too small to time a read
    assert main([*args, "--dry-run", "--out", str(tmp_path / "ds")]) == 0
    printed = " ".join(capfd.readouterr().out.split())
    assert "features: read in place from" in printed and "reads: edges once (0.00 GB)," in printed
    assert "features once (0.00 GB: checked); writes 0.00 GB" in printed
    assert f"time: about 0 s (0.0 h): the edges and labels at {publish.COPY_RATIO}× the speed of a copy" in printed
    assert "dry run: nothing written" in printed and not list(tmp_path.glob("ds*"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    assert main([*args, "--dry-run", "--out", str(tmp_path / "ds")]) == 1
    err = " ".join(capfd.readouterr().err.split())
    assert f"{tmp_path / 'ds'}: needs" in err and "GB short" in err and not list(tmp_path.glob("ds*"))


def test_a_full_disk_is_one_line_naming_the_output_and_nothing_is_kept(tmp_path: Path, monkeypatch, capfd) -> None:
    import errno

    _igb(tmp_path / "igb", raw=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(publish, "_write_labels", full)
    out = tmp_path / "ds"
    args = [*_cli(tmp_path), "--out", str(out)]
    assert main(args) == 1
    err = " ".join(capfd.readouterr().err.split())
    assert f"moment dataset import: error: {out}: No space left on device while writing the dataset" in err
    assert not list(tmp_path.glob("ds*"))


def test_a_blank_line_is_named_by_its_number(tmp_path: Path, recwarn) -> None:
    raw = _ogb_csv(tmp_path / "o")
    with gzip.open(raw / "node-label.csv.gz", "rt") as fh:
        lines = fh.readlines()
    lines[-1] = "\n"  # line 2000 of 2000
    with gzip.open(raw / "node-label.csv.gz", "wt") as fh:
        fh.write("".join(lines))
    with pytest.raises(DatasetError, match=r"node-label\.csv\.gz: line 2000: an empty line"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **QUIET)
    assert not [w for w in recwarn if "loadtxt" in str(w.message)]


def test_npy_dry_run_says_what_it_reads_and_refuses_without_space(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "f.npy", rng.standard_normal((N, D)).astype(np.float32))
    np.save(tmp_path / "l.npy", rng.integers(0, 3, N))
    np.save(tmp_path / "e.npy", rng.integers(0, N, (E, 2)))
    files = {"features": tmp_path / "f.npy", "labels": tmp_path / "l.npy", "edges": tmp_path / "e.npy"}
    lines: list[str] = []
    assert import_arrays(tmp_path / "ds", **files, dry_run=True, log=lines.append) is None
    assert any(line.startswith("reads: edges once (0.00 GB),") and "features once" in line for line in lines)
    assert lines[-1] == "dry run: nothing written" and not list(tmp_path.glob("ds*"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    with pytest.raises(DatasetError, match=r"ds: needs .* GB short"):
        import_arrays(tmp_path / "ds", **files, dry_run=True, log=lines.append)


def test_replacing_an_imported_dataset_never_deletes_its_source(tmp_path: Path) -> None:
    from placement.synth import synthesize

    src = _igb(tmp_path / "igb", raw=True)
    run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, **QUIET)
    size = src.stat().st_size
    synthesize(tmp_path / "ds", nodes=50, avg_degree=3, dim=4, replace=True)  # moment deletes what it wrote
    assert src.stat().st_size == size and open_dataset(tmp_path / "ds").num_nodes == 50
