"""IGB and OGB importers on tiny fixtures written in the exact on-disk layouts, checked against a
direct in-memory reading of the same files."""

from __future__ import annotations

import gzip
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from placement.dataset import Dataset, DatasetError, check_dataset
from placement.importers import csr, readers, run
from placement.importers import splits as conventions

N, E = 300, 2500


def _csr(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[list[int], list[int]]:
    """CSR by destination, neighbours in input order: the in-memory reference."""
    order = np.argsort(dst, kind="stable")
    return [0, *np.cumsum(np.bincount(dst, minlength=n)).tolist()], src[order].tolist()


def _rows(ds: Dataset) -> tuple[list[int], list[int]]:
    return ds.indptr().tolist(), ds.indices().tolist()


def _igb(
    root: Path, size: str, feats: np.ndarray, labels: np.ndarray, edges: np.ndarray, raw: bool, classes: int = 19
) -> None:
    base = root / size / "processed"
    (base / "paper").mkdir(parents=True)
    (base / "paper__cites__paper").mkdir()
    name = "node_label_19.npy" if classes == 19 else "node_label_2K.npy"
    if raw:  # IGB large/full: bare float32 bytes behind a .npy name
        feats.astype(np.float32).tofile(base / "paper" / "node_feat.npy")
        labels.astype(np.float32).tofile(base / "paper" / name)
    else:
        np.save(base / "paper" / "node_feat.npy", feats.astype(np.float32))
        np.save(base / "paper" / name, labels.astype(np.float32))
    np.save(base / "paper__cites__paper" / "edge_index.npy", edges)


@pytest.fixture
def graph() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return (
        rng.standard_normal((N, 16)).astype(np.float32),
        rng.integers(0, 19, N).astype(np.float32),
        rng.integers(0, N, (E, 2)),
    )


def test_igb_npy_layout_matches_a_direct_reading(tmp_path: Path, graph) -> None:
    feats, labels, edges = graph
    _igb(tmp_path / "igb", "tiny", feats, labels, edges, raw=False)
    lines: list[str] = []
    ds = run("igb", tmp_path / "ds", {"root": str(tmp_path / "igb"), "size": "tiny"}, log=lines.append)
    check_dataset(ds)
    assert _rows(ds) == _csr(edges[:, 0], edges[:, 1], N)
    assert np.array_equal(ds.features(), feats) and ds.labels().tolist() == labels.astype(int).tolist()
    assert (ds.num_classes, ds.meta["source"]["format"], ds.meta["source"]["split"]) == (19, "igb", "igb")
    assert ds.labels().dtype == np.int8  # the narrowest type holding -1 and 18
    # igb: 60/20/20 of a torch.randperm seeded 0, each split sorted
    torch.manual_seed(0)
    perm = torch.randperm(N).numpy()
    for name, (a, b) in zip(("train", "val", "test"), ((0, 180), (180, 240), (240, 300))):
        assert ds.split(name).tolist() == sorted(perm[a:b].tolist())
    assert any("warning" in line and "vertices, where IGB publishes 100,000" in line for line in lines)


def test_igb_mlperf_split_is_mlperf_split_seeds(tmp_path: Path, graph) -> None:
    """The same ids as MLPerf's split_seeds.py: torch.manual_seed(42); torch.randperm(L); 60 %, 0.5 %."""
    feats, labels, edges = graph
    _igb(tmp_path / "igb", "small", feats, labels, edges, raw=False, classes=2983)
    ds = run(
        "igb",
        tmp_path / "ds",
        {"root": str(tmp_path / "igb"), "size": "small", "classes": 2983, "split": "mlperf"},
        log=lambda _: None,
    )
    torch.manual_seed(42)
    shuffled = torch.randperm(N)
    n_train, n_val = int(N * 0.6), int(N * 0.005)
    assert ds.split("train").tolist() == sorted(shuffled[:n_train].tolist())
    assert ds.split("val").tolist() == sorted(shuffled[n_train : n_train + n_val].tolist())
    assert ds.split("test").tolist() == sorted(shuffled[n_train + n_val : n_train + 2 * n_val].tolist())
    assert ds.num_classes == 2983 and ds.labels().dtype == np.int16


def test_igb_full_raw_files_padding_and_zero_tail(tmp_path: Path) -> None:
    """Headerless float32 features (N from the size) and labels, a labelled prefix, padding → -1,
    and a zero feature tail (an old download) warned about."""
    n, labelled = 64, 40
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((n, 1024)).astype(np.float32)
    feats[-4:] = 0  # the missing embeddings of a pre-2023-11-07 download
    labels = np.where(np.arange(n) < labelled, rng.integers(0, 19, n), 0).astype(np.float32)  # zero padding
    edges = rng.integers(0, n, (400, 2)).astype(np.int32)
    _igb(tmp_path / "igb", "full", feats, labels, edges, raw=True)
    lines: list[str] = []
    given = {"root": str(tmp_path / "igb"), "size": "full", "labelled": labelled, "split": "fraction:0.25"}
    ds = run(
        "igb",
        tmp_path / "ds",
        {**given, "undirected": True, "self_loops": True, "feature_dtype": "float16"},
        log=lines.append,
    )
    check_dataset(ds)
    assert any("no .npy header" in line and "N = 262,144 bytes / 4096 = 64 vertices" in line for line in lines)
    assert any(line.startswith("warning:") and "all zero" in line and "node_feat_5M_tail.npy" in line for line in lines)
    want = labels.astype(np.int64)
    want[labelled:] = -1
    assert ds.labels().tolist() == want.tolist()
    assert ds.feature_dtype == np.float16 and np.array_equal(ds.features(), feats.astype(np.float16))
    # reference: drop self-loops, one per vertex first, then the given edges, then their reverses
    keep = edges[edges[:, 0] != edges[:, 1]].astype(np.int64)
    src = np.concatenate([np.arange(n), keep[:, 0], keep[:, 1]])
    dst = np.concatenate([np.arange(n), keep[:, 1], keep[:, 0]])
    assert _rows(ds) == _csr(src, dst, n)
    train = ds.split("train")
    assert len(train) == 10 and len(ds.split("val")) == len(ds.split("test")) == 5 and train.max() < labelled
    assert ds.meta["source"]["labelled"] == labelled and ds.meta["source"]["self_loops"] is True


def _ogb(root: Path, n: int, e: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "edge_index": rng.integers(0, n, (2, e)),
        "node_feat": rng.standard_normal((n, 8)).astype(np.float32),
        "node_label": np.where(rng.random((n, 1)) < 0.4, rng.integers(0, 5, (n, 1)), np.nan),
    }
    (root / "raw").mkdir(parents=True)
    np.savez_compressed(
        root / "raw" / "data.npz",
        edge_index=arrays["edge_index"],
        node_feat=arrays["node_feat"],
        node_year=rng.integers(1990, 2020, (n, 1)),
        num_nodes_list=np.array([n]),
        num_edges_list=np.array([e]),
    )
    np.savez_compressed(root / "raw" / "node-label.npz", node_label=arrays["node_label"])
    labelled = rng.permutation(np.flatnonzero(~np.isnan(arrays["node_label"][:, 0])))
    third = len(labelled) // 3
    (root / "split" / "time").mkdir(parents=True)
    for name, ids in (
        ("train", labelled[:third]),
        ("valid", labelled[third : 2 * third]),
        ("test", labelled[2 * third :]),
    ):
        with gzip.open(root / "split" / "time" / f"{name}.csv.gz", "wt") as fh:
            fh.write("".join(f"{i}\n" for i in ids))
        arrays[name] = ids
    return arrays


def test_ogb_binary_layout_streams_the_compressed_npz(tmp_path: Path, monkeypatch) -> None:
    got = _ogb(tmp_path / "papers100M-bin", N, E)
    with zipfile.ZipFile(tmp_path / "papers100M-bin" / "raw" / "data.npz") as zf:  # the fixture is DEFLATEd
        assert zf.getinfo("edge_index.npy").compress_type == zipfile.ZIP_DEFLATED
    # a budget that forces several windows: the 2×E member is then read (inflated) three times
    monkeypatch.setattr(csr.Layout, "plan", staticmethod(lambda n, memory: csr.Layout(333, 700)))
    ds = run("ogb", tmp_path / "ds", {"root": str(tmp_path / "papers100M-bin"), "undirected": True}, log=lambda _: None)
    check_dataset(ds)
    src, dst = got["edge_index"]
    keep = src != dst
    assert _rows(ds) == _csr(np.concatenate([src, dst[keep]]), np.concatenate([dst, src[keep]]), N)
    assert np.array_equal(ds.features(), got["node_feat"])
    want = np.where(np.isnan(got["node_label"][:, 0]), -1, np.nan_to_num(got["node_label"][:, 0])).astype(int)
    assert ds.labels().tolist() == want.tolist() and ds.labels().dtype == np.int8
    for name, key in (("train", "train"), ("val", "valid"), ("test", "test")):
        assert ds.split(name).tolist() == sorted(got[key].tolist())
    assert ds.meta["source"]["split"] == "time" and ds.meta["directed"] is False


def _gz(path: Path, rows: np.ndarray, fmt: str) -> None:
    with gzip.open(path, "wt") as fh:
        fh.write("".join(",".join(fmt % v for v in np.atleast_1d(row)) + "\n" for row in rows))


def test_ogb_csv_layout_matches_a_direct_reading(tmp_path: Path, monkeypatch) -> None:
    """ogbn-arxiv's layout: raw/*.csv.gz, counts in num-*-list.csv.gz; parsed in small batches of lines."""
    rng = np.random.default_rng(4)
    n, e = 120, 700
    edges, feats = rng.integers(0, n, (e, 2)), rng.standard_normal((n, 5)).astype(np.float32)
    labels = rng.integers(0, 40, n)
    labels[7] = 200  # past int8: OGB declares no number of classes, so the labels' type is known after a pass
    raw = tmp_path / "ogbn_arxiv" / "raw"
    raw.mkdir(parents=True)
    _gz(raw / "edge.csv.gz", edges, "%d")
    _gz(raw / "node-feat.csv.gz", feats, "%.9g")  # round-trips float32
    _gz(raw / "node-label.csv.gz", labels, "%d")
    _gz(raw / "num-node-list.csv.gz", np.array([n]), "%d")
    _gz(raw / "num-edge-list.csv.gz", np.array([e]), "%d")
    (tmp_path / "ogbn_arxiv" / "split" / "time").mkdir(parents=True)
    for name, ids in (("train", [3, 1, 4]), ("valid", [15, 9]), ("test", [26, 5])):
        _gz(tmp_path / "ogbn_arxiv" / "split" / "time" / f"{name}.csv.gz", np.array(ids), "%d")
    monkeypatch.setattr(readers, "CSV_LINES", 7)
    ds = run("ogb", tmp_path / "ds", {"root": str(tmp_path / "ogbn_arxiv")}, log=lambda _: None)
    check_dataset(ds)
    assert _rows(ds) == _csr(edges[:, 0], edges[:, 1], n)
    assert np.array_equal(ds.features(), feats) and ds.labels().tolist() == labels.tolist()
    assert ds.num_classes == 201 and ds.labels().dtype == np.int16
    assert (ds.split("train").tolist(), ds.split("val").tolist(), ds.split("test").tolist()) == (
        [1, 3, 4],
        [9, 15],
        [5, 26],
    )
    lines = [f"{s},{d}\n" for s, d in edges]
    lines[50] = "1,2,3\n"  # line 51
    with gzip.open(raw / "edge.csv.gz", "wt") as fh:
        fh.write("".join(lines))
    with pytest.raises(DatasetError, match=r"edge\.csv\.gz: line 51: 3 value\(s\) \(expected 2 value"):
        run("ogb", tmp_path / "ds2", {"root": str(tmp_path / "ogbn_arxiv")}, log=lambda _: None)


@pytest.mark.parametrize("pairs", [True, False])
def test_edge_streams_give_the_same_csr_for_every_chunk_size(tmp_path: Path, pairs: bool) -> None:
    n, e = 12, 30
    edges = np.random.default_rng(1).integers(0, n, (e, 2))
    if pairs:
        np.save(tmp_path / "e.npy", edges)
        arr = readers.npy(tmp_path / "e.npy", "edges")
    else:
        np.savez_compressed(tmp_path / "d.npz", edge_index=edges.T.copy())
        arr = readers.npz_member(tmp_path / "d.npz", "edge_index", "edges")
    want = _csr(edges[:, 0], edges[:, 1], n)
    for chunk in range(1, e + 1):
        out = tmp_path / f"c{chunk}"
        out.mkdir()
        csr.build(out, readers.EdgeArray(arr, n, pairs=pairs), n, memory=0, layout=csr.Layout(chunk, 10**6))
        assert (np.load(out / "indptr.npy").tolist(), np.load(out / "indices.npy").tolist()) == want


def test_dry_run_prints_the_schema_and_writes_nothing(tmp_path: Path, graph) -> None:
    _ogb(tmp_path / "o", N, E)
    lines: list[str] = []
    assert run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o"), "dry_run": True}, log=lines.append) is None
    text = "\n".join(lines)
    assert "data.npz:edge_index: .npz member, int64 2 × 2,500" in text and "data.npz:node_feat" in text
    assert "RAM: budget" in text and "disk:" in text and "dry run: nothing written" in text
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob("ds*"))


