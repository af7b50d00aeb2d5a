"""What a run may take of the host's memory (npuforge.memory.available_mb)."""

from npuforge.memory import available_mb

MEMINFO = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"


def test_free_memory_is_memavailable_within_the_cgroups_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    group = tmp_path / "cgroup"
    group.mkdir()
    assert available_mb(meminfo, group) == 20_480  # 20,000,000 KiB
    (group / "memory.max").write_text("max\n")
    assert available_mb(meminfo, group) == 20_480
    (group / "memory.max").write_text("8000000000\n")
    (group / "memory.current").write_text("3000000000\n")
    assert available_mb(meminfo, group) == 5_000  # the container's limit, less its use
    assert available_mb(tmp_path / "absent", group) == 5_000
    assert available_mb(tmp_path / "absent", tmp_path / "absent") is None
