"""Readers of feature rows from SSD bin files, for the tiered feature store.

A read is a batch of requests, each "these rows of this file into this buffer": ``rows`` are row
numbers within the bin file, sorted ascending and unique, and the buffer holds ``len(rows)``
rows back to back. Runs of consecutive rows become one read, and the requests of all bins are in
flight together, so every SSD has work queued at once (the plan counts on the SSDs reading in
parallel).

* :class:`~trainer.file_reader.FileReader` reads into host memory from a thread pool
  (:mod:`trainer.file_reader`; its io_uring, pread and Python engines).
* :class:`KvikioReader` reads straight into GPU memory with kvikio (GPUDirect Storage when the
  system has it, kvikio's POSIX compat mode otherwise). kvikio is imported only when one is made,
  and configured explicitly (:func:`configure_kvikio`), because its defaults changed under us:
  since 25.04 a read of ``gds_threshold`` = 16 KiB or more (not 1 MiB) goes to kvikio's own
  thread pool, which has ``num_threads`` = 1 thread unless told otherwise, and compat-mode reads
  go through the page cache unless ``auto_direct_io_read`` (kvikio ≥ 25.12) is on. The reader
  sets ``num_threads`` to its own thread count, ``gds_threshold`` to :data:`GDS_THRESHOLD` and
  ``auto_direct_io_read`` on; ``config`` records what kvikio then reports. Its reads are planned
  as the file reader's and issued from a thread pool too: a read below the threshold runs in the
  calling thread when its future is waited for (``IOFuture.get`` releases the GIL). Each run is
  passed as a raw device pointer (:class:`DeviceSpan`), not a tensor slice: a slice plus torch's
  ``__cuda_array_interface__`` cost ~5 µs of GIL per run.

:class:`Reader` (:mod:`trainer.read_base`, with the request planning both readers share) is what
the feature store needs of a reader; :data:`READERS` names each reader
(``--io``'s choices and help come from it), and :func:`make_reader` picks one: a name forces that
reader; ``io="auto"`` takes, on a CUDA device, whichever reader that can run here a short probe of
the caller's files (:func:`probe_io`) measured fastest — what is installed does not decide it —
and the file reader otherwise. Adding a reader (SPDK, say) is a class with the
:class:`Reader` interface and one :data:`READERS` entry.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.file_reader import ENGINE_ENV, READ_ENGINES, FileReader, engine_refusal, pick_engine
from trainer.read_base import (
    DIRECT_ALIGN,
    MAX_RUN_BYTES,
    FileRef,
    Reader,
    ReadError,
    ReadRequest,
    ReadTask,
    _finish_times,
    _Reader,
    _row_bytes,
    coalesce,
    plan_runs,
)

# Re-exported: the readers' one entry point for the feature store, benches and tests.
__all__ = [
    "ENGINE_ENV",
    "GDS_THRESHOLD",
    "MAX_RUN_BYTES",
    "READERS",
    "READ_ENGINES",
    "FileReader",
    "FileRef",
    "KvikioReader",
    "ReadError",
    "ReadRequest",
    "Reader",
    "ReaderKind",
    "choose_reader",
    "coalesce",
    "configure_kvikio",
    "engine_refusal",
    "import_kvikio",
    "io_help",
    "io_refusal",
    "kvikio_mode",
    "make_reader",
    "pick_engine",
    "probe_io",
]


# kvikio's GDS threshold since 25.04 (it was 1 MiB before): reads of this many bytes or more go
# through cuFile (GPUDirect Storage) and kvikio's pool; smaller ones through its POSIX path.
GDS_THRESHOLD = 16 << 10
# ``routes`` key of reads at or above the threshold of files kvikio opened under its AUTO compat
# mode with cuFile available: cuFile, unless registering that file failed and kvikio fell back
# to POSIX. kvikio decides that per file at open, and its Python API (26.x) does not say which:
# ``CuFile`` binds no ``get_compat_mode_manager``.
UNREPORTED = "gds_or_posix"


class DeviceSpan:
    """``size`` bytes at device address ``ptr``, as kvikio's ``pread`` takes a buffer (anything
    with a ``__cuda_array_interface__``): built from an integer, so a run costs no tensor slice
    and no call of torch's interface property, which rebuilds its dict every time."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (size,), "typestr": "|u1", "version": 3}


