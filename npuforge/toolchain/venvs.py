"""Native toolchains: a venv per backend and definition, built from its lock in the
machine's cache and shared by every checkout."""

import json
import os
import shutil
import subprocess
import sys

from npuforge.cache import build_once, evict_older
from npuforge.errors import NpuforgeError
from npuforge.toolchain.definitions import backend_module, env_dir, typed_options
from npuforge.toolchain.machine_cache import (
    check_free_space,
    disk_full,
    native_venv,
    report_eviction,
)
from npuforge.toolchain.reporting import Tee, run_logged, run_reporting, waiting_reporter


def _native_base_python(backend: str, target_options) -> str:
    module = backend_module(backend)
    chooser = getattr(module, "native_python", None)
    if chooser is not None:
        return chooser(typed_options(module, target_options))
    return sys.executable


def _pip_environment() -> dict:
    """The host's pip settings that a build needs to reach the registry as set up here."""
    keep = (
        "PIP_CERT",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_FIND_LINKS",
        "PIP_DEFAULT_TIMEOUT",
    )
    return {k: os.environ[k] for k in keep if os.environ.get(k)}


def _versions_native(python: str, backend: str, repo_root) -> dict:
    script = env_dir(backend, repo_root) / "versions.py"
    out = subprocess.run([python, str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise NpuforgeError(
            f"toolchain '{backend}' is broken: {script.name} failed: "
            + (out.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return json.loads(out.stdout)


def prepare_native(backend, repo_root, target_options, log) -> dict:
    lock = env_dir(backend, repo_root) / "requirements.lock"
    if not lock.is_file():
        raise NpuforgeError(f"backend '{backend}' has no {lock}: cannot build a native toolchain")
    # Locks are complete (every package pinned), and some toolkits declare pins that the
    # lock deliberately overrides (rknn-toolkit2 asks for torch<=2.4): install exactly the lock.
    venv = native_venv(backend, repo_root)
    python = venv / "bin" / "python"
    # Older versions go first: their space may be what this build needs.
    others = [p for p in venv.parent.glob(f"{backend}-native-*") if p.is_dir() and p != venv]
    removed, busy = evict_older(others, shutil.rmtree)
    report_eviction(backend, [e.name for e in removed], [e.name for e in busy], log)

    def build():
        log.write(f"building the {backend} toolchain venv in {venv}\n")
        log.flush()
        shutil.rmtree(venv, ignore_errors=True)
        check_free_space(backend, venv.parent)
        base = _native_base_python(backend, target_options)
        try:
            run_logged([base, "-m", "venv", venv], log=log, what=f"creating the {backend} venv")
            env = {**os.environ, **_pip_environment()}
            # Minutes for a large lock (TPU-MLIR's: ~4 GB): pip's lines go to the step's
            # output too, with a line every 10 s while pip is quiet.
            install = [python, "-m", "pip", "install", "--no-input", "--no-deps"]
            install += ["--no-cache-dir", "-r", lock]
            log.write(f"$ {' '.join(map(str, install))}\n")
            log.flush()
            code, output = run_reporting(
                install, env, None, f"installing {lock.name}", out=Tee(log, sys.stdout)
            )
            if code != 0:
                what = f"installing {lock}"
                full = disk_full(what, output)
                raise NpuforgeError(full or f"{what} failed (exit {code}): see {log.name}")
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        (venv / ".complete").write_text("ok\n")

    # Another checkout may be building the same venv: the second waits, then reuses it.
    build_once(venv, (venv / ".complete").exists, build, say=waiting_reporter(log))
    return {"python": str(python), "versions": _versions_native(str(python), backend, repo_root)}
