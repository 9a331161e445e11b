"""The broadcast engine of `moment infer`: agrees with the gather engine (the reference) on the same
checkpoint, writes the same bytes whatever the ranks, the memory budget (partitions, edges held or
spilled to disk) and the slab size, resumes after a kill, leaves GAT to the gather engine and says so; the SAGE scatter form
equals PyG's SAGEConv, including vertices without in-edges."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moment import faults, host_memory
from moment.cli import main
from moment.contracts.inference import InferenceError, InferenceManifest
from test_infer import CPU, TRAIN, _arrays, _run_cli
from trainer import broadcast, loop
from trainer.infer import InferOptions, infer
from trainer.models import LAYERS, Layer, scatter_form


@pytest.fixture(scope="module")
def data(make_placed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small placed graph (every tier used) and a SAGE and a GAT checkpoint of it."""
    root = tmp_path_factory.mktemp("broadcast")
    placed = make_placed(nodes=2000, avg_degree=7, dim=24, seed=11, classes=5, gpu_cache="5%", cpu_cache="5%", epochs=1)
    out = {"placed": placed}
    for model in ("sage", "gat"):
        ck = root / model
        assert loop.main(["--data", str(placed), "--model", model, *TRAIN, "--checkpoint-dir", str(ck)]) == 0
        out[model] = ck
    return out


BLOCK = 256  # --batch-size: the broadcast engine's source block


def small_memory(ranks: int = 1) -> int:
    """A budget that cuts each rank's destinations of layer 1 into several partitions (each of
    ``ranks`` ranks gets its share)."""
    return ranks * (max(broadcast.fixed_bytes(BLOCK, 24, 16), broadcast.fixed_bytes(BLOCK, 16, 5)) + 20_000)


def run(data: dict[str, Path], out: Path, **kw: object) -> InferenceManifest:
    opts = {"data": data["placed"], "checkpoint": data["sage"], "out": out, "batch_size": BLOCK, "device": "cpu"}
    return infer(InferOptions(**{**opts, "layers": "all", **kw}))  # type: ignore[arg-type]


