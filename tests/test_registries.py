"""Every registry is the one list of its members: a member registered here, in the test, runs
through its stage end to end, and no contract or budget names the built-in ones (the way
networkx's flow tests run every ``flow_func``). The flow models, max-flow engines and MILP solvers
have theirs in test_flow_registry.py, test_planner_models.py and test_planner_search.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moment.cli import main
from placement.dataset import open_dataset
from placement.ddak import hash_placement
from placement.placed import open_placed, verify
from placement.policies import POLICIES, Policy


def _coldest_first(hotness: np.ndarray, bins: Any, order: np.ndarray, opts: Any) -> Any:
    """A toy policy: the hash baseline fed the vertices coldest first, so the caches get the coldest."""
    return hash_placement(hotness, bins, seed=opts.seed, order=order[::-1].copy())


def test_a_registered_policy_places_end_to_end(
    monkeypatch: pytest.MonkeyPatch, plan_file: Path, small_dataset: Path, tmp_path: Path
) -> None:
    monkeypatch.setitem(POLICIES, "coldest", Policy(_coldest_first, "the coldest rows to the caches"))
    out = tmp_path / "placed"
    argv = ["place", "--plan", str(plan_file), "--dataset", str(small_dataset), "--out", str(out)]
    assert main([*argv, "--policy", "coldest", "--gpu-cache", "5%", "--cpu-cache", "5%"]) == 0
    manifest = json.loads((out / "placed.json").read_text())
    assert (manifest["policy"], manifest["priority"]) == ("coldest", None)  # it reads no priority
    placed = open_placed(out)
    hot = np.asarray(placed.array("hotness"))
    gpu = next(b for b in placed.bins if b.tier == "gpu")
    ssd_start = sum(b.count for b in placed.bins if b.tier != "ssd")
    assert gpu.count > 0 and hot[: gpu.count].max() <= hot[ssd_start:].min()  # the toy's choice, kept
    assert verify(out)["rows"] == open_dataset(small_dataset).num_nodes


def test_the_policy_help_is_the_registrys(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(POLICIES, "coldest", Policy(_coldest_first, "the coldest rows to the caches"))
    with pytest.raises(SystemExit):
        main(["place", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "coldest: the coldest rows to the caches" in text
    assert all(f"{name}: {p.about}" in text for name, p in POLICIES.items())


def _toy_importer() -> types.ModuleType:
    """A format none of the built-in importers reads: one .npz bundle with features, labels, edges (E×2)."""
    from placement.importers.publish import Found, write_dataset
    from placement.importers.readers import EdgeArray, npz_member

    def run(out: Path, *, bundle: str, seed: int | None = None, progress: Any = None, log: Any = print, **common: Any):
        feats = npz_member(bundle, "features", "features")
        labels = npz_member(bundle, "labels", "labels")
        edges = EdgeArray(npz_member(bundle, "edges", "edges"), feats.shape[0])
        n = feats.shape[0]
        found = Found(
            fmt="toy",
            features=feats,
            labels=labels,
            edges=edges,
            splits=lambda: {
                "train": np.arange(0, n // 2),
                "val": np.arange(n // 2, n // 2 + 5),
                "test": np.arange(n - 5, n),
            },
            split="halves",
            given_splits=[],
            files={"bundle": str(Path(bundle).absolute())},
            seed=seed or 0,
        )
        return write_dataset(out, found, progress=progress, log=log, **common)

    module = types.ModuleType("toy_importer")
    module.run = run  # type: ignore[attr-defined]
    return module


def test_a_registered_importer_imports_end_to_end(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from placement.importers import IMPORTERS, Importer

    monkeypatch.setitem(sys.modules, "toy_importer", _toy_importer())
    monkeypatch.setitem(
        IMPORTERS,
        "toy",
        Importer(
            "toy", "one .npz: --bundle B", ("bundle", "seed"), ("bundle",), "toy_importer", {"bundle": "the .npz"}
        ),
    )
    rng = np.random.default_rng(0)
    n = 200
    bundle = tmp_path / "graph.npz"
    np.savez_compressed(
        bundle,
        features=rng.standard_normal((n, 8)).astype(np.float32),
        labels=rng.integers(0, 3, n),
        edges=rng.integers(0, n, (1000, 2)),
    )
    out = tmp_path / "ds"
    assert main(["dataset", "import", "--format", "toy", "--bundle", str(bundle), "--out", str(out)]) == 0
    ds = open_dataset(out)
    assert (ds.num_nodes, ds.num_edges, ds.feature_dim) == (n, 1000, 8)
    source = json.loads((out / "dataset.json").read_text())["source"]
    assert (source["format"], source["files"]) == ("toy", {"bundle": str(bundle.absolute())})
    assert np.array_equal(np.asarray(ds.features()), np.load(bundle)["features"])


def test_a_registered_importers_option_is_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another format's option is refused naming the format, as the built-in ones are."""
    from placement.importers import IMPORTERS, Importer

    monkeypatch.setitem(
        IMPORTERS,
        "toy",
        Importer("toy", "one .npz: --bundle B", ("bundle",), ("bundle",), "toy_importer", {"bundle": "x"}),
    )
    code = main(["dataset", "import", "--format", "npy", "--bundle", "b.npz", "--out", str(tmp_path / "o")])
    assert code == 2 and "--bundle is not an option of --format npy" in capsys.readouterr().err


def test_a_registered_layer_trains_and_is_budgeted_as_itself(
    monkeypatch: pytest.MonkeyPatch, small_placed: Path, tmp_path: Path
) -> None:
    """The memory budget asks the registered model for its activations instead of taking it for SAGE."""
    from trainer import loop, memory
    from trainer.config import TrainConfig
    from trainer.models import LAYERS, Layer, LayerSize

    def graphconv(cfg: Any, in_dim: int, out_dim: int, last: bool) -> Any:
        from torch_geometric.nn import GraphConv

        return GraphConv(in_dim, out_dim), out_dim

    seen: list[LayerSize] = []

    def estimate(s: LayerSize) -> tuple[float, float, int]:
        seen.append(s)
        return 1000 * s.n_dst, 0.0, s.out

    monkeypatch.setitem(LAYERS, "graphconv", Layer(graphconv, hidden=24, activations=estimate))
    cfg = TrainConfig(data=str(small_placed), model="graphconv", hidden=24, fanouts=(5, 3), batch_size=64, device="cpu")
    shape = memory.shape_of_placed(open_placed(small_placed), cfg, 1, 1)
    assert memory.activation_bytes(shape) == int(4 * sum(1000 * s.n_dst for s in seen))
    assert [s.last for s in seen] == [False, True] and [s.out for s in seen] == [24, shape.classes]
    sage = memory.activation_bytes(memory.RunShape(**{**vars(shape), "model": "sage"}))
    assert sage != memory.activation_bytes(shape)
    metrics = tmp_path / "metrics.json"
    argv = ["--data", str(small_placed), "--model", "graphconv", "--fanouts", "5,3", "--batch-size", "64"]
    argv += ["--device", "cpu", "--epochs", "1", "--max-batches-per-epoch", "3", "--metrics-json", str(metrics)]
    assert loop.main(argv) == 0
    doc = json.loads(metrics.read_text())
    assert doc["config"]["model"] == "graphconv" and np.isfinite(doc["epochs"][0]["loss"])
