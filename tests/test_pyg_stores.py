"""The placed dataset through PyG's remote-backend interface: a FeatureStore with x and y, a
GraphStore with the CSR as CSC/COO/CSR, and a PyG model trained through PyG's NodeLoader on them.

PyG 2.8's ``NeighborLoader`` samples with pyg-lib or torch-sparse, which the project does not
install; ``NodeLoader`` with moment's ``StoreNeighborSampler`` runs the rest of PyG's loader
machinery (input batching, ``filter_custom_store`` fetching x and y with ``multi_get_tensor``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.loader import NodeLoader
from torch_geometric.nn import GraphSAGE

from placement.placed import Placed, open_placed
from trainer.pyg import PlacedGraphStore, StoreNeighborSampler, pyg_stores


@pytest.fixture(scope="module")
def placed(make_placed) -> Placed:
    return open_placed(
        make_placed(
            nodes=2000,
            avg_degree=6,
            dim=16,
            seed=7,
            classes=4,
            train_fraction=0.3,
            gpu_cache="5%",
            cpu_cache="5%",
            epochs=1,
        )
    )


def test_feature_store_serves_x_and_y_graph_store_the_csr(placed: Placed) -> None:
    fs, gs = pyg_stores(placed)
    idx = torch.from_numpy(np.random.default_rng(1).integers(0, placed.num_nodes, 50))
    labels = np.asarray(placed.array("labels"))
    assert np.array_equal(fs[None, "x", idx].numpy(), placed.read_vertices(idx.numpy()))
    assert np.array_equal(fs[None, "y", idx].numpy(), labels[idx.numpy()])
    assert fs.get_tensor_size(None, "y") == (placed.num_nodes,)
    assert np.array_equal(fs.get_tensor(group_name=None, attr_name="y", index=None).numpy(), labels)
    assert sorted(a.attr_name for a in fs.get_all_tensor_attrs()) == ["x", "y"]

    indptr, indices = np.asarray(placed.array("indptr")), np.asarray(placed.array("indices")).astype(np.int64)
    [attr] = gs.get_all_edge_attrs()
    assert attr.layout.value == "csc" and attr.size == (placed.num_nodes, placed.num_nodes)
    row, colptr = gs.get_edge_index(edge_type=None, layout="csc")
    assert np.array_equal(colptr.numpy(), indptr) and np.array_equal(row.numpy(), indices)
    src, dst = gs.get_edge_index(edge_type=None, layout="coo")
    targets = np.repeat(np.arange(placed.num_nodes), np.diff(indptr))
    assert np.array_equal(src.numpy(), indices) and np.array_equal(dst.numpy(), targets)
    rowptr, col = gs.get_edge_index(edge_type=None, layout="csr")
    for v in (0, 17, placed.num_nodes - 1):  # out-neighbours of v: the targets of edges v -> *
        assert sorted(col[rowptr[v] : rowptr[v + 1]].tolist()) == sorted(targets[indices == v].tolist())
    with pytest.raises(NotImplementedError, match="read-only"):
        gs.put_edge_index((row, colptr), edge_type=None, layout="csc", size=attr.size)
    assert isinstance(gs, PlacedGraphStore)


def test_a_pyg_model_trains_through_nodeloader_on_the_stores(placed: Placed) -> None:
    fs, gs = pyg_stores(placed)
    train = torch.from_numpy(np.array(placed.array("train"), dtype=np.int64))
    loader = NodeLoader(
        (fs, gs), node_sampler=StoreNeighborSampler(gs, [5, 3], seed=0), input_nodes=train, batch_size=128, shuffle=True
    )
    torch.manual_seed(0)
    model = GraphSAGE(placed.feature_dim, 16, num_layers=2, out_channels=placed.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    indptr, indices = np.asarray(placed.array("indptr")), np.asarray(placed.array("indices"))
    labels = np.asarray(placed.array("labels"))
    losses, seen = [], []
    for epoch in range(3):
        for batch in loader:
            n_id = batch.n_id.numpy()
            if epoch == 0:  # what PyG assembled is the placed data
                assert np.array_equal(batch.x.numpy(), placed.read_vertices(n_id))
                assert np.array_equal(batch.y.numpy(), labels[n_id])
                for s, t in batch.edge_index.t()[:50].tolist():  # every edge is a real in-edge
                    assert n_id[s] in indices[indptr[n_id[t]] : indptr[n_id[t] + 1]]
                seen.append(n_id[: batch.batch_size])
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert sorted(np.concatenate(seen).tolist()) == sorted(train.tolist())  # seeds first, each once per epoch
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])  # it learns