def test_broadcast_agrees_with_gather_and_records_its_partitions(data: dict[str, Path], tmp_path: Path) -> None:
    g = run(data, tmp_path / "gather", engine="gather")
    b = run(data, tmp_path / "broadcast", nproc=2, memory=small_memory(2))
    want, got = _arrays(tmp_path / "gather"), _arrays(tmp_path / "broadcast")
    np.testing.assert_allclose(got["embeddings"], want["embeddings"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
    assert got["embeddings"].tobytes() != want["embeddings"].tobytes()  # really another engine's sums
    assert [t.engine for t in g.throughput[:2]] == ["gather", "gather"] and g.throughput[0].note is None
    assert b.engine == "broadcast" and b.memory == small_memory(2)
    assert [t.engine for t in b.throughput[:2]] == ["broadcast", "broadcast"]
    assert b.throughput[0].partitions > 2 and b.throughput[1].partitions >= 2  # layer 1: the budget cut them
    first = b.throughput[0]  # 24 → 16 wide: each rank streams the input once, then its relayed messages
    assert first.predicted.input_streams == 2 and first.read_bytes < first.partitions * first.predicted.input_bytes
    assert b.accuracy == pytest.approx(g.accuracy, abs=1 / 200)


def test_same_bytes_whatever_ranks_budget_and_slabs(
    data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = run(data, tmp_path / "one")  # one rank, half the free memory: one partition per layer
    assert [t.partitions for t in one.throughput[:2]] == [1, 1]
    monkeypatch.setattr(broadcast, "SLAB_EDGES", 500)  # edges bucketed in many slabs
    three = run(data, tmp_path / "three", nproc=3, memory=small_memory(3))
    assert three.throughput[0].partitions > 3
    assert one.throughput[0].edges_on_disk == 0 and three.throughput[0].edges_on_disk >= 3  # held and spilled
    a, b = _arrays(tmp_path / "one"), _arrays(tmp_path / "three")
    assert set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_a_killed_broadcast_resumes_to_the_same_bytes(data: dict[str, Path], tmp_path: Path) -> None:
    memory = small_memory()
    run(data, tmp_path / "straight", memory=memory)
    out = tmp_path / "killed"
    args = ["--data", str(data["placed"]), "--checkpoint", str(data["sage"]), "--batch-size", str(BLOCK), *CPU]
    args += ["--layers", "all", "--memory", str(memory), "--out", str(out)]
    killed = _run_cli(args, fault="infer:layer1:chunk1")
    assert killed.returncode == faults.FAULT_EXIT, killed.stderr
    progress = json.loads((tmp_path / "killed.partial/data/work/progress-0.json").read_text())
    assert (progress["stage"], progress["chunks"]) == (0, 1)  # one partition of layer 1 recorded, the 2nd written
    logged: list[str] = []
    # resumed with another budget asked for: the first run's partitions are kept
    infer(
        InferOptions(data["placed"], data["sage"], out, layers="all", batch_size=BLOCK, device="cpu", memory=10**9),
        log=logged.append,
    )
    assert any("resuming" in line for line in logged) and any("keeping the interrupted" in x for x in logged), logged
    a, b = _arrays(tmp_path / "straight"), _arrays(out)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert InferenceManifest.read(out / "inference.json").memory == memory


def test_gat_runs_on_the_gather_engine_and_says_so(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["gat"]), "--out", str(tmp_path / "o")]
    assert main([*args, *CPU]) == 0
    m = InferenceManifest.read(tmp_path / "o" / "inference.json")
    assert [t.engine for t in m.throughput[:2]] == ["gather", "gather"]
    assert m.throughput[0].note == "gat has no scatter form" and m.memory is None
    assert "gather engine (gat has no scatter form)" in " ".join(capsys.readouterr().out.split())


def test_a_budget_too_small_or_not_a_size_is_one_line(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["sage"]), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stop:  # a usage error, as argparse reports every bad value
        main([*base, *CPU, "--memory", "lots"])
    assert stop.value.code == 2 and "argument --memory: 'lots': expected a size like 4GB" in capsys.readouterr().err
    with pytest.raises(InferenceError, match="too small for the broadcast engine"):
        broadcast.partitions(np.zeros(11, dtype=np.int64), 0, 10, 16, 24, BLOCK, 1000)


def test_partitions_fit_the_budget_and_cover_the_range() -> None:
    rng = np.random.default_rng(0)
    indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 40, 5000))])
    memory = broadcast.fixed_bytes(BLOCK, 8, 8) + 30_000
    parts = broadcast.partitions(indptr, 100, 4900, 8, 8, BLOCK, memory)
    assert parts[0][0] == 100 and parts[-1][1] == 4900 and all(a < b for a, b in parts)
    assert all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
    room = memory - broadcast.fixed_bytes(BLOCK, 8, 8)
    sums = [(b - a) * broadcast.row_bytes(8) for a, b in parts]
    assert max(sums) <= room and len(parts) == -(-4800 // (room // broadcast.row_bytes(8)))  # the fewest
    # the sums fill the budget: the edges go to disk; with room for them too, they stay in memory
    a, b = parts[0]
    edges = int(indptr[b] - indptr[a])
    assert not broadcast.edges_in_memory(b - a, edges, 8, 8, BLOCK, memory)
    assert broadcast.edges_in_memory(b - a, edges, 8, 8, BLOCK, memory + 8 * edges + (1 << 20))


@pytest.mark.parametrize(("hold", "chunk"), [(0, 4096), (12_000, 4096), (0, 7), (0, 250)])
def test_spilled_edges_are_the_same_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hold: int, chunk: int
) -> None:
    """Edges held, spilled, read back in chunks smaller than a block's run (7) or straddling runs (250): the same."""
    monkeypatch.setattr(broadcast, "READ_CHUNK_MIN", chunk)
    monkeypatch.setattr(broadcast, "READ_BUFFER", 0)
    rng = np.random.default_rng(5)
    indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 30, 900))])
    indices = rng.integers(0, 1000, int(indptr[-1])).astype(np.int32)
    held = broadcast.Buckets(indptr, indices, 40, 870, BLOCK, 1000, slab=700)
    spilled = broadcast.Buckets(indptr, indices, 40, 870, BLOCK, 1000, 700, tmp_path / "edges.bin", hold)
    size, edges = (tmp_path / "edges.bin").stat().st_size, int(indptr[870] - indptr[40])
    in_memory = sum(p[0].nbytes + p[1].nbytes for p in spilled.pieces if isinstance(p[0], np.ndarray))
    assert len(spilled.pieces) > 3 and size + in_memory == 8 * edges and in_memory <= hold
    assert (in_memory > 0) == (hold > 0)  # the first slabs stay in memory while they fit ``hold``
    assert np.array_equal(held.counts, spilled.counts)
    for k in range(held.blocks):
        assert all(np.array_equal(x, y) for x, y in zip(held.of(k), spilled.of(k)))
    spilled.close()
    assert not (tmp_path / "edges.bin").exists()


