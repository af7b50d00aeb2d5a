"""The toolchain runner: native venvs, container command lines, failures as one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from npuforge import toolchain
from npuforge.cache import CACHE_ENV, cache_root
from npuforge.errors import NpuforgeError
from npuforge.toolchain import definitions, images, machine_cache, reporting

REPO = Path(__file__).resolve().parents[1]

VERSIONS_PY = "import json, sys\nprint(json.dumps({'python': sys.version.split()[0]}))\n"

JOB_PY = textwrap.dedent(
    """
    import json, os, sys
    spec = json.load(open(sys.argv[1]))
    if spec.get("fail"):
        print("progress line")
        print("RuntimeError: the compiler rejected node X", file=sys.stderr)
        sys.exit(3)
    if spec.get("aslr"):
        import ctypes
        allowed = ctypes.CDLL(None, use_errno=True).personality(0x0040000) != -1
        open(os.path.join(spec["out_dir"], "aslr.txt"), "w").write(str(allowed))
    with open(os.path.join(spec["out_dir"], "result.txt"), "w") as out:
        out.write(open(spec["input"]).read().upper() + os.environ.get("EXTRA", ""))
    """
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Toy venvs go to a private cache, never the machine's shared one."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def make_backend(root: Path, name="toy", lock="", containerfile=None) -> Path:
    env = root / "envs" / name
    env.mkdir(parents=True)
    (env / "requirements.lock").write_text(lock)
    (env / "versions.py").write_text(VERSIONS_PY)
    if containerfile:
        (env / "Containerfile").write_text(containerfile)
    return env


def write_job(tmp_path: Path, **spec):
    job = tmp_path / "jobs" / "toy_job.py"
    job.parent.mkdir(exist_ok=True)
    job.write_text(JOB_PY)
    (tmp_path / "in.txt").write_text("hello")
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        json.dumps({"input": str(tmp_path / "in.txt"), "out_dir": str(out_dir), **spec})
    )
    return job, spec_path, out_dir


def test_env_hash_follows_content(tmp_path):
    env = make_backend(tmp_path)
    before = toolchain.env_hash("toy", tmp_path)
    assert before == toolchain.env_hash("toy", tmp_path)
    (env / "requirements.lock").write_text("numpy==2.0.0\n")
    assert toolchain.env_hash("toy", tmp_path) != before
    assert toolchain.image_name("toy", tmp_path).endswith(":" + toolchain.env_hash("toy", tmp_path))
    # Docs beside the lock do not rebuild a venv of several GB.
    edited = toolchain.env_hash("toy", tmp_path)
    (env / "README.md").write_text("measured 11 min\n")
    assert toolchain.env_hash("toy", tmp_path) == edited


def test_unknown_backend_and_runtime_are_one_line_errors(tmp_path):
    with pytest.raises(NpuforgeError, match="no toolchain definition for backend 'nope'"):
        toolchain.env_hash("nope", tmp_path)
    reason = toolchain.unavailable_reason("toy", "kubernetes")
    assert "unknown toolchain runtime 'kubernetes'" in reason and "native" in reason


def test_missing_engine_is_reported(monkeypatch):
    definitions.engine_problem.cache_clear()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    reason = toolchain.unavailable_reason("toy", "docker")
    definitions.engine_problem.cache_clear()
    assert "container engine 'docker' is not installed" in reason
    assert "\n" not in reason


def test_native_prepare_and_run(tmp_path):
    make_backend(tmp_path)
    stamp_path = tmp_path / "toolchains" / "toy-native.json"
    stamp = toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
    assert json.loads(stamp_path.read_text()) == stamp
    assert stamp["versions"]["python"] == sys.version.split()[0]
    assert Path(stamp["python"]).is_file()

    job, spec, out_dir = write_job(tmp_path)
    toolchain.run_job(stamp_path, job, spec, env={"EXTRA": "!"}, log_path=tmp_path / "job.log")
    assert (out_dir / "result.txt").read_text() == "HELLO!"

    # A second prepare reuses the finished venv.
    marker = Path(stamp["python"]).parents[1] / ".complete"
    mtime = marker.stat().st_mtime_ns
    toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
    assert marker.stat().st_mtime_ns == mtime


def test_failed_job_raises_its_error_line(tmp_path):
    make_backend(tmp_path)
    stamp_path = tmp_path / "toy-native.json"
    toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
    job, spec, _ = write_job(tmp_path, fail=True)
    with pytest.raises(NpuforgeError) as err:
        toolchain.run_job(stamp_path, job, spec, log_path=tmp_path / "job.log")
    message = str(err.value)
    assert "RuntimeError: the compiler rejected node X" in message
    assert "job.log" in message and "\n" not in message
    assert "progress line" in (tmp_path / "job.log").read_text()


@pytest.mark.parametrize(
    "runtime, returncode, says",
    [
        # a native job exits 143 through job_stage.exit_on_sigterm's cleanup
        ("native", 128 + signal.SIGTERM, "was stopped from outside (signal SIGTERM)"),
        ("podman", 128 + signal.SIGTERM, "was stopped from outside (signal SIGTERM)"),
        ("native", -signal.SIGSEGV, "crashed (signal SIGSEGV)"),
        ("podman", 128 + signal.SIGSEGV, "crashed (signal SIGSEGV)"),
        # natively, 139 is only an exit code
        ("native", 128 + signal.SIGSEGV, "failed in the native toolchain: compiling"),
        # the OOM killer's signal: smaller chunks are the fix the plan can make
        ("native", -signal.SIGKILL, "lower the target's memory_budget_gb in targets.yaml"),
    ],
)
def test_a_job_ended_by_a_signal_is_named(runtime, returncode, says):
    stamp = {"backend": "qnn", "runtime": runtime}
    message = toolchain.job_failure(stamp, returncode, "compiling graph 3 of 9\n")
    assert says in message and "\n" not in message


def test_a_quiet_job_is_reported_while_it_runs():
    import io

    out = io.StringIO()
    quiet = "import time; print('quantizing', flush=True); time.sleep(1.2); print('done')"
    code, output = reporting.run_reporting(
        [sys.executable, "-c", quiet], None, None, "toy job", quiet_s=0.3, out=out
    )
    assert code == 0 and output == "quantizing\ndone\n"
    lines = out.getvalue().splitlines()
    assert lines[0] == "quantizing" and lines[-1] == "done"
    # The silence between them was filled, each line naming the job, the time and the
    # last thing it said.
    beats = lines[1:-1]
    assert len(beats) >= 2
    assert all(b.startswith("toy job running for ") for b in beats)
    assert all(b.endswith("(last output: quantizing)") for b in beats)


def test_a_quiet_jobs_report_names_its_stage_beside_a_later_library_warning():
    import io

    out = io.StringIO()
    quiet = (
        "import time; print('[qnn_job] generating the HTP context of decode.onnx'); "
        "print('libnative: warning: unused option', flush=True); time.sleep(0.8)"
    )
    reporting.run_reporting(
        [sys.executable, "-c", quiet], None, None, "qnn job", quiet_s=0.3, out=out
    )
    beats = [line for line in out.getvalue().splitlines() if "running for" in line]
    assert beats and all(
        b.endswith(
            "(at: [qnn_job] generating the HTP context of decode.onnx; "
            "last output: libnative: warning: unused option)"
        )
        for b in beats
    )


def test_a_quiet_jobs_report_counts_its_stages_estimate_down():
    stage = "TPU-MLIR step 9/30 [about 600 s left before the cmodel check]: prefill_2:model_deploy"
    line = reporting.quiet_report("tpumlir job", 1500.4, stage, 120.2, "tpuc-opt done")
    assert line == (
        "tpumlir job running for 1500 s, about 480 s left before the cmodel check "
        "(at: TPU-MLIR step 9/30: prefill_2:model_deploy; last output: tpuc-opt done)"
    )
    # The stage line as the last output: said once, without its stale figure; an
    # estimate overrun says 0, not a negative time.
    line = reporting.quiet_report("job", 900, stage, 700, stage)
    assert line == (
        "job running for 900 s, about 0 s left before the cmodel check "
        "(last output: TPU-MLIR step 9/30: prefill_2:model_deploy)"
    )
    assert reporting.quiet_report("job", 30, "verify: call 2/9 (decode)", 5, "x") == (
        "job running for 30 s (at: verify: call 2/9 (decode); last output: x)"
    )


STOPPABLE_JOB_PY = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as pids:
    pids.write(f"{os.getpid()} {child.pid}")
print("started", flush=True)
time.sleep(600)
"""

