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
``moment train --model`` accept. ``Layer(make, activations=...)`` gives the memory budget its
activation size where it differs from a gathering conv's (:func:`gathered`; GAT's: :func:`attention`). Factories import PyG when called, so reading the names (the
command lines do) costs no PyG import.

A layer that is a sum of per-edge messages can also give a **scatter form** (``Layer(scatter=...)``):
``moment infer``'s broadcast engine (:mod:`trainer.broadcast`) then streams the sources once and
adds their messages into the destinations, instead of gathering every destination's neighbours.
A layer without one (GAT: a softmax over each destination's in-edges) runs on the gather engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from placement.sampler import SampledBlock
    from trainer.config import TrainConfig

LayerFactory = Callable[["TrainConfig", int, int, bool], tuple[nn.Module, int]]
# (cfg, in_dim, out_dim, last) -> (parameters of the layer the factory makes, its output width),
# without making it: the launcher's memory pre-flight then needs no PyG import (seconds a command).
LayerCount = Callable[["TrainConfig", int, int, bool], tuple[int, int]]
HIDDEN = 256  # default hidden width of a model that does not set its own


@dataclass(frozen=True)
class Scatter:
    """A conv written as a broadcast over its in-edges: for destination ``d`` with ``deg`` in-edges
    (``c = max(deg, 1)``), ``out_d = finish(sum_{j->d} message(x_j) + c * root(x_d), c)``.

    Messages are computed per source (transform, then aggregate: fewer bytes scattered when the
    layer narrows), and the destination's own term is folded into the same sum, so the partial
    state of a destination is one row of the layer's output width."""

    message: Callable[[torch.Tensor], torch.Tensor]  # source rows -> their messages (output width)
    root: Callable[[torch.Tensor], torch.Tensor]  # destination rows -> their own term (output width)
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (sums, c as a column) -> output; may reuse sums


ScatterFactory = Callable[[nn.Module], "Scatter | None"]


@dataclass(frozen=True)
class LayerSize:
    """One layer over one batch, as the memory budget sees it (counts are expected values)."""

    n_src: float  # vertices whose rows come in
    n_dst: float  # vertices the layer computes
    edges: float  # sampled edges into them
    width: int  # input width
    out: int  # output channels (per head)
    heads: int  # attention heads of a hidden layer (``--heads``)
    last: bool  # the output layer


# (floats autograd saves for the backward pass, floats of the layer's largest per-edge tensor,
# its output width): what trainer.memory budgets a batch's activations from.
Activations = Callable[[LayerSize], tuple[float, float, int]]


def gathered(s: LayerSize) -> tuple[float, float, int]:
    """A conv that gathers each edge's source row and reduces it (SAGE's ``x_j``: [edges, input
    width]), saving about four outputs' worth per destination."""
    return s.n_dst * (s.width + 4 * s.out), s.edges * s.width, s.out


def attention(s: LayerSize) -> tuple[float, float, int]:
    """GAT: projected sources per head, attention coefficients per edge and head, and per-edge
    messages of every head."""
    heads = 1 if s.last else s.heads
    saved = s.n_src * heads * s.out + s.edges * heads * 3 + s.n_dst * heads * s.out * 3
    return saved, 2 * s.edges * heads * s.out, heads * s.out


# Forward FLOPs of one layer over one batch (a multiply-add is 2): what trainer.flops counts a
# training step's compute from (``moment plan --nodes``).
Flops = Callable[[LayerSize], float]


def gathered_flops(s: LayerSize) -> float:
    """SAGE: the sum of each destination's gathered neighbour rows (one add per edge and input
    element) and two linear maps of the destinations (of the neighbours' mean and of the root),
    ``2 × in × out`` a row each. Memory-bound: the gather moves 4 bytes per add."""
    return s.edges * s.width + 4 * s.n_dst * s.width * s.out


def attention_flops(s: LayerSize) -> float:
    """GAT: every source projected to heads × out, the two attention scores of every projected
    row, and per edge (self loops included) and head the score's softmax (about 4) and its
    weighted message (2 × out)."""
    heads = 1 if s.last else s.heads
    width = heads * s.out
    edges = s.edges + s.n_dst
    return 2 * s.n_src * s.width * width + 2 * (s.n_src + s.n_dst) * width + edges * heads * (4 + 2 * s.out)


@dataclass(frozen=True)
class Layer:
    """A registered model: its layer factory, its default hidden width (``--hidden``), its
    activation estimate for the memory budget and its forward FLOPs (a gathering conv's unless it
    says otherwise) and, when its convs are sums of messages, their scatter form (None where a
    conv has none)."""

    make: LayerFactory
    hidden: int = HIDDEN
    scatter: ScatterFactory | None = None
    activations: Activations = gathered
    flops: Flops = gathered_flops
    count: LayerCount | None = None  # its parameters by formula (None: the model is built to count them)

    def __call__(self, cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[nn.Module, int]:
        return self.make(cfg, in_dim, out_dim, last)


def _sage(cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[nn.Module, int]:
    from torch_geometric.nn import SAGEConv

    return SAGEConv(in_dim, out_dim), out_dim


def _sage_count(cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[int, int]:
    """SAGEConv(in, out): ``lin_l`` with a bias and ``lin_r`` without."""
    return 2 * in_dim * out_dim + out_dim, out_dim


def _sage_scatter(conv: nn.Module) -> Scatter | None:
    """SAGEConv with mean aggregation: ``lin_l(mean_j x_j) + lin_r(x_d)`` is
    ``(sum_j lin_l.weight x_j + c * lin_r(x_d)) / c + lin_l.bias`` (c: the in-degree, at least 1;
    no in-edges: the mean is 0, as PyG's scatter mean). Other set-ups (normalize, project, another
    aggregation) have none."""
    if getattr(conv, "aggr", None) != "mean" or getattr(conv, "project", True) or getattr(conv, "normalize", True):
        return None
    # PyG's Linear layers (untyped here): Any.
    lin_l: Any = conv.lin_l
    lin_r: Any = getattr(conv, "lin_r", None) if conv.root_weight else None
    bias = lin_l.bias

    def message(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, lin_l.weight)

    def root(x: torch.Tensor) -> torch.Tensor:
        return lin_r(x) if lin_r is not None else x.new_zeros(x.shape[0], lin_l.weight.shape[0])

    def finish(sums: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sums.div_(c)  # in place: the sums of a partition are most of its memory
        return sums.add_(bias) if bias is not None else sums

    return Scatter(message, root, finish)


def _gat(cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[nn.Module, int]:
    """Hidden layers concatenate ``heads`` heads of ``hidden`` channels; the output layer has one
    head (the usual GAT set-up for node classification). Self loops are added for the targets,
    which is right here because target i is source i."""
    from torch_geometric.nn import GATConv

    if last:
        return GATConv(in_dim, out_dim, heads=1, concat=False), out_dim
    return GATConv(in_dim, out_dim, heads=cfg.heads, concat=True), out_dim * cfg.heads


def _gat_count(cfg: TrainConfig, in_dim: int, out_dim: int, last: bool) -> tuple[int, int]:
    """GATConv as :func:`_gat` makes it: ``lin`` (no bias) to heads × out, the source and
    destination attention vectors (heads × out each), and a bias (heads × out when concatenated)."""
    width = out_dim if last else out_dim * cfg.heads
    heads_out = out_dim if last else width  # one head on the output layer, concat=False
    return in_dim * heads_out + 2 * heads_out + width, width


LAYERS: dict[str, LayerFactory] = {
    "sage": Layer(_sage, scatter=_sage_scatter, count=_sage_count),
    "gat": Layer(_gat, hidden=64, activations=attention, flops=attention_flops, count=_gat_count),  # 64 per head
}


def default_hidden(model: str) -> int:
    """The hidden width ``model`` is registered with (a plain factory: :data:`HIDDEN`)."""
    return getattr(LAYERS.get(model), "hidden", HIDDEN)


def activations_of(model: str) -> Activations:
    """The activation estimate ``model`` is registered with (a plain factory: a gathering conv's)."""
    return getattr(LAYERS.get(model), "activations", gathered)


def flops_of(model: str) -> Flops:
    """The forward FLOPs ``model`` is registered with (a plain factory: a gathering conv's)."""
    return getattr(LAYERS.get(model), "flops", gathered_flops)


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
        return self.after(i, self.convs[i]((x_src, x_src[:num_dst]), edge_index))

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """What follows conv ``i``: ReLU and dropout, except after the last."""
        if i < len(self.convs) - 1:
            x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x


def scatter_form(model: str, conv: nn.Module) -> Scatter | None:
    """The scatter form of a conv of registered model ``model`` (None: it has none)."""
    factory = getattr(LAYERS.get(model), "scatter", None)
    return factory(conv) if factory is not None else None


def count_parameters(cfg: TrainConfig, in_dim: int, num_classes: int) -> int | None:
    """Parameters of :func:`build_model`'s model by its layers' formulas, without building it
    (None when the registered model has none: build it on the meta device instead)."""
    count = getattr(LAYERS.get(cfg.model), "count", None)
    if count is None:
        return None
    total, width = 0, in_dim
    for i in range(cfg.layers):
        last = i == cfg.layers - 1
        params, width = count(cfg, width, num_classes if last else cfg.resolved_hidden, last)
        total += params
    return total


def build_model(cfg: TrainConfig, in_dim: int, num_classes: int) -> BlockGNN:
    """The configured model: ``cfg.layers`` layers (one per fan-out), ``cfg.hidden`` wide."""
    try:
        make = LAYERS[cfg.model]
    except KeyError:
        raise ValueError(f"unknown model {cfg.model!r}; known: {', '.join(LAYERS)}") from None
    convs, width = [], in_dim
    for i in range(cfg.layers):
        last = i == cfg.layers - 1
        conv, width = make(cfg, width, num_classes if last else cfg.resolved_hidden, last)
        convs.append(conv)
    return BlockGNN(convs, cfg.dropout)