@pytest.mark.parametrize("root_weight", [True, False])
def test_the_sage_scatter_form_equals_sageconv(root_weight: bool) -> None:
    from torch_geometric.nn import SAGEConv

    torch.manual_seed(0)
    conv = SAGEConv(6, 3, root_weight=root_weight).eval()
    x = torch.randn(10, 6)
    src = torch.tensor([1, 2, 3, 3, 0, 9, 9, 9])  # vertex 4.. have no in-edges but 5 and 7
    dst = torch.tensor([0, 0, 0, 1, 5, 5, 7, 7])
    want = conv(x, torch.stack([src, dst]))
    form = scatter_form("sage", conv)
    assert form is not None
    deg = torch.bincount(dst, minlength=10).clamp(min=1).float().unsqueeze(1)
    sums = torch.zeros(10, 3).index_add_(0, dst, form.message(x)[src]) + deg * form.root(x)
    torch.testing.assert_close(form.finish(sums, deg), want, rtol=1e-5, atol=1e-6)
    assert scatter_form("sage", SAGEConv(6, 3, aggr="max")) is None  # no scatter form: gather
    assert scatter_form("sage", SAGEConv(6, 3, normalize=True)) is None
    assert isinstance(LAYERS["gat"], Layer) and LAYERS["gat"].scatter is None


