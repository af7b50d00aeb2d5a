"""Reproducible vendor binaries: the pinned process every toolchain job compiles in.

rknn-toolkit2 and QAIRT's HTP compiler copy uninitialised memory into their
binaries: struct padding holding stale pointers and the toolkit's own elapsed
times (rknn-toolkit2), and the unused 16-bit halves of fp16 constants' 128-byte
HVX vectors, which hold earlier tensors' values and freed objects' pointers
(QAIRT 2.51). What that memory holds follows the process's whole allocation
history, so a job repeats its bytes only in a process whose history repeats:

* glibc fills every fresh heap block with one pattern (``MALLOC_PERTURB_=85``);
  the tcache skips that fill and keys blocks per process, so QNN jobs turn it off
  (``glibc.malloc.tcache_count=0``); jobs use one malloc arena and one CPU
  (``one_cpu``), so threads neither race for blocks nor size their pools by the
  machine (a QNN context once took another stale byte under heavy load);
* a fixed mmap threshold (``glibc.malloc.mmap_threshold=131072``, glibc's own
  starting value): by default glibc raises it whenever a block it mapped is freed,
  so when one of QAIRT's threads freed such a block decided, for every later large
  block, whether it came from the heap or from a mapping of its own; about one QNN
  context build in four (30 runs of one chunk in one container) came out with 64
  other padding bytes, and none of 36 with the threshold fixed;
* the job's output is a pipe (``run_relayed``): the chunk process's heap history
  follows the type of its stdout and stderr (a pipe and /dev/null gave two
  contexts), so it is the same however the job itself was started;
* ``PYTHONHASHSEED=0``: Python's own allocation order (sets, dicts) repeats;
* ONNX Runtime's telemetry is off (``NO_TELEMETRY``): its thread allocated beside the
  compile at times of its own choosing;
* a clock that counts instead of ticking (``fixed_clock``): QAIRT's context
  generation allocates by the elapsed times it reads, so under load a context
  came out with other padding bytes, and rknn-toolkit2 leaves elapsed times (as
  floats) in stack slots its tensor records later copy (SmolLM2-135M: 2,475 bytes
  of chunk 0 differed build to build); libfaketime (preloaded from the
  toolchain's own pinned ``libfaketime`` wheel) makes every read advance 1 ms
  from a fixed start. QAIRT's sleeps and timed waits then never end, so of a QNN
  job only context generation runs with it; the whole rknn job does (build,
  export, simulator);
* one thread (``no_tqdm_monitor``): tqdm, which rknn-toolkit2 loads its model with,
  starts a monitor thread that wakes on its own timer and takes the GIL; where the
  main thread then hands it over follows machine load, and the calls that hand it
  over leave their stack bytes where the toolkit's tensor records later copy stale
  slots (an 8-byte value in each record differed between two builds of a 16-layer
  Llama beside three busy jobs; waking the monitor every 2 ms made two builds of
  three differ on an idle machine). The job sets tqdm's ``monitor_interval`` to 0,
  its documented switch, and ``thread_count`` records that the job ran alone;
* no address randomisation (``personality(ADDR_NO_RANDOMIZE)``, ``disable_aslr``):
  the stale pointers, and allocation decisions that depend on them, repeat.
  Container engines' default seccomp profiles refuse the call unless allowed
  (npuforge.toolchain adds a rule); the job then runs randomised and says so;
* the heap history also follows the length of every path and environment string
  the process handles (the checkout, the inputs, the toolchain venv: the dynamic
  loader resolves every shared library's real path for $ORIGIN), so the compile
  runs in a fresh process from ``/tmp/npuforge-<kind>-<hash>``, a stage whose name
  depends only on the staged spec (``make_stage``):

  - inputs are reached through symlinks with fixed names (``links``);
  - ``py/`` is a venv of fixed content: a pyvenv.cfg naming the base interpreter,
    ``bin/python`` linking to it, and site-packages hard-linked from the real venv
    when one filesystem holds both (else a symlink, and the venv's location still
    shows: ``site_packages_mode`` tells which);
  - the environment is replaced by a fixed one (``fixed_environment``), and
    modules are compiled afresh (cached .pyc files carry the paths they were
    compiled at).

What stays different is the interpreter binary and the shared libraries around
it: a native venv and a container image differ in a few dozen padding bytes, so
bytes are promised identical per toolchain runtime (the manifest names it).
``heap_settings`` reports what a process actually ran with, for the record.

Standard library only: vendor jobs import this module inside their toolchain.
"""

import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig

