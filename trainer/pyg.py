"""A placed dataset seen through PyG's remote-backend interface, so PyG users can put their own
loaders and models on top of moment's tiers.

* :class:`PygFeatureStore`: PyG's ``FeatureStore`` over the :class:`TieredFeatureStore` —
  features ``x`` from the tiers, and with ``label_name`` the labels (``y``), indexed by vertex ids;
* :class:`PlacedGraphStore`: PyG's ``GraphStore`` over the placed CSR. moment's CSR lists each
  vertex's *in*-neighbours (the vertices it aggregates from), which is PyG's CSC layout
  (``colptr`` = indptr, ``row`` = indices) for ``edge_index = [source, target]``: served
  memory-mapped, without a copy. COO and CSR are converted on request (in memory: O(edges));
* :class:`StoreNeighborSampler`: a PyG ``BaseSampler`` that samples from a graph store's CSC with
  moment's own uniform sampler, for ``NodeLoader((feature_store, graph_store), node_sampler=...)``
  where PyG's ``NeighborLoader`` cannot sample (it needs pyg-lib or torch-sparse)::

      fs, gs = pyg_stores(open_placed("placed"))
      loader = NodeLoader((fs, gs), node_sampler=StoreNeighborSampler(gs, [10, 5]), input_nodes=train, batch_size=512)
      for batch in loader:  # batch.x, batch.y, batch.edge_index, batch.n_id, batch.batch_size
          out = model(batch.x, batch.edge_index)[: batch.batch_size]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch_geometric.data import EdgeAttr, FeatureStore, GraphStore, TensorAttr
from torch_geometric.sampler import BaseSampler, NodeSamplerInput, SamplerOutput

from placement.placed import Placed
from placement.sampler import NeighborSampler
from trainer.featurestore import TieredFeatureStore


class PygFeatureStore(FeatureStore):
    """PyG's ``FeatureStore`` over a :class:`TieredFeatureStore`: one read-only tensor, attribute
    ``attr_name`` of group ``None`` (a homogeneous graph), indexed by vertex ids. Lets PyG loaders
    (``NeighborLoader((feature_store, graph_store), ...)``) fetch features from the tiers."""

    def __init__(self, store: TieredFeatureStore, attr_name: str = "x", label_name: str | None = None) -> None:
        """``label_name``: also serve the placed labels (int64, vertex ids) under this attribute."""
        super().__init__()
        self.store = store
        self.attr_name = attr_name
        self.label_name = label_name
        self._labels = store.placed.array("labels") if label_name is not None else None

    def _put_tensor(self, tensor: Any, attr: TensorAttr) -> bool:
        raise NotImplementedError("the tiered feature store is read-only: features come from a placed dataset")

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        raise NotImplementedError("the tiered feature store is read-only: features come from a placed dataset")

    def _get_tensor(self, attr: TensorAttr) -> torch.Tensor:
        if self._labels is not None and attr.group_name is None and attr.attr_name == self.label_name:
            return self._get_labels(attr.index)
        self._check(attr)
        index, n = attr.index, self.store.placed.num_nodes
        if index is None:
            return self.store.get(torch.arange(n))
        if isinstance(index, slice):
            return self.store.get(torch.arange(*index.indices(n)))
        if isinstance(index, int):
            return self.store.get(torch.tensor([index]))[0]
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = index.nonzero().view(-1)
        return self.store.get(index)

    def _get_labels(self, index: Any) -> torch.Tensor:
        labels = self._labels
        assert labels is not None
        if index is None:
            index = slice(None)
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        return torch.from_numpy(np.array(labels[index], dtype=np.int64))

    def _get_tensor_size(self, attr: TensorAttr) -> tuple[int, ...] | None:
        if self._labels is not None and attr.group_name is None and attr.attr_name == self.label_name:
            return (self.store.placed.num_nodes,)
        if not self._matches(attr):
            return None
        return (self.store.placed.num_nodes, self.store.dim)

    def get_all_tensor_attrs(self) -> list[TensorAttr]:
        attrs = [TensorAttr(group_name=None, attr_name=self.attr_name)]
        if self.label_name is not None:
            attrs.append(TensorAttr(group_name=None, attr_name=self.label_name))
        return attrs

    def _matches(self, attr: TensorAttr) -> bool:
        return attr.group_name is None and attr.attr_name == self.attr_name

    def _check(self, attr: TensorAttr) -> None:
        if not self._matches(attr):
            raise KeyError(
                f"no tensor for group {attr.group_name!r}, attribute {attr.attr_name!r} "
                f"(this store holds group None, attribute {self.attr_name!r})"
            )


class PlacedGraphStore(GraphStore):
    """PyG's ``GraphStore`` over a placed dataset's CSR (vertex ids), homogeneous (edge type None):
    CSC natively (memory-mapped), COO and CSR converted on request. Read-only."""

    def __init__(self, placed: Placed) -> None:
        super().__init__()
        self.placed = placed
        self.num_nodes = placed.num_nodes
        # copy-on-write mappings: writable for torch (no warning), read from disk page by page
        self._colptr = torch.from_numpy(np.load(placed.file("indptr"), mmap_mode="c"))
        self._row = torch.from_numpy(np.load(placed.file("indices"), mmap_mode="c"))

    def _put_edge_index(self, edge_index: Any, edge_attr: EdgeAttr) -> bool:
        raise NotImplementedError("the placed graph store is read-only: edges come from a placed dataset")

    def _remove_edge_index(self, edge_attr: EdgeAttr) -> bool:
        raise NotImplementedError("the placed graph store is read-only: edges come from a placed dataset")

    def get_all_edge_attrs(self) -> list[EdgeAttr]:
        return [EdgeAttr(edge_type=None, layout="csc", is_sorted=True, size=(self.num_nodes, self.num_nodes))]

    def _get_edge_index(self, edge_attr: EdgeAttr) -> tuple[torch.Tensor, torch.Tensor] | None:
        if edge_attr.edge_type is not None:
            return None
        layout = edge_attr.layout.value
        if layout == "csc":
            return self._row, self._colptr  # PyG's CSC: (row, colptr)
        col = torch.repeat_interleave(torch.arange(self.num_nodes), self._colptr.diff())
        row = self._row.to(torch.int64)
        if layout == "coo":
            return row, col
        order = torch.argsort(row, stable=True)  # csr: grouped by source
        rowptr = torch.zeros(self.num_nodes + 1, dtype=torch.int64)
        rowptr[1:] = torch.cumsum(torch.bincount(row, minlength=self.num_nodes), 0)
        return rowptr, col[order]


def pyg_stores(placed: Placed, device: str | torch.device = "cpu") -> tuple[PygFeatureStore, PlacedGraphStore]:
    """The placed dataset as PyG's (feature store with ``x`` and ``y``, graph store)."""
    return PygFeatureStore(TieredFeatureStore(placed, device=device), label_name="y"), PlacedGraphStore(placed)