def configure_kvikio(kvikio: Any, threads: int) -> dict[str, Any]:
    """Set kvikio's pool to ``threads`` threads, its GDS threshold to :data:`GDS_THRESHOLD` and
    direct (O_DIRECT) compat-mode reads on, where the installed version has the setting; return
    what kvikio reports afterwards (``auto_direct_io_read`` False where it has no such setting:
    compat-mode reads then go through the page cache)."""
    defaults = kvikio.defaults
    wanted = {"num_threads": threads, "gds_threshold": GDS_THRESHOLD, "auto_direct_io_read": True}
    if hasattr(defaults, "set"):  # kvikio ≥ 25.04: set(key, value) / get(key)
        for key, value in wanted.items():
            with contextlib.suppress(KeyError):  # a setting this version does not have
                defaults.set(key, value)
        got = {key: _kvikio_get(defaults, key) for key in wanted}
    else:  # older: <name>_reset(value) and a getter per setting
        defaults.num_threads_reset(threads)
        defaults.gds_threshold_reset(GDS_THRESHOLD)
        getter = getattr(defaults, "get_num_threads", None) or defaults.num_threads
        got = {"num_threads": getter(), "gds_threshold": defaults.gds_threshold(), "auto_direct_io_read": None}
    got["auto_direct_io_read"] = bool(got["auto_direct_io_read"])
    return got


def _kvikio_get(defaults: Any, key: str) -> Any:
    try:
        return defaults.get(key)
    except KeyError:
        return None


