"""Sampling with the CSR in registered host memory ("uva", zero-copy reads from the GPU), and the
choice between gpu, uva and cpu (``--sampling``; GPU review #16). CUDA is faked strictly
(tests/uva_fake.py): the "device" tensors are CPU views of the registered memory, so the
sampler runs on the CPU over exactly the bytes a GPU would read."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import uva_fake
from placement.sampler import CSR_GPU_SHARE, NeighborSampler
from trainer import memory, sampling, uva
from trainer.config import TrainConfig, from_args
from trainer.sampling import Choice
from trainer.shm import MEMORY_FILE_SYSTEMS, file_system, not_in_memory

GiB = 2**30
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def csr(n: int = 400, seed: int = 3, index_type: type = np.int32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, 30, size=n)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    return indptr, rng.integers(0, n, size=int(indptr[-1])).astype(index_type)


# -- the registered mapping -------------------------------------------------------------------


def test_a_mapping_is_registered_once_viewed_in_place_and_unregistered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = uva_fake.install(monkeypatch)
    m = uva.HostMapping(10_000, CPU)
    assert m.ptr % 4096 == 0  # page-aligned
    m.host(0, 1250, np.int64)[:] = np.arange(1250)
    m.register()
    m.register()  # a second call registers nothing more
    assert fake.calls == [("register", m.ptr, 10_000, uva.PORTABLE | uva.MAPPED)]
    view = m.view(8, 10, np.int64)
    assert view.tolist() == list(range(1, 11))
    m.host(0, 1250, np.int64)[5] = -7  # the view reads the host memory itself, not a copy
    assert int(view[4]) == -7
    with pytest.raises(ValueError):
        m.view(9_999, 10, np.int64)
    del view
    m.close()
    m.close()
    assert fake.calls[1:] == [("unregister", m.ptr)] and fake.live == {}
    # Both CUDA calls ran in a thread of their own (a failure stays that thread's last error).
    assert all(name == "moment-cuda-register" for name in fake.threads)
    assert threading.current_thread().name not in fake.threads


def test_a_sandbox_refusal_names_the_os_error_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """gVisor-like runtimes answer cudaHostRegister with cudaErrorOperatingSystem (304)."""
    fake = uva_fake.install(monkeypatch)
    monkeypatch.setattr(fake, "cudaHostRegister", lambda ptr, size, flags: uva_fake.CudaError(304))
    m = uva.HostMapping(4096, CPU)
    with pytest.raises(uva.UvaError) as err:
        m.register()
    assert "cudaErrorOperatingSystem (304): an OS call failed" in str(err.value)
    m.close()


def test_the_fake_refuses_what_cuda_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = uva_fake.install(monkeypatch)
    m = uva.HostMapping(8192, CPU)
    m.register()
    assert int(fake.cudaHostRegister(m.ptr + 4096, 4096, 3)) == 712  # overlaps a registration
    assert int(fake.cudaHostUnregister(m.ptr + 4096)) == 713  # does not start one
    with pytest.raises(AssertionError, match="not registered"):
        uva_fake.from_cuda_array(fake, uva.CudaArray(m.ptr + 8192, 1, np.dtype(np.int64), m), CPU)
    m.close()
    with pytest.raises(AssertionError, match="not registered"):  # gone once unregistered
        uva_fake.from_cuda_array(fake, uva.CudaArray(m.ptr, 1, np.dtype(np.int64), m), CPU)


def test_a_failed_registration_is_one_line_naming_the_cuda_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = uva_fake.install(monkeypatch, limit=4096)
    m = uva.HostMapping(3 * GiB // 1024, CPU)
    with pytest.raises(uva.UvaError) as err:
        m.register()
    line = str(err.value)
    assert "\n" not in line and "cudaHostRegister" in line and "cudaErrorMemoryAllocation (2)" in line
    m.close()
    assert [c[0] for c in fake.calls] == ["register"]  # nothing to unregister

    def no_bindings() -> None:
        raise RuntimeError("torch was built without CUDA\nmore")

    monkeypatch.setattr(uva, "cudart", no_bindings)  # a torch without cudart: the same one line
    with pytest.raises(uva.UvaError, match="^cudaHostRegister for cpu: torch was built without CUDA$"):
        uva.HostMapping(4096, CPU).register()


# -- the choice -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "device", "gpu_free", "host_free", "where", "noted"),
    [
        ("auto", CUDA, 100 * GiB, 100 * GiB, "gpu", False),  # fits a quarter of free GPU memory
        ("auto", CUDA, 10 * GiB, 100 * GiB, "uva", False),  # does not; the host has room
        ("auto", CUDA, 10 * GiB, 6 * GiB, "cpu", True),  # neither has room
        ("auto", CUDA, 10 * GiB, None, "uva", False),  # host memory unknown: try
        ("gpu", CUDA, 1 * GiB, 100 * GiB, "gpu", False),  # asked for: as asked
        ("uva", CUDA, 100 * GiB, 1 * GiB, "uva", False),
        ("cpu", CUDA, 100 * GiB, 100 * GiB, "cpu", False),
        ("auto", CPU, None, 100 * GiB, "cpu", False),  # a CPU device samples on the CPU
        ("uva", CPU, None, 100 * GiB, "cpu", True),
        ("gpu", CPU, None, 100 * GiB, "cpu", True),
    ],
)
def test_where_sampling_goes(
    mode: str, device: torch.device, gpu_free: int | None, host_free: int | None, where: str, noted: bool
) -> None:
    choice = sampling.choose(mode, device, 4 * GiB, gpu_free, host_free)
    assert choice.where == where and bool(choice.note) == noted, choice
    assert CSR_GPU_SHARE * 100 * GiB >= 4 * GiB > CSR_GPU_SHARE * 10 * GiB  # what the table assumes


def test_ranks_agree_on_the_lowest_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sampling.agree(Choice("gpu")) == Choice("gpu")  # alone
    monkeypatch.setattr(sampling, "all_gather", lambda mine: [("gpu", None), mine, ("uva", None)])
    got = sampling.agree(Choice("gpu"))
    assert got.where == "uva" and "another rank" in (got.note or "")
    monkeypatch.setattr(sampling, "all_gather", lambda mine: [mine, ("cpu", "no room")])
    assert sampling.agree(Choice("uva")) == Choice("cpu", "no room")


def test_sampling_is_a_trainer_option() -> None:
    assert TrainConfig(data="d").sampling == "auto"
    assert from_args(["--data", "d", "--sampling", "uva"]).sampling == "uva"
    assert TrainConfig(data="d").host_gather == "auto"
    assert from_args(["--data", "d", "--host-gather", "stage"]).host_gather == "stage"
    with pytest.raises(SystemExit) as exc:
        from_args(["--data", "d", "--sampling", "zero-copy"])
    assert exc.value.code == 2


# -- sampling through it ----------------------------------------------------------------------


@pytest.mark.parametrize("index_type", [np.int32, np.int64])
def test_uva_sampling_gives_the_batches_cpu_sampling_gives(monkeypatch: pytest.MonkeyPatch, index_type: type) -> None:
    fake = uva_fake.install(monkeypatch)
    indptr, indices = csr(index_type=index_type)
    got = sampling.open_csr(indptr, indices, Choice("uva"), CPU)
    assert got.where == "uva" and got.mapping is not None
    assert got.indptr.data_ptr() == got.mapping.ptr  # zero-copy: a view of the registered memory
    assert got.indices.dtype == torch.from_numpy(indices).dtype
    mapped = NeighborSampler(got.indptr, got.indices, (5, 3), device=CPU, seed=11, csr_on_device=True)
    plain = NeighborSampler(indptr, indices, (5, 3), device=CPU, seed=11, csr_on_device=False)
    assert mapped.indptr.data_ptr() == got.mapping.ptr  # the sampler did not copy it either
    for seeds in ([1, 5, 9, 200], [3, 399, 0], list(range(0, 400, 7))):
        a, b = mapped.sample(torch.tensor(seeds)), plain.sample(torch.tensor(seeds))
        assert torch.equal(a.nodes, b.nodes)
        assert all(torch.equal(x.edge_index, y.edge_index) for x, y in zip(a.blocks, b.blocks, strict=True))
    del mapped
    got.close()
    got.close()
    assert [c[0] for c in fake.calls] == ["register", "unregister"] and fake.live == {}


def test_a_failed_registration_falls_back_to_cpu_sampling_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = uva_fake.install(monkeypatch, limit=1024)
    indptr, indices = csr()
    got = sampling.open_csr(indptr, indices, Choice("uva"), CPU)
    assert got.where == "cpu" and got.mapping is None and got.indptr is indptr
    assert "cudaErrorMemoryAllocation" in (got.note or "") and (got.note or "").endswith("sampling on the CPU")
    assert fake.live == {} and [c[0] for c in fake.calls] == ["register"]


def test_the_socket_shares_one_file_each_rank_registers_its_mapping(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = uva_fake.install(monkeypatch)
    indptr, indices = csr()
    path = tmp_path / "moment-csr-x"
    first = sampling.map_csr(indptr, indices, CPU, path)  # the socket's writer: writes, then maps
    assert path.stat().st_size == sampling.csr_bytes(indptr, indices) == len(indptr) * 8 + len(indices) * 4
    mtime = path.stat().st_mtime_ns
    second = sampling.map_csr(indptr, indices, CPU, path)  # another rank: maps the same file
    assert path.stat().st_mtime_ns == mtime
    first.register()
    second.register()
    a = first.view(len(indptr) * 8, len(indices), np.int32)
    b = second.view(len(indptr) * 8, len(indices), np.int32)
    assert np.array_equal(a.numpy(), indices) and np.array_equal(b.numpy(), indices)
    first.host(0, 1, np.int64)[0] = 42  # one copy: a write through one mapping shows in the other
    assert int(second.view(0, 1, np.int64)[0]) == 42
    del a, b
    first.close()
    second.close()
    assert fake.live == {}
    path.write_bytes(b"short")
    with pytest.raises(Exception, match="another run"):
        sampling.map_csr(indptr, indices, CPU, path)


def test_the_loop_trains_the_same_through_uva_as_through_the_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, plan_file: Path
) -> None:
    """A whole CPU run with the CSR in (fake-)registered memory: the metrics say uva, the model
    ends bit for bit where CPU sampling ends, and the registration is released once."""
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize
    from trainer import loop

    synthesize(tmp_path / "ds", nodes=600, avg_degree=5, dim=8, dtype="float32", seed=1, classes=3,
               train_fraction=0.3, val_fraction=0.1, test_fraction=0.1)  # fmt: skip
    place(plan_file, tmp_path / "ds", tmp_path / "placed", PlaceOptions(gpu_cache="5%", cpu_cache="5%"))
    args = ["--data", str(tmp_path / "placed"), "--device", "cpu", "--fanouts", "3,3", "--batch-size", "32",
            "--hidden", "8", "--epochs", "1", "--max-batches-per-epoch", "3", "--eval-every", "1"]  # fmt: skip
    assert loop.main([*args, "--metrics-json", str(tmp_path / "cpu.json")]) == 0
    fake = uva_fake.install(monkeypatch)
    monkeypatch.setattr(sampling, "choose", lambda *a: Choice("uva"))  # as on a GPU whose memory is full
    assert loop.main([*args, "--metrics-json", str(tmp_path / "uva.json")]) == 0
    cpu, mapped = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("cpu", "uva"))
    assert cpu["sampling"]["where"] == "cpu"
    assert mapped["sampling"] == {"where": "uva", "threads": None, "note": None, "stored_batches": None}
    assert mapped["rank_param_digests"] == cpu["rank_param_digests"]
    assert [c[0] for c in fake.calls] == ["register", "unregister"] and fake.live == {}


# -- the memory budget ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def placed(plan_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from placement.place import PlaceOptions, place
    from placement.synth import synthesize

    root = tmp_path_factory.mktemp("uva")
    synthesize(root / "ds", nodes=2000, avg_degree=6, dim=16, dtype="float32", seed=2, classes=3,
               train_fraction=0.1, val_fraction=0.05, test_fraction=0.05)  # fmt: skip
    place(plan_file, root / "ds", root / "placed", PlaceOptions(gpu_cache="10%", cpu_cache="10%"))
    return root / "placed"


def test_the_budget_counts_the_graph_where_sampling_puts_it(placed: Path) -> None:
    from placement.placed import open_placed

    p = open_placed(placed)
    nbytes = len(p.array("indptr")) * 8 + len(p.array("indices")) * p.array("indices").dtype.itemsize
    shape = memory.shape_of_placed(p, TrainConfig(data=str(placed), device="cuda", sampling="uva"), 4, 2)
    b = memory.budget(shape)
    assert shape.csr_bytes == nbytes and b.host["pinned_csr"] == 2 * nbytes and "csr" not in b.gpu
    assert b.to_dict()["sampling"] == "uva"
    private = memory.shape_of_placed(p, TrainConfig(data=str(placed), device="cuda", sampling="uva", shm_dir=""), 4, 2)
    assert memory.budget(private).host["pinned_csr"] == 4 * nbytes  # no shared copy: one per rank
    on_gpu = memory.budget(
        memory.shape_of_placed(p, TrainConfig(data=str(placed), device="cuda", sampling="gpu"), 4, 2)
    )
    assert on_gpu.gpu["csr"] == nbytes and "pinned_csr" not in on_gpu.host
    assert on_gpu.gpu_bytes_per_rank == b.gpu_bytes_per_rank + nbytes
    cpu = memory.budget(memory.shape_of_placed(p, TrainConfig(data=str(placed), device="cpu", sampling="uva"), 4, 2))
    assert "pinned_csr" not in cpu.host and cpu.to_dict()["sampling"] == "cpu"
    # auto: the GPU when the graph takes at most a quarter of what is left there, else uva
    auto = TrainConfig(data=str(placed), device="cuda")
    roomy = memory.shape_of_placed(p, auto, 4, 2, gpu_free=80 * GiB)
    full = memory.shape_of_placed(p, auto, 4, 2, gpu_free=memory.CUDA_CONTEXT + 16 * memory.model_parameters(roomy))
    assert (roomy.sampling, full.sampling) == ("gpu", "uva")


def test_dry_run_json_reports_the_pinned_graph(
    placed: Path, plan_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from moment.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    smi = tmp_path / "nvidia-smi"  # 80 GiB free per GPU
    smi.write_text("#!/bin/sh\necho 81920\necho 81920\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    argv = ["train", "--plan", str(plan_file), "--data", str(placed), "--nproc", "2", "--dry-run", "--json"]
    assert main([*argv, "--", "--sampling", "uva"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["sampling"] == "uva" and mem["host"]["pinned_csr"] > 0
    assert mem["host_bytes_per_node"] == sum(mem["host"].values())
    assert main(argv) == 0  # auto: this small graph fits the GPU
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["sampling"] == "gpu" and mem["gpu"]["csr"] > 0 and "pinned_csr" not in mem["host"]


# -- on a real GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_uva_sampling_on_a_gpu_matches_gpu_resident_sampling() -> None:
    """Really registered host memory: the sampler's kernels read it zero-copy and draw exactly
    the batches they draw from the same CSR in GPU memory."""
    device = torch.device("cuda", torch.cuda.current_device())
    indptr, indices = csr(n=5000)
    got = sampling.open_csr(indptr, indices, Choice("uva"), device)
    assert got.where == "uva", got.note
    assert got.indptr.is_cuda and got.indptr.device == device and got.indptr.data_ptr() == got.mapping.ptr
    mapped = NeighborSampler(got.indptr, got.indices, (10, 5), device=device, seed=4, csr_on_device=True)
    resident = NeighborSampler(indptr, indices, (10, 5), device=device, seed=4, csr_on_device=True)
    assert mapped.indptr.data_ptr() == got.mapping.ptr and resident.indptr.data_ptr() != got.mapping.ptr
    for seeds in ([1, 5, 9, 200], list(range(0, 5000, 13))):
        a = mapped.sample(torch.tensor(seeds, device=device))
        b = resident.sample(torch.tensor(seeds, device=device))
        assert torch.equal(a.nodes, b.nodes)
        assert all(torch.equal(x.edge_index, y.edge_index) for x, y in zip(a.blocks, b.blocks, strict=True))
    del mapped, a, b
    torch.cuda.synchronize(device)
    got.close()
    torch.zeros(1, device=device).add_(1)  # no CUDA error left behind
    torch.cuda.synchronize(device)


# -- the CPU tier gathered on the device (GPU review #17) ----------------------------------------


@pytest.mark.parametrize("shared", [False, True])
def test_cpu_tier_rows_gathered_from_the_registered_tier_match_the_staged_path(
    placed: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shared: bool
) -> None:
    from placement.placed import open_placed
    from trainer.featurestore import TieredFeatureStore

    p = open_placed(placed)
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, p.num_nodes, size=3000))
    with TieredFeatureStore(p, device="cpu", uva=False) as plain:
        want = plain.get(ids)
        staged = plain.stats()["tiers"]["cpu"]["rows"]
    fake = uva_fake.install(monkeypatch)
    shm = tmp_path / "moment-host-x" if shared else None
    store = TieredFeatureStore(p, device="cpu", uva=True, host_shm=shm)
    assert store.host_gather == "uva" and store.host_gather_note is None
    nbytes = store.cpu.numel() * store.cpu.element_size()
    assert fake.calls == [("register", store.cpu.data_ptr(), nbytes, uva.PORTABLE | uva.MAPPED)]
    got = store.get(ids)
    assert torch.equal(got, want)
    assert staged > 0 and store.stats()["tiers"]["cpu"]["rows"] == staged  # the CPU tier did serve rows
    store.cpu.view(torch.uint8)[0].fill_(0)  # the device reads the tier itself: a change shows at once
    first_cpu_row = next(b.start for b in p.bins if b.tier == "cpu")
    first_cpu_id = int(np.flatnonzero(np.asarray(p.array("old_to_new")) == first_cpu_row)[0])  # its vertex
    assert int(store.get(torch.tensor([first_cpu_id])).view(torch.uint8)[0, 0]) == 0
    store.close()
    store.close()
    assert [c[0] for c in fake.calls] == ["register", "unregister"] and fake.live == {}


def test_a_cpu_tier_that_cannot_be_registered_is_staged_and_says_why(
    placed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from placement.placed import open_placed
    from trainer.featurestore import TieredFeatureStore

    p = open_placed(placed)
    ids = torch.arange(p.num_nodes)
    with TieredFeatureStore(p, device="cpu", uva=False) as plain:
        want = plain.get(ids)
    fake = uva_fake.install(monkeypatch, limit=4096)
    with TieredFeatureStore(p, device="cpu", uva=True) as store:
        assert store.host_gather == "stage" and "cudaErrorMemoryAllocation" in (store.host_gather_note or "")
        assert torch.equal(store.get(ids), want)
    assert fake.live == {} and [c[0] for c in fake.calls] == ["register"]
    with TieredFeatureStore(p, device="cpu") as default:  # not asked for, not on CUDA: not tried
        assert default.host_gather == "stage" and default.host_gather_note is None
    assert [c[0] for c in fake.calls] == ["register"]


MOUNTS = """proc /proc proc rw,relatime 0 0
devtmpfs /dev devtmpfs rw,relatime,size=12334460k,mode=755 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24684084k 0 0
/dev/vda / ext4 rw,relatime,discard 0 0
/dev/nvme0n1 /mnt/my\\040data xfs rw,noatime 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24684084k 0 0
"""  # a capture of /proc/self/mounts (a mount point with a space, as the kernel escapes it)


def test_the_file_system_of_a_path_is_its_longest_mount_point() -> None:
    assert file_system("/dev/shm/moment-host-1", MOUNTS) == "tmpfs"
    assert file_system("/dev/shm", MOUNTS) == "tmpfs"
    assert file_system("/dev/shmx", MOUNTS) == "devtmpfs"  # a prefix of the name is not the mount
    assert file_system("/mnt/my data/cache", MOUNTS) == "xfs"
    assert file_system("/var/tmp", MOUNTS) == "ext4"
    assert file_system("/x", "") is None


def test_a_shared_cpu_tier_on_disk_that_cannot_be_registered_says_to_use_a_memory_file_system(
    placed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux (since 6.x) refuses to pin the pages of a file on disk for a device, as the first GPU
    run saw (cudaErrorInvalidValue for a --shm-dir under /tmp): the note says where to put it."""
    from placement.placed import open_placed
    from trainer.featurestore import TieredFeatureStore

    uva_fake.install(monkeypatch, limit=4096)
    with TieredFeatureStore(open_placed(placed), device="cpu", uva=True, host_shm=tmp_path / "moment-host-x") as store:
        assert store.host_gather == "stage"
        on_disk = file_system(tmp_path) not in MEMORY_FILE_SYSTEMS
        assert ("not a memory file system" in (store.host_gather_note or "")) == on_disk
        assert ("use a tmpfs such as /dev/shm" in (store.host_gather_note or "")) == on_disk


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_cpu_tier_rows_gathered_on_a_gpu_from_registered_memory_match_the_staged_path(
    placed: Path, tmp_path: Path, shared: bool
) -> None:
    from placement.placed import open_placed
    from trainer.featurestore import TieredFeatureStore

    p = open_placed(placed)
    ids = torch.from_numpy(np.random.default_rng(6).integers(0, p.num_nodes, size=5000)).cuda()
    with TieredFeatureStore(p, device="cuda", uva=False) as staged:
        want = staged.get(ids)
    # Shared as --shm-dir shares it: in a memory file system (a GPU cannot pin file pages on disk).
    if shared and not_in_memory("/dev/shm") is not None or shared and not Path("/dev/shm").is_dir():
        pytest.skip("/dev/shm is not a memory file system here")
    shm = Path("/dev/shm") / f"moment-host-test-{os.getpid()}-{tmp_path.name}" if shared else None
    try:
        with TieredFeatureStore(p, device="cuda", host_shm=shm) as store:  # uva by default on CUDA
            assert store.host_gather == "uva", store.host_gather_note
            got = store.get(ids)
            torch.cuda.synchronize()
            assert got.is_cuda and torch.equal(got, want) and store.stats()["tiers"]["cpu"]["rows"] > 0
    finally:
        if shm is not None:
            shm.unlink(missing_ok=True)
    torch.zeros(1, device="cuda").add_(1)  # no CUDA error left behind
    torch.cuda.synchronize()
