"""Container toolchains: the base image, an image per backend and definition (built,
labelled with its inputs, evicted beyond the kept versions) and the Debian userland it
holds, as a digest."""

import functools
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from npuforge.cache import build_once, evict_older
from npuforge.errors import NpuforgeError
from npuforge.toolchain.definitions import (
    BASE_IMAGE,
    CONTAINER_PYTHON,
    REPO_ROOT,
    backend_module,
    env_dir,
    image_name,
    typed_options,
)
from npuforge.toolchain.machine_cache import (
    IMAGE_LAYER_COPIES,
    check_free_space,
    image_marker,
    report_eviction,
)
from npuforge.toolchain.reporting import run_logged, waiting_reporter


def _image_store(engine: str) -> Path:
    """Where the engine keeps image layers (rootful podman: /var/lib/containers/storage)."""
    field = {"podman": "{{.Store.GraphRoot}}", "docker": "{{.DockerRootDir}}"}[engine]
    probe = subprocess.run([engine, "info", "--format", field], capture_output=True, text=True)
    return Path(probe.stdout.strip() or "/")


def build_base_image(engine: str, log) -> None:
    """Build the Debian bookworm base image from the configured apt mirror (no registry needed)."""
    script = REPO_ROOT / "envs" / "base" / "build-base-image.sh"
    run_logged(["bash", script, engine, BASE_IMAGE], log=log, what="building the base image")


def image_exists(engine: str, image: str) -> bool:
    if engine == "podman":
        return subprocess.run([engine, "image", "exists", image]).returncode == 0
    probe = subprocess.run([engine, "image", "inspect", image], capture_output=True)
    return probe.returncode == 0


# Image labels that name what an image was built from beyond envs/<backend>/.
INPUT_LABEL_PREFIX = "npuforge."


def remove_image(engine: str, image: str) -> None:
    """Remove ``image`` and the untagged build layers only it used (podman keeps each
    build step as an image); a layer another image builds on stays."""

    def inspect(ref, field):
        probe = subprocess.run(
            [engine, "image", "inspect", "--format", field, ref], capture_output=True, text=True
        )
        return probe.stdout.strip() if probe.returncode == 0 else None

    parent = inspect(image, "{{.Parent}}")
    if subprocess.run([engine, "rmi", image], capture_output=True).returncode != 0:
        return
    while parent and inspect(parent, "{{len .RepoTags}}") == "0":
        above = inspect(parent, "{{.Parent}}")
        if subprocess.run([engine, "rmi", parent], capture_output=True).returncode != 0:
            return
        parent = above


def evict_older_images(backend, engine, image, log) -> None:
    """Remove the images of ``image``'s repository beyond the cache's kept versions,
    least recently used first (one never used by this npuforge counts as oldest)."""
    listed = subprocess.run(
        [engine, "images", "--format", "{{.Repository}}:{{.Tag}}", image.rsplit(":", 1)[0]],
        capture_output=True,
        text=True,
    )
    names = {image_marker(name): name for name in listed.stdout.split() if name != image}
    removed, busy = evict_older(list(names), lambda marker: remove_image(engine, names[marker]))
    report_eviction(backend, [names[m] for m in removed], [names[m] for m in busy], log)


def prepare_container(backend, engine, repo_root, target_options, log) -> dict:
    image = image_name(backend, repo_root)
    evict_older_images(backend, engine, image, log)

    def build():
        check_free_space(backend, _image_store(engine), layer_copies=IMAGE_LAYER_COPIES)
        _build_image(backend, engine, image, repo_root, target_options, log)

    # Another checkout may be building the same image: the second waits, then reuses it.
    present = functools.partial(image_exists, engine, image)
    build_once(image_marker(image), present, build, say=waiting_reporter(log))
    versions = _run_in_image(
        engine,
        image,
        [CONTAINER_PYTHON, "-"],
        "versions.py",
        stdin=(env_dir(backend, repo_root) / "versions.py").read_text(),
    )
    described = {
        "image": image,
        "versions": json.loads(versions),
        "debian_packages": debian_package_digest(
            _run_in_image(engine, image, DPKG_LISTING, "dpkg-query")
        ),
    }
    inputs = _image_input_labels(engine, image)
    if inputs:
        described["image_inputs"] = inputs
    return described


