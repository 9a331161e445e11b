"""Packed placements (issue #25, ``moment place --pack``, placement/pack.py): SSD rows laid out
in the order the trainer's batches read them. Checked by reading every row back against the
source, by training on small rows (128 B) packed and unpacked and comparing the pages the
readers moved, against the replay's prediction, and by killing the packing and re-running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moment import faults
from moment.contracts.metrics import MetricsDoc
from moment.contracts.placed import PlacedError, PlacedManifest
from moment.errors import UsageError
from moment.planner.plan import plan
from moment.planner.planfile import save_plan
from moment.planner.workload import load_workload
from moment.topology.profile_io import resolve_profile
from placement.chunks import (
    MINHASHES,
    SHARED_ORDERS,
    Gathered,
    chunk_file,
    parse_budget,
    plan_chunks,
    space,
    write_gathered,
)
from placement.dataset import open_dataset
from placement.digests import PLACED_DIGEST, file_digest
from placement.pack import SsdRows, minhash_order, plan_pack, readers
from placement.place import PlaceOptions, place
from placement.placed import Placed, chunk_starts, open_placed, verify
from placement.synth import synthesize
from trainer.featurestore import TieredFeatureStore
from trainer.loop import main as train_main
from trainer.metrics import chunk_batches

OPTS = dict(gpu_cache="1%", cpu_cache="2%", epochs=1)


def test_rows_go_where_batches_first_read_them() -> None:
    """By hand: one bin of 16 rows of 1 KiB (4 to a page), ids 100-115. Batch 1 reads rows 3,
    9, 14 (unpacked: pages 0, 2 and 3); batch 2 reads 9 again, and 1 (unpacked: pages 0 and 2);
    batch 3 reads 3 again. Batch 1's rows take file rows 0-2, ordered by the batch that reads
    them next (9 for batch 2, 3 for batch 3, 14 never); row 1 takes file row 3. So batch 1
    reads one page in one run, batch 2 file rows 0 and 3 (one page, two runs), batch 3 file row
    1. Rows nobody read follow in id order."""
    batches = [np.array([114, 103, 109]), np.array([109, 101]), np.array([103])]
    plan = plan_pack(lambda: iter(batches), [100], [16], 1024)
    assert plan.slots[0].tolist() == [4, 3, 5, 1, 6, 7, 8, 9, 10, 0, 11, 12, 13, 14, 2, 15]
    assert (plan.batches, plan.useful_bytes, plan.reads) == (3, 6 * 1024, 4)
    assert (plan.unpacked_bytes, plan.packed_bytes) == (6 * 4096, 3 * 4096)


def test_rows_outside_the_ssd_bins_are_not_packed() -> None:
    """Ids below the first SSD bin (the caches) and bins are kept apart: two bins [10, 14) and
    [14, 20); a batch reading 2 (a cache row), 15 and 11 places 11 first in bin 0, 15 in bin 1."""
    plan = plan_pack(lambda: iter([np.array([2, 15, 11])]), [10, 14], [4, 6], 512)
    assert plan.slots[0].tolist() == [1, 0, 2, 3] and plan.slots[1].tolist() == [1, 0, 2, 3, 4, 5]
    assert plan.useful_bytes == 2 * 512 and plan.packed_bytes == 2 * 4096 and plan.reads == 2


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pack-plan")
    machine = resolve_profile("moment-machine-b")
    workload = load_workload(machine.workload, fanouts=[5, 3], batch_size=64)
    save_plan(machine, workload, plan(machine, workload, 1, 8, top=1), root / "plan.json")
    return root / "plan.json"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """128-byte rows (64 float16): 32 to a page."""
    out = tmp_path_factory.mktemp("pack-data") / "ds"
    synthesize(out, nodes=30_000, avg_degree=10, dim=64, dtype="float16", seed=0, train_fraction=0.03)
    return out


@pytest.fixture(scope="module")
def runs(
    plan_file: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, MetricsDoc]]:
    """The same placement unpacked and packed, each trained for one epoch on one CPU rank."""
    root = tmp_path_factory.mktemp("pack-runs")
    out = {}
    for name, pack in (("unpacked", False), ("packed", True)):
        place(plan_file, dataset, root / name, PlaceOptions(pack=pack, **OPTS))
        metrics = root / f"{name}.json"
        args = ["--data", str(root / name), "--plan", str(plan_file), "--device", "cpu", "--epochs", "1"]
        assert train_main([*args, "--hidden", "8", "--eval-every", "2", "--metrics-json", str(metrics)]) == 0
        out[name] = (root / name, MetricsDoc.read(metrics))
    return out


def test_packed_rows_read_back_byte_for_byte(runs: dict[str, tuple[Path, MetricsDoc]], dataset: Path) -> None:
    """Every vertex's row, through the trainer's feature store and through verify's reader, is
    the source's; the packed bins really are out of id order."""
    root = runs["packed"][0]
    placed = open_placed(root)
    src = np.asarray(open_dataset(dataset).features())
    vertex_at = np.argsort(np.asarray(placed.array("old_to_new")))  # the vertex at each row
    ids = np.random.default_rng(0).permutation(placed.num_nodes)
    with TieredFeatureStore(placed, device="cpu", io="posix") as store:
        got = store.get(ids).numpy()  # dataset ids
    assert got.tobytes() == src[ids].tobytes()
    assert placed.read_rows(ids).tobytes() == src[vertex_at[ids]].tobytes()  # rows
    assert verify(root, sample=placed.num_nodes)["sampled"] > 0.6 * placed.num_nodes
    ssd = [b for b in placed.bins if b.tier == "ssd"]
    assert ssd and all(b.slots is not None for b in ssd)
    for b in ssd:
        slots = np.load(b.slots)
        assert np.array_equal(np.sort(slots), np.arange(b.count)) and not np.array_equal(slots, np.arange(b.count))


