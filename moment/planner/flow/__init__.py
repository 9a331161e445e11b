"""Flow models: each predicts the time of one iteration's feature reads on a layout's
:class:`~moment.planner.network.Network`.

* ``proportional`` (:mod:`.proportional_share`): what random neighbour sampling does — every
  GPU reads the same share of its bytes from each bin; an LP picks the shares.
* ``paper`` (:mod:`.paper_max_flow`): the Moment paper's single-commodity max flow inside a time
  bisection, on one of the interchangeable max-flow :data:`ENGINES`.
"""

from __future__ import annotations

from moment.planner.flow.engines import ENGINES, MaxFlow, networkx_max_flow, ortools_max_flow
from moment.planner.flow.paper_max_flow import explain_difference, paper
from moment.planner.flow.prediction import TIGHT, Prediction
from moment.planner.flow.proportional_share import SsdClass, proportional

__all__ = ["ENGINES", "TIGHT", "MaxFlow", "Prediction", "SsdClass", "explain_difference", "networkx_max_flow",
           "ortools_max_flow", "paper", "proportional"]
