"""Importing plain arrays: exact CSR by destination, splits, feature conversion, and errors naming the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moment.contracts.dataset import DatasetManifest
from moment.errors import UsageError
from placement.dataset import Dataset, DatasetError, check_dataset
from placement.importers.arrays import import_arrays

# 0→1, 2→1, 1→0, 3→4, 4→4 (a self-loop), 0→1 again
EDGES = np.array([[0, 1], [2, 1], [1, 0], [3, 4], [4, 4], [0, 1]], dtype=np.int64)
N = 5


def _save(where: Path, name: str, array: np.ndarray) -> Path:
    path = where / f"{name}.npy"
    np.save(path, array)
    return path


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    return {
        "features": _save(src, "features", rng.standard_normal((N, 3)).astype(np.float32)),
        "labels": _save(src, "labels", np.array([0, 1, 2, 1, 0])),
        "edges": _save(src, "edges", EDGES),
    }


def _rows(ds: Dataset) -> tuple[list[int], list[int]]:
    return ds.indptr().tolist(), ds.indices().tolist()


def test_edge_list_becomes_csr_by_destination_in_input_order(tmp_path: Path, inputs: dict[str, Path]) -> None:
    ds = import_arrays(tmp_path / "ds", **inputs, chunk=2)  # three chunks: order must survive them
    check_dataset(ds)
    # neighbours of v = sources of the edges into v
    assert _rows(ds) == ([0, 1, 4, 4, 4, 6], [1, 0, 2, 0, 3, 4])
    assert ds.indices().dtype == np.int32 and ds.meta["directed"] is True
    assert (ds.num_nodes, ds.num_edges, ds.num_classes, ds.feature_dim) == (N, 6, 3, 3)
    assert ds.features().tobytes() == np.load(inputs["features"]).tobytes()
    assert ds.labels().dtype == np.int8 and ds.labels().tolist() == [0, 1, 2, 1, 0]  # 3 classes: int8


def test_undirected_adds_every_reverse_but_self_loops_once(tmp_path: Path, inputs: dict[str, Path]) -> None:
    ds = import_arrays(tmp_path / "ds", **inputs, undirected=True)
    # per row: forward edges in input order, then the reverses in input order
    assert _rows(ds) == ([0, 3, 7, 8, 9, 11], [1, 1, 1, 0, 2, 0, 0, 1, 4, 3, 4])
    assert ds.meta["directed"] is False


def test_csr_input_is_kept_as_is_or_symmetrised(tmp_path: Path, inputs: dict[str, Path]) -> None:
    indptr, indices = [0, 1, 4, 4, 4, 6], [1, 0, 2, 0, 3, 4]
    csr = {
        "indptr": _save(tmp_path, "indptr", np.array(indptr)),
        "indices": _save(tmp_path, "indices", np.array(indices, dtype=np.int32)),
    }
    plain = {k: v for k, v in inputs.items() if k != "edges"}
    assert _rows(import_arrays(tmp_path / "a", **plain, **csr, chunk=2)) == (indptr, indices)
    both = import_arrays(tmp_path / "b", **plain, **csr, undirected=True)
    from_list = import_arrays(tmp_path / "c", **inputs, undirected=True)
    for ds in (both, from_list):  # the same multiset of neighbours per row, whatever the input form
        ptr, idx = _rows(ds)
        assert [sorted(idx[a:b]) for a, b in zip(ptr, ptr[1:])] == [[1, 1, 1], [0, 0, 0, 2], [1], [4], [3, 4]]


def test_given_splits_are_sorted_and_missing_ones_drawn_from_labelled_vertices(tmp_path: Path) -> None:
    n = 2000
    labels = np.where(np.arange(n) % 4 == 0, -1, np.arange(n) % 7)  # a quarter unlabelled
    files = {
        "features": _save(tmp_path, "f", np.zeros((n, 2), np.float16)),
        "labels": _save(tmp_path, "l", labels),
        "edges": _save(tmp_path, "e", np.array([[1, 2]])),
        "train": _save(tmp_path, "t", np.array([9, 3, 5], dtype=np.int32)),
    }
    ds = import_arrays(tmp_path / "ds", **files, fractions=(0.5, 0.02, 0.01))
    assert ds.split("train").tolist() == [3, 5, 9]
    val, test = np.asarray(ds.split("val")), np.asarray(ds.split("test"))
    assert (val.size, test.size) == (30, 15)  # fractions of the 1500 labelled vertices
    assert (np.diff(val) > 0).all() and (np.diff(test) > 0).all()
    assert (labels[val] >= 0).all() and (labels[test] >= 0).all()
    assert not set(val) & set(test) and not {3, 5, 9} & (set(val) | set(test))
    assert ds.num_classes == 7 and ds.feature_dtype == np.float16
    again = import_arrays(tmp_path / "again", **files, fractions=(0.5, 0.02, 0.01))
    assert again.split("val").tolist() == val.tolist()  # the seed decides


def test_features_convert_on_request_and_refuse_overflow(tmp_path: Path, inputs: dict[str, Path]) -> None:
    wide = np.random.default_rng(1).standard_normal((N, 3))
    inputs["features"] = _save(tmp_path, "f64", wide)
    with pytest.raises(DatasetError, match=r"f64\.npy: features have dtype float64"):
        import_arrays(tmp_path / "a", **inputs)
    ds = import_arrays(tmp_path / "b", **inputs, feature_dtype="float32", chunk=4)
    assert np.array_equal(ds.features(), wide.astype(np.float32))
    inputs["features"] = _save(tmp_path, "huge", np.full((N, 3), 1e6))
    with pytest.raises(DatasetError, match=r"huge\.npy: .* do not fit in float16"):
        import_arrays(tmp_path / "c", **inputs, feature_dtype="float16")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("key", "array", "message"),
    [
        ("edges", np.array([[0, 1], [1, 5]]), r"edges\.npy: edges\[1\] holds 5, not a vertex id \(N = 5"),
        ("edges", np.array([[0, 1], [-1, 2]]), r"edges\.npy: edges\[1\] holds -1"),
        ("edges", np.array([[0, 1, 2]]), r"edges\.npy: edges must be an E×2 integer array"),
        ("edges", np.array([[0.0, 1.0]]), r"edges\.npy: .* got float64"),
        ("features", np.zeros((N, 3), dtype=np.int32), r"features\.npy: features have dtype int32"),
        ("features", np.zeros((N, 3, 2), dtype=np.float32), r"features\.npy: features must be a 2-D"),
        ("labels", np.array([0, 1, 2]), r"labels\.npy: labels have 3 entries but .*features\.npy has 5 rows"),
        ("labels", np.array([0, 1, -2, 1, 0]), r"labels\.npy: labels\[2\] = -2"),
        ("labels", np.full(N, -1), r"labels\.npy: no vertex is labelled"),
        ("train", np.array([0, 7]), r"train\.npy: train\[1\] holds 7"),
        ("train", np.array([1, 1]), r"train\.npy: train lists vertex 1 twice"),
    ],
)
def test_bad_inputs_name_the_file_and_the_problem(
    tmp_path: Path, inputs: dict[str, Path], key: str, array: np.ndarray, message: str
) -> None:
    inputs[key] = _save(tmp_path, key, array)
    with pytest.raises(DatasetError, match=message):
        import_arrays(tmp_path / "ds", **inputs)
    assert not (tmp_path / "ds").exists()


def test_bad_csr_and_split_relations_are_refused(tmp_path: Path, inputs: dict[str, Path]) -> None:
    plain = {k: v for k, v in inputs.items() if k != "edges"}
    indices = _save(tmp_path, "indices", np.array([1, 0, 2]))
    for indptr, message in (
        ([0, 1, 3, 3, 3], r"indptr has 5 entries, expected N\+1 = 6"),
        ([0, 2, 1, 3, 3, 3], r"indptr decreases at vertex 1"),
        ([0, 1, 2, 2, 2, 2], r"indptr must run from 0 to len\(indices\) = 3"),
    ):
        with pytest.raises(DatasetError, match=message):
            import_arrays(tmp_path / "ds", **plain, indptr=_save(tmp_path, "indptr", np.array(indptr)), indices=indices)
    splits = {"train": _save(tmp_path, "tr", np.array([0, 1])), "val": _save(tmp_path, "va", np.array([1, 2]))}
    with pytest.raises(DatasetError, match="train and val share 1 vertices"):
        import_arrays(tmp_path / "ds", **inputs, **splits)
    unlabelled = _save(tmp_path, "l", np.array([0, -1, 2, 1, 0]))
    with pytest.raises(DatasetError, match=r"l\.npy: vertex 1 of the train split is unlabelled"):
        import_arrays(tmp_path / "ds", **{**inputs, "labels": unlabelled}, train=splits["train"])
    with pytest.raises(DatasetError, match=r"nowhere\.npy: missing \(features\)"):
        import_arrays(tmp_path / "ds", **{**inputs, "features": tmp_path / "nowhere.npy"})


def test_usage_and_existing_output(tmp_path: Path, inputs: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="either --edges \\(an edge list\\), or --indptr with --indices"):
        import_arrays(tmp_path / "ds", **inputs, indptr=inputs["edges"], indices=inputs["edges"])
    with pytest.raises(UsageError, match="feature_dtype"):
        import_arrays(tmp_path / "ds", **inputs, feature_dtype="int8")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "keep.txt").write_text("mine")
    with pytest.raises(DatasetError, match="already exists and is not empty"):
        import_arrays(tmp_path / "ds", **inputs)
    assert (tmp_path / "ds" / "keep.txt").read_text() == "mine"


def test_random_edge_list_matches_an_in_memory_reference(tmp_path: Path) -> None:
    n, e = 300, 5000
    rng = np.random.default_rng(3)
    edges = rng.integers(0, n, (e, 2))
    files = {
        "features": _save(tmp_path, "f", np.zeros((n, 1), np.float32)),
        "labels": _save(tmp_path, "l", rng.integers(0, 4, n)),
        "edges": _save(tmp_path, "e", edges),
    }
    ds = import_arrays(tmp_path / "ds", **files, chunk=700)
    order = np.argsort(edges[:, 1], kind="stable")
    assert ds.indices().tolist() == edges[order, 0].tolist()
    assert ds.indptr().tolist() == [0, *np.cumsum(np.bincount(edges[:, 1], minlength=n)).tolist()]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_non_finite_features_are_refused_naming_the_first_row(
    tmp_path: Path, inputs: dict[str, Path], bad: float, dtype: type
) -> None:
    """Today NaN is copied silently, and `moment verify` then reports a false corruption (NaN != NaN)."""
    x = np.random.default_rng(0).standard_normal((1000, 16)).astype(dtype)
    x[705, 3] = x[900, 0] = bad
    files = {
        "features": _save(tmp_path, "x", x),
        "labels": _save(tmp_path, "y", np.arange(1000) % 4),
        "edges": _save(tmp_path, "e", np.array([[0, 1]])),
    }
    convert = {"feature_dtype": "float32"} if dtype == np.float64 else {}
    with pytest.raises(DatasetError, match=rf"x\.npy: features row 705 holds {bad} \(column 3\): NaN and inf "):
        import_arrays(tmp_path / "ds", **files, chunk=16 * 100, **convert)  # row 705 is in the 8th chunk
    assert not (tmp_path / "ds").exists()


def test_an_empty_train_split_is_refused(tmp_path: Path, inputs: dict[str, Path]) -> None:
    empty = _save(tmp_path, "tr", np.zeros(0, np.int64))
    with pytest.raises(DatasetError, match=r"tr\.npy: train split is empty"):
        import_arrays(tmp_path / "ds", **inputs, train=empty)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"hello\n", r"t\.npy: not a \.npy file \(features\)$"),
        (b"", r"t\.npy: not a \.npy file \(features\)$"),
        (b"\x93NUMPY\x01\x00", r"t\.npy: not a readable \.npy file \(features: "),
    ],
)
def test_a_file_that_is_not_npy_is_named(tmp_path: Path, inputs: dict[str, Path], content: bytes, message: str) -> None:
    """Not numpy's allow_pickle advice, which a user with a text file cannot act on."""
    (tmp_path / "t.npy").write_bytes(content)
    with pytest.raises(DatasetError, match=message) as info:
        import_arrays(tmp_path / "ds", **{**inputs, "features": tmp_path / "t.npy"})
    assert "pickle" not in str(info.value)


