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
    hot = np.load(out / "hotness.npy")[np.argsort(np.asarray(placed.array("old_to_new")))]  # by row
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


class _ToyReader:
    """A reader none of the built-in ones is: rows by numpy fancy indexing of a read-only memory
    map of each bin (the page cache does the I/O), counting a "read" per request."""

    on_device = False
    device_type = "cpu"
    route = "host"
    engine = "memmap"
    mode = None
    config = None

    def __init__(self) -> None:
        self.preads = 0
        self.modes: dict[str, str] = {}
        self.read_bytes: dict[str, int] = {}
        self.routes: dict[str, int] = {}
        self.probe: dict[str, float] = {}
        self._maps: dict[str, np.memmap] = {}
        self.closed = False

    def read_batch(self, requests: Any) -> list[float]:
        import time

        start, seconds = time.perf_counter(), []
        for req in requests:
            name = str(req.file)
            if name not in self._maps:
                self._maps[name] = np.memmap(name, dtype=np.uint8, mode="r")
            out = req.out.reshape(len(req.rows), -1).view(np.uint8)
            at = req.base + np.asarray(req.rows, dtype=np.int64)[:, None] * out.shape[1]  # rows from byte base
            out[:] = self._maps[name][at + np.arange(out.shape[1])]
            self.preads += 1
            self.modes[name] = "memmap"
            self.read_bytes[name] = self.read_bytes.get(name, 0) + out.nbytes
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        self._maps.clear()
        self.closed = True


def test_a_registered_reader_trains_end_to_end(
    monkeypatch: pytest.MonkeyPatch, small_placed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--io toy`` is a choice as soon as the reader is registered; a run reads every SSD row
    through it and learns exactly what the built-in file reader's run learns (same seed)."""
    from trainer import loop, readers

    made: list[_ToyReader] = []

    def make(threads: int, direct: bool) -> _ToyReader:
        made.append(_ToyReader())
        return made[-1]

    monkeypatch.setitem(readers.READERS, "toy", readers.ReaderKind(make, "rows from a memory map"))
    with pytest.raises(SystemExit):
        loop.main(["--help"])
    assert "toy rows from a memory map" in " ".join(capsys.readouterr().out.split())
    docs = {}
    for io in ("posix", "toy"):
        metrics = tmp_path / f"{io}.json"
        argv = ["--data", str(small_placed), "--fanouts", "5,3", "--batch-size", "64", "--device", "cpu"]
        argv += ["--epochs", "1", "--max-batches-per-epoch", "3", "--io", io, "--metrics-json", str(metrics)]
        assert loop.main(argv) == 0
        docs[io] = json.loads(metrics.read_text())
    assert len(made) == 1 and made[0].closed and made[0].preads > 0
    toy, posix = docs["toy"], docs["posix"]
    assert toy["prediction"]["ssd_route"] == {
        "planned": None,
        "run": "host",
        "reader": "_ToyReader",
        "engine": "memmap",
    }
    assert toy["epochs"][0]["bytes_per_ssd"] == posix["epochs"][0]["bytes_per_ssd"]
    assert sum(toy["epochs"][0]["bytes_per_ssd"].values()) > 0  # the toy served SSD rows
    assert toy["rank_param_digests"] == posix["rank_param_digests"]  # the same rows, so the same model
    assert toy["epochs"][0]["loss"] == posix["epochs"][0]["loss"]


def test_an_unregistered_reader_is_refused_in_one_line(small_placed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer import loop

    with pytest.raises(SystemExit) as exit_:
        loop.main(["--data", str(small_placed), "--device", "cpu", "--io", "toy"])
    assert exit_.value.code == 2 and "argument --io: invalid choice: 'toy'" in capsys.readouterr().err


def _toy_source() -> Any:
    """A capture format none of the built-in sources reads: PCI functions as JSON lines, one
    object per function with PciFunction's fields (what a tool like hwloc could be turned into)."""
    from moment.errors import SourceError
    from moment.topology.pci import PciFunction
    from moment.topology.profiler import Source

    def parse(text: str, label: str, notes: list[str]) -> list[PciFunction]:
        try:
            return [PciFunction(**json.loads(line)) for line in text.splitlines() if line.strip()]
        except (ValueError, TypeError) as exc:
            raise SourceError(label, f"not PCI functions as JSON lines: {exc}") from None

    return Source("pci_json", "tree", parse, files=("pci-functions.jsonl",))


def test_a_registered_capture_source_profiles_end_to_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder holding only the toy's file is profiled through it: the same machine as the real
    lspci capture the toy's file was made from; the help names the file; a mangled one is skipped
    with a warning naming it."""
    import dataclasses

    from moment.topology import profiler
    from moment.topology.profile_io import load_profile
    from moment.topology.sources.lspci_tree import parse_lspci_tree

    capture = Path(__file__).parent / "fixtures" / "asus-esc8000a-e12"
    functions = parse_lspci_tree((capture / "lspci-tv.txt").read_text(), "lspci-tv.txt", [])
    folder = tmp_path / "asus-esc8000a-e12"
    folder.mkdir()
    (folder / "pci-functions.jsonl").write_text("".join(json.dumps(dataclasses.asdict(f)) + "\n" for f in functions))
    monkeypatch.setitem(profiler.SOURCES, "pci_json", _toy_source())
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert "pci-functions.jsonl" in capsys.readouterr().out
    assert main(["profile", "--from", str(folder), "--out", str(tmp_path / "toy.yaml")]) == 0
    assert main(["profile", "--from", str(capture), "--out", str(tmp_path / "lspci.yaml")]) == 0
    toy, real = load_profile(tmp_path / "toy.yaml"), load_profile(tmp_path / "lspci.yaml")
    assert toy.sources == ["pci-functions.jsonl (asus-esc8000a-e12)", "tree from pci_json"]
    assert toy.model_dump(exclude={"sources"}) == real.model_dump(exclude={"sources"})
    assert len(toy.devices()) > 0
    (folder / "pci-functions.jsonl").write_text('{"bdf": "0000:00:00.0", "colour": "red"}\n')
    capsys.readouterr()
    assert main(["profile", "--from", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "skipped pci-functions.jsonl: pci-functions.jsonl: not PCI functions as JSON lines" in err
