"""The one YAML reader: safe, and a key given twice in one mapping is an error.

PyYAML's ``safe_load`` keeps the last of two equal keys silently, so a profile, workload or layout
edited by hand could lose a setting without a word. Every YAML file moment reads goes through
:func:`load_yaml`, whose errors carry the line.
"""

from __future__ import annotations

from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping naming the same key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse YAML safely (no Python objects), refusing duplicate keys; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(exc: yaml.YAMLError) -> str:
    """``line N: what is wrong`` of a YAML error, on one line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}: {problem}" if mark is not None else str(problem)