def test_packing_moves_fewer_pages_as_predicted(runs: dict[str, tuple[Path, MetricsDoc]]) -> None:
    """The readers' page count (what the SSDs moved) per feature byte: packed at most half of
    unpacked on 128-byte rows, and within 5% of what the replay predicted (the trainer's batches
    are the replayed ones, so only the replay's own count could differ)."""
    unpacked, packed = (runs[k][1].epochs[0] for k in ("unpacked", "packed"))
    assert unpacked.bytes_per_ssd == pytest.approx(packed.bytes_per_ssd)  # the same rows read from each bin
    # the same ids, batches and features: packing changes where rows lie, not what is trained
    assert packed.loss == pytest.approx(unpacked.loss, rel=1e-5)
    assert runs["packed"][1].test_acc == pytest.approx(runs["unpacked"][1].test_acc, abs=1e-9)
    assert packed.ssd_read_amplification <= 0.5 * unpacked.ssd_read_amplification
    predicted = runs["packed"][1].prediction.ssd_amplification
    assert predicted == pytest.approx(packed.ssd_read_amplification, rel=0.05)
    m = PlacedManifest.read(runs["packed"][0] / "placed.json")
    assert m.pack is not None and m.pack.unpacked_bytes > 2 * m.pack.packed_bytes
    assert m.prediction.ssd_amplification == pytest.approx(m.pack.amplification)
    assert m.timings_s["pack"] > 0


def test_a_flipped_byte_in_a_pack_is_caught(plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    place(plan_file, dataset, out, PlaceOptions(pack=True, **OPTS))
    slot_file = next(b.slots for b in open_placed(out).bins if b.slots is not None)
    data = bytearray(slot_file.read_bytes())
    data[-1] ^= 1
    slot_file.write_bytes(bytes(data))
    with pytest.raises(PlacedError, match=rf"{slot_file.name}: checksum mismatch"):
        verify(out, sample=0)


def _killed_at(point: str, call: str) -> int:
    env = {**os.environ, faults.ENV: point}
    done = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, faults.FAULT_EXIT), done.stderr
    return done.returncode


def _killed_and_rerun(
    point: str, plan_file: Path, dataset: Path, tmp_path: Path, opts: dict
) -> tuple[Path, Path, Placed]:
    """Place with ``opts`` (nvme0's bin in a directory of its own), killed at ``point``, then
    again to the end: the placement, checked against the source row by row."""
    out, ssd = tmp_path / "pk", tmp_path / "ssd"
    call = (
        "from placement.place import PlaceOptions, place; from pathlib import Path; "
        f"place({str(plan_file)!r}, {str(dataset)!r}, {str(out)!r}, PlaceOptions("
        f"ssd_dirs={{'nvme0': Path({str(ssd)!r})}}, **{opts!r}))"
    )
    assert _killed_at(point, call) == faults.FAULT_EXIT
    place(plan_file, dataset, out, PlaceOptions(ssd_dirs={"nvme0": ssd}, **opts))
    placed = open_placed(out)
    assert verify(out, sample=placed.num_nodes)["rows"] == placed.num_nodes
    return out, ssd, placed


