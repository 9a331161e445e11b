"""What a training run measured, beside what the plan predicted.

Rank 0 prints a progress bar per epoch and a summary table, and (with ``--metrics-json``)
rewrites one JSON document atomically after every epoch (``"complete": false`` until the end),
written and read only through its contract, :class:`moment.contracts.metrics.MetricsDoc`:

* ``format``: ``"moment.metrics/2"``; ``complete``; ``config`` (the TrainConfig); ``world_size``;
  ``ranks``: each rank's device line (GPU, why that GPU, CPU pinning);
* ``epochs``: one record per epoch, the training part only (validation is outside the timings):
  ``epoch`` (1-based, as the console counts), ``epoch_s`` (training wall time, slowest rank), ``iterations`` (per
  rank), ``iteration_s`` (``epoch_s / iterations``), ``seeds`` (all ranks), ``seeds_per_s``,
  ``loss`` (mean over steps and ranks), ``val_acc`` (None when not evaluated that epoch),
  ``data_wait_s`` (time the loop waited for a prepared batch, mean over ranks),
  ``feature_read_s`` (time in the feature store per rank, mean) and
  ``feature_read_s_per_iteration`` (wall time: waiting for the SSDs included),
  ``feature_cpu_s_per_iteration`` (the CPU time of those calls on the thread making them, the
  prefetch thread: what they take from training where the cores are busy), ``rows_per_tier`` and
  ``bytes_per_tier`` (summed over ranks; SSD bytes count distinct rows read per batch),
  ``bytes_per_ssd`` (the same per SSD bin: how the reads spread over the SSDs: the useful
  feature bytes), ``read_bytes_per_ssd`` (the bytes of the pages the reader's reads of each SSD
  bin touched: what the SSD moved, 4 KiB pages, each once per batch) and
  ``ssd_read_amplification`` (their sum over the useful bytes' sum; None without SSD reads),
  ``placed_read_bytes`` (a packed placement: the pages the batches read of the placed directory's
  files, per key of placed.json ``files``: each loaded batch's stored sample, each chunk row map's
  slice a replayed batch is checked against; not the graph live sampling reads) and
  ``disk_read_amplification`` (the SSD pages and these over the useful bytes: every byte a batch
  read from disk),
  ``chunks`` (a placement packed within a budget: how many batches read only their chunks, of how
  many, and the (batch, bin) reads served by chunks or by the bins; ``replayed``: the epoch's
  batches are the ones packed for, so all should; None for other placements),
  ``gbps_per_tier`` and ``gbps_per_ssd`` (those bytes / ``epoch_s``, GB = 1e9 B: the rate the
  run drew from each tier and SSD bin), ``hit_rate`` (share of requested rows served by each
  memory tier: ``gpu``, ``cpu``);
* ``measured_iteration_s``: mean wall time of a training iteration (sample + feature fetch,
  overlapped by the prefetcher, + forward/backward/step) over all epochs of the run:
  ``sum(epoch_s) / sum(iterations)``; ``measured_feature_read_s``: the same for the time a rank
  spent in the feature store (its data time, per rank), to set beside the predicted
  ``iteration_s`` when ``on_plan_gpus`` (every rank ran on the GPU the plan placed it on, found by
  PCI address: the profile's machine; the printed summary compares them only then);
* ``prediction``: the placement's (placed.json ``prediction``, re-solved by ``moment place``
  for this dataset and its caches on the plan's machine and layout): ``iteration_s`` (time of
  one iteration's feature reads), ``tier_shares`` and ``bin_shares`` (share of feature reads
  each tier and bin should serve: compare with the epochs' ``read_share_per_tier`` and
  ``read_share_per_bin``), ``ssd_amplification`` (the pages the SSDs should move per feature
  byte: compare with the epochs' ``ssd_read_amplification``), ``disk_amplification`` (a packed
  placement: with the placed directory's pages too; compare with ``disk_read_amplification``),
  the workload it is for, and
  ``note`` where this run differs;
  ``comparable`` is false when it is the plan's prediction for other data (the profile was not
  found when placing); ``predicted_iteration_s`` repeats its ``iteration_s``;
* ``test_acc`` (None until the end); ``rank_param_digests``: a SHA-256 of each rank's parameters
  at the end (all equal when DDP kept the replicas in step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from torch import nn

from moment.contracts.metrics import FORMAT, MetricsDoc
from moment.contracts.placed import Prediction
from moment.contracts.tiers import TIERS
from moment.progress import Reporter
from trainer.config import TrainConfig
from trainer.packs import CHUNK_COUNTS
from trainer.read_base import Reader

MEMORY_TIERS = TIERS[:-1]


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Feature-store stats of all ranks summed: rows, bytes and seconds per tier and SSD bin."""
    tiers = {t: {"rows": 0, "bytes": 0, "seconds": 0.0} for t in TIERS}
    bins: dict[str, dict[str, float]] = {}
    bin_rows: dict[str, int] = {}
    asked, seconds, cpu = 0, 0.0, 0.0
    placed: dict[str, int] = {}
    for s in per_rank:
        asked += s["asked"]
        for key, n in s.get("placed_read_bytes", {}).items():
            placed[key] = placed.get(key, 0) + int(n)
        seconds += s["seconds"]
        cpu += s.get("cpu_seconds", 0.0)
        for t, v in s["tiers"].items():
            for k in ("rows", "bytes", "seconds"):
                tiers.setdefault(t, {"rows": 0, "bytes": 0, "seconds": 0.0})[k] += v[k]
        for name, rows in s.get("bin_rows", {}).items():
            bin_rows[name] = bin_rows.get(name, 0) + rows
        for name, v in s["ssd_bins"].items():
            b = bins.setdefault(name, {"rows": 0, "bytes": 0, "read_bytes": 0, "seconds": 0.0})
            for k in b:
                b[k] += v[k]
    return {
        "asked": asked,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tiers": tiers,
        "ssd_bins": bins,
        "bin_rows": bin_rows,
        "placed_read_bytes": placed,
    }