STAGE_ROOT = "/tmp"
# libfaketime: start at a fixed instant, each clock read advances 1 ms.
FIXED_CLOCK = "@2000-01-01 00:00:00 i0.001"
FAKETIME_LIBRARY = ("libfaketime", "vendor", "libfaketime", "src", "libfaketime.so.1")
MALLOC_PERTURB = "85"
TCACHE_OFF = "glibc.malloc.tcache_count=0"
MMAP_THRESHOLD = "glibc.malloc.mmap_threshold=131072"
ADDR_NO_RANDOMIZE = 0x0040000
# ONNX Runtime's telemetry (1.31's Linux wheels carry it) runs a thread of its own that
# allocates on timers, reads /tmp/.ses and keeps a device-id database: heap history that
# follows the machine, not the inputs (a context's padding changed when it was turned off).
NO_TELEMETRY = {"ORT_DISABLE_TELEMETRY": "1"}


def disable_aslr() -> bool:
    """Turn off address randomisation for this process's future execs and children;
    True if it took (a container's seccomp profile may refuse it)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        # unsigned long, as declared: a sign-extended -1 would not match seccomp rules.
        libc.personality.argtypes = [ctypes.c_ulong]
        current = libc.personality(0xFFFFFFFF)
        return current != -1 and libc.personality(current | ADDR_NO_RANDOMIZE) != -1
    except (OSError, AttributeError):
        return False


PR_SET_PDEATHSIG = 1


def die_with_parent(then=None):
    """A ``preexec_fn``: the child is killed when the process that started it dies, so a
    step killed with SIGKILL does not leave its toolchain job (or a job its chunk
    processes) writing into a staging directory the next run removes as an orphan.
    ``then``: another preexec function to run after. Built in the parent: the child
    only makes the call (loading a library after fork could wait on a lock forever)."""
    import ctypes
    import signal

    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the call took
                os._exit(1)
        if then is not None:
            then()

    return preexec


def one_cpu() -> None:
    """Run this process (and what it execs) on one CPU: thread pools size themselves by
    the CPUs allowed, and threads' allocations interleave by load. Any one CPU will do
    for the bytes; the one the scheduler runs it on now (it starts a process on an idle
    one), so concurrent jobs spread. Not one chosen by pid: in a container every job has
    the same small pid, and side-by-side chunk jobs all took one CPU."""
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        cpu = current_cpu()
        os.sched_setaffinity(0, {cpu if cpu in allowed else allowed[0]})


def current_cpu() -> int | None:
    """The CPU this process last ran on (field 39 of /proc/self/stat), or None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[39 - 3])  # fields after the name start at the 3rd
    except (OSError, IndexError, ValueError):
        return None


def tunable(tunables: str, name: str):
    """The value ``GLIBC_TUNABLES``-style ``tunables`` give ``name`` (the last one wins,
    as in glibc), or None."""
    values = [t.split("=", 1)[1] for t in tunables.split(":") if t.startswith(f"{name}=")]
    return values[-1] if values else None


def run_relayed(command: list, **options) -> int:
    """Run ``command`` with its stdout and stderr on one pipe whose lines go to our
    stdout; return its exit code. Its heap history then does not depend on where our
    own output goes (see the module doc)."""
    import subprocess

    options["preexec_fn"] = die_with_parent(then=options.get("preexec_fn"))
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **options
    ) as process:
        try:
            for line in process.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
        except BaseException:
            process.kill()
            raise
        return process.wait()


def heap_settings() -> dict:
    """What this process actually runs with (for compile.json)."""
    try:
        with open("/proc/self/personality", encoding="ascii") as handle:
            personality = int(handle.read(), 16)
    except (OSError, ValueError):
        personality = 0
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    preloaded = os.path.basename(os.environ.get("LD_PRELOAD", ""))
    return {
        "aslr_disabled": bool(personality & ADDR_NO_RANDOMIZE),
        "malloc_perturb": os.environ.get("MALLOC_PERTURB_") or None,
        "tcache_disabled": TCACHE_OFF in tunables.split(":"),
        "mmap_threshold": tunable(tunables, "glibc.malloc.mmap_threshold"),
        "python_hash_seed": os.environ.get("PYTHONHASHSEED") or None,
        "fixed_clock": os.environ.get("FAKETIME") if preloaded == FAKETIME_LIBRARY[-1] else None,
        "malloc_arenas": os.environ.get("MALLOC_ARENA_MAX") or None,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ort_telemetry_off": os.environ.get("ORT_DISABLE_TELEMETRY") == "1",
    }


def no_tqdm_monitor() -> None:
    """Keep tqdm from starting its monitor thread in this process (see the module doc)."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.monitor_interval = 0


def thread_count() -> int:
    """Threads this process runs now, native ones included (1 on a platform without /proc)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def fixed_clock(stage: str) -> dict:
    """Environment entries that run a staged process on the counting clock (see the
    module doc), the library reached through the stage's own site-packages."""
    site = sysconfig.get_paths()["purelib"]
    if not os.path.isfile(os.path.join(site, *FAKETIME_LIBRARY)):
        raise RuntimeError(
            f"error: this toolchain has no {'/'.join(FAKETIME_LIBRARY)}; rebuild it from "
            "its requirements.lock (it pins libfaketime)"
        )
    staged_site = os.path.join(stage, "py", "lib", _python_dir(), "site-packages")
    return {
        "LD_PRELOAD": os.path.join(staged_site, *FAKETIME_LIBRARY),
        "FAKETIME": FIXED_CLOCK,
        # File times stay real: only clock reads are pinned.
        "NO_FAKE_STAT": "1",
    }


