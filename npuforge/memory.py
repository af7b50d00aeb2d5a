"""The host's memory: what a run may take, and giving it back between the pieces of a
step that streams."""

from pathlib import Path


def release_memory():
    """Hand the memory of released objects back to the system: glibc keeps freed blocks
    in its heap otherwise, so the next chunk or model would sit on top of the last one's."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: nothing to trim
        pass


def available_mb(meminfo="/proc/meminfo", cgroup=None) -> int | None:
    """The memory a run may take now, in MB: the kernel's MemAvailable, within what this
    process's cgroup (v2) may still take; None where neither can be read."""
    found = []
    cgroup = cgroup or own_cgroup()
    try:
        with open(meminfo, encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = (Path(cgroup) / "memory.max").read_text().strip()
        if limit != "max":
            used = int((Path(cgroup) / "memory.current").read_text())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return int(min(found) // 1_000_000) if found else None


def own_cgroup() -> Path:
    """This process's cgroup v2 directory (in a container: the container's)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as groups:
            for line in groups:
                if line.startswith("0::"):
                    return Path("/sys/fs/cgroup") / line[3:].strip().lstrip("/")
    except OSError:
        pass
    return Path("/sys/fs/cgroup")