def _per_iteration(history: list[dict[str, Any]], key: str) -> float | None:
    """A per-rank epoch total (mean over ranks) over all epochs, per training iteration."""
    iterations = sum(r["iterations"] for r in history)
    return sum(r[key] for r in history) / iterations if iterations else None


def epoch_record(
    epoch: int,
    *,
    train_s: float,
    iterations: int,
    seeds: int,
    loss: float,
    val_acc: float | None,
    data_wait_s: float,
    stats: list[dict[str, Any]],
    replayed: bool = False,
) -> dict[str, Any]:
    """One epoch's record from the loop's counters and every rank's feature-store stats;
    ``replayed``: the epoch's batches are those a budget-packed placement's chunks hold."""
    merged = merge_stats(stats)
    asked = max(merged["asked"], 1)
    secs = max(train_s, 1e-12)
    return {
        "epoch": epoch,
        "epoch_s": train_s,
        "iterations": iterations,
        "iteration_s": train_s / max(iterations, 1),
        "seeds": seeds,
        "seeds_per_s": seeds / secs,
        "loss": loss,
        "val_acc": val_acc,
        "data_wait_s": data_wait_s,
        "feature_read_s": merged["seconds"] / max(len(stats), 1),
        "feature_read_s_per_iteration": merged["seconds"] / max(len(stats), 1) / max(iterations, 1),
        "feature_cpu_s_per_iteration": merged["cpu_seconds"] / max(len(stats), 1) / max(iterations, 1),
        "rows_per_tier": {t: int(v["rows"]) for t, v in merged["tiers"].items()},
        "bytes_per_tier": {t: int(v["bytes"]) for t, v in merged["tiers"].items()},
        "bytes_per_ssd": {name: int(v["bytes"]) for name, v in merged["ssd_bins"].items()},
        "read_bytes_per_ssd": {name: int(v["read_bytes"]) for name, v in merged["ssd_bins"].items()},
        "ssd_read_amplification": read_amplification(merged["ssd_bins"].values()),
        "placed_read_bytes": merged["placed_read_bytes"],
        "disk_read_amplification": read_amplification(
            merged["ssd_bins"].values(), sum(merged["placed_read_bytes"].values())
        ),
        "chunks": chunk_reads(stats, replayed),
        "gbps_per_tier": {t: v["bytes"] / secs / 1e9 for t, v in merged["tiers"].items()},
        "gbps_per_ssd": {name: v["bytes"] / secs / 1e9 for name, v in merged["ssd_bins"].items()},
        "hit_rate": {t: merged["tiers"][t]["rows"] / asked for t in MEMORY_TIERS if t in merged["tiers"]},
        **read_shares(merged),
    }


