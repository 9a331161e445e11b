"""The tiered feature store seen through PyG's ``FeatureStore`` interface, so PyG loaders can
fetch features from the tiers."""

from __future__ import annotations

from typing import Any

import torch
from torch_geometric.data import FeatureStore, TensorAttr

from trainer.featurestore import TieredFeatureStore


class PygFeatureStore(FeatureStore):
    """PyG's ``FeatureStore`` over a :class:`TieredFeatureStore`: one read-only tensor, attribute
    ``attr_name`` of group ``None`` (a homogeneous graph), indexed by new ids. Lets PyG loaders
    (``NeighborLoader((feature_store, graph_store), ...)``) fetch features from the tiers."""

    def __init__(self, store: TieredFeatureStore, attr_name: str = "x") -> None:
        super().__init__()
        self.store = store
        self.attr_name = attr_name

    def _put_tensor(self, tensor: Any, attr: TensorAttr) -> bool:
        raise NotImplementedError("the tiered feature store is read-only: features come from a placed dataset")

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        raise NotImplementedError("the tiered feature store is read-only: features come from a placed dataset")

    def _get_tensor(self, attr: TensorAttr) -> torch.Tensor:
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

    def _get_tensor_size(self, attr: TensorAttr) -> tuple[int, ...] | None:
        if not self._matches(attr):
            return None
        return (self.store.placed.num_nodes, self.store.dim)

    def get_all_tensor_attrs(self) -> list[TensorAttr]:
        return [TensorAttr(group_name=None, attr_name=self.attr_name)]

    def _matches(self, attr: TensorAttr) -> bool:
        return attr.group_name is None and attr.attr_name == self.attr_name

    def _check(self, attr: TensorAttr) -> None:
        if not self._matches(attr):
            raise KeyError(f"no tensor for group {attr.group_name!r}, attribute {attr.attr_name!r} "
                           f"(this store holds group None, attribute {self.attr_name!r})")