def _system_site_packages() -> bool:
    if sys.prefix == sys.base_prefix:
        return True
    with open(os.path.join(sys.prefix, "pyvenv.cfg"), encoding="utf-8") as handle:
        for line in handle:
            key, _, value = line.partition("=")
            if key.strip() == "include-system-site-packages":
                return value.strip().lower() == "true"
    return False


def _link_tree(source: str, target: str) -> None:
    """Hard-link ``source`` at ``target`` where one filesystem holds both, else symlink it."""
    if os.stat(source).st_dev == os.stat(os.path.dirname(target)).st_dev:
        try:
            shutil.copytree(source, target, symlinks=True, copy_function=os.link)
            return
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
    os.symlink(source, target)


def _python_dir() -> str:
    return f"python{sys.version_info[0]}.{sys.version_info[1]}"


def staged_python(stage: str) -> str:
    """Lay out ``stage/py`` (see module doc); return the interpreter path to exec."""
    base = os.path.realpath(sys.executable)
    root = os.path.join(stage, "py")
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "lib", _python_dir()))
    with open(os.path.join(root, "pyvenv.cfg"), "w", encoding="utf-8") as handle:
        handle.write(
            f"home = {os.path.dirname(base)}\n"
            f"include-system-site-packages = {str(_system_site_packages()).lower()}\n"
            f"version = {platform.python_version()}\n"
        )
    os.symlink(base, os.path.join(root, "bin", "python"))
    if sys.prefix != sys.base_prefix:
        site = os.path.join(root, "lib", _python_dir(), "site-packages")
        _link_tree(sysconfig.get_paths()["purelib"], site)
    return os.path.join(root, "bin", "python")


def site_packages_mode(stage: str = ".") -> str:
    """How a staged run reaches its packages: hard-linked, symlinked, or none."""
    site = os.path.join(stage, "py", "lib", _python_dir(), "site-packages")
    if os.path.islink(site):
        return "symlinked"
    return "hard-linked" if os.path.isdir(site) else "none"


def _lock(path: str) -> int:
    """Hold an exclusive lock on ``path``, retrying if its holder removed it meanwhile."""
    import fcntl

    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stage(stage: str) -> None:
    """Delete a stage and its lock file; only the lock's holder may call this.

    The lock file goes first, while still locked: a waiter then finds its file
    unlinked and locks a fresh one, so no two jobs share a stage.
    """
    try:
        os.unlink(f"{stage}.lock")
    except FileNotFoundError:
        pass
    shutil.rmtree(stage, ignore_errors=True)


def exit_on_sigterm() -> None:
    """Make SIGTERM (a stopped build step) exit through the job's ``finally`` blocks, so
    its stage is removed: natively /tmp is no container tmpfs that goes with the job, and
    a QNN stage holds gigabytes. Python's default for SIGTERM skips every cleanup."""
    import signal

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda number, _frame: sys.exit(128 + number))


def make_stage(kind: str, staged_spec: dict, links: dict, scripts: list):
    """Create the stage for ``staged_spec``; return (stage, interpreter, lock fd).

    ``links`` maps names in the stage to real paths; ``scripts`` are copied in by
    base name. The lock file serialises the rare concurrent job with the same
    staged spec; ``remove_stage`` (called by the holder, or by a process that
    inherited the fd across exec) deletes both and so releases it.
    """
    exit_on_sigterm()
    spec_bytes = json.dumps(staged_spec, indent=1, sort_keys=True).encode()
    stage = f"{STAGE_ROOT}/npuforge-{kind}-{hashlib.sha256(spec_bytes).hexdigest()[:16]}"
    lock = _lock(f"{stage}.lock")
    shutil.rmtree(stage, ignore_errors=True)
    os.mkdir(stage, 0o700)
    for name, target in links.items():
        os.symlink(target, os.path.join(stage, name))
    python = staged_python(stage)
    for script in scripts:
        shutil.copyfile(script, os.path.join(stage, os.path.basename(script)))
    with open(os.path.join(stage, "spec.json"), "wb") as handle:
        handle.write(spec_bytes)
    return stage, python, lock


def fixed_environment(stage: str, extra: dict) -> dict:
    """The whole environment of a staged process: nothing of the caller's leaks in."""
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": stage,
        # A warm .pyc cache would allocate differently from a cold one.
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPYCACHEPREFIX": os.path.join(stage, "no-pycache"),
        **NO_TELEMETRY,
        **extra,
    }
