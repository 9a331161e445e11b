"""How much memory this process may still take: the host's MemAvailable, bounded by its memory
cgroup (v1 or v2), page cache excepted. The import's and inference's default budgets read it."""

from __future__ import annotations

from pathlib import Path


def free_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); a conservative 2 GB where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 30


def available_memory() -> int:
    """MemAvailable, bounded by this process's memory cgroup (v1 or v2): its limit less what it
    uses, page cache excepted (the kernel reclaims that); 2 GB where /proc cannot be read."""
    free = free_memory()
    group = cgroup_memory()
    return min(free, group) if group is not None else free


def cgroup_memory(proc: Path = Path("/proc/self/cgroup"), sys_fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup (v1 or v2) still allows: its limit less its usage, page
    cache excepted; None where there is no limit (or nothing can be read)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v1 = "memory" in controllers.split(",")
        if not v1 and controllers:
            continue
        root = (sys_fs / "memory" if v1 else sys_fs) / path.lstrip("/")
        limit_file, usage_file, cache = (
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
            if v1
            else ("memory.max", "memory.current", "file")
        )
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                continue  # no limit at this level
            stat = dict(ln.split()[:2] for ln in (root / "memory.stat").read_text().splitlines() if " " in ln)
            used = int((root / usage_file).read_text()) - int(stat.get(cache, 0))
            return max(int(limit) - used, 0)
        except (OSError, ValueError):
            continue
    return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    numpy's blocks of a few MB come from malloc's heaps once a larger one was freed (glibc raises
    its mmap threshold), and freed they stay there: resident, anonymous, counted against the
    process (at 20 M vertices ``moment place`` carried 80–150 MiB of such free heap from
    pre-sampling into the bin pass). A step that follows one of many such blocks calls this."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
