"""``moment dataset import --format NAME``: one module per on-disk format, one registry entry each.

Every importer takes the options shared by all formats (``--feature-dtype``, ``--undirected``,
``--self-loops``, ``--memory``, ``--dry-run``, ``--copy-features``) and its own (``options``). Adding a format is one
module with a ``run`` and one line in :data:`IMPORTERS`: ``moment dataset import`` offers its name as a
``--format`` and adds the options no other format has (``option_help``), and dataset.json records
its name and its files under the importer's own keys (the contract lists no format).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moment.errors import UsageError

if TYPE_CHECKING:
    from placement.dataset import Dataset

COMMON = ("feature_dtype", "undirected", "self_loops", "memory", "dry_run", "copy_features")
DEFAULT_FORMAT = "npy"  # --format's default
UNRECORDED_FORMAT = "npy"  # of a dataset.json written before imports recorded their format: the only one then


@dataclass(frozen=True)
class Importer:
    name: str
    help: str
    options: tuple[str, ...]  # its own options (argument names), besides COMMON
    required: tuple[str, ...]
    module: str  # a module whose run(out, progress=, log=, **common, **options) imports; imported on use
    option_help: Mapping[str, str] = field(default_factory=dict)  # help of options the CLI does not have yet


IMPORTERS: dict[str, Importer] = {
    i.name: i
    for i in (
        Importer(
            "npy",
            "plain .npy arrays: --features, --labels, and --edges (E×2) or --indptr with --indices",
            ("features", "labels", "edges", "indptr", "indices", "train", "val", "test", "seed"),
            ("features", "labels"),
            "placement.importers.arrays",
        ),
        Importer(
            "igb",
            "IGB homogeneous (IGB260M): --root R --size tiny|small|medium|large|full "
            "[--classes 19|2983] [--split mlperf|igb|fraction:F]",
            ("root", "size", "classes", "split", "seed", "labelled"),
            ("root", "size"),
            "placement.importers.igb",
        ),
        Importer(
            "ogb",
            "OGB raw files: the binary layout (ogbn-papers100M's data.npz) or the CSV one (ogbn-arxiv, "
            "ogbn-products: edge.csv.gz, node-feat.csv.gz ...): --root R [--split NAME]",
            ("root", "split"),
            ("root",),
            "placement.importers.ogb",
        ),
    )
}


def all_options() -> tuple[str, ...]:
    """Every importer's own options, each once, in registry order (what the CLI passes on)."""
    return tuple(dict.fromkeys(o for imp in IMPORTERS.values() for o in imp.options))


def run(fmt: str, out: str | Path, given: dict[str, Any], **extra: Any) -> Dataset | None:
    """Run importer ``fmt`` with the options the user gave (None/False: not given); an option of
    another format, or a missing required one, is a usage error naming it."""
    imp = IMPORTERS[fmt]
    flag = lambda key: "--" + key.replace("_", "-")  # noqa: E731
    for key, value in given.items():
        if value not in (None, False) and key not in imp.options and key not in COMMON:
            raise UsageError(f"{flag(key)} is not an option of --format {fmt} ({imp.help})")
    missing = [flag(key) for key in imp.required if given.get(key) is None]
    if missing:
        raise UsageError(f"--format {fmt} needs {', '.join(missing)} ({imp.help})")
    kw = {k: v for k, v in given.items() if v is not None and (k in imp.options or k in COMMON)}
    module = importlib.import_module(imp.module)
    return module.run(Path(out), **kw, **extra)