@pytest.mark.parametrize("point", ["place:bins-written", "place:pack-planned", "place:packed"])
def test_packing_killed_resumes(point: str, plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """Killed before, during or after packing, the re-run finishes a placement that verifies,
    and leaves no unpacked copy in the SSD directory."""
    out, ssd, placed = _killed_and_rerun(point, plan_file, dataset, tmp_path, {**OPTS, "pack": True})
    assert [p.name for p in ssd.iterdir()] == [Path(b.path).name for b in placed.bins if b.name == "nvme0"]
    assert json.loads((out / "placed.json").read_text())["pack"]["batches"] > 0


def test_reused_samples_keep_the_packing(
    runs: dict[str, tuple[Path, MetricsDoc]], plan_file: Path, tmp_path: Path
) -> None:
    """Past the replayed epoch, new batches read rows packed for other ones; with
    --reuse-samples epoch 2 trains on epoch 1's batches again and moves exactly its pages."""
    root = runs["packed"][0]
    amp = {}
    for reuse in (False, True):
        metrics = tmp_path / f"{reuse}.json"
        args = ["--data", str(root), "--plan", str(plan_file), "--device", "cpu", "--epochs", "2", "--hidden", "8"]
        assert train_main([*args, "--metrics-json", str(metrics), *(["--reuse-samples"] if reuse else [])]) == 0
        amp[reuse] = [e.ssd_read_amplification for e in MetricsDoc.read(metrics).epochs]
    assert amp[True][1] == pytest.approx(amp[True][0]) and amp[True][0] == pytest.approx(amp[False][0])
    assert amp[False][1] > 1.5 * amp[False][0]


def test_reuse_needs_a_packed_placement(runs: dict[str, tuple[Path, MetricsDoc]], capsys) -> None:
    args = ["--data", str(runs["unpacked"][0]), "--device", "cpu", "--epochs", "1", "--reuse-samples"]
    assert train_main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a packed placement" in err[0]


def test_another_seed_is_warned_about_and_reads_more_pages(
    runs: dict[str, tuple[Path, MetricsDoc]], plan_file: Path, tmp_path: Path, capsys
) -> None:
    """Training with another --seed than the one packed for samples other batches: the rows
    still read right, more pages move, and rank 0 says why once."""
    root, packed = runs["packed"]
    metrics = tmp_path / "m.json"
    args = ["--data", str(root), "--plan", str(plan_file), "--device", "cpu", "--epochs", "1", "--hidden", "8"]
    assert train_main([*args, "--seed", "1", "--metrics-json", str(metrics)]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "packed for other batches" in line]
    assert len(warned) == 1 and "--seed 1 (packed for 0)" in warned[0]
    other = MetricsDoc.read(metrics).epochs[0].ssd_read_amplification
    assert other > 1.5 * packed.epochs[0].ssd_read_amplification


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, "0.45x"])
def test_two_ranks_read_what_the_replay_of_two_ranks_predicted(
    budget: str | None, plan_file: Path, dataset: Path, tmp_path: Path
) -> None:
    """Packed (ordered, or into chunks within a budget) for two ranks and trained by two gloo
    ranks under torchrun: each rank's batches are the replayed ones (each rank reads its own
    batches' chunks), so the pages moved are the replay's (no warning)."""
    from trainer import launch

    out, metrics = tmp_path / "p2", tmp_path / "m.json"
    place(plan_file, dataset, out, PlaceOptions(pack=True, pack_ranks=2, pack_budget=budget, **OPTS))
    argv = ["--data", str(out), "--plan", str(plan_file), "--device", "cpu", "--epochs", "1", "--hidden", "8"]
    cmd = launch.build_torchrun_command(launch.check_command([*argv, "--metrics-json", str(metrics)]), nproc=2)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "packed for other batches" not in done.stdout + done.stderr
    doc = MetricsDoc.read(metrics)
    assert doc.world_size == 2
    assert doc.epochs[0].ssd_read_amplification == pytest.approx(doc.prediction.ssd_amplification, rel=0.05)
    pack = PlacedManifest.read(out / "placed.json").pack
    assert pack.ranks == 2
    # both ranks' stored samples (and chunk row maps) read: the pages the replay counted, summed
    assert sum(doc.epochs[0].placed_read_bytes.values()) == pack.placed_bytes > 0
    assert doc.epochs[0].disk_read_amplification == pytest.approx(doc.prediction.disk_amplification, rel=0.05)
    if budget is not None:  # both ranks' batches read only their chunks
        predicted, measured = chunk_batches(doc)
        assert predicted == measured == 2 * doc.epochs[0].iterations