# A step CLI whose job runs in the toolchain (argv: the job command as JSON, the output
# path): run_cli around an atomic output, as compile.py has.
STEP_PY = """
import json, sys
from npuforge.toolchain import reporting
from npuforge.cli import run_cli
from npuforge.fileio import atomic_path

def main(argv):
    with atomic_path(sys.argv[2]) as tmp:
        tmp.mkdir()
        (tmp / "partial.bin").write_bytes(b"x")
        reporting.run_reporting(json.loads(sys.argv[1]), None, None, "toy job")

sys.exit(run_cli(main))
"""


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _stop_step_once_started(job_cmd, out, started) -> subprocess.CompletedProcess:
    step = subprocess.Popen(
        [sys.executable, "-c", STEP_PY, json.dumps(job_cmd), str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not started() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started(), "the job never started"
    step.send_signal(signal.SIGTERM)
    stdout, stderr = step.communicate(timeout=60)
    return subprocess.CompletedProcess(step.args, step.returncode, stdout, stderr)


def test_a_stopped_step_stops_its_job_and_keeps_nothing(tmp_path):
    """SIGTERM (Snakemake stopping its jobs, a cluster's time limit) reaches the job and
    every process it started; the step's temporary output goes; one line says so."""
    job = tmp_path / "job.py"
    job.write_text(STOPPABLE_JOB_PY)
    pids = tmp_path / "pids.txt"
    out = tmp_path / "out"
    done = _stop_step_once_started(
        [sys.executable, str(job), str(pids)], out, lambda: pids.is_file() and pids.read_text()
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: stopped by SIGTERM; nothing of this step was kept"
    )
    job_pid, child_pid = map(int, pids.read_text().split())
    assert not _alive(job_pid) and not _alive(child_pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "pids.txt"]


def test_broken_lock_leaves_no_venv(tmp_path, private_cache):
    make_backend(tmp_path, lock="this-package-does-not-exist-npuforge==0.0.0\n")
    stamp_path = tmp_path / "toolchains" / "toy-native.json"
    with pytest.raises(NpuforgeError, match="installing"):
        toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
    assert not stamp_path.exists()
    assert not [p for p in (private_cache / "toolchains").iterdir() if p.is_dir()]


def test_native_venv_lives_in_the_machine_cache_and_is_shared(tmp_path, private_cache):
    make_backend(tmp_path)
    first = toolchain.prepare(
        "toy", "native", tmp_path / "a" / "toy-native.json", repo_root=tmp_path
    )
    second = toolchain.prepare(
        "toy", "native", tmp_path / "b" / "toy-native.json", repo_root=tmp_path
    )
    assert first["python"] == second["python"]
    assert Path(first["python"]).is_relative_to(private_cache / "toolchains")


def test_missing_stamp_says_how_to_prepare(tmp_path):
    with pytest.raises(NpuforgeError, match="prepare the toolchain first"):
        toolchain.run_job(tmp_path / "none.json", "job.py", "spec.json")


def test_container_command_isolates_the_job(tmp_path):
    stamp = {"backend": "toy", "runtime": "podman", "image": "localhost/npuforge-toy:abc"}
    job = tmp_path / "jobs" / "toy_job.py"
    cmd = toolchain.container_command(
        stamp,
        job,
        tmp_path / "spec.json",
        read_only=[tmp_path / "in"],
        writable=[tmp_path / "out"],
        env={"MALLOC_PERTURB_": "0"},
    )
    assert cmd[:3] == ["podman", "run", "--rm"]
    # A signal-passing PID 1: the job itself as PID 1 would ignore SIGTERM.
    assert "--init" in cmd
    assert "--network=none" in cmd
    uid, gid = toolchain.job_user()
    assert cmd[cmd.index("--user") + 1] == f"{uid}:{gid}"
    assert uid != 0 and gid != 0
    volumes = [cmd[i + 1] for i, part in enumerate(cmd) if part == "--volume"]
    assert f"{tmp_path / 'in'}:{tmp_path / 'in'}:ro" in volumes
    assert f"{tmp_path / 'out'}:{tmp_path / 'out'}:rw" in volumes
    assert f"{job.parent}:{job.parent}:ro" in volumes
    assert cmd[-4:] == [
        stamp["image"],
        toolchain.CONTAINER_PYTHON,
        str(job),
        str(tmp_path / "spec.json"),
    ]
    assert "MALLOC_PERTURB_=0" in cmd


def test_a_root_caller_lends_the_job_its_writable_directories_and_gets_them_back(tmp_path):
    if os.getuid() != 0:
        assert toolchain.job_user() == (os.getuid(), os.getgid())
        pytest.skip("not root here: container jobs run as the caller, nothing is lent")
    stage = tmp_path / "stage"
    (stage / "sub").mkdir(parents=True)
    (stage / "sub" / "spec.json").write_text("{}")

    def owners():
        return {(p.stat().st_uid, p.stat().st_gid) for p in [stage, *stage.rglob("*")]}

    with pytest.raises(RuntimeError), toolchain.lent_to_job_user([stage]):
        assert owners() == {toolchain.job_user()}
        (stage / "sub" / "out.bin").write_bytes(b"x")
        raise RuntimeError("the job failed")
    assert owners() == {(0, 0)}


def test_seccomp_profile_adds_only_the_no_randomize_personality(tmp_path):
    default = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}],
    }
    (tmp_path / "seccomp.json").write_text(json.dumps(default))
    derived = json.loads(toolchain.seccomp_profile(tmp_path / "seccomp.json").read_text())
    assert derived["defaultAction"] == "SCMP_ACT_ERRNO"
    assert derived["syscalls"][0] == default["syscalls"][0]
    added = derived["syscalls"][1:]
    assert [rule["names"] for rule in added] == [["personality"]]
    assert added[0]["args"][0]["value"] == toolchain.ADDR_NO_RANDOMIZE
    assert toolchain.seccomp_profile(tmp_path / "missing.json") is None


