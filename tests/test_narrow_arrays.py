"""Arrays narrower than int64 (labels in the narrowest type holding the classes, as imports
write them; the hotness counts in int32): the same values as the int64 ones written before,
which still load, and every consumer widens per batch, so none may read them as int64. A placed
dataset's labels are its dataset's file: the wide side is the source of
tests/placed_fixtures/sha256 (written with int64 labels and counts) placed now, the narrow side
the same source with its labels narrowed, placed alike."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import TensorAttr

from placement.dataset import LABEL_DTYPES, label_type
from placement.place import PlaceOptions, place
from placement.placed import Placed, open_placed
from placement.sampler import NeighborSampler
from trainer.epoch import make_prepare
from trainer.featurestore import TieredFeatureStore
from trainer.nodes import NodeData
from trainer.pyg import PygFeatureStore

FIXTURE = Path(__file__).parent / "placed_fixtures" / "sha256"


@pytest.fixture(scope="module")
def old_and_new(plan_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Placed, Placed]:
    """The fixture's source (int64 labels) and a copy with narrow labels, each placed with the
    fixture's options."""
    root = tmp_path_factory.mktemp("narrow")
    shutil.copytree(FIXTURE, root / "old")
    shutil.copytree(FIXTURE / "ds", root / "narrow-ds")
    labels = root / "narrow-ds" / "labels.npy"
    np.save(labels, np.load(labels).astype(label_type(int(np.load(labels).max()) + 1)))
    opts = PlaceOptions(gpu_cache="3%", cpu_cache="4%", pack=True, pack_budget="1MiB")
    place(plan_file, root / "old" / "ds", root / "wide", opts)
    place(plan_file, root / "narrow-ds", root / "new", opts)
    return open_placed(root / "wide", checksums=True), open_placed(root / "new", checksums=True)


@pytest.mark.parametrize(
    "classes, dtype",
    [(1, "int8"), (19, "int8"), (128, "int8"), (129, "int16"), (2983, "int16"), (32_768, "int16")]
    + [(32_769, "int32"), (2**31, "int32"), (2**31 + 1, "int64")],
)
def test_labels_take_the_narrowest_type_holding_minus_one_and_every_class(classes: int, dtype: str) -> None:
    got = label_type(classes)
    assert got == np.dtype(dtype) and got.name in LABEL_DTYPES
    assert np.iinfo(got).min <= -1 and np.iinfo(got).max >= classes - 1
    if dtype != "int8":  # the next narrower type would not hold the last class
        assert np.iinfo(LABEL_DTYPES[LABEL_DTYPES.index(dtype) - 1]).max < classes - 1


def test_placed_labels_are_the_datasets_narrow_or_wide(old_and_new: tuple[Placed, Placed]) -> None:
    old, new = old_and_new
    assert old.array("labels").dtype == np.int64  # written before labels were narrowed
    assert new.array("labels").dtype == np.int8 == label_type(new.num_classes)
    assert np.array_equal(new.array("labels"), old.array("labels"))


def test_every_consumer_widens_narrow_and_old_labels_alike(old_and_new: tuple[Placed, Placed]) -> None:
    """The trainer's batches, PyG's label tensor and the node check read int8 and int64 labels
    as the same int64 values: a consumer that took the file for int64 (a memmap of its own, a
    tensor of the raw array) would read other values or fail in the loss."""
    old, new = old_and_new
    seeds = torch.from_numpy(np.array(new.array("train")[:50], dtype=np.int64))  # a copy: the split is a read-only map
    want = torch.from_numpy(np.asarray(old.array("labels"))[seeds.numpy()])
    for placed in (old, new):
        labels = placed.array("labels")  # the memory map: widened per batch, never as a whole
        arrays = [placed.array(k) for k in ("indptr", "indices")]
        with TieredFeatureStore(placed, device="cpu", io="posix") as store:
            y = make_prepare(NeighborSampler(*arrays, [3, 2], seed=1), store, labels, torch.device("cpu"))(seeds).y
            assert y.dtype == torch.int64 and torch.equal(y, want)
            assert torch.nn.functional.cross_entropy(torch.zeros(len(y), placed.num_classes), y).isfinite()
            pyg = PygFeatureStore(store, label_name="y").get_tensor(
                TensorAttr(group_name=None, attr_name="y", index=seeds)
            )
            assert pyg.dtype == torch.int64 and torch.equal(pyg, want)
    assert NodeData.of(old).train_labels == NodeData.of(new).train_labels  # the same data on every node


def test_place_takes_old_int64_and_new_int32_hotness_files_alike(
    old_and_new: tuple[Placed, Placed], plan_file: Path, tmp_path: Path
) -> None:
    """``moment place --hotness`` with the old placement's int64 counts and with the new one's
    int32 counts (the same values) places alike, and saves them as int32."""
    _, new = old_and_new
    before = new.root.parent / "old" / "placed"  # the fixture's placement: its counts file in int64
    assert np.load(before / "hotness.npy").dtype == np.int64 and np.load(new.root / "hotness.npy").dtype == np.int32
    assert np.array_equal(np.load(before / "hotness.npy"), np.load(new.root / "hotness.npy"))
    source = new.root.parent / "old" / "ds"
    outs = []
    for given in (before / "hotness.npy", new.root / "hotness.npy"):
        out = tmp_path / given.parent.name
        place(plan_file, source, out, PlaceOptions(gpu_cache="3%", cpu_cache="4%", hotness=given))
        outs.append(open_placed(out, checksums=True))
        assert np.load(out / "hotness.npy").dtype == np.int32
    for key in ("old_to_new", "labels", "indptr", "indices"):
        assert np.array_equal(outs[0].array(key), outs[1].array(key)), key
    assert np.array_equal(outs[0].array("old_to_new"), new.array("old_to_new"))