class KvikioReader(_Reader):
    """Reads rows straight into GPU memory with kvikio (GPUDirect Storage, or its compat mode).

    ``out`` buffers are contiguous CUDA tensors. Runs of rows are planned as in
    :class:`FileReader` and each thread of a pool issues its runs' ``CuFile.pread`` and waits for
    them (see the module's docstring for why not kvikio's own pool alone). ``module`` replaces
    the kvikio module (tests); ``device_type`` is the kind of tensor ``out`` must be. ``config``
    is kvikio's configuration as set (:func:`configure_kvikio`). ``modes`` maps each file to
    what kvikio's compat setting at its open says of it (:func:`kvikio_mode`); ``routes`` counts
    the reads by path, only as far as kvikio lets it be known: ``posix`` (below the GDS threshold,
    or of a file in compat mode), ``gds`` (at or above it, of a file kvikio must read through
    cuFile: compat mode OFF), and :data:`UNREPORTED` (at or above it, of a file opened under AUTO
    with cuFile available; the key appears once there is such a read)."""

    on_device = True
    device_type = "cuda"

    def __init__(self, threads: int = 16, max_run_bytes: int = MAX_RUN_BYTES, module: Any = None) -> None:
        if module is None:
            if not torch.cuda.is_available():
                raise RuntimeError("KvikioReader needs CUDA")
            module = import_kvikio()
        super().__init__(threads, max_run_bytes, "moment-kvikio")
        self._kvikio = module
        self.config: dict[str, Any] = configure_kvikio(module, threads)
        self.mode: str = kvikio_mode(module)
        self.routes = {"posix": 0, "gds": 0}
        self._files: dict[str, Any] = {}

    @property
    def route(self) -> str:
        """How SSD bytes reach the GPU: ``host`` (compat mode: a bounce buffer in host memory) or
        ``direct`` (kvikio prefers cuFile, i.e. GPUDirect Storage: only reads of ``gds_threshold``
        bytes or more take it, and under AUTO not those of a file cuFile could not register)."""
        return "host" if self.mode == "kvikio-compat" else "direct"

    def read(self, file: FileRef, rows: np.ndarray, out: torch.Tensor) -> float:
        """Read ``rows`` (sorted, unique) of ``file`` into the CUDA tensor ``out``."""
        return self.read_batch([ReadRequest(file, rows, out)])[0]

    def read_batch(self, requests: Sequence[ReadRequest]) -> list[float]:
        """Serve all requests with their reads in flight together; seconds per request as FileReader."""
        start = time.perf_counter()
        tasks = self._plan(requests)
        results = self._pool.run(self.issue, tasks)
        seconds, preads = _finish_times(start, len(requests), results)
        self.preads += preads
        threshold = self.config["gds_threshold"]
        for task in tasks:
            large = int((task.sizes >= threshold).sum())
            self.routes["posix"] += len(task.sizes) - large  # below the threshold: POSIX in every mode
            route = {"kvikio-gds": "gds", "kvikio-compat": "posix"}.get(self.modes.get(task.name, ""), UNREPORTED)
            if large or route in self.routes:
                self.routes[route] = self.routes.get(route, 0) + large
        return seconds

    def close(self) -> None:
        """Stop the threads; deregister and close every file, once (a second call does nothing).

        The trainer calls this when training ends (``trainer.loop.train``'s ``finally``), not at
        interpreter exit, so cuFile handles are deregistered while CUDA is up. It is hygiene, not
        a fix for the segfault at exit with GDS active (rapidsai/kvikio#497, cuFile's, on CUDA
        12): what that thread reports avoids it is ``"profile": {"cufile_stats": 0}`` in
        cufile.json, compat mode (``KVIKIO_COMPAT_MODE=ON``), or CUDA 13.0 ("fixed in CUDA-13.0",
        NVIDIA); README says the same under ``--io``."""
        self._pool.shutdown()
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def plan_task(self, i: int, req: ReadRequest) -> ReadTask:
        rows = np.asarray(req.rows, dtype=np.int64)
        if isinstance(req.file, int):
            raise TypeError("KvikioReader reads files by path, not by descriptor")
        out = req.out
        if not (isinstance(out, torch.Tensor) and out.device.type == self.device_type and out.is_contiguous()):
            raise TypeError(f"out must be a contiguous {self.device_type.upper()} tensor")
        name = str(req.file)
        nbytes = out.numel() * out.element_size()
        offsets, dests, sizes, pages = plan_runs(rows, _row_bytes(nbytes, rows.size), self.max_run_bytes, req.base)
        handle = self._handle(name) if rows.size else None
        gds = self.modes.get(name) == "kvikio-gds"  # known to be read through cuFile
        # The buffer travels as the tensor (kept alive until the reads are done) and its address.
        return ReadTask(i, handle, name, gds, offsets, dests, sizes, (out, out.data_ptr()), pages)

    def issue(self, task: ReadTask) -> tuple[int, float, int]:
        """Issue a task's reads, then wait for each (a small read is done in this thread, in
        ``get``). kvikio never reads short: at the end of the file it raises; that becomes an
        OSError naming the file, after every read issued has ended (none writes into the buffer
        after this returns)."""
        handle, base, span = task.file, task.buffer[1], DeviceSpan
        offsets, sizes = task.offsets.tolist(), task.sizes.tolist()
        futures: list[Any] = []
        failed: tuple[int, int, Exception] | None = None
        try:
            for offset, dest, size in zip(offsets, task.dests.tolist(), sizes):
                futures.append(handle.pread(span(base + dest, size), size, offset))
        except RuntimeError as exc:  # e.g. a cuFile error at submission: wait for those issued first
            failed = (sizes[len(futures)], offsets[len(futures)], exc)
        for future, size, offset in zip(futures, sizes, offsets):
            try:
                future.get()
            except RuntimeError as exc:
                failed = failed or (size, offset, exc)
        if failed is not None:
            size, offset, error = failed
            raise ReadError(errno.EIO, f"{task.name}: reading {size} bytes at byte {offset}: {error}")
        return task.request, time.perf_counter(), len(futures)

    def _handle(self, name: str) -> Any:
        if name not in self._files:
            try:
                self._files[name] = self._kvikio.CuFile(name, "r")
            except (RuntimeError, OSError) as exc:  # e.g. cuFile cannot register it (compat mode OFF, kvikio ≤ 24.12)
                raise ReadError(errno.EIO, f"{name}: kvikio cannot open it: {exc}") from None
            self.modes[name] = kvikio_mode(self._kvikio)  # read at open, as kvikio does for the file
        return self._files[name]