PODMAN = toolchain.unavailable_reason("toy", "podman")


# The base image need not exist: prepare builds it (debootstrap) when it is missing.
@pytest.mark.skipif(PODMAN is not None, reason=f"podman: {PODMAN}")
def test_podman_runtime_runs_the_job_offline_as_the_user(tmp_path):
    containerfile = textwrap.dedent(
        f"""
        FROM {toolchain.BASE_IMAGE}
        RUN apt-get update -qq && apt-get install -y -qq python3-minimal >/dev/null \\
            && mkdir -p /opt/toolchain/bin && ln -s /usr/bin/python3 {toolchain.CONTAINER_PYTHON}
        """
    )
    make_backend(tmp_path, containerfile=containerfile)
    stamp_path = tmp_path / "toy-podman.json"
    stamp = toolchain.prepare("toy", "podman", stamp_path, repo_root=tmp_path)
    try:
        assert stamp["image"] == toolchain.image_name("toy", tmp_path)
        job, spec, out_dir = write_job(tmp_path)
        toolchain.run_job(
            stamp_path, job, spec, read_only=[tmp_path / "in.txt"], writable=[out_dir]
        )
        result = out_dir / "result.txt"
        assert result.read_text() == "HELLO"
        assert result.stat().st_uid == os.getuid()

        # The derived seccomp profile lets a job turn off address randomisation.
        job, spec, out_dir = write_job(tmp_path, aslr=True)
        toolchain.run_job(
            stamp_path, job, spec, read_only=[tmp_path / "in.txt"], writable=[out_dir]
        )
        assert (out_dir / "aslr.txt").read_text() == "True"

        # An image the machine lost is built again, the same, when a job needs it.
        subprocess.run(["podman", "rmi", stamp["image"]], capture_output=True, check=True)
        job, spec, out_dir = write_job(tmp_path)
        toolchain.run_job(
            stamp_path, job, spec, read_only=[tmp_path / "in.txt"], writable=[out_dir]
        )
        assert (out_dir / "result.txt").read_text() == "HELLO"

        job, spec, _ = write_job(tmp_path, fail=True)
        with pytest.raises(NpuforgeError, match="the compiler rejected node X"):
            toolchain.run_job(stamp_path, job, spec, writable=[out_dir])

        # A stopped step stops its container too (the job is not PID 1, which would
        # ignore the SIGTERM).
        sleeper = tmp_path / "jobs" / "sleeper.py"
        sleeper.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
        ours = ["podman", "ps", "-q", "--filter", f"ancestor={stamp['image']}"]

        def running():
            return subprocess.run(ours, capture_output=True, text=True).stdout.split()

        cmd = toolchain.container_command(stamp, sleeper, spec)
        done = _stop_step_once_started(cmd, tmp_path / "stopped", running)
        assert done.returncode == 128 + signal.SIGTERM, done.stderr
        assert running() == []
        assert not (tmp_path / "stopped").exists()
    finally:
        subprocess.run(["podman", "rmi", "-f", stamp["image"]], capture_output=True)


