"""Running a job in a prepared toolchain: the engine command line that isolates it, the
user it runs as, and its failure as one line."""

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path
from npuforge.jobs import job_stage
from npuforge.toolchain.definitions import CONTAINER_PYTHON, CONTAINER_RUNTIMES
from npuforge.toolchain.machine_cache import disk_full, environment_in_use
from npuforge.toolchain.reporting import run_reporting
from npuforge.toolchain.stamps import environment_present, read_stamp, rebuild_environment

# personality(ADDR_NO_RANDOMIZE): jobs that need the same heap addresses every run
# (rknn-toolkit2 writes raw pointers into .rknn files) turn off address randomisation.
ADDR_NO_RANDOMIZE = 0x0040000
PODMAN_DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")


def seccomp_profile(default_profile=PODMAN_DEFAULT_SECCOMP) -> Path | None:
    """The engine's default seccomp profile plus one rule: personality(ADDR_NO_RANDOMIZE).

    Everything else the default refuses stays refused (unlike seccomp=unconfined).
    Returns None when the default profile is not on this machine.
    """
    default_profile = Path(default_profile)
    if not default_profile.is_file():
        return None
    profile = json.loads(default_profile.read_text())
    profile["syscalls"].append(
        {
            "names": ["personality"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": ADDR_NO_RANDOMIZE, "valueTwo": 0, "op": "SCMP_CMP_EQ"}],
        }
    )
    text = json.dumps(profile, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"npuforge-seccomp-{digest}.json"
    if not path.is_file():
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    return path


# Container jobs never run as root: a root caller's jobs run as Debian's "nobody".
UNPRIVILEGED_UID = UNPRIVILEGED_GID = 65534


def job_user() -> tuple[int, int]:
    """The uid and gid a container job runs as: the caller's, unless the caller is root."""
    uid, gid = os.getuid(), os.getgid()
    return (UNPRIVILEGED_UID, UNPRIVILEGED_GID) if uid == 0 else (uid, gid)


def _chown_tree(paths, uid: int, gid: int) -> None:
    for top in paths:
        os.lchown(top, uid, gid)
        for parent, dirs, files in os.walk(top):
            for name in dirs + files:
                os.lchown(os.path.join(parent, name), uid, gid)


@contextlib.contextmanager
def lent_to_job_user(writable):
    """The job's writable directories (private stage directories of one job) belong to the
    job's uid while it runs, and to the caller again afterwards, whatever the outcome."""
    owner, caller = job_user(), (os.getuid(), os.getgid())
    if owner == caller:
        yield
        return
    _chown_tree(writable, *owner)
    try:
        yield
    finally:
        _chown_tree(writable, *caller)


def container_command(stamp, job_script, spec_path, *, read_only=(), writable=(), env=None):
    """The engine command line that runs one job; pure, so tests can check it."""
    engine = stamp["runtime"]
    job_script = Path(job_script).resolve()
    spec_path = Path(spec_path).resolve()
    # --init: a tiny PID 1 passes the engine's signals on; the job as PID 1 would ignore a
    # SIGTERM (no handler) and keep compiling after its step was stopped.
    cmd = [engine, "run", "--rm", "--init", "--network=none", "--tmpfs", "/tmp"]
    cmd += ["--workdir", "/tmp"]
    uid, gid = job_user()
    if engine == "podman" and os.getuid() != 0:
        cmd += ["--userns=keep-id"]
    cmd += ["--user", f"{uid}:{gid}", "-e", "HOME=/tmp"]
    profile = seccomp_profile() if engine == "podman" else None
    if profile is not None:
        cmd += ["--security-opt", f"seccomp={profile}"]
    for key, value in sorted((env or {}).items()):
        cmd += ["-e", f"{key}={value}"]
    mounts = {job_script.parent: "ro", spec_path: "ro"}
    for path in read_only:
        mounts.setdefault(Path(path).resolve(), "ro")
    for path in writable:
        mounts[Path(path).resolve()] = "rw"
    for path, mode in sorted(mounts.items()):
        cmd += ["--volume", f"{path}:{path}:{mode}"]
    cmd += [stamp["image"], CONTAINER_PYTHON, str(job_script), str(spec_path)]
    return cmd


def run_job(
    stamp_path, job_script, spec_path, *, read_only=(), writable=(), env=None, log_path=None
):
    """Run ``python job_script spec_path`` in the toolchain; raise NpuforgeError on failure."""
    stamp = read_stamp(stamp_path)
    # Twice: an eviction may remove the environment between the check and the lock.
    for _ in range(2):
        if not environment_present(stamp):
            rebuild_environment(stamp, stamp_path, log_path)
        with environment_in_use(stamp):
            if environment_present(stamp):
                return _run_job_in(stamp, job_script, spec_path, read_only, writable, env, log_path)
    raise NpuforgeError(
        f"the {stamp['backend']} toolchain was removed again as its job started: another "
        "checkout on this machine keeps evicting it; run one build at a time"
    )


def _run_job_in(stamp, job_script, spec_path, read_only, writable, env, log_path):
    # A build tool sends nothing anywhere, and ONNX Runtime's telemetry thread would.
    env = {**job_stage.NO_TELEMETRY, **(env or {})}
    if stamp["runtime"] == "native":
        cmd = [stamp["python"], str(Path(job_script).resolve()), str(Path(spec_path).resolve())]
        full_env = {**os.environ, **env}
    else:
        for path in writable:
            Path(path).mkdir(parents=True, exist_ok=True)
        cmd = container_command(
            stamp, job_script, spec_path, read_only=read_only, writable=writable, env=env
        )
        full_env = None
    lent = writable if stamp["runtime"] in CONTAINER_RUNTIMES else ()
    # Toolkits drop debug files into their working directory: give them a scratch one.
    with (
        tempfile.TemporaryDirectory(prefix="npuforge-job-") as scratch,
        lent_to_job_user([Path(p).resolve() for p in lent]),
    ):
        returncode, output = run_reporting(cmd, full_env, scratch, f"{stamp['backend']} job")
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {' '.join(map(str, cmd))}\n{output}")
    if returncode != 0:
        raise NpuforgeError(job_failure(stamp, returncode, output, log_path))
    return output


# What a job that ran out of memory prints (Python, glibc's loader, C++ toolkits).
OUT_OF_MEMORY = (
    "MemoryError",
    "Cannot allocate memory",
    "failed to map segment from shared object",
    "std::bad_alloc",
    "out of memory",
)


def job_failure(stamp: dict, returncode: int, output: str, log_path=None) -> str:
    """One line for a failed toolchain job: out of memory, a stop from outside (SIGTERM),
    a crash (killed by a signal: a negative exit code natively, 128 + the signal from a
    container engine), or an error."""
    import signal

    what = f"{stamp['backend']} job"
    where = f" (full log: {log_path})" if log_path else ""
    number = -returncode if returncode < 0 else 0
    if stamp.get("runtime") in CONTAINER_RUNTIMES and 128 < returncode < 128 + 65:
        number = returncode - 128
    elif returncode == 128 + signal.SIGTERM:  # a native job's own exit on SIGTERM
        number = signal.SIGTERM
    try:
        name = signal.Signals(number).name if number else None
    except ValueError:
        name = f"signal {number}"
    full = disk_full(f"{what} in the {stamp['runtime']} toolchain", output)
    if full:
        return full + where
    memory = [line.strip() for line in output.splitlines() if any(m in line for m in OUT_OF_MEMORY)]
    if memory or name == "SIGKILL":
        said = memory[-1] if memory else "killed by SIGKILL, as the kernel's OOM killer does"
        return (
            f"{what} ran out of memory in the {stamp['runtime']} toolchain ({said}); lower the "
            "target's memory_budget_gb in targets.yaml so the plan cuts smaller chunks, raise "
            "its compile_mem_mb (the least its compile jobs reserve) and build where that much "
            f"is free, or run fewer jobs at once (--cores){where}"
        )
    if name == "SIGTERM":
        return (
            f"{what} was stopped from outside (signal SIGTERM) in the {stamp['runtime']} "
            f"toolchain after: {_last_line(output)}; rerun the build to finish it{where}"
        )
    if name:
        return (
            f"{what} crashed ({name if name.startswith('signal') else f'signal {name}'}) in the "
            f"{stamp['runtime']} toolchain after: {_last_line(output)}; the vendor compiler "
            f"failed, not npuforge: rerun once, and report it with the log if it repeats{where}"
        )
    return f"{what} failed in the {stamp['runtime']} toolchain: {_last_error_line(output)}{where}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower():
            return line
    return lines[-1] if lines else "no output"
