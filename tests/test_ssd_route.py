"""The trainer says when its SSD reader contradicts the plan's ``ssd_reads`` (issue #12's
leftover): the prediction assumed a route the run does not take."""

from __future__ import annotations

import io

from rich.console import Console

from kvikio_fake import FakeKvikio
from prediction_fixture import prediction
from trainer.config import TrainConfig
from trainer.metrics import Metrics
from trainer.readers import READ_ENGINES, FileReader, KvikioReader

PREDICTION = prediction({"gpu": 0.2})


def metrics() -> tuple[Metrics, io.StringIO]:
    out = io.StringIO()
    cfg = TrainConfig(data="d", fanouts=(10, 5), batch_size=512, device="cuda")
    return Metrics(cfg, PREDICTION, [], enabled=True, console=Console(file=out, width=400)), out


def test_posix_reads_against_a_direct_plan_are_noted_once() -> None:
    m, out = metrics()
    with FileReader(threads=1) as reader:
        m.note_ssd_route("direct", reader)
    assert m.predicted["ssd_route"] == {
        "planned": "direct",
        "run": "host",
        "reader": "FileReader",
        "engine": reader.engine,
    }
    assert reader.engine in READ_ENGINES
    assert "ssd_reads: direct" in m.predicted["note"] and "through host memory (FileReader)" in m.predicted["note"]
    assert out.getvalue().count("note:") == 1


def test_kvikio_compat_mode_is_host_reads_gds_is_not() -> None:
    class CpuKvikio(KvikioReader):
        device_type = "cpu"

    kvikio = FakeKvikio()  # AUTO without cuFile: compat mode, a bounce buffer in host memory
    m, out = metrics()
    with CpuKvikio(threads=1, module=kvikio) as reader:
        m.note_ssd_route("direct", reader)
    assert m.predicted["ssd_route"]["run"] == "host" and "kvikio-compat" in m.predicted["note"]
    kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF)
    m, out = metrics()
    with CpuKvikio(threads=1, module=kvikio) as reader:
        m.note_ssd_route("direct", reader)
    assert m.predicted["ssd_route"]["run"] == "direct" and "ssd_reads" not in m.predicted["note"]
    assert out.getvalue() == ""


def test_without_a_plan_there_is_nothing_to_contradict() -> None:
    m, out = metrics()
    before = m.predicted["note"]
    with FileReader(threads=1) as reader:
        m.note_ssd_route(None, reader)
    assert m.predicted["note"] == before and out.getvalue() == ""