def test_bad_inputs_are_one_line_naming_the_file(tmp_path: Path, graph) -> None:
    feats, labels, edges = graph
    quiet = {"log": lambda _: None}
    with pytest.raises(DatasetError, match=r"nowhere/tiny/processed: missing"):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "nowhere"), "size": "tiny"}, **quiet)
    bad = edges.copy()
    bad[7] = (3, N)
    _igb(tmp_path / "a", "tiny", feats, labels, bad, raw=False)
    with pytest.raises(DatasetError, match=rf"edge_index\.npy: edge 7 \(3 → {N}\) names vertex {N}, not a vertex id"):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "a"), "size": "tiny"}, **quiet)
    assert not list(tmp_path.glob("ds*"))
    _igb(tmp_path / "b", "tiny", feats, labels, np.zeros((5, 3), np.int64), raw=False)
    with pytest.raises(DatasetError, match=r"edge_index\.npy: edges must be an E×2 or 2×E integer array"):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "b"), "size": "tiny"}, **quiet)
    _igb(tmp_path / "c", "large", feats[:, :10], labels, edges, raw=True)  # 40 bytes a row, not 4096
    with pytest.raises(DatasetError, match=r"node_feat\.npy: features has no \.npy header, and its 12,000 bytes"):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "c"), "size": "large"}, **quiet)
    _igb(tmp_path / "d", "tiny", feats, np.full(N, 19.0), edges, raw=False)
    with pytest.raises(DatasetError, match=r"node_label_19\.npy: labels\[0\] = 19\.0 is not a class \(--classes 19\)"):
        run("igb", tmp_path / "ds", {"root": str(tmp_path / "d"), "size": "tiny"}, **quiet)
    _ogb(tmp_path / "o", N, E)
    (tmp_path / "o" / "raw" / "node-label.npz").unlink()
    with pytest.raises(DatasetError, match=r"raw/node-label\.npz: missing \(labels\)"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **quiet)
    _ogb(tmp_path / "p", N, E)
    with gzip.open(tmp_path / "p" / "split" / "time" / "valid.csv.gz", "wt") as fh:
        fh.write(f"1\n{N + 2}\n")
    with pytest.raises(DatasetError, match=rf"valid\.csv\.gz: line 2 holds {N + 2}, not a vertex id"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "p")}, **quiet)
    np.savez_compressed(tmp_path / "o" / "raw" / "node-label.npz", labels=np.zeros(N))
    with pytest.raises(DatasetError, match=r"node-label\.npz: no member 'node_label' \(labels\); it holds labels"):
        run("ogb", tmp_path / "ds", {"root": str(tmp_path / "o")}, **quiet)