def test_the_command_line_packs_and_says_what_it_saves(plan_file: Path, dataset: Path, tmp_path: Path, capsys) -> None:
    """``moment place --pack``: the placement printed says what the replayed batches move packed
    and unpacked (placed.json's figures); a bad --pack-epochs is one usage line."""
    from moment.cli import main

    out = tmp_path / "p"
    args = ["place", "--plan", str(plan_file), "--dataset", str(dataset), "--out", str(out)]
    assert main([*args, "--gpu-cache", "1%", "--cpu-cache", "2%", "--epochs", "1", "--pack", "--pack-ranks", "1"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    pack = PlacedManifest.read(out / "placed.json").pack
    assert pack is not None and pack.ranks == 1
    packed, unpacked = pack.packed_bytes / pack.useful_bytes, pack.unpacked_bytes / pack.useful_bytes
    assert f"are {packed:.2f}× their feature bytes, {unpacked:.2f}× with rows in id order" in printed
    with pytest.raises(SystemExit) as stop:
        main([*args[:-1], str(tmp_path / "q"), "--pack-epochs", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--pack-epochs" in err[0]


# -- per-batch chunks and a shared cache within a disk budget (--pack-budget, placement/chunks.py) --


BATCHES = [np.array([114, 103, 109]), np.array([109, 101]), np.array([103]), np.array([103, 109])]


def test_the_budget_decides_which_rows_are_shared() -> None:
    """By hand: one bin of 16 rows of 1 KiB, ids 100-115. Rows 3 and 9 are read by three
    batches, 14 and 1 by one. Replicating everything takes 3 + 3 + 1 + 1 = 8 rows, each of the
    four chunks padded to a page: 16 KiB (counted at most 8 + 4 × 3 KiB = 20 KiB beforehand);
    sharing 3 and 9 takes two one-row chunks, padded, and 2 rows once: 10 KiB (counted exactly:
    at most one chunk per row). A 20 KiB budget replicates all; 12 KiB shares the rows read by
    more than 2 batches; 9 KiB is refused in one line naming the 10 KiB it needs."""
    full = plan_chunks(lambda: iter(BATCHES), [100], [16], 1024, 20 << 10, "--pack-budget 20KiB")
    assert (full.threshold, full.bytes, full.shared_rows[0].tolist()) == (3, 16 << 10, [])
    assert full.chunk_rows[0].tolist() == [3, 9, 14, 1, 9, 3, 3, 9]
    assert full.chunk_offsets[0].tolist() == [0, 3, 5, 6, 8]
    # each chunk starts on a page: one page per chunk read (back to back, batch 1's 2 rows from
    # byte 3072 would touch two pages, batch 2's and 3's the second page: 5)
    assert chunk_starts(full.chunk_offsets[0], 1024, full.align).tolist() == [0, 4096, 8192, 12288, 16384]
    assert (full.packed_bytes, full.reads) == (4 * 4096, 4)
    plan = plan_chunks(lambda: iter(BATCHES), [100], [16], 1024, 12 << 10, "--pack-budget 12KiB")
    assert (plan.threshold, plan.bytes) == (2, 10 << 10)
    assert sorted(plan.shared_rows[0].tolist()) == [3, 9]
    assert plan.chunk_rows[0].tolist() == [14, 1] and plan.chunk_offsets[0].tolist() == [0, 1, 2, 2, 2]
    # pages: batch 0 its chunk (1) + shared rows 0-1 (1); batch 1 chunk (1) + shared 0 (1);
    # batches 2 and 3 the shared page once each. In id order: 3 + 2 + 1 + 2 pages.
    assert (plan.packed_bytes, plan.unpacked_bytes, plan.reads) == (6 * 4096, 8 * 4096, 6)
    assert (plan.batches, plan.useful_bytes) == (4, 8 << 10)
    with pytest.raises(UsageError, match=r"--pack-budget 9KiB: .* cannot hold even the shared cache") as err:
        plan_chunks(lambda: iter(BATCHES), [100], [16], 1024, 9 << 10, "--pack-budget 9KiB")
    assert "take up to 10,240 bytes" in str(err.value) and "\n" not in str(err.value)


def test_the_padding_counted_beforehand_bounds_the_padding_laid_out() -> None:
    """Random batches over two bins of 1.5 KiB rows (a chunk pads by up to 3.5 KiB): at every
    budget from the least up, the files laid out fit it, and the chunks start on pages."""
    rng = np.random.default_rng(3)
    batches = [np.unique(rng.integers(0, 400, 60)) for _ in range(12)]
    count = np.bincount(np.concatenate(batches), minlength=400).astype(np.int32)
    pairs = sum(int((b < 150).any()) + int((b >= 150).any()) for b in batches)
    least = int(space(count, 1536, pairs)[1])
    for budget in np.linspace(least, 2 * 12 * 60 * 1536, 9).astype(int):
        plan = plan_chunks(lambda: iter(batches), [0, 150], [150, 250], 1536, int(budget), "b")
        assert plan.bytes <= budget
        for offsets, rows in zip(plan.chunk_offsets, plan.chunk_rows):
            starts = chunk_starts(offsets, 1536, plan.align)
            assert (starts % 4096 == 0).all() and starts[-1] >= rows.size * 1536


def test_small_bins_get_the_threshold_their_padding_as_laid_out_allows() -> None:
    """Random batches over two bins of 1.5 KiB rows: a chunk pads by 2.5 KiB or 1 KiB, or none
    (at most 3.5 KiB, as the bound counts it). Budgets from the least the chunks take as laid
    out up to the bound's least were refused before; now each takes the largest threshold whose
    files, counted by brute force chunk by chunk, fit it; the next one's do not; the files laid
    out are that count."""
    rng = np.random.default_rng(3)
    batches = [np.unique(rng.integers(0, 400, 60)) for _ in range(12)]
    count = np.bincount(np.concatenate(batches), minlength=400)
    pairs = sum(int((b < 150).any()) + int((b >= 150).any()) for b in batches)

    def by_hand(t: int) -> int:
        chunks = sum(
            -(-int(((count[b[(b >= lo) & (b < hi)]]) <= t).sum()) * 1536 // 4096) * 4096
            for b in batches
            for lo, hi in ((0, 150), (150, 400))
        )
        return chunks + int((count > t).sum()) * 1536

    bound_least, laid_least = int(space(count, 1536, pairs)[1]), by_hand(1)
    assert laid_least < bound_least
    with pytest.raises(UsageError, match=f"take up to {laid_least:,} bytes"):
        plan_chunks(lambda: iter(batches), [0, 150], [150, 250], 1536, laid_least - 1, "b")
    for budget in np.linspace(laid_least, bound_least + 40 * 1536, 7).astype(int).tolist():
        plan = plan_chunks(lambda: iter(batches), [0, 150], [150, 250], 1536, budget, "b")
        assert plan.bytes == by_hand(plan.threshold) <= budget < by_hand(plan.threshold + 1)


@pytest.mark.parametrize(("seed", "winner"), [(1, "minhash"), (0, "first-reader")])
def test_the_shared_cache_takes_the_order_that_reads_fewer_pages(seed: int, winner: str) -> None:
    """Both shared-cache orders are counted in the one replay and the one moving fewer pages is
    laid out: the plan is the one-order plan of the winner, page for page (20 batches of 60 of
    600 rows of 256 B; which order wins depends on the draws)."""
    rng = np.random.default_rng(seed)
    batches = [np.unique(rng.integers(0, 600, 60)) for _ in range(20)]
    both = plan_chunks(lambda: iter(batches), [0], [600], 256, 250_000, "b")
    alone = {o: plan_chunks(lambda: iter(batches), [0], [600], 256, 250_000, "b", orders=(o,)) for o in SHARED_ORDERS}
    assert both.shared_rows[0].size > 0 and set(both.shared_pages) == set(SHARED_ORDERS)
    for o, one in alone.items():
        assert one.order == o and one.shared_pages[o] == both.shared_pages[o]
    assert both.order == winner and both.packed_bytes == min(p.packed_bytes for p in alone.values())
    assert np.array_equal(both.shared_rows[0], alone[winner].shared_rows[0])


def test_minhash_puts_rows_with_the_same_readers_together() -> None:
    """HashOrder: rows read by the same batches are neighbours in the shared cache whatever
    their ids, the order is the same for the same seed, and another seed draws other hashes."""
    rng = np.random.default_rng(0)
    sets = [rng.choice(40, 10, replace=False) for _ in range(5)]  # 5 reader sets, 40 batches
    owner = rng.integers(0, 5, 200)  # each of 200 rows read by one of the sets
    batches = [np.flatnonzero([i in sets[o] for o in owner]) for i in range(40)]
    rows = SsdRows([0], [200])
    who, _ = readers(iter(batches), rows, hashes=MINHASHES, seed=7)
    order = minhash_order(who, np.arange(200))
    runs = np.flatnonzero(np.diff(owner[order]) != 0).size + 1
    assert runs == 5  # each set's rows in one run
    again, _ = readers(iter(batches), rows, hashes=MINHASHES, seed=7)
    other, _ = readers(iter(batches), rows, hashes=MINHASHES, seed=8)
    assert np.array_equal(minhash_order(again, np.arange(200)), order)
    assert not np.array_equal(other.signature, who.signature)


@pytest.mark.parametrize(
    ("text", "want"), [("20GB", 20 * 10**9), ("512MiB", 512 << 20), ("1.5x", 1500), ("2048", 2048)]
)
def test_budgets_read_as_sizes_or_multiples_of_the_bins(text: str, want: int) -> None:
    assert parse_budget(text, 1000) == want


def test_a_bad_budget_is_one_line() -> None:
    with pytest.raises(UsageError, match="--pack-budget 'lots': expected a size like 4GB, 512MiB, 2e9, 2x"):
        parse_budget("lots", 1000)
    with pytest.raises(UsageError, match=r"--pack-budget '5%' is a share of the vertices: expected .*2x"):
        parse_budget("5%", 1000)


def test_one_pass_scatters_every_row_to_its_copies(tmp_path: Path) -> None:
    """10 rows of 8 B read 3 at a time, copied to two files (one with repeats and rows out of
    order); each file holds the rows its row map names, and its digest is the file's."""
    src = tmp_path / "src.bin"
    rows = np.arange(80, dtype=np.uint8).reshape(10, 8)
    src.write_bytes(rows.tobytes())
    outputs = [
        Gathered("chunks", tmp_path / "c.bin", np.array([0, 4, 9, 1, 2, 4, 9, 9, 5])),
        Gathered("shared", tmp_path / "s.bin", np.array([7, 3, 8])),
    ]
    written = write_gathered(src, 10, 8, outputs, slice_rows=3)
    for w, g in zip(written, outputs):
        assert g.path.read_bytes() == rows[g.rows].tobytes() and w.bytes == g.rows.size * 8
        assert w.digest == file_digest(g.path, PLACED_DIGEST) and w.algorithm == PLACED_DIGEST


def test_chunks_are_written_from_their_pages_on(tmp_path: Path) -> None:
    """Chunks of 3, 0, 2 and 5 rows of 24 B aligned to 64 B: each starts on a multiple of 64,
    zeros between, the rows in place; rows read 4 at a time."""
    src = tmp_path / "src.bin"
    rows = np.arange(1, 241, dtype=np.uint8).reshape(10, 24)
    src.write_bytes(rows.tobytes())
    at, offsets = np.array([1, 2, 3, 0, 9, 4, 5, 6, 7, 8]), np.array([0, 3, 3, 5, 10])
    (w,) = write_gathered(src, 10, 24, [chunk_file("chunks", tmp_path / "c.bin", at, offsets, 24, 64)], slice_rows=4)
    data = np.frombuffer((tmp_path / "c.bin").read_bytes(), dtype=np.uint8)
    assert w.bytes == data.size == 128 + 0 + 64 + 128
    for start, (lo, hi) in zip([0, 128, 128, 192], zip(offsets[:-1], offsets[1:])):
        n = (hi - lo) * 24
        assert data[start : start + n].tobytes() == rows[at[lo:hi]].tobytes()
        assert not data[start + n : -(-(start + n) // 64) * 64].any()


@pytest.fixture(scope="module")
def chunked(plan_file: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MetricsDoc]:
    """The placement of ``runs`` packed within a budget that shares some rows, trained two
    epochs with --reuse-samples (one replayed)."""
    root = tmp_path_factory.mktemp("pack-chunked")
    place(plan_file, dataset, root / "c", PlaceOptions(pack_budget=CHUNK_BUDGET, **OPTS))
    metrics = root / "m.json"
    args = ["--data", str(root / "c"), "--plan", str(plan_file), "--device", "cpu", "--epochs", "2", "--hidden", "8"]
    assert train_main([*args, "--eval-every", "2", "--reuse-samples", "--metrics-json", str(metrics)]) == 0
    return root / "c", MetricsDoc.read(metrics)


# the test graph: every row once 0.33x with its chunks padded (0.40x with the padding counted at its
# most), full copies 0.41x (0.48x); at 0.40x rows read by more than 3 batches are shared
CHUNK_BUDGET = "0.40x"


def test_chunks_hold_each_batch_s_rows_and_share_the_hot_ones(
    chunked: tuple[Path, MetricsDoc], runs: dict[str, tuple[Path, MetricsDoc]], dataset: Path
) -> None:
    """The bins stay whole and in id order; every chunk row and shared row is its bin row; the
    files fit the budget, some rows are shared, and verify reads them back against the source."""
    root = chunked[0]
    m = PlacedManifest.read(root / "placed.json")
    assert m.pack is not None and m.pack.chunks is not None and m.pack.slots == {}
    c = m.pack.chunks
    ssd_bytes = sum(b.bytes for b in m.bins if b.tier == "ssd")
    assert c.bytes <= c.budget == int(0.40 * ssd_bytes) and c.threshold > 1
    placed = open_placed(root)
    src = np.asarray(open_dataset(dataset).features())
    vertex_at = np.argsort(np.asarray(placed.array("old_to_new")))  # the vertex at each row
    shared = 0
    for b in placed.bins:
        if b.tier != "ssd":
            continue
        assert b.slots is None and b.chunks is not None
        for path, at, where in b.copies(placed.row_bytes):
            data = np.fromfile(path, dtype=np.uint8)
            copy = data[where(np.arange(at.size))[:, None] + np.arange(placed.row_bytes)]
            assert copy.tobytes() == src[vertex_at[b.start + np.asarray(at)]].view(np.uint8).tobytes()
        shared += np.load(b.chunks.shared_rows).size
    assert shared > 0
    assert verify(root, sample=placed.num_nodes)["sampled"] > 0


def test_chunks_move_fewer_pages_than_the_ordering_as_predicted(
    chunked: tuple[Path, MetricsDoc], runs: dict[str, tuple[Path, MetricsDoc]]
) -> None:
    """Trained on the replayed batches (epoch 2 reusing epoch 1's), each batch reads its chunk
    and shared pages: the pages per feature byte are the replay's count, the same in both
    epochs, below the ordering's; the rows are the same (the loss is the unpacked run's)."""
    doc = chunked[1]
    first, second = doc.epochs
    ordered = runs["packed"][1].epochs[0].ssd_read_amplification
    assert first.loss == pytest.approx(runs["unpacked"][1].epochs[0].loss, rel=1e-5)
    assert first.bytes_per_ssd == runs["unpacked"][1].epochs[0].bytes_per_ssd
    assert first.ssd_read_amplification == pytest.approx(doc.prediction.ssd_amplification, rel=0.01)
    assert second.ssd_read_amplification == pytest.approx(first.ssd_read_amplification)
    assert first.ssd_read_amplification < 0.8 * ordered
    for e in doc.epochs:  # every batch read its chunks only, as predicted
        c = e.chunks
        assert c is not None and c.replayed and c.batches == c.batches_from_chunks == e.iterations > 0
        assert c.bin_reads == c.missed == 0 and c.chunk_reads >= e.iterations
    assert chunk_batches(doc) == (2 * first.iterations, 2 * first.iterations)


def test_chunk_reads_that_miss_are_counted_and_compared(
    chunked: tuple[Path, MetricsDoc], plan_file: Path, tmp_path: Path, capsys
) -> None:
    """Another --seed draws other batches under the replayed numbers: each misses its chunk and
    reads the bins; an epoch past the replayed one (no --reuse-samples) reads the bins, as
    predicted. metrics.json counts both and the summary sets them beside the prediction."""
    metrics = tmp_path / "m.json"
    args = ["--data", str(chunked[0]), "--plan", str(plan_file), "--device", "cpu", "--epochs", "2", "--hidden", "8"]
    assert train_main([*args, "--seed", "1", "--metrics-json", str(metrics)]) == 0
    doc = MetricsDoc.read(metrics)
    first, second = (e.chunks for e in doc.epochs)
    assert first.replayed and first.batches == doc.epochs[0].iterations and first.batches_from_chunks == 0
    assert first.missed == first.bin_reads > 0 and first.chunk_reads == 0
    assert not second.replayed and second.bin_reads > 0 and second.missed == second.chunk_reads == 0
    assert chunk_batches(doc) == (first.batches, 0)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"0 of {first.batches + second.batches} batches read only their chunks, {first.batches} predicted" in printed


def test_only_the_replayed_batch_reads_its_chunk(chunked: tuple[Path, MetricsDoc], dataset: Path) -> None:
    """A batch asked for under another batch's number still gets its own rows (from the bin):
    the chunk is used only when its rows are the batch's."""
    from placement.pack import replay_samples

    placed = open_placed(chunked[0])
    pack = placed.manifest.pack
    arrays = [placed.array(k) for k in ("indptr", "indices", "train")]
    drawn = replay_samples(*arrays, pack.fanouts, pack.batch_size, pack.seed, 1, 1)
    nodes = [b.nodes.numpy() for b, _ in zip(drawn, range(2))]
    src = np.asarray(open_dataset(dataset).features())
    with TieredFeatureStore(placed, device="cpu", io="posix") as store:
        assert store.chunks.first_batch(0, 0, 1) == 0 and store.chunks.first_batch(1, 0, 1) is None
        for number, ids, right in ((0, nodes[0], True), (0, nodes[1], False), (1, nodes[1], True)):
            store.reset_stats()
            got = store.get(torch.from_numpy(ids), batch=number).numpy()
            assert got.tobytes() == src[ids].tobytes()
            chunks = store.stats()["chunks"]
            assert (chunks["chunk_reads"] > 0, chunks["missed"] > 0) == (right, not right)
            assert (chunks["batches"], chunks["batches_from_chunks"]) == (1, int(right))


def test_a_budget_that_shares_nothing_reads_each_batch_from_its_chunk(
    plan_file: Path, dataset: Path, tmp_path: Path
) -> None:
    """At 1x the budget holds every row in chunks (no shared cache): each replayed batch reads
    its chunks alone, in id order, and gets the source's rows; another batch's rows under its
    number still miss."""
    from placement.pack import replay_samples

    place(plan_file, dataset, tmp_path / "c", PlaceOptions(pack_budget="1x", **OPTS))
    placed = open_placed(tmp_path / "c")
    assert placed.manifest.pack.chunks.threshold >= 1
    assert all(b.chunks is None or np.load(b.chunks.shared_rows).size == 0 for b in placed.bins)
    pack = placed.manifest.pack
    arrays = [placed.array(k) for k in ("indptr", "indices", "train")]
    drawn = replay_samples(*arrays, pack.fanouts, pack.batch_size, pack.seed, 1, 1)
    nodes = [b.nodes.numpy() for b, _ in zip(drawn, range(3))]
    src = np.asarray(open_dataset(dataset).features())
    with TieredFeatureStore(placed, device="cpu", io="posix") as store:
        for number, ids in ((0, nodes[0]), (1, nodes[1]), (2, nodes[2]), (2, nodes[0])):
            store.reset_stats()
            assert store.get(torch.from_numpy(ids), batch=number).numpy().tobytes() == src[ids].tobytes()
            chunks, right = store.stats()["chunks"], ids is nodes[number]
            assert chunks["batches_from_chunks"] == int(right) and chunks["batches"] == 1
            assert chunks["missed"] == chunks["bin_reads"] and (chunks["missed"] > 0) != right
            assert (chunks["chunk_reads"] > 0) == right


def _pages(start: int, size: int) -> int:
    """By hand: the 4 KiB pages a read of ``size`` bytes from byte ``start`` touches, in bytes."""
    return 0 if size == 0 else ((start + size - 1) // 4096 - start // 4096 + 1) * 4096


def _npy_data_at(path: Path) -> int:
    """By hand: where a .npy file's array starts (its version 1 header: magic, version, length)."""
    head = path.read_bytes()[:10]
    assert head[:8] == b"\x93NUMPY\x01\x00"
    return 10 + int.from_bytes(head[8:10], "little")


def _placed_reads_by_hand(placed: Placed) -> dict[str, int]:
    """The pages of the placed directory's files a pass over every replayed batch reads: each
    batch's vertices and edges in the sample files (their ranges from samples_index.npy), and
    each bin's chunk row map slice (from its chunk offsets)."""
    pack = placed.manifest.pack
    samples, hops = pack.samples, pack.samples.hops
    index = np.load(placed.file(samples.index))
    nodes, edges = index[:, hops].tolist(), (index[:, :hops].sum(axis=1) + index[:, hops + 1 :].sum(axis=1)).tolist()
    out = {}
    for key, sizes, item in ((samples.nodes, nodes, np.dtype(samples.node_dtype).itemsize), (samples.edges, edges, 4)):
        at = [0, *np.cumsum(sizes).tolist()]
        out[key] = sum(_pages(at[i] * item, n * item) for i, n in enumerate(sizes))
    for b in placed.bins:
        if b.chunks is None:
            continue
        offsets, item = np.load(b.chunks.chunk_offsets).tolist(), np.load(b.chunks.chunk_rows).dtype.itemsize
        start = _npy_data_at(b.chunks.chunk_rows)
        out[b.chunks.chunk_rows.stem] = sum(
            _pages(start + lo * item, (hi - lo) * item) for lo, hi in zip(offsets, offsets[1:])
        )
    return out


def test_every_byte_a_batch_reads_from_disk_is_counted_and_predicted(
    plan_file: Path, dataset: Path, tmp_path: Path
) -> None:
    """At 1x (no shared cache) an epoch of the replayed batches reads each chunk once, from its
    page: the SSD bytes are the chunk files' sizes. Besides, each batch reads its stored sample
    and its slice of each chunk row map: the pages counted per file are those by hand, in both
    epochs (the second reusing the first's batches). The prediction charges the same bytes:
    measured equals predicted, SSD pages and every byte read from disk."""
    place(plan_file, dataset, tmp_path / "c", PlaceOptions(pack_budget="1x", **OPTS))
    placed = open_placed(tmp_path / "c")
    assert all(np.load(b.chunks.shared_rows).size == 0 for b in placed.bins if b.chunks is not None)
    metrics = tmp_path / "m.json"
    args = ["--data", str(tmp_path / "c"), "--plan", str(plan_file), "--device", "cpu", "--epochs", "2"]
    assert (
        train_main([*args, "--hidden", "8", "--eval-every", "2", "--reuse-samples", "--metrics-json", str(metrics)])
        == 0
    )
    doc = MetricsDoc.read(metrics)
    chunk_files = {b.name: b.chunks.chunks.stat().st_size for b in placed.bins if b.chunks is not None}
    by_hand = _placed_reads_by_hand(placed)
    assert set(by_hand) == {"samples_nodes", "samples_edges", *(f"chunkrows_{n}" for n in chunk_files)}
    assert all(n > 0 for n in by_hand.values())
    useful = doc.epochs[0].bytes_per_ssd
    for e in doc.epochs:
        assert e.bytes_per_ssd == useful
        assert e.read_bytes_per_ssd == chunk_files
        assert e.placed_read_bytes == by_hand
        disk = (sum(chunk_files.values()) + sum(by_hand.values())) / sum(useful.values())
        assert e.disk_read_amplification == pytest.approx(disk, rel=1e-12)
    pack, pred = placed.manifest.pack, doc.prediction
    assert pack.placed_bytes == sum(by_hand.values()) and pack.packed_bytes == sum(chunk_files.values())
    assert pred.ssd_amplification == pytest.approx(doc.epochs[0].ssd_read_amplification, rel=1e-12)
    assert pred.disk_amplification == pytest.approx(doc.epochs[0].disk_read_amplification, rel=1e-12)
    assert pred.disk_amplification > pred.ssd_amplification


def test_a_placement_with_chunks_back_to_back_still_reads_right(
    chunked: tuple[Path, MetricsDoc], dataset: Path, tmp_path: Path
) -> None:
    """A placement made before chunks started on pages (no ``align`` in placed.json: chunks back
    to back; nor the placed directory's pages counted) verifies and serves a replayed batch from
    its chunk with the source's rows."""
    from placement.pack import replay_samples

    old = tmp_path / "old"
    shutil.copytree(chunked[0], old)
    raw = json.loads((old / "placed.json").read_text())
    c = raw["pack"]["chunks"]
    assert c.pop("align") == 4096
    assert raw["pack"].pop("placed_bytes") > 0 and raw["prediction"].pop("disk_amplification") > 1
    placed = open_placed(old)
    for b in placed.bins:
        if b.chunks is None:
            continue
        path, at, where = b.copies(placed.row_bytes)[0]
        data = np.fromfile(path, dtype=np.uint8)
        path.write_bytes(data[where(np.arange(at.size))[:, None] + np.arange(placed.row_bytes)].tobytes())
        entry = c["bins"][b.name]["chunks"]
        c["bytes"] += path.stat().st_size - entry["bytes"]
        entry.update(bytes=path.stat().st_size, digest=file_digest(path, entry["digest_algorithm"]))
    (old / "placed.json").write_text(json.dumps(raw))
    placed = open_placed(old)
    assert verify(old, sample=placed.num_nodes)["sampled"] > 0
    assert placed.manifest.pack.disk_amplification is None and placed.manifest.prediction.disk_amplification is None
    pack = placed.manifest.pack
    arrays = [placed.array(k) for k in ("indptr", "indices", "train")]
    nodes = next(replay_samples(*arrays, pack.fanouts, pack.batch_size, pack.seed, 1, 1)).nodes.numpy()
    src = np.asarray(open_dataset(dataset).features())
    with TieredFeatureStore(placed, device="cpu", io="posix") as store:
        got = store.get(torch.from_numpy(nodes), batch=0).numpy()
        assert store.stats()["chunks"]["chunk_reads"] > 0
    assert got.tobytes() == src[nodes].tobytes()


@pytest.mark.parametrize("kind", ["chunks", "shared"])
def test_a_flipped_byte_in_a_chunk_or_the_shared_cache_is_caught(
    kind: str, plan_file: Path, dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "c"
    place(plan_file, dataset, out, PlaceOptions(pack_budget=CHUNK_BUDGET, **OPTS))
    path = getattr(next(b.chunks for b in open_placed(out).bins if b.chunks is not None), kind)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(PlacedError, match=rf"{path.name}: checksum mismatch"):
        verify(out, sample=0)


@pytest.mark.parametrize("point", ["place:bins-written", "place:pack-planned", "place:packed", "place:bins-renamed"])
def test_chunking_killed_resumes(point: str, plan_file: Path, dataset: Path, tmp_path: Path) -> None:
    """Killed before, during or after packing the chunks, or mid-commit, the re-run finishes a
    placement that verifies; the SSD directory holds the bin, its chunks and shared cache only."""
    _, ssd, placed = _killed_and_rerun(point, plan_file, dataset, tmp_path, {**OPTS, "pack_budget": CHUNK_BUDGET})
    nvme0 = next(b for b in placed.bins if b.name == "nvme0")
    assert nvme0.chunks is not None
    assert sorted(p.name for p in ssd.iterdir()) == sorted(
        p.name for p in (nvme0.path, nvme0.chunks.chunks, nvme0.chunks.shared)
    )


def test_the_command_line_refuses_a_budget_too_small_in_one_line(
    plan_file: Path, dataset: Path, tmp_path: Path, capsys
) -> None:
    from moment.cli import main

    args = ["place", "--plan", str(plan_file), "--dataset", str(dataset), "--gpu-cache", "1%", "--cpu-cache", "2%"]
    assert main([*args, "--epochs", "1", "--out", str(tmp_path / "a"), "--pack-budget", "1KiB"]) != 0
    err = capsys.readouterr().err  # progress lines, then the refusal (found after the replay)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "--pack-budget 1KiB" in last and "cannot hold even the shared cache" in last
    assert main([*args, "--epochs", "1", "--out", str(tmp_path / "b"), "--pack-budget", "some"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pack-budget 'some'" in err[0]
    assert main([*args, "--epochs", "1", "--out", str(tmp_path / "c"), "--pack-budget", CHUNK_BUDGET]) == 0
    c = PlacedManifest.read(tmp_path / "c" / "placed.json").pack.chunks
    printed = " ".join(capsys.readouterr().out.split())
    assert f"{c.bytes / 1e9:.3f} GB of the {c.budget / 1e9:.3f} GB --pack-budget" in printed
    assert f"more than {c.threshold} replayed batches, in {c.order} order" in printed
