"""No package imports "upward": the stages stack as moment's core (contracts, topology, planner,
I/O helpers) < placement < trainer < the CLI. Checked on the source, import by import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("moment.cli", "moment.__main__")  # the commands: may import every stage


def layer(module: str) -> int:
    if module.startswith(TOP):
        return 3
    if module.startswith("trainer"):
        return 2
    if module.startswith("placement"):
        return 1
    return 0  # moment's core: contracts, topology, planner, outputs, fileio, ...


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return [(line, name) for line, name in out if name.split(".")[0] in ("moment", "placement", "trainer")]


def test_no_stage_imports_a_higher_one() -> None:
    upward = []
    for package in ("moment", "placement", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for line, name in imports(path):
                if layer(name) > layer(module):
                    upward.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {name}")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("import os\nfrom trainer.loop import main\n")
    assert imports(bad) == [(2, "trainer.loop")] and layer("trainer.loop") > layer("placement.place")


def test_the_trainer_reads_plans_through_their_contract() -> None:
    """A rank reads plan.json through moment.contracts.plan: it never loads the planner's search,
    flow models or rich tables (moment.planner.*)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "trainer").rglob("*.py"))
        for line, name in imports(path)
        if name.startswith("moment.planner")
    ]
    assert not found, "\n".join(found)