@pytest.mark.parametrize("version", [1, 2])
def test_the_default_budget_stays_within_the_memory_cgroup(tmp_path: Path, version: int) -> None:
    proc = tmp_path / "cgroup"
    if version == 1:
        proc.write_text("5:cpu:/\n4:memory:/jobs/a\n0::/\n")
        group = tmp_path / "sys/memory/jobs/a"
        files = {"memory.limit_in_bytes": "3000000000", "memory.usage_in_bytes": "1500000000"}
        stat = "cache 1\ntotal_cache 500000000\n"
    else:
        proc.write_text("0::/user/b\n")
        group = tmp_path / "sys/user/b"
        files = {"memory.max": "3000000000", "memory.current": "1500000000"}
        stat = "anon 1000000000\nfile 500000000\n"
    group.mkdir(parents=True)
    for name, text in {**files, "memory.stat": stat}.items():
        (group / name).write_text(text + "\n")
    assert host_memory.cgroup_memory(proc, tmp_path / "sys") == 2_000_000_000  # limit - (usage - page cache)
    (group / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(
        "9223372036854771712\n" if version == 1 else "max\n"
    )
    assert host_memory.cgroup_memory(proc, tmp_path / "sys") is None  # no limit


def test_the_compiled_loops_equal_numpy_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    indptr = np.concatenate([[0], np.cumsum(rng.integers(0, 9, 700))])
    indices = rng.integers(0, 1000, int(indptr[-1])).astype(np.int32)
    msg = torch.from_numpy(rng.standard_normal((BLOCK, 5), dtype=np.float32))
    compiled = broadcast.Buckets(indptr, indices, 50, 650, BLOCK, 1000)
    acc = torch.zeros(600, 5)
    broadcast._scatter_add(torch.device("cpu"))(acc, *reversed(compiled.of(1)), msg)
    monkeypatch.setattr(broadcast, "_KERNELS", [None, None])  # numba missing: numpy's sort, index_add_
    plain = broadcast.Buckets(indptr, indices, 50, 650, BLOCK, 1000)
    assert all(np.array_equal(x, y) for p, q in zip(compiled.pieces, plain.pieces) for x, y in zip(p, q))
    local, dst = plain.of(1)
    ptr = indptr[50:651]  # block 1's in-edges of destinations 50..649, in CSR order
    src, to = indices[ptr[0] : ptr[-1]], np.repeat(np.arange(600), np.diff(ptr))
    assert np.array_equal(local, src[src // BLOCK == 1] - BLOCK) and np.array_equal(dst, to[src // BLOCK == 1])
    want = torch.zeros(600, 5)
    broadcast._scatter_add(torch.device("cpu"))(want, dst, local, msg)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)


def test_without_numba_the_torch_path_gives_the_same_layers(
    data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a CUDA device takes (``index_add_``, numpy's sort), run on the CPU."""
    run(data, tmp_path / "compiled")
    monkeypatch.setattr(broadcast, "_KERNELS", [None, None])
    run(data, tmp_path / "torch", nproc=2, memory=small_memory(2))
    a, b = _arrays(tmp_path / "compiled"), _arrays(tmp_path / "torch")
    for k in ("embeddings", "logits"):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_a_partition_shows_progress_as_its_stream_advances(data: dict[str, Path], tmp_path: Path) -> None:
    seen: dict[str, list[int]] = {}
    opts = InferOptions(data["placed"], data["sage"], tmp_path / "o", batch_size=BLOCK, device="cpu")
    m = infer(opts, progress=lambda stage, done, total: seen.setdefault(stage, []).append(done))
    steps = seen["infer: layer 1"]
    assert m.throughput[0].partitions == 1 and len(steps) > 4  # one partition, many steps (2000 / 256 blocks)
    assert steps == sorted(steps) and steps[-1] == 2000


@pytest.mark.parametrize("ranks", [1, 2])
def test_inference_json_holds_the_prediction_beside_what_was_measured(
    data: dict[str, Path], plan_file: Path, tmp_path: Path, ranks: int
) -> None:
    """Per layer: the passes, the bytes the engine asked for (exactly: every pass streams every
    source block here), memory within a rank's budget, a time on the plan's machine."""
    from moment.cli.infer import plan_rates

    rates = plan_rates(plan_file)
    assert rates is not None and rates.machine == "moment-machine-b" and rates.ssd("nvme0") > 0
    memory = small_memory(ranks) if ranks > 1 else 10**9
    m = run(data, tmp_path / "o", nproc=ranks, memory=memory, plan=plan_file, rates=rates)
    for t in m.throughput[:2]:
        pr = t.predicted
        assert pr is not None and pr.engine == "broadcast" and pr.passes == t.partitions
        assert t.read_bytes == pr.read_bytes and t.disk_read_bytes is not None
        assert pr.read_bytes >= pr.input_streams * pr.input_bytes and pr.memory_bytes <= memory // ranks
        assert pr.seconds is not None and pr.seconds >= max(pr.read_s, pr.compute_s) > 0
        assert pr.machine == "moment-machine-b"
    first = m.throughput[0].predicted
    assert (first.spilled_edge_bytes > 0) == (ranks > 1)  # the small budget spills edges, the large one not
    assert m.throughput[2].predicted is None  # the export


def test_the_dry_run_prints_the_prediction_and_writes_nothing(
    data: dict[str, Path], plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["infer", "--data", str(data["placed"]), "--checkpoint", str(data["sage"]), "--plan", str(plan_file)]
    args += ["--batch-size", str(BLOCK), "--memory", str(small_memory()), *CPU]
    before = set(tmp_path.iterdir())
    assert main([*args, "--dry-run"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert set(tmp_path.iterdir()) == before
    assert "reads at the rates of moment-machine-b" in text
    m = run(data, tmp_path / "o", memory=small_memory())  # the same figures as the run records
    for k, t in enumerate(m.throughput[:2], 1):
        pr = t.predicted
        passes = f"{pr.passes} pass{'es' if pr.passes != 1 else ''}"
        assert f"layer {k}: broadcast, {passes}" in text and f"reads {pr.read_bytes / 1e9:.3g} GB" in text
    assert m.throughput[0].predicted.input_streams == 1  # layer 1 (24 → 16 wide) relays its messages
    assert "1 over the input, the others over its relayed messages" in text
    assert main(args) == 2  # without --dry-run, --out is required
    assert "--out: required" in capsys.readouterr().err


def test_the_space_check_counts_the_spilled_edges(
    data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any byte is written, the free-space check asks for the layer arrays and, beside
    them, the largest layer's spilled edges (its scratch files live until its passes end)."""
    import trainer.infer as ti

    asked: list[int] = []
    real = ti.check_free_space
    monkeypatch.setattr(
        ti, "check_free_space", lambda needs, error: (asked.append(sum(needs.values())), real(needs, error))
    )
    m = run(data, tmp_path / "o", nproc=2, memory=small_memory(2))
    spilled = max(t.predicted.spilled_edge_bytes for t in m.throughput if t.predicted is not None)
    arrays = run(data, tmp_path / "big", memory=10**9)  # nothing spilled: the arrays alone
    assert spilled > 0 and asked == [asked[1] + spilled, asked[1]]
    assert all(t.predicted is None or t.predicted.spilled_edge_bytes == 0 for t in arrays.throughput)