def _build_image(backend, engine, image, repo_root, target_options, log) -> None:
    if not image_exists(engine, BASE_IMAGE):
        build_base_image(engine, log)
    cmd = [engine, "build", "--network=host", "-t", image]
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        # pip inside the build trusts what the host's pip trusts.
        cmd += ["--volume", f"{cert}:/etc/npuforge-host-ca.crt:ro"]
        cmd += ["--build-arg", "PIP_CERT=/etc/npuforge-host-ca.crt"]
    cmd += _pip_source_args()
    cmd += ["-f", env_dir(backend, repo_root) / "Containerfile"]
    # A backend may need more than its envs/ directory (TPU-MLIR: a CPython 3.10).
    module = backend_module(backend)
    contexts = getattr(module, "image_build_contexts", None)
    with tempfile.TemporaryDirectory(prefix=f"npuforge-{backend}-context-") as staging:
        if contexts is not None:
            named, labels = contexts(typed_options(module, target_options), Path(staging))
            for name, path in named.items():
                cmd += ["--build-context", f"{name}={path}"]
            for key, value in labels.items():
                cmd += ["--label", f"{key}={value}"]
        cmd.append(env_dir(backend, repo_root))
        run_logged(cmd, log=log, what=f"building image {image}")


def _run_in_image(engine: str, image: str, argv, what: str, stdin=None) -> str:
    """Standard output of ``argv`` in a fresh offline container of ``image``; a failure
    says the image is broken, in one line."""
    cmd = [engine, "run", "--rm", "--network=none"] + (["-i"] if stdin is not None else [])
    ran = subprocess.run([*cmd, image, *argv], input=stdin, capture_output=True, text=True)
    if ran.returncode != 0:
        raise NpuforgeError(
            f"image {image} is broken: {what} failed: "
            + (ran.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return ran.stdout


def _image_input_labels(engine: str, image: str) -> dict:
    probe = subprocess.run(
        [engine, "image", "inspect", "--format", "{{json .Config.Labels}}", image],
        capture_output=True,
        text=True,
    )
    labels = json.loads(probe.stdout or "null") if probe.returncode == 0 else None
    return {
        key.removeprefix(INPUT_LABEL_PREFIX): value
        for key, value in sorted((labels or {}).items())
        if key.startswith(INPUT_LABEL_PREFIX)
    }


# One line per installed package, as name=version (architecture-qualified where multi-arch).
DPKG_LISTING = ["dpkg-query", "--show", "--showformat", "${binary:Package}=${Version}\n"]


def debian_package_digest(listing: str) -> dict:
    """The identity of a Debian userland: the sha256 of its sorted package=version lines.

    An image tag names the pinned inputs, but the base under them is whatever the apt
    mirror served the day it was built; this names that too.
    """
    lines = sorted({line.strip() for line in listing.splitlines() if line.strip()})
    text = "".join(f"{line}\n" for line in lines)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "count": len(lines)}


def _pip_source_args() -> list[str]:
    """Build arguments that give pip in an image build the host's extra package sources.

    Local wheel directories (PIP_FIND_LINKS) are mounted read-only at the same path,
    so a lock pin such as torch==2.13.0+cpu resolves to the very file the native
    toolchain installed.
    """
    args = []
    links = [p for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
    local = [p for p in links if Path(p).is_dir()]
    for path in local:
        args += ["--volume", f"{Path(path).resolve()}:{Path(path).resolve()}:ro"]
    if links:
        args += ["--build-arg", f"PIP_FIND_LINKS={' '.join(links)}"]
    if os.environ.get("PIP_EXTRA_INDEX_URL"):
        args += ["--build-arg", f"PIP_EXTRA_INDEX_URL={os.environ['PIP_EXTRA_INDEX_URL']}"]
    return args
