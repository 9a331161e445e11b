"""The contracts name no registry member: a field recording one is a plain name, and where files
older than the field must still read, its default is the member the registry declares for them."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import moment.contracts
from moment.contracts.dataset import ImportProvenance

# Every stage registry (module, name): a dict's keys or a tuple's members.
REGISTRIES = (
    ("moment.topology.profiler", "SOURCES"),
    ("moment.planner.flow", "FLOW_MODELS"),
    ("moment.planner.flow.engines", "MAX_FLOW_ENGINES"),
    ("moment.planner.flow.milp", "MILP_SOLVERS"),
    ("placement.policies", "POLICIES"),
    ("placement.ddak", "PRIORITIES"),
    ("placement.importers", "IMPORTERS"),
    ("placement.digests", "DIGESTS"),
    ("trainer.readers", "READERS"),
    ("trainer.file_reader", "READ_ENGINES"),
    ("trainer.models", "LAYERS"),
    ("trainer.infer_options", "INFER_ENGINES"),
)


def members() -> dict[str, str]:
    """Every registered member's name -> the registry that holds it."""
    out = {}
    for module, name in REGISTRIES:
        for member in getattr(importlib.import_module(module), name):
            out[member] = f"{module}.{name}"
    return out


def contract_models() -> list[type[BaseModel]]:
    models = []
    for info in pkgutil.iter_modules(moment.contracts.__path__, "moment.contracts."):
        module = importlib.import_module(info.name)
        models += [
            obj
            for obj in vars(module).values()
            if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__
        ]
    return models


def named_members(model: type[BaseModel], known: dict[str, str]) -> list[str]:
    """``model``'s fields whose default or ``Literal`` choices are registry members."""
    found = []
    for name, field in model.model_fields.items():
        values: list[Any] = [field.default]
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if typing.get_origin(t) is typing.Literal:
                values += typing.get_args(t)
            else:
                stack += typing.get_args(t)
        found += [
            f"{model.__module__}.{model.__name__}.{name}: {v!r} ({known[v]})"
            for v in values
            if isinstance(v, str) and v in known
        ]
    return found


def test_no_contract_names_a_registry_member() -> None:
    known = members()
    assert {"npy", "gather", "ddak", "sage"} <= set(known)
    models = contract_models()
    assert len(models) > 30  # every contract module's models were found
    named = [line for model in models for line in named_members(model, known)]
    assert not named, "\n".join(named)


def test_the_check_sees_a_named_member() -> None:
    class Bad(BaseModel):
        engine: typing.Literal["broadcast", "other"] = "broadcast"
        fmt: str = "npy"

    assert len(named_members(Bad, members())) == 3


def test_files_older_than_a_field_read_the_registrys_declared_member(
    monkeypatch: pytest.MonkeyPatch, small_dataset: Path
) -> None:
    """A dataset.json import record and an inference.json from before they named their importer
    and engine take the member their registry declares, and follow it there."""
    import placement.importers as importers
    import trainer.infer_options as infer_options
    from moment.contracts.inference import InferenceManifest

    record = {"kind": "import", "files": {"features": "/f.npy"}, "given_splits": [], "undirected": False, "seed": 0}
    assert ImportProvenance.model_validate(record).format == importers.UNRECORDED_FORMAT in importers.IMPORTERS
    assert infer_options.UNRECORDED_ENGINE in infer_options.INFER_ENGINES
    monkeypatch.setattr(importers, "UNRECORDED_FORMAT", "toy")
    assert ImportProvenance.model_validate(record).format == "toy"
    assert ImportProvenance.model_validate({**record, "format": "igb"}).format == "igb"
    monkeypatch.setattr(infer_options, "UNRECORDED_ENGINE", "toy-engine")
    field = InferenceManifest.model_fields["engine"]
    assert not field.is_required() and field.get_default(call_default_factory=True) == "toy-engine"
    assert json.dumps(ImportProvenance.model_validate(record).model_dump())  # a plain name, written as one
    import placement.digests as digests
    from moment.contracts.placed import FileEntry

    entry = {"path": "labels.npy", "bytes": 8, "digest": "0" * 64}  # placed.json before it named the algorithm
    assert FileEntry.model_validate(entry).digest_algorithm == digests.UNRECORDED_DIGEST in digests.DIGESTS
    monkeypatch.setattr(digests, "UNRECORDED_DIGEST", "toy-digest")
    assert FileEntry.model_validate(entry).digest_algorithm == "toy-digest"
