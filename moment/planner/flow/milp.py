"""MILP solvers for the proportional model's SSD-count MILP (the layout search's ``milp``
method), chosen by name: ``ortools`` (SCIP through ortools' pywraplp, the default) and
``pulp-cbc`` (COIN-OR CBC through PuLP). Two solvers, so each checks the other
(tests/test_planner_search.py); the LP without SSD counts always runs on GLOP.

:class:`PulpSolver` takes the few pywraplp calls the model's MILP pass makes (``NumVar``,
``IntVar``, ``Constraint(...).SetCoefficient``, ``Objective()``, ``Solve``), so the model is
written once. It solves that one pass: the search asks the MILP for nothing more.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from moment.errors import MomentError


def scip() -> Any:
    """ortools' SCIP (what the MILP always ran on)."""
    from ortools.linear_solver import pywraplp

    return pywraplp.Solver.CreateSolver("SCIP")


class _Var:
    """A PuLP variable seen through pywraplp's variable calls."""

    __slots__ = ("lp",)

    def __init__(self, lp: Any) -> None:
        self.lp = lp

    def solution_value(self) -> float:
        return self.lp.value() or 0.0


class _Row:
    """A linear row (or the objective), kept as coefficients until the problem is built."""

    def __init__(self, lb: float = -math.inf, ub: float = math.inf) -> None:
        self.lb, self.ub = lb, ub
        self.terms: dict[_Var, float] = {}
        self.maximise = False

    def SetCoefficient(self, var: _Var, coef: float) -> None:
        self.terms[var] = coef

    def SetMaximization(self) -> None:
        self.maximise = True

    def expr(self) -> Any:
        import pulp

        return pulp.lpSum(c * v.lp for v, c in self.terms.items())


def _bound(x: float) -> float | None:
    return None if math.isinf(x) else x


class PulpSolver:
    """PuLP + CBC behind the slice of pywraplp's ``Solver`` the MILP pass uses (hence the names)."""

    def __init__(self) -> None:
        try:
            import pulp
        except ImportError:  # an optional extra since the offline bundle (scripts/wheelhouse.sh --no-pulp)
            raise MomentError("--milp-solver pulp-cbc needs PuLP: pip install 'moment[pulp]'") from None

        self.prob = pulp.LpProblem("proportional")
        self.vars: list[_Var] = []
        self.rows: list[_Row] = []
        self.objective = _Row()
        self.built = False

    @staticmethod
    def infinity() -> float:
        return math.inf

    def _var(self, lb: float, ub: float, cat: str) -> _Var:
        # Named by number: PuLP rewrites characters of the bin names pywraplp's names carry.
        var = _Var(self.prob.add_variable(f"x{len(self.vars)}", _bound(lb), _bound(ub), cat))
        self.vars.append(var)
        return var

    def NumVar(self, lb: float, ub: float, name: str) -> _Var:
        return self._var(lb, ub, "Continuous")

    def IntVar(self, lb: float, ub: float, name: str) -> _Var:
        return self._var(lb, ub, "Integer")

    def Constraint(self, lb: float, ub: float) -> _Row:
        if self.built:
            raise MomentError("the pulp-cbc MILP solves one pass: rows added after it are not supported")
        row = _Row(lb, ub)
        self.rows.append(row)
        return row

    def Objective(self) -> _Row:
        return self.objective

    def Solve(self, params: object = None) -> int:
        """Solve with CBC (the problem is built on the first call); pywraplp's status code."""
        import pulp
        from ortools.linear_solver import pywraplp

        if not self.built:
            self._build()
        status = self.prob.solve(_cbc())
        return pywraplp.Solver.OPTIMAL if pulp.LpStatus[status] == "Optimal" else pywraplp.Solver.NOT_SOLVED

    def _build(self) -> None:
        import pulp

        self.built = True
        self.prob.sense = pulp.LpMaximize if self.objective.maximise else pulp.LpMinimize
        self.prob.setObjective(self.objective.expr())
        for row in self.rows:
            if not row.terms:
                continue
            if row.lb == row.ub:
                self.prob += row.expr() == row.lb
                continue
            if not math.isinf(row.lb):
                self.prob += row.expr() >= row.lb
            if not math.isinf(row.ub):
                self.prob += row.expr() <= row.ub


def _cbc() -> Any:
    """CBC on the PATH or from ``pulp[cbc]`` (PuLP 4's way), else the binary PuLP 3 bundles."""
    import pulp

    coin = pulp.COIN_CMD(msg=False, gapRel=1e-9)
    if coin.available():
        return coin
    with warnings.catch_warnings():  # PuLP 3 flags its bundled CBC as leaving in PuLP 4 (pyproject: <4)
        warnings.simplefilter("ignore", DeprecationWarning)
        bundled = pulp.PULP_CBC_CMD(msg=False, gapRel=1e-9) if hasattr(pulp, "PULP_CBC_CMD") else None
    if bundled is None or not bundled.available():
        raise MomentError("--milp-solver pulp-cbc: no CBC binary found (pip install 'pulp[cbc]')")
    return bundled


MILP_SOLVERS: dict[str, Callable[[], Any]] = {"ortools": scip, "pulp-cbc": PulpSolver}