def test_truncated_and_pickled_inputs_are_named(tmp_path: Path, inputs: dict[str, Path]) -> None:
    path = inputs["labels"]
    path.write_bytes(path.read_bytes()[:-8])  # one int64 label short
    with pytest.raises(DatasetError, match=r"labels\.npy: truncated: \d+ bytes, expected \d+$"):
        import_arrays(tmp_path / "ds", **inputs)
    objects = tmp_path / "o.npy"
    np.save(objects, np.array([0, "x", None], dtype=object), allow_pickle=True)
    with pytest.raises(DatasetError, match=r"o\.npy: labels holds Python objects \(pickled data\), not numbers"):
        import_arrays(tmp_path / "ds", **{**inputs, "labels": objects})


def test_a_bad_split_id_is_named_at_its_index_in_the_file(tmp_path: Path, inputs: dict[str, Path]) -> None:
    with pytest.raises(DatasetError, match=r"train\.npy: train\[0\] holds 7"):  # not its index once sorted
        import_arrays(tmp_path / "ds", **inputs, train=_save(tmp_path, "train", np.array([7, 0])))


def test_the_manifest_records_the_import_through_the_contract(tmp_path: Path, inputs: dict[str, Path]) -> None:
    ds = import_arrays(tmp_path / "ds", **inputs, undirected=True, seed=4)
    source = DatasetManifest.read(tmp_path / "ds" / "dataset.json").source
    assert source is not None and source.kind == "import" and (source.undirected, source.seed) == (True, 4)
    assert source.files["features"] == str(inputs["features"].absolute())
    assert ds.manifest.directed is False and ds.manifest.generator is None
    check_dataset(ds)  # labels < num_classes by construction: num_classes is the largest label + 1
    assert ds.num_classes == int(np.load(inputs["labels"]).max()) + 1


def test_cli_import_error_is_one_line(tmp_path: Path, inputs: dict[str, Path], capfd) -> None:
    from moment.cli import main

    (tmp_path / "t.npy").write_text("hello\n")
    code = main(
        [
            "dataset",
            "import",
            "--features",
            str(tmp_path / "t.npy"),
            "--labels",
            str(inputs["labels"]),
            "--edges",
            str(inputs["edges"]),
            "--out",
            str(tmp_path / "ds"),
        ]
    )
    err = capfd.readouterr().err
    assert code == 1 and "t.npy: not a .npy file" in err and len(err.strip().splitlines()) == 1