def import_kvikio() -> Any:
    """The kvikio module (the optional GPU extra; imported only here). Any failure of the import
    is an ImportError: an incomplete wheel set fails inside libkvikio's loader with a RuntimeError
    (cuda.pathfinder's DynamicLibNotFoundError for a missing libcufile) or an OSError (ctypes)."""
    try:
        import kvikio
        import kvikio.defaults  # a submodule kvikio's __init__ does not import (26.10): the reader configures it
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 (whatever the loader raises means "not usable here")
        raise ImportError(f"kvikio cannot be loaded: {type(exc).__name__}: {exc}") from exc
    return kvikio


def kvikio_mode(kvikio: Any) -> str:
    """What kvikio's compat setting says of a file it opens now: "kvikio-compat" (every read
    POSIX), "kvikio-gds" (reads of ``gds_threshold`` or more through cuFile: compat mode OFF,
    where a file cuFile cannot register fails to open) or "kvikio-auto" (AUTO with cuFile
    available: cuFile unless registering the file fails, and then POSIX; kvikio decides that per
    file at open — compat_mode_manager.cpp — and does not say which: its Python ``CuFile`` has
    no such query in 26.x). Reads below the threshold are POSIX in every mode (``routes``)."""
    defaults = kvikio.defaults
    get = getattr(defaults, "get", None)  # kvikio ≥ 25.04; before, a compat_mode() getter
    mode = get("compat_mode") if get is not None else defaults.compat_mode()
    name = getattr(mode, "name", None)  # a CompatMode enum (ON, OFF, AUTO) or, before 24.10, a bool
    if name is None:
        return "kvikio-compat" if mode else "kvikio-gds"
    if name == "AUTO":
        preferred = getattr(defaults, "is_compat_mode_preferred", None)  # AUTO without cuFile: compat
        return "kvikio-compat" if preferred is not None and preferred() else "kvikio-auto"
    return {"ON": "kvikio-compat", "OFF": "kvikio-gds"}[name]


def kvikio_refusal(cuda: bool) -> str | None:
    """Why ``io="kvikio"`` cannot work here, as a phrase starting with "kvikio"; None when it
    can. ``cuda``: the device is a GPU and CUDA is available. kvikio is looked up, not imported."""
    if not cuda:
        return "kvikio reads into GPU memory: it needs CUDA"
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed (pip install 'moment[gpu]')"
    return None


@dataclass(frozen=True)
class ReaderKind:
    """One ``--io`` choice: how to make the reader, what it does, why it cannot run here."""

    make: Callable[[int, bool], Reader]  # (threads, direct) → a reader; ImportError when a module is missing
    about: str  # for the help text
    refusal: Callable[[bool], str | None] = lambda cuda: None  # (device is CUDA) → why not, or None


READERS: dict[str, ReaderKind] = {
    "posix": ReaderKind(
        lambda threads, direct: FileReader(threads=threads, direct=direct), "preads into pinned host memory"
    ),
    "kvikio": ReaderKind(
        lambda threads, direct: KvikioReader(threads=threads),
        "into GPU memory (GPUDirect Storage or its compat mode)",
        kvikio_refusal,
    ),
}


def io_help() -> str:
    """``--io``'s help text, from :data:`READERS`."""
    kinds = ", ".join(f"{name} {kind.about}" for name, kind in READERS.items())
    return f"how SSD bins are read: {kinds}, or auto: on CUDA, whichever of them a short read probe of the SSD bins measures fastest (default)"


def io_refusal(io: str, cuda: bool) -> str | None:
    """Why reader ``io`` cannot work here (a phrase starting with its name), or None; ``cuda``:
    the device is a GPU and CUDA is available. "auto" always works."""
    return None if io == "auto" else READERS[io].refusal(cuda)


# A probe reads about this many bytes per candidate reader (a few milliseconds on NVMe).
PROBE_BYTES = 4 << 20


