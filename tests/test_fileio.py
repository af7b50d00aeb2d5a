"""Atomic outputs: nothing partial survives a failure, and a killed writer's leftovers go."""

import errno
import os
import subprocess
import sys

import pytest

from npuforge.cli import run_cli
from npuforge.fileio import atomic_path, write_json


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    out = tmp_path / "release"
    # A writer that dies without cleaning up (SIGKILL): its temporary stays behind.
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); from npuforge.fileio import atomic_path\n"
        "with atomic_path(sys.argv[2]) as tmp:\n"
        "    tmp.mkdir(); (tmp / 'half.bin').write_bytes(b'x'); os._exit(9)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code, repo, str(out)])
    orphans = list(tmp_path.glob(".release.*.tmp"))
    assert len(orphans) == 1
    # A live writer's temporary is not touched.
    live = tmp_path / f".release.{os.getpid()}.abc.tmp"
    live.mkdir()
    with atomic_path(out) as tmp:
        tmp.mkdir()
    assert out.is_dir()
    assert [p.name for p in tmp_path.glob(".release.*.tmp")] == [live.name]


def test_a_killed_nested_writers_temporary_is_removed_too(tmp_path):
    """A writer that writes its own temporary atomically, killed before the inner rename,
    leaves "..name.<pid>.*.tmp.<pid>.*.tmp" (seen once in CI's killed-fetch trial)."""
    out = tmp_path / "checkpoint.pth"
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); from npuforge.fileio import atomic_path\n"
        "with atomic_path(sys.argv[2]) as outer:\n"
        "    with atomic_path(outer) as inner:\n"
        "        inner.write_bytes(b'half'); os._exit(9)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code, repo, str(out)])
    assert len(list(tmp_path.glob("..checkpoint.pth.*.tmp"))) == 1
    with atomic_path(out) as tmp:
        tmp.write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pth"]


def test_os_refusals_become_one_line_errors(capsys):
    def disk_full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/results/export/chunk0.onnx")

    assert run_cli(disk_full) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: /results/export/chunk0.onnx: No space left on device; free disk space or point "
        "results= at a larger filesystem"
    ]

    def out_of_memory(argv):
        raise MemoryError

    assert run_cli(out_of_memory) == 2
    assert "compile_mem_mb" in capsys.readouterr().err


def test_other_errors_still_raise():
    def broken(argv):
        raise OSError(errno.EBADF, "Bad file descriptor")

    with pytest.raises(OSError):
        run_cli(broken)


def test_file_size_limit_mid_write_leaves_nothing(tmp_path):
    """A real EFBIG: the write stops at the limit, the error is one line, no file stays."""
    script = (
        "import resource, signal, sys; sys.path.insert(0, sys.argv[1])\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "from npuforge.cli import run_cli\n"
        "from npuforge.fileio import write_json\n"
        "sys.exit(run_cli(lambda argv: write_json(sys.argv[2], {'x': 'y' * 100000})))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "big.json"
    result = subprocess.run(
        [sys.executable, "-c", script, repo, str(out)], capture_output=True, text=True
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0] and "ulimit -f" in lines[0]
    assert list(tmp_path.iterdir()) == []
    write_json(out, {"ok": True})  # and the next run writes it
    assert out.is_file()
