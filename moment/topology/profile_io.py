"""Reading and writing topology profiles (YAML), and finding the bundled ones by name.

Loading validates the whole file against the model and reports the first problem as one line
naming the file and the field; saving writes to a temporary file and renames it, so a profile
on disk is always complete.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from moment.contracts import first_error
from moment.errors import ProfileError, UsageError
from moment.fileio import atomic_write_text
from moment.planner.workload import Workload
from moment.topology.model import SCHEMA, Machine
from moment.yamlio import load_yaml

BUNDLED_PACKAGE = "topology_profiles"


def machine_from_dict(data: Any, source: str) -> Machine:
    """Validate plain data (parsed YAML/JSON) into a Machine; errors name ``source`` and the field."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a mapping at the top level, got {type(data).__name__}")
    try:
        machine = Machine.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{source}: {first_error(exc)}") from None
    try:  # the default workload is checked with the profile, so a typo in it names the file
        Workload.model_validate(machine.workload or {})
    except ValidationError as exc:
        raise ProfileError(f"{source}: workload.{first_error(exc)}") from None
    return machine


def load_profile(path: str | Path) -> Machine:
    """Load and validate one YAML profile file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read: {exc}") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ProfileError(f"{where}: YAML syntax error: {problem}") from None
    if data is None:
        raise ProfileError(f"{path}: empty profile")
    return machine_from_dict(data, str(path))


def machine_to_dict(machine: Machine) -> dict[str, Any]:
    """Plain data for YAML/JSON: defaults and empty fields left out, ``schema`` first."""
    body = machine.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
    body.pop("schema", None)
    return {"schema": SCHEMA, **body}


def dump_profile(machine: Machine) -> str:
    return yaml.safe_dump(machine_to_dict(machine), sort_keys=False, default_flow_style=None, width=100)


def save_profile(machine: Machine, path: str | Path) -> None:
    """Write atomically: a temporary file in the same directory, fsync, rename."""
    atomic_write_text(Path(path), dump_profile(machine))


def bundled_profiles() -> dict[str, Path]:
    """Name → path of every profile shipped in topology_profiles/."""
    root = resources.files(BUNDLED_PACKAGE)
    return {Path(str(entry)).stem: Path(str(entry)) for entry in root.iterdir() if str(entry).endswith(".yaml")}


def resolve_profile(name_or_path: str) -> Machine:
    """A bundled profile by name, or a profile file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_profile(path)
    bundled = bundled_profiles()
    if name_or_path in bundled:
        return load_profile(bundled[name_or_path])
    names = ", ".join(sorted(bundled))
    raise UsageError(f"unknown profile {name_or_path!r}: not a file, and not a bundled profile ({names})")