def chunk_reads(per_rank: list[dict[str, Any]], replayed: bool) -> dict[str, Any] | None:
    """The ranks' chunk counts (``stats()["chunks"]``) summed; None without chunks."""
    counted = [c for s in per_rank if (c := s.get("chunks")) is not None]
    if not counted or len(counted) < len(per_rank):
        return None
    return {"replayed": replayed, **{k: sum(c[k] for c in counted) for k in CHUNK_COUNTS}}


def chunk_batches(doc: MetricsDoc) -> tuple[int, int] | None:
    """The closed loop for chunks: batches predicted to read only their chunks (every batch of
    a replayed epoch) and batches that did, over the run; None without chunks."""
    counted = [e.chunks for e in doc.epochs if e.chunks is not None]
    if not counted:
        return None
    return sum(c.batches for c in counted if c.replayed), sum(c.batches_from_chunks for c in counted)


def read_shares(merged: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The share of requested feature rows each tier and each bin served (:func:`merge_stats`'s sums)."""
    asked = max(merged["asked"], 1)
    return {
        "read_share_per_tier": {t: merged["tiers"][t]["rows"] / asked for t in TIERS},
        "read_share_per_bin": {name: rows / asked for name, rows in merged["bin_rows"].items()},
    }


def read_amplification(bins: Iterable[dict[str, Any]], placed: int = 0) -> float | None:
    """Bytes read from the SSDs (the pages the reads touched), and ``placed`` bytes of the placed
    directory's pages, per feature byte read from them; None when nothing was read."""
    bins = list(bins)
    useful = sum(b["bytes"] for b in bins)
    return (sum(b["read_bytes"] for b in bins) + placed) / useful if useful else None


def prediction(placed: Prediction, cfg: TrainConfig) -> dict[str, Any]:
    """What the placement predicts for this run (placed.json ``prediction``: re-solved by
    ``moment place`` for this dataset and its caches on the plan's machine and layout), and a
    note where this run differs from the workload it was made for."""
    wl = placed.workload
    out = {
        "source": placed.source,
        "iteration_s": placed.iteration_s,
        "profile": placed.profile,
        "layout": placed.layout,
        "tier_shares": placed.tier_shares.model_dump(),
        "bin_shares": dict(placed.bin_shares),
        "ssd_amplification": placed.ssd_amplification,
        "disk_amplification": placed.disk_amplification,
        "workload": wl.model_dump(),
        "comparable": placed.source == "dataset",  # re-solved for this data (else the plan's, for other data)
    }
    differs = [
        f"{k} {theirs} (this run {mine})"
        for k, theirs, mine in (
            ("fanouts", wl.fanouts, list(cfg.fanouts or ())),
            ("batch_size", wl.batch_size, cfg.batch_size),
        )
        if theirs != mine
    ]
    if differs:
        differs.append("so the read shares will differ from the prediction")
    if cfg.resolved_device() == "cpu":
        differs.append("the time is predicted for the profile's machine, this run is on the CPU")
    if cfg.live_sampling and placed.disk_amplification is not None:
        differs.append("--live-sampling: the stored samples' pages disk_amplification counts are not read")
    where = (
        f"predicted by moment place for this dataset on {placed.profile} ({placed.layout})"
        if placed.source == "dataset"
        else f"the plan's prediction ({placed.profile}, {placed.layout}), not re-solved for this dataset"
    )
    out["note"] = where + ("; " + ", ".join(differs) if differs else "")
    return out


def read_share_rows(pred: dict[str, Any], epochs: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(tier or bin, predicted share, measured share over all epochs) for every tier and bin:
    the closed loop, printed by ``moment train`` and checked in CI."""
    asked = sum(sum(e["rows_per_tier"].values()) for e in epochs)
    if not asked:
        return []
    rows: list[tuple[str, float, float]] = []
    for t in TIERS:
        rows.append((t, pred["tier_shares"][t], sum(e["rows_per_tier"].get(t, 0) for e in epochs) / asked))
    for name, share in pred["bin_shares"].items():
        measured = (
            sum(e["read_share_per_bin"].get(name, 0.0) * sum(e["rows_per_tier"].values()) for e in epochs) / asked
        )
        rows.append((name, share, measured))
    return rows


def param_digest(module: nn.Module) -> str:
    """SHA-256 of the parameters' bytes, in order: equal across ranks when replicas agree."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _amplification_line(doc: MetricsDoc, placed: bool = False) -> str:
    """Pages read from the SSDs per feature byte over the run, beside the prediction's; with
    ``placed``, the placed directory's pages too (every byte the batches read from disk)."""
    measured = read_amplification(
        (
            {"bytes": sum(e.bytes_per_ssd.get(b, 0) for e in doc.epochs), "read_bytes": n}
            for b, n in _summed(e.read_bytes_per_ssd for e in doc.epochs).items()
        ),
        sum(_summed(e.placed_read_bytes for e in doc.epochs).values()) if placed else 0,
    )
    predicted = doc.prediction.disk_amplification if placed else doc.prediction.ssd_amplification
    return f"{_fmt(measured, '.2f')}× the feature bytes measured (whole pages), {_fmt(predicted, '.2f')}× predicted"


def _summed(maps: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return out


def _table(title: str) -> Table:
    """A summary table as the console prints them: titled on the left, a simple head."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


class Metrics:
    """Collects epoch records, prints on rank 0 (``enabled``), writes the JSON document."""

    def __init__(
        self,
        cfg: TrainConfig,
        predicted: Prediction,
        history: list[dict[str, Any]],
        enabled: bool,
        console: Console | None = None,
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.history = history
        self.predicted = prediction(predicted, cfg)
        self.console = console or Console()
        self.world_size = 1
        self.ranks: list[str] = []
        self.on_plan_gpus = False  # every rank on the GPU the plan gave it (found by PCI address)
        self.sampling: dict[str, Any] | None = None  # where neighbour sampling ran (rank 0's)
        self.memory: dict[str, Any] | None = None  # rank 0's measured peaks (trainer.memory.measured)
        self.nodes: list[dict[str, Any]] | None = None  # several nodes: each one's prediction (trainer.nodes)

    def note_ssd_route(self, planned: str | None, reader: Reader) -> None:
        """Say (once, and in the prediction's ``note`` and ``ssd_route``) when the reader takes SSD
        bytes another way than the prediction assumes: the plan's workload ``ssd_reads: direct``
        (GPUDirect Storage, SSD → GPU peer to peer) against posix reads or kvikio's compat mode,
        which go through host memory, or the reverse. ``planned``: the plan's ``ssd_reads``
        (None without a plan: nothing to compare)."""
        route = reader.route
        self.predicted["ssd_route"] = {
            "planned": planned,
            "run": route,
            "reader": type(reader).__name__,
            "engine": reader.engine,
        }
        if planned is None or planned == route:
            return
        how = {"host": "through host memory", "direct": "straight to the GPU (GPUDirect Storage)"}
        what = f"{type(reader).__name__}" + (f", {reader.mode}" if reader.mode else "")
        line = (
            f"the prediction assumes SSD reads {how[planned]} (plan workload ssd_reads: {planned}); this run "
            f"reads them {how[route]} ({what}): the SSD links it loads differ from the predicted ones"
        )
        self.predicted["note"] += "; " + line
        if self.enabled:
            self.console.print(f"[yellow]note:[/] {line}", highlight=False)

    def print_config(self, ranks: list[str], on_plan_gpus: bool = False) -> None:
        """The config and where each rank runs, at the start. ``on_plan_gpus``: every rank runs on
        the GPU the plan placed it on, so this is the profile's machine and its data time compares."""
        self.world_size, self.ranks, self.on_plan_gpus = len(ranks), ranks, on_plan_gpus
        if not self.enabled:
            return
        fields = ", ".join(f"{k}={v}" for k, v in self.cfg.to_dict().items())
        self.console.print(f"[bold]moment train[/]: {fields}", highlight=False)
        for r, where in enumerate(ranks):
            self.console.print(f"  rank {r}: {where}", highlight=False)
        if len(self.history) >= self.cfg.epochs:  # every node still came: only node 0 sees the checkpoint
            self.console.print(
                f"  resuming after epoch {len(self.history)} of {self.cfg.epochs}: nothing left to train "
                "(the test accuracy is measured again)"
            )
        elif self.history:
            self.console.print(f"  resuming after epoch {len(self.history)}")

    @contextmanager
    def progress(self, epoch: int, steps: int) -> Iterator[Callable[[], None]]:
        """One epoch's steps on rank 0's console (a live bar, or lines in a log); yields the
        per-step callback."""
        if not self.enabled:
            yield lambda: None
            return
        stage, done = f"epoch {epoch + 1}/{self.cfg.epochs}", [0]
        with Reporter(self.console) as report:
            report(stage, 0, steps)

            def step() -> None:
                done[0] += 1
                report(stage, done[0], steps)

            yield step

    def add_epoch(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if not self.enabled:
            return
        self.console.print(
            f"epoch {record['epoch']}: loss {record['loss']:.4f}, val acc {_fmt(record['val_acc'], '.4f')}, "
            f"{record['epoch_s']:.2f} s, {record['seeds_per_s']:,.0f} seeds/s, "
            f"{sum(record['gbps_per_tier'].values()):.2f} GB/s of features",
            highlight=False,
        )
        for node in record.get("nodes") or []:
            self.console.print(
                f"  node {node['node']} ({node['host']}): {node['seeds_per_s']:,.0f} seeds/s, "
                f"{node['data_wait_s']:.2f} s waiting for data",
                highlight=False,
            )
        if record.get("straggler"):
            self.console.print(f"  [yellow]straggler:[/] {record['straggler']}", highlight=False)
        self._write(test_acc=None, digests=None)

    def document(self, test_acc: float | None, digests: list[str] | None) -> MetricsDoc:
        """The metrics file's contents so far (validated: a record that does not fit, say from a
        checkpoint's history, is one line naming the field)."""
        doc = {
            "format": FORMAT,
            "complete": test_acc is not None,
            "config": self.cfg.to_dict(),
            "world_size": self.world_size,
            "ranks": self.ranks,
            "sampling": self.sampling,
            "epochs": self.history,
            "measured_iteration_s": _per_iteration(self.history, "epoch_s"),
            "predicted_iteration_s": self.predicted["iteration_s"],
            "measured_feature_read_s": _per_iteration(self.history, "feature_read_s"),
            "on_plan_gpus": self.on_plan_gpus,
            "prediction": self.predicted,
            "test_acc": test_acc,
            "rank_param_digests": digests,
            "memory": self.memory,
            "nodes": self.nodes,
        }
        return MetricsDoc.parse(doc, self.cfg.metrics_json or "the metrics document")

    def _write(self, test_acc: float | None, digests: list[str] | None) -> MetricsDoc:
        doc = self.document(test_acc, digests)
        if self.enabled and self.cfg.metrics_json:
            doc.write(self.cfg.metrics_json)
        return doc

    def finish(self, test_acc: float, rank_param_digests: list[str]) -> dict[str, Any]:
        """The final document: written, summarised in a table (rank 0), and returned as the file
        holds it (JSON types)."""
        doc = self._write(test_acc, rank_param_digests)
        if self.enabled:
            self._summary(doc)
        return doc.model_dump(mode="json")

    def _summary(self, doc: MetricsDoc) -> None:
        table = _table("training (GB/s per tier, summed over ranks)")
        for col in ("epoch", "s", "seeds/s", "loss", "val acc", *TIERS, "gpu hit"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in doc.epochs:
            table.add_row(
                str(r.epoch),
                f"{r.epoch_s:.1f}",
                f"{r.seeds_per_s:,.0f}",
                f"{r.loss:.3f}",
                _fmt(r.val_acc, ".3f"),
                *(f"{r.gbps_per_tier.get(t, 0.0):.2f}" for t in TIERS),
                f"{r.hit_rate.get('gpu', 0.0):.1%}",
            )
        self.console.print(table)
        shares = _table("share of feature reads: predicted by moment place vs measured")
        for col in ("tier / bin", "predicted", "measured", "difference"):
            shares.add_column(col, justify="left" if col == "tier / bin" else "right", no_wrap=True)
        shared = read_share_rows(doc.prediction.model_dump(), [e.model_dump() for e in doc.epochs])
        for name, predicted_share, measured_share in shared:
            shares.add_row(
                name, f"{predicted_share:.1%}", f"{measured_share:.1%}", f"{measured_share - predicted_share:+.1%}"
            )
        self.console.print(shares)
        measured, predicted = doc.measured_iteration_s, doc.predicted_iteration_s
        pred = doc.prediction
        summary = Table(title="iteration time", title_justify="left", box=box.SIMPLE_HEAD, show_header=False)
        summary.add_column(justify="left", no_wrap=True)
        summary.add_column(justify="left")
        summary.add_row("measured", f"{measured:.4f} s (mean wall time per training iteration)" if measured else "—")
        summary.add_row("predicted", f"{predicted:.3g} s of feature reads ({pred.layout} on {pred.profile})")
        if measured and predicted and doc.on_plan_gpus:  # elsewhere the ratio says nothing about the model
            summary.add_row("measured / predicted", f"{measured / predicted:.2f}× (whole iteration / feature reads)")
        reads = doc.measured_feature_read_s
        if reads and doc.on_plan_gpus and pred.comparable:
            summary.add_row(
                "feature reads",
                f"{reads:.4f} s measured per iteration vs {predicted:.3g} s predicted "
                f"({reads / predicted:.2f}×), on the plan's GPUs",
            )
        else:
            why = "ranks are not on the plan's GPUs" if not doc.on_plan_gpus else "the prediction is for other data"
            summary.add_row("feature reads", f"{_fmt(reads, '.4f')} s per iteration; not compared: {why}")
        summary.add_row("SSD bytes read", _amplification_line(doc))
        if doc.prediction.disk_amplification is not None or any(e.placed_read_bytes for e in doc.epochs):
            summary.add_row(
                "disk bytes read", _amplification_line(doc, placed=True) + " (with stored samples, row maps)"
            )
        if (chunks := chunk_batches(doc)) is not None:
            batches = sum(e.chunks.batches for e in doc.epochs if e.chunks is not None)
            summary.add_row(
                "chunk reads",
                f"{chunks[1]:,} of {batches:,} batches read only their chunks, {chunks[0]:,} predicted "
                "(the batches of the epochs packed for)",
            )
        summary.add_row("note", pred.note)
        summary.add_row("test accuracy", _fmt(doc.test_acc, ".4f"))
        self.console.print(summary)
        if doc.nodes and doc.epochs and doc.epochs[-1].nodes:
            self._nodes_summary(doc)

    def _nodes_summary(self, doc: MetricsDoc) -> None:
        """Each node's last epoch beside its own placement's prediction."""
        table = _table("nodes (last epoch; tier shares measured / predicted by each node's placement)")
        for col in ("node", "host", "seeds/s", "data wait s", *TIERS):
            table.add_column(col, justify="left" if col == "host" else "right", no_wrap=True)
        predicted = {p.node: p for p in doc.nodes or []}
        for n in doc.epochs[-1].nodes or []:
            p = predicted.get(n.node)
            shares = [
                f"{n.read_share_per_tier.get(t, 0.0):.1%} / " + (f"{getattr(p.tier_shares, t):.1%}" if p else "—")
                for t in TIERS
            ]
            table.add_row(str(n.node), n.host, f"{n.seeds_per_s:,.0f}", f"{n.data_wait_s:.2f}", *shares)
        self.console.print(table)
        if doc.epochs[-1].straggler:
            self.console.print(f"[yellow]straggler:[/] {doc.epochs[-1].straggler}", highlight=False)