def test_cli_import_errors_are_one_line_with_a_non_zero_exit(tmp_path: Path, graph, capfd) -> None:
    from moment.cli import main

    assert (
        main(
            [
                "dataset",
                "import",
                "--format",
                "igb",
                "--root",
                str(tmp_path / "no"),
                "--size",
                "tiny",
                "--out",
                str(tmp_path / "ds"),
            ]
        )
        == 1
    )
    err = capfd.readouterr().err
    assert "no/tiny/processed: missing" in err and len(err.strip().splitlines()) == 1
    assert main(["dataset", "import", "--format", "igb", "--root", str(tmp_path), "--out", str(tmp_path / "ds")]) == 2
    assert "--format igb needs --size" in capfd.readouterr().err
    assert (
        main(
            [
                "dataset",
                "import",
                "--format",
                "ogb",
                "--root",
                str(tmp_path),
                "--size",
                "tiny",
                "--out",
                str(tmp_path / "ds"),
            ]
        )
        == 2
    )
    assert "--size is not an option of --format ogb" in capfd.readouterr().err
    assert (
        main(
            [
                "dataset",
                "import",
                "--format",
                "igb",
                "--root",
                str(tmp_path),
                "--size",
                "tiny",
                "--memory",
                "lots",
                "--out",
                str(tmp_path / "ds"),
            ]
        )
        == 2
    )
    assert "--memory 'lots': expected a size like 4GB, 512MiB, 2e9" in capfd.readouterr().err