def probe_io(readers: dict[str, Reader], files: Sequence[tuple[FileRef, int]], seed: int = 0) -> dict[str, float]:
    """Seconds each reader took to read the same amount of random rows (different rows per reader,
    so none reads from the page cache another one filled) spread over ``files`` — (path, row
    bytes) pairs — best of two rounds. What :func:`make_reader` chooses ``io="auto"`` by."""
    rng = np.random.default_rng(seed)
    sizes = [(f, rb, os.stat(f).st_size // rb) for f, rb in files if rb > 0 and os.stat(f).st_size >= rb]
    if not sizes:
        return {}
    per_file = max(1, PROBE_BYTES // sum(rb for _, rb, _ in sizes))  # rows per file: PROBE_BYTES in all
    seconds: dict[str, float] = {}
    for name, reader in readers.items():
        best = float("inf")
        for _ in range(2):
            requests = []
            for f, rb, n in sizes:
                rows = np.unique(rng.integers(0, n, min(per_file, n)))
                if reader.on_device:
                    out: Any = torch.empty((rows.size, rb), dtype=torch.uint8, device=reader.device_type)
                else:
                    out = _aligned_rows(rows.size, rb)
                requests.append(ReadRequest(f, rows, out))
            start = time.perf_counter()
            reader.read_batch(requests)
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
    return seconds


def _aligned_rows(rows: int, row_bytes: int) -> np.ndarray:
    """A (rows, row_bytes) uint8 array at a DIRECT_ALIGN boundary, so O_DIRECT can read into it."""
    raw = np.empty(rows * row_bytes + DIRECT_ALIGN, dtype=np.uint8)
    skew = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skew : skew + rows * row_bytes].reshape(rows, row_bytes)


def make_reader(
    device: str | torch.device,
    threads: int = 16,
    direct: bool = True,
    io: str = "auto",
    probe: Sequence[tuple[FileRef, int]] | None = None,
) -> Reader:
    """The reader for ``device``: a name of :data:`READERS`: that reader, or an error saying why
    not; ``io="auto"``: on a CUDA device with ``probe`` files — (path, row bytes) pairs, the SSD
    bins — whichever reader that can be made here :func:`probe_io` measured fastest (its figures
    in the reader's ``probe``), plain file reads otherwise."""
    if io != "auto" and io not in READERS:
        raise ValueError(f"io must be auto or one of {', '.join(READERS)}, not {io!r}")
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    if (why := io_refusal(io, cuda)) is not None:
        raise ValueError(f"{why} (device {device})")
    if io != "auto":
        try:
            reader = READERS[io].make(threads, direct)
        except ImportError as exc:
            raise ValueError(f"{io} cannot be imported: {exc}") from None
        if reader.on_device and reader.route == "host":
            # The first GPU run measured 0.05 of raw random reads for kvikio in compat mode on
            # 128-byte rows (a bounce and a copy per run of rows), 0.57 for posix.
            print(
                f"warning: --io {io}: no GPUDirect Storage here (kvikio's compat mode): every run of rows "
                "bounces through host memory on its own, much slower than --io posix for small rows; "
                "--io auto measures both and takes the faster",
                file=sys.stderr,
            )
        return reader
    posix = READERS["posix"].make(threads, direct)
    if not cuda or not probe:
        return posix
    candidates: dict[str, Reader] = {"posix": posix}
    for name, kind in READERS.items():
        if name in candidates or kind.refusal(cuda) is not None:
            continue
        try:
            candidates[name] = kind.make(threads, direct)
        except (ImportError, OSError, RuntimeError) as exc:  # e.g. libkvikio's ctypes load: OSError
            print(f"warning: io=auto: the {name} reader cannot be made ({exc}): not used", file=sys.stderr)
    return choose_reader(candidates, probe) if len(candidates) > 1 else posix


def choose_reader(readers: dict[str, Reader], probe: Sequence[tuple[FileRef, int]]) -> Reader:
    """The reader that read ``probe``'s files fastest (the first one when nothing could be
    measured), the others closed; its ``probe`` attribute holds every reader's seconds."""
    seconds: dict[str, float] = {}
    for k, (name, reader) in enumerate(readers.items()):
        try:
            seconds.update(probe_io({name: reader}, probe, seed=k))  # rows of its own: no page-cache hits
        except (OSError, RuntimeError) as exc:  # e.g. cuFile cannot register the files: not a candidate
            print(f"warning: io=auto: {name} reader failed its probe ({exc}): not used", file=sys.stderr)
            seconds[name] = float("inf")
    best = min(seconds, key=seconds.__getitem__) if seconds else next(iter(readers))
    for name, reader in readers.items():
        if name != best:
            reader.close()
    chosen = readers[best]
    chosen.probe = seconds
    return chosen
