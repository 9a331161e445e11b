"""Flow models: each predicts the time of one iteration's feature reads on a layout's
:class:`~moment.planner.network.Network`.

* ``proportional`` (:mod:`.proportional_share`): what random neighbour sampling does — every
  GPU reads the same share of its bytes from each bin; an LP picks the shares.
* ``paper`` (:mod:`.paper_max_flow`): the Moment paper's single-commodity max flow inside a time
  bisection, on one of the interchangeable max-flow :data:`MAX_FLOW_ENGINES`.

:func:`~moment.planner.scoring.score` runs every model of :data:`FLOW_MODELS`, in order. To add
one: a module here defining its function and ``MODEL = FlowModel(name, title, predict, explain)``,
and its ``MODEL`` in the registry below. Its figures then appear in ``plan``/``score`` (text and
``--json``), the ranking table and plan.json (``<name>_iteration_s``, ``<name>_gbps_per_gpu``,
``<name>_bottleneck``; see :class:`moment.contracts.plan.LayoutRecord`).
"""

from __future__ import annotations

from moment.planner.flow import paper_max_flow, proportional_share
from moment.planner.flow.engines import MAX_FLOW_ENGINES, MaxFlow, networkx_max_flow, ortools_max_flow
from moment.planner.flow.paper_max_flow import explain_difference, paper
from moment.planner.flow.prediction import TIGHT, FlowModel, Prediction
from moment.planner.flow.proportional_share import SsdClass, proportional

PRIMARY = "proportional"  # the model layouts are ranked by; plan.json's unprefixed figures and bin targets are its
FLOW_MODELS: dict[str, FlowModel] = {m.name: m for m in (proportional_share.MODEL, paper_max_flow.MODEL)}

__all__ = [
    "MAX_FLOW_ENGINES",
    "FLOW_MODELS",
    "PRIMARY",
    "TIGHT",
    "FlowModel",
    "MaxFlow",
    "Prediction",
    "SsdClass",
    "explain_difference",
    "networkx_max_flow",
    "ortools_max_flow",
    "paper",
    "proportional",
]