def test_cli_imports_igb_and_prints_the_dataset(tmp_path: Path, graph, capfd) -> None:
    from moment.cli import main

    feats, labels, edges = graph
    _igb(tmp_path / "igb", "tiny", feats, labels, edges, raw=False)
    assert (
        main(
            [
                "dataset",
                "import",
                "--format",
                "igb",
                "--root",
                str(tmp_path / "igb"),
                "--size",
                "tiny",
                "--split",
                "fraction:0.1",
                "--memory",
                "64MB",
                "--out",
                str(tmp_path / "ds"),
            ]
        )
        == 0
    )
    printed = " ".join(capfd.readouterr().out.split())  # rich wraps long lines
    assert f"{N:,} vertices, {E:,} edges, 19 classes, 30 training vertices" in printed


@pytest.mark.parametrize("text", ["fraction:0", "fraction:0.6", "fraction:x", "random"])
def test_bad_split_conventions_are_refused(text: str) -> None:
    with pytest.raises(Exception, match="--split"):
        conventions.parse(text)


def test_arrays_in_fortran_order_or_big_endian_read_the_same(tmp_path: Path, graph) -> None:
    """The npy importer reads with plain reads; layouts a plain read cannot take still give the same dataset."""
    feats, labels, edges = graph
    np.save(tmp_path / "x.npy", feats.astype(">f4"))
    np.save(tmp_path / "y.npy", labels.astype(">i8"))
    np.save(tmp_path / "e.npy", edges)
    np.save(tmp_path / "ef.npy", np.asfortranarray(edges))
    common = {"features": str(tmp_path / "x.npy"), "labels": str(tmp_path / "y.npy"), "feature_dtype": "float32"}
    a = run("npy", tmp_path / "a", {**common, "edges": str(tmp_path / "e.npy")})
    b = run("npy", tmp_path / "b", {**common, "edges": str(tmp_path / "ef.npy")})
    assert _rows(a) == _rows(b) == _csr(edges[:, 0], edges[:, 1], N)
    assert np.array_equal(a.features(), feats) and a.labels().tolist() == labels.astype(int).tolist()