def test_debian_package_digest_names_the_package_set_whatever_its_order():
    listing = "libc6:amd64=2.36-9+deb12u10\nbash=5.2.15-2+b7\n"
    digest = toolchain.debian_package_digest(listing)
    assert digest["count"] == 2 and len(digest["sha256"]) == 64
    reordered = "\nbash=5.2.15-2+b7\nlibc6:amd64=2.36-9+deb12u10\nbash=5.2.15-2+b7\n"
    assert toolchain.debian_package_digest(reordered) == digest
    upgraded = listing.replace("2.36-9+deb12u10", "2.36-9+deb12u11")
    assert toolchain.debian_package_digest(upgraded)["sha256"] != digest["sha256"]


def test_only_the_two_most_recently_used_versions_stay_and_a_used_one_is_never_evicted(
    tmp_path,
):
    from npuforge.cache import entry_in_use, evict_older, last_used

    entries = [tmp_path / name for name in ("old", "older", "oldest", "busy")]
    for age, entry in enumerate(entries):
        entry.mkdir()
        lock = entry.parent / f"{entry.name}.lock"
        lock.touch()
        os.utime(lock, (1000 - age, 1000 - age))
    with entry_in_use(tmp_path / "busy"):
        # Holding it marks it used: it is now the most recent, and kept either way.
        assert last_used(tmp_path / "busy") > 1000
        os.utime(tmp_path / "busy.lock", (1, 1))
        removed, busy = evict_older(entries, lambda e: e.rmdir(), keep=1)
    assert removed == [tmp_path / "older", tmp_path / "oldest"]
    assert busy == [tmp_path / "busy"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["busy", "old"]


def test_a_lock_edit_evicts_the_oldest_venv_and_a_lost_venv_is_rebuilt_for_its_job(
    tmp_path, private_cache
):
    env = make_backend(tmp_path)
    stamps = []
    for version in ("", "# v2\n", "# v3\n"):
        (env / "requirements.lock").write_text(version)
        stamp_path = tmp_path / f"stamp-{len(stamps)}" / "toy-native.json"
        stamp = toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
        stamps.append((stamp_path, stamp))
    venvs = [Path(stamp["python"]).parents[1] for _, stamp in stamps]
    assert [venv.is_dir() for venv in venvs] == [False, True, True]
    log = (stamps[2][0].parent / "toy-native.log").read_text()
    assert f"removed an older toy toolchain from the machine's cache: {venvs[0].name}" in log

    # The first stamp's checkout is back at its lock: its job rebuilds the venv and runs.
    (env / "requirements.lock").write_text("")
    job, spec, out_dir = write_job(tmp_path)
    toolchain.run_job(stamps[0][0], job, spec)
    assert (out_dir / "result.txt").read_text() == "HELLO"
    assert venvs[0].is_dir()

    # A lost venv whose lock this checkout no longer has is a one-line error.
    shutil.rmtree(venvs[0])
    (env / "requirements.lock").write_text("# v4\n")
    with pytest.raises(NpuforgeError, match="gone from this machine and this checkout defines"):
        toolchain.run_job(stamps[0][0], job, spec)


@pytest.mark.skipif(PODMAN is not None, reason=f"podman: {PODMAN}")
def test_an_older_image_is_evicted_with_the_build_layers_only_it_used(tmp_path):
    repository = f"localhost/npuforge-evicttoy{os.getpid()}"
    log = open(tmp_path / "build.log", "w")
    if not toolchain.image_exists("podman", toolchain.BASE_IMAGE):
        toolchain.build_base_image("podman", log)

    def inspect(ref, field):
        probe = ["podman", "image", "inspect", "--format", field, ref]
        done = subprocess.run(probe, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    tags = ("oldest", "older", "current")
    try:
        for age, tag in enumerate(reversed(tags)):
            (tmp_path / "Containerfile").write_text(
                f"FROM {toolchain.BASE_IMAGE}\nRUN echo {tag} > /tag\nRUN echo {tag} > /done\n"
            )
            build = ["podman", "build", "-q", "-t", f"{repository}:{tag}", str(tmp_path)]
            subprocess.run(build, capture_output=True, check=True)
            marker = toolchain.image_marker(f"{repository}:{tag}")
            marker.parent.mkdir(parents=True, exist_ok=True)
            (marker.parent / f"{marker.name}.lock").touch()
            os.utime(marker.parent / f"{marker.name}.lock", (1000 - age, 1000 - age))
        layer_of_oldest = inspect(f"{repository}:oldest", "{{.Parent}}")
        assert layer_of_oldest and inspect(layer_of_oldest, "{{len .RepoTags}}") == "0"

        layer_of_older = inspect(f"{repository}:older", "{{.Parent}}")
        toolchain.evict_older_images("evicttoy", "podman", f"{repository}:current", log)
        assert inspect(f"{repository}:oldest", "{{.Id}}") is None
        assert inspect(layer_of_oldest, "{{.Id}}") is None
        assert inspect(f"{repository}:older", "{{.Id}}")
        assert inspect(toolchain.BASE_IMAGE, "{{.Id}}")
        log.close()
        assert f"{repository}:oldest" in (tmp_path / "build.log").read_text()
    finally:
        # With the build layers only each used: a layer left on the base keeps it.
        for tag in tags:
            images.remove_image("podman", f"{repository}:{tag}")
    assert inspect(layer_of_older, "{{.Id}}") is None


def test_a_job_that_fills_the_disk_says_so_in_one_line(tmp_path):
    make_backend(tmp_path)
    stamp_path = tmp_path / "toolchains" / "toy-native.json"
    toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
    job = tmp_path / "full.py"
    job.write_text(
        "import sys\nprint('writing chunk0')\n"
        "print(\"OSError: [Errno 28] No space left on device: '/out/chunk0'\", file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    (tmp_path / "spec.json").write_text("{}")
    with pytest.raises(NpuforgeError) as raised:
        toolchain.run_job(stamp_path, job, tmp_path / "spec.json")
    message = str(raised.value)
    assert message.startswith("toy job in the native toolchain ran out of disk space")
    assert str(cache_root()) in message and "\n" not in message


def test_an_image_build_that_fills_the_disk_says_so_in_one_line(tmp_path):
    # What podman printed when a layer commit found the container store full.
    said = (
        "Error: committing container for step {...}: writing blob: processing tar file"
        "(write /opt/toolchain/lib/x.bmodel: no space left on device): exit status 1"
    )
    command = [sys.executable, "-c", f"import sys; print({said!r}); sys.exit(1)"]
    with open(tmp_path / "build.log", "w") as log, pytest.raises(NpuforgeError) as raised:
        reporting.run_logged(command, log=log, what="building image localhost/npuforge-toy:1")
    message = str(raised.value)
    assert message.startswith("building image localhost/npuforge-toy:1 ran out of disk space")
    assert "container store" in message and "\n" not in message


def test_a_toolchain_build_the_disk_cannot_hold_does_not_start(
    tmp_path, private_cache, monkeypatch
):
    import types

    make_backend(tmp_path)
    huge = types.SimpleNamespace(TOOLCHAIN_SIZE_MB=2**40)
    monkeypatch.setattr(machine_cache, "backend_module", lambda backend: huge)
    stamp_path = tmp_path / "toolchains" / "toy-native.json"
    with pytest.raises(NpuforgeError, match=r"building the toy toolchain needs about [\d.]+ GB"):
        toolchain.prepare("toy", "native", stamp_path, repo_root=tmp_path)
    assert not stamp_path.exists()
    assert not [p for p in (private_cache / "toolchains").iterdir() if p.is_dir()]


def test_an_image_build_needs_room_for_its_layer_twice(tmp_path, monkeypatch):
    import types

    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    half = types.SimpleNamespace(TOOLCHAIN_SIZE_MB=free_mb // 2)
    monkeypatch.setattr(machine_cache, "backend_module", lambda backend: half)
    # A venv of half the free space fits with pip's headroom; an image of it does not.
    toolchain.check_free_space("toy", tmp_path)
    with pytest.raises(NpuforgeError, match=r"needs about [\d.]+ GB .*2 copies while an image"):
        toolchain.check_free_space("toy", tmp_path, layer_copies=toolchain.IMAGE_LAYER_COPIES)


def test_a_stamp_records_the_toolchain_options_from_a_dict_or_a_backends_typed_options():
    import types

    typed = types.SimpleNamespace(python="/opt/py310/bin/python3.10", processor="bm1688")
    assert toolchain.toolchain_options("tpumlir", typed) == {"python": typed.python}
    assert toolchain.toolchain_options("tpumlir", vars(typed)) == {"python": typed.python}
    assert toolchain.toolchain_options("tpumlir", types.SimpleNamespace(python=None)) == {}
    assert toolchain.toolchain_options("tpumlir", None) == {}


def test_a_prepare_does_not_wait_for_a_job_using_the_finished_venv(tmp_path):
    from npuforge.cache import entry_in_use

    make_backend(tmp_path)
    stamp = toolchain.prepare(
        "toy", "native", tmp_path / "a" / "toy-native.json", repo_root=tmp_path
    )
    venv = Path(stamp["python"]).parents[1]
    prepared = []
    # A job of another checkout runs in the venv (it holds the entry shared) meanwhile.
    with entry_in_use(venv):
        second = threading.Thread(
            target=lambda: prepared.append(
                toolchain.prepare(
                    "toy", "native", tmp_path / "b" / "toy-native.json", repo_root=tmp_path
                )
            ),
            daemon=True,
        )
        second.start()
        second.join(timeout=60)
        assert prepared and prepared[0]["python"] == stamp["python"]


def test_a_builder_waiting_for_another_says_so_while_it_waits(tmp_path, monkeypatch):
    from npuforge import cache

    monkeypatch.setattr(cache, "WAIT_REPORT_EVERY", 0.2)
    entry, said, built = tmp_path / "venv-x", [], []
    with cache.entry_lock(entry):  # another process is building it
        waiter = threading.Thread(
            target=cache.build_once,
            args=(entry, entry.exists, lambda: built.append(1), said.append),
        )
        waiter.start()
        time.sleep(1.2)
        assert not built and len(said) >= 3
        entry.mkdir()  # the other build completes
    waiter.join(timeout=30)
    assert not waiter.is_alive() and not built  # found complete: not built twice
    assert said[0].startswith("waiting for venv-x: another npuforge process on this machine")


# A step that runs a job through run_reporting, the job a chunk process through
# job_stage.run_relayed: each prints its pid, then the job and the chunk sleep.
CHUNK = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
JOB = (
    "import os, sys; sys.path.insert(0, {jobs!r}); import job_stage; "
    "print(os.getpid(), flush=True); job_stage.run_relayed([sys.executable, '-c', {chunk!r}])"
)
KILLED_STEP = """
import os, sys
from npuforge.toolchain.reporting import run_reporting
run_reporting([sys.executable, "-c", {job!r}], dict(os.environ), None, "job", out=sys.stdout)
"""


def test_a_killed_step_takes_its_toolchain_job_and_the_jobs_children_with_it(tmp_path):
    """SIGKILL gives a step no chance to stop its job (in a session of its own): the job
    and the processes it starts die with their parents, so none writes on into the
    staging directory that the next run removes as an orphan."""
    jobs = str(Path(toolchain.__file__).resolve().parents[1] / "jobs")
    log = tmp_path / "step.log"
    with open(log, "w") as out:
        step = subprocess.Popen(
            [sys.executable, "-c", KILLED_STEP.format(job=JOB.format(jobs=jobs, chunk=CHUNK))],
            stdout=out,
            text=True,
        )
        deadline = time.monotonic() + 60
        while len(log.read_text().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(word) for word in log.read_text().split()[:2]]
        assert len(pids) == 2, log.read_text()
        step.kill()
        step.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), pids