class StoreNeighborSampler(BaseSampler):
    """Uniform neighbour sampling over a graph store's CSC with moment's sampler (the one training
    uses), for PyG's ``NodeLoader``. The output is PyG's: ``node`` (seeds first), and every sampled
    edge of every hop once, ``row`` → ``col`` in local ids."""

    def __init__(self, graph_store: GraphStore, num_neighbors: Sequence[int], seed: int = 0) -> None:
        row, colptr = graph_store.get_edge_index(edge_type=None, layout="csc")
        self.sampler = NeighborSampler(colptr, row, num_neighbors, seed=seed)

    def sample_from_nodes(self, index: NodeSamplerInput, **kwargs: Any) -> SamplerOutput:
        batch = self.sampler.sample(index.node)
        edges = torch.cat([b.edge_index for b in batch.blocks], dim=1)
        n = batch.nodes.numel()
        edges = torch.unique(edges[0] * n + edges[1])  # an edge sampled at several hops, once
        counts = [batch.blocks[-1].num_dst] + [b.num_src - b.num_dst for b in reversed(batch.blocks)]
        return SamplerOutput(
            node=batch.nodes,
            row=edges // n,
            col=edges % n,
            edge=None,
            num_sampled_nodes=counts,
            metadata=(index.input_id, index.time),
        )

    def sample_from_edges(self, index: Any, neg_sampling: Any = None) -> Any:
        raise NotImplementedError("StoreNeighborSampler samples from nodes only")
