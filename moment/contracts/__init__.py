"""The stage contracts: one typed model per file one stage hands to the next.

Every exchanged document (plan.json, placed.json, dataset.json, workload, checkpoints) is a
:class:`Contract`: a pydantic model that rejects unknown keys, carries its ``format`` marker,
and is read and written only through :meth:`Contract.read` / :meth:`Contract.write`, so a
missing key, a wrong type or an unknown key is one line naming the file and the field.
This package sits below every stage: it imports nothing from ``placement`` or ``trainer``. A
field that records a registry's member names none: where files older than the field must still
read, its default is the member the registry declares for them (:func:`registry_default`), looked
up by name only when such a file is read.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moment.errors import MomentError
from moment.fileio import atomic_write_text

C = TypeVar("C", bound="Contract")
# A member of a stage's registry (a placement policy, an importer, ...) as a contract records it:
# a plain name, checked against the registry where a stage uses it, never a copy of the registry's
# list here (a registered member must not need a contract change).
Registered = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


def registry_default(module: str, name: str) -> Callable[[], str]:
    """The default of a :data:`Registered` field for files written before it was: the member
    the registry's module declares as ``name`` (so a contract names no member), imported by name
    when such a file is read (so reading a contract loads no stage otherwise)."""
    return lambda: str(getattr(importlib.import_module(module), name))


def first_error(exc: ValidationError) -> str:
    """``field.path: message`` of a validation error's first problem (and how many more).

    A whole-document check has no field path: its message names the fields itself.
    """
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {msg}{more}" if where else f"{msg}{more}"


class Strict(BaseModel):
    """A part of a contract: unknown keys are errors (a typo must not fall back to a default)."""

    model_config = ConfigDict(extra="forbid")


class Contract(Strict):
    """A versioned JSON document with a ``format`` marker."""

    FORMAT: ClassVar[str]
    ALSO_READS: ClassVar[tuple[str, ...]] = ()  # older formats parsed too (what reads them decides what it takes)
    WHAT: ClassVar[str] = "document"  # what the file is, for "missing" messages
    ERROR: ClassVar[type[MomentError]] = MomentError

    format: str

    @classmethod
    def parse(cls: type[C], doc: Any, source: str | Path) -> C:
        """Validate parsed JSON; the error names ``source`` and the field."""
        if not isinstance(doc, dict):
            raise cls.ERROR(f"{source}: expected a JSON object ({cls.WHAT}), got {type(doc).__name__}")
        if doc.get("format") not in (cls.FORMAT, *cls.ALSO_READS):
            raise cls.ERROR(f"{source}: format: expected {cls.FORMAT!r}, got {doc.get('format')!r}")
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            raise cls.ERROR(f"{source}: {first_error(exc)}") from None

    @classmethod
    def read(cls: type[C], path: str | Path) -> C:
        """Read and validate ``path``: one line naming the file (and field) if anything is wrong."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise cls.ERROR(f"{p}: missing ({cls.WHAT})") from None
        except IsADirectoryError:
            raise cls.ERROR(f"{p}: a directory, expected a {cls.WHAT} file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise cls.ERROR(
                f"{p}: unreadable ({exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'})"
            ) from None
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise cls.ERROR(f"{p}: not valid JSON ({str(exc).splitlines()[0]})") from None
        return cls.parse(doc, p)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def write(self, path: str | Path) -> None:
        """Atomically: a reader sees the old file or the whole new one."""
        atomic_write_text(Path(path), self.to_json())
