"""Stream fencing on CUDA, checked on the CPU with a recorder in place of torch's streams and
events (tests/cuda_stream_fake.py): the prefetch thread produces on a stream of its own and
records an event after its work; training and evaluation run on a stream of their own too — not
the legacy default stream, which kvikio's small reads (a blocking stream) and GDS reads (a NULL
stream sync) serialise with — and wait for each batch's event, and keep its tensors alive on
their stream (GPU review #1, #24)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cuda_stream_fake import StreamRecorder, install
from trainer import loop
from trainer.prefetch import Prefetcher, Prepared, compute_stream

CUDA = torch.device("cuda", 0)


def _prepare(rec: StreamRecorder) -> Any:
    def prepare(seeds: torch.Tensor) -> Prepared:
        k = int(seeds[0])
        rec.note("produced", k)
        blocks = [SimpleNamespace(edge_index=torch.zeros(2, 3, dtype=torch.long)) for _ in range(2)]
        return Prepared(SimpleNamespace(blocks=blocks), torch.full((4, 2), float(k)), torch.full((4,), k))

    return prepare


def check_fenced(rec: StreamRecorder, k: int, item: Prepared) -> None:
    """Batch k was produced on a side stream, its event recorded after; the consumer's stream
    (not the default one) waited on that event, and took every tensor onto its stream, before
    it read the batch."""
    produced = next(i for i, e in enumerate(rec.log) if e[:2] == ("produced", k))
    producer = rec.log[produced][2]
    consumed = next(i for i, e in enumerate(rec.log) if e[:2] == ("consumed", k))
    consumer = rec.log[consumed][2]
    assert producer != 0 and consumer != 0 and producer != consumer, (producer, consumer)
    assert item.ready is not None
    recorded = rec.index(("record", producer, item.ready.id))
    waited = rec.index(("wait_event", consumer, item.ready.id))
    assert produced < recorded and waited < consumed, f"batch {k}: read before its producer's event was waited for"
    tensors = [item.x, item.y, *(b.edge_index for b in item.batch.blocks)]
    for t in tensors:
        assert rec.index(("record_stream", id(t), consumer)) < consumed


def test_every_batch_is_fenced_and_training_is_off_the_default_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = install(monkeypatch)
    seeds = (torch.tensor([k]) for k in range(5))
    got = []
    with compute_stream(CUDA) as train_stream:
        prefetcher = Prefetcher(seeds, _prepare(rec), 2, CUDA)
        for item in prefetcher:
            k = int(item.y[0])
            rec.note("consumed", k)
            got.append((k, item))
        prefetcher.close()
    assert [k for k, _ in got] == list(range(5))
    for k, item in got:
        check_fenced(rec, k, item)
    # The training stream starts after what the default stream had queued, and the default
    # stream (checkpoints, all-reduces after the epoch) after what it did.
    s = train_stream.id
    assert (
        rec.index(("wait_stream", s, 0))
        < rec.index(("enter", s))
        < rec.index(("exit", s))
        < rec.index(("wait_stream", 0, s))
    )


def test_the_check_catches_a_consumer_that_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = install(monkeypatch)
    monkeypatch.setattr(type(rec.default), "wait_event", lambda self, event: None)  # a consumer that forgot
    with compute_stream(CUDA):
        prefetcher = Prefetcher((torch.tensor([k]) for k in range(2)), _prepare(rec), 1, CUDA)
        items = []
        for item in prefetcher:
            rec.note("consumed", int(item.y[0]))
            items.append(item)
        prefetcher.close()
    with pytest.raises(ValueError):  # no wait_event in the log: the check fails
        check_fenced(rec, 0, items[0])


def test_compute_stream_is_a_no_op_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = install(monkeypatch)
    with compute_stream(torch.device("cpu")) as s:
        assert s is None
    assert [e for e in rec.log if e[0] != "new_stream"] == []


def test_training_and_evaluation_run_inside_compute_stream(
    monkeypatch: pytest.MonkeyPatch, plan_file: Path, tmp_path: Path
) -> None:
    """The run wraps every training epoch and every evaluation in compute_stream."""
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    synthesize(
        tmp_path / "ds",
        nodes=1500,
        avg_degree=5,
        dim=8,
        dtype="float32",
        seed=1,
        classes=3,
        train_fraction=0.2,
        val_fraction=0.1,
        test_fraction=0.1,
    )
    place(plan_file, tmp_path / "ds", tmp_path / "placed", PlaceOptions(gpu_cache="5%", cpu_cache="5%"))
    inside: list[str] = []
    depth = [0]
    real = loop.compute_stream

    class Counting:
        def __init__(self, device: torch.device, stream: Any = None) -> None:
            self._cm = real(device, stream)

        def __enter__(self) -> Any:
            depth[0] += 1
            return self._cm.__enter__()

        def __exit__(self, *exc: object) -> Any:
            depth[0] -= 1
            return self._cm.__exit__(*exc)

    def wrap(name: str) -> Any:
        fn = getattr(loop, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            inside.append(f"{name}:{depth[0] > 0}")
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(loop, "compute_stream", Counting)
    monkeypatch.setattr(loop, "train_epoch", wrap("train_epoch"))
    monkeypatch.setattr(loop, "evaluate", wrap("evaluate"))
    assert (
        loop.main(
            [
                "--data",
                str(tmp_path / "placed"),
                "--device",
                "cpu",
                "--fanouts",
                "3,3",
                "--batch-size",
                "64",
                "--hidden",
                "8",
                "--epochs",
                "1",
                "--max-batches-per-epoch",
                "2",
            ]
        )
        == 0
    )
    assert inside and set(inside) == {"train_epoch:True", "evaluate:True"}, inside
