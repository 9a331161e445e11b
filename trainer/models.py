"""GNN models over sampled blocks: GraphSAGE and GAT from PyG, one layer per sampled hop.

Each layer consumes one :class:`~placement.sampler.SampledBlock` as bipartite message passing:
the sources are the first ``num_src`` rows of the current representation, the targets its first
``num_dst`` rows (the sampler keeps every hop's targets a prefix of its sources), so the layer is
``conv((x_src, x_src[:num_dst]), edge_index)`` and the representation shrinks hop by hop down to
the seeds, whose logits come out of the last layer.

Plugging in another PyG-style layer: any module called as ``conv((x_src, x_dst), edge_index)``
(every ``MessagePassing`` conv that accepts bipartite input: ``SAGEConv``, ``GATConv``,
``GraphConv``, ``GINConv``, ``TransformerConv``, ...) works. Write a factory
``make(cfg, in_dim, out_dim, last) -> (module, width_of_its_output)`` and add it to ``LAYERS``
under a new name: ``LAYERS`` is the one list of models, which ``python -m trainer --model`` and
``moment train --model`` accept. Factories import PyG when called, so reading the names (the
command lines do) costs no PyG import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from placement.sampler import SampledBlock
    from trainer.config import TrainConfig

LayerFactory = Callable[["TrainConfig", int, int, bool], tuple[nn.Module, int]]
HIDDEN = 256  # default hidden width of a model that does not set its own


@dataclass(frozen=True)
class Layer:
    """A registered model: its layer factory and its default hidden width (``--hidden``)."""

    make: LayerFactory
    hidden: int = HIDDEN

    def __call__(self, cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[nn.Module, int]:
        return self.make(cfg, in_dim, out_dim, last)


def _sage(cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[nn.Module, int]:
    from torch_geometric.nn import SAGEConv

    return SAGEConv(in_dim, out_dim), out_dim


def _gat(cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[nn.Module, int]:
    """Hidden layers concatenate ``heads`` heads of ``hidden`` channels; the output layer has one
    head (the usual GAT set-up for node classification). Self loops are added for the targets,
    which is right here because target i is source i."""
    from torch_geometric.nn import GATConv

    if last:
        return GATConv(in_dim, out_dim, heads=1, concat=False), out_dim
    return GATConv(in_dim, out_dim, heads=cfg.heads, concat=True), out_dim * cfg.heads


LAYERS: dict[str, LayerFactory] = {"sage": Layer(_sage), "gat": Layer(_gat, hidden=64)}  # gat: 64 per head


def default_hidden(model: str) -> int:
    """The hidden width ``model`` is registered with (a plain factory: :data:`HIDDEN`)."""
    return getattr(LAYERS.get(model), "hidden", HIDDEN)


class BlockGNN(nn.Module):
    """A stack of bipartite convs, one per block; ReLU and dropout between layers."""

    def __init__(self, convs: Sequence[nn.Module], dropout: float) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, blocks: Sequence[SampledBlock]) -> torch.Tensor:
        """Logits of the seeds (the last block's targets) from the rows of ``batch.nodes``."""
        if len(blocks) != len(self.convs):
            raise ValueError(
                f"{len(blocks)} blocks for a {len(self.convs)}-layer model: fanouts and model depth differ"
            )
        for i, block in enumerate(blocks):
            x = self.layer(i, x[: block.num_src], block.num_dst, block.edge_index)
        return x

    def layer(self, i: int, x_src: torch.Tensor, num_dst: int, edge_index: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` on one bipartite graph whose targets are the first ``num_dst`` sources, with
        what follows it (ReLU and dropout, except after the last): the one step training and
        layer-wise inference (``trainer.infer``) share."""
        x = self.convs[i]((x_src, x_src[:num_dst]), edge_index)
        if i < len(self.convs) - 1:
            x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x


def build_model(cfg: TrainConfig, in_dim: int, num_classes: int) -> BlockGNN:
    """The configured model: ``cfg.layers`` layers (one per fan-out), ``cfg.hidden`` wide."""
    try:
        make = LAYERS[cfg.model]
    except KeyError:
        raise ValueError(f"unknown model {cfg.model!r}; known: {', '.join(LAYERS)}") from None
    convs, width = [], in_dim
    for i in range(cfg.layers):
        last = i == cfg.layers - 1
        conv, width = make(cfg, width, num_classes if last else int(cfg.hidden), last)
        convs.append(conv)
    return BlockGNN(convs, cfg.dropout)
