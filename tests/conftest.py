"""Shared helpers for the workflow-spine tests: temporary workflow copies and runners."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Job scripts import their siblings (job_stage) as top-level modules, as they do when
# run by path in a toolchain; tests that load them in-process need the same.
sys.path.append(str(REPO / "npuforge" / "jobs"))
# What a workflow run needs from the checkout; results/ and .venv stay behind.
WORKFLOW_PARTS = (
    "Snakefile",
    "config",
    "rules",
    "profiles",
    "envs",
    "workflow_scripts",
    "npuforge",
    "data",
    "report",
)


def script_env(**extra) -> dict:
    """Environment for a step CLI run as a subprocess: npuforge importable from the checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update({k: v for k, v in extra.items() if v is not None})
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
    return env


def run_script(name: str, *args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "workflow_scripts" / name), *map(str, args)],
        capture_output=True,
        text=True,
        env=env or script_env(),
        cwd=cwd,
    )


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / part)
    pin_native_runtime(dest / "config" / "config.yaml")
    return dest


def pin_native_runtime(config_file: Path):
    # The shipped default (auto) would build vendor targets in podman wherever it runs;
    # tests select the container route by name (test_vendor_builds), so each test's
    # runtime does not depend on what the machine has.
    text = config_file.read_text()
    pinned = text.replace("\ntoolchain_runtime: auto\n", "\ntoolchain_runtime: native\n")
    assert pinned != text, f"{config_file} no longer sets toolchain_runtime: auto"
    config_file.write_text(pinned)


def snakemake(workdir: Path, *args, check=False, env=None) -> subprocess.CompletedProcess:
    """Run the real snakemake CLI of this interpreter in ``workdir``."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *map(str, args)]
    result = subprocess.run(
        cmd, cwd=workdir, capture_output=True, text=True, env=env or script_env()
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(map(str, args))} failed:\n{result.stdout[-4000:]}\n"
            f"{result.stderr[-4000:]}"
        )
    return result


def rknn_stamp(scratch: Path, built_at: Path | None = None) -> tuple[Path | None, str]:
    """The rknn toolchain stamp the real-toolkit tests run with, or (None, why not):
    $NPUFORGE_RKNN_STAMP; a stamp naming $NPUFORGE_RKNN_PYTHON (written in ``scratch``);
    this checkout's results/toolchains/rknn-native.json; else the machine's native venv,
    built from the lock where none is yet (a fresh machine), stamped at ``built_at``
    (default: in ``scratch``). A failed build raises NpuforgeError."""
    from npuforge import toolchain
    from npuforge.fileio import write_json

    if os.environ.get("NPUFORGE_RKNN_STAMP"):
        return Path(os.environ["NPUFORGE_RKNN_STAMP"]), ""
    python = os.environ.get("NPUFORGE_RKNN_PYTHON")
    if python:
        stamp = scratch / "rknn-native.json"
        write_json(stamp, {"backend": "rknn", "runtime": "native", "python": python,
                           "versions": {"rknn-toolkit2": "2.5.0"}})  # fmt: skip
        return stamp, ""
    default = REPO / "results" / "toolchains" / "rknn-native.json"
    if default.is_file():
        return default, ""
    options = {"target_platform": "rk3588"}
    reason = toolchain.unavailable_reason("rknn", "native", options)
    if reason:
        return None, f"no rknn toolchain: {reason}"
    stamp = built_at or scratch / "rknn-native.json"
    toolchain.prepare("rknn", "native", stamp, target_options=options)
    return stamp, ""


# pytest-xdist (pyproject's addopts: two workers, --dist loadgroup) runs each group on one
# worker. Every test that runs a vendor compiler or simulator is in one group, so they run
# one after another: two simulators side by side fight for 2 cores (earlier runs measured
# calls 4x slower), and the vendor builds several tests share are made once per run. The
# other tests go by module, so a module's fixtures are built on one worker.
VENDOR_GROUP = "vendor-toolchains"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        vendor = item.get_closest_marker("toolchain") is not None
        group = VENDOR_GROUP if vendor else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_runtest_setup(item):
    # The images built again from nothing start with the first vendor test of the worker
    # that will run the test needing them, so that they build beside the tests before it.
    if (
        item.get_closest_marker("toolchain")
        and not ImagesFromNothing.checked
        and any(other.name == REBUILT_IMAGES_TEST for other in item.session.items)
    ):
        ImagesFromNothing.start()


def pytest_sessionfinish(session):
    ImagesFromNothing.discard()


# Per worker: the seconds its tests took and when its last one ended, printed after the
# durations so each CI log shows which worker is the critical path.
_WORKER_TIMES: dict[str, list[float]] = {}
_SESSION_START = [time.monotonic()]


def pytest_sessionstart(session):
    _SESSION_START[0] = time.monotonic()


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    busy, _ = _WORKER_TIMES.get(worker, (0.0, 0.0))
    _WORKER_TIMES[worker] = [busy + report.duration, time.monotonic()]


def pytest_terminal_summary(terminalreporter):
    if not _WORKER_TIMES:
        return
    start = _SESSION_START[0]
    terminalreporter.write_sep("=", "busy time per worker")
    for worker, (busy, last) in sorted(_WORKER_TIMES.items()):
        terminalreporter.write_line(
            f"{worker}: {busy:7.0f} s of tests, its last one ended {last - start:7.0f} s in"
        )


@pytest.fixture
def workflow(tmp_path) -> Path:
    """A private copy of the workflow to run snakemake in."""
    return copy_workflow(tmp_path / "wf")


# --------------------------------------------------------------- builds tests share
# Each vendor build several tests assert on is made once per run (session fixtures, on
# the vendor worker); a test that rebuilds does so only because rebuilding is what it
# checks. They skip, with the reason, where the toolchain cannot run.


def _unavailable(backend, runtime, target):
    import yaml

    from npuforge import toolchain

    targets = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())
    return toolchain.unavailable_reason(backend, runtime, targets[target]["options"])


# The smallest RWKV-7 for one SoC of each vendor, in the toolchain images, in one run: the
# build is done twice (the second in images built again from nothing), and rwkv7-tiny
# takes half the demo's time for the same checks (162 s against 311 s for the three).
PODMAN_MODEL = "rwkv7-tiny"
PODMAN_SELECTION = (
    "--config", f"model={PODMAN_MODEL}", "target=RK3588,SM8650,BM1688", "precision=fp16,f16",
    "toolchain_runtime=podman",
)  # fmt: skip
PODMAN_TOOLCHAINS = (("rknn", "RK3588"), ("qnn", "SM8650"), ("tpumlir", "BM1688"))


def podman_build_env() -> dict:
    # The build time model_tool writes into a bmodel is pinned (to the epoch by default).
    return script_env(SOURCE_DATE_EPOCH=None)


@pytest.fixture(scope="session")
def podman_release(tmp_path_factory) -> Path:
    """A workflow that built PODMAN_MODEL for RK3588 fp16, SM8650 fp16 and BM1688 f16 in
    the machine's toolchain images (building any image it lacks)."""
    for backend, target in PODMAN_TOOLCHAINS:
        reason = _unavailable(backend, "podman", target)
        if reason:
            pytest.skip(f"{backend} in podman: {reason}")
    workflow = copy_workflow(tmp_path_factory.mktemp("podman") / "wf")
    snakemake(workflow, *PODMAN_SELECTION, check=True, env=podman_build_env())
    return workflow


REBUILT_IMAGES_TEST = "test_images_built_again_from_nothing_give_every_release_byte_again"


class ImagesFromNothing:
    """The base and every toolchain image of PODMAN_TOOLCHAINS built again from nothing, in
    a podman storage of the run's own (CONTAINERS_STORAGE_CONF), so the machine's images,
    which other runs may be using, are never touched. An image build runs no simulator:
    it goes on in the background while the vendor tests before REBUILT_IMAGES_TEST run,
    and that test waits for it (``wait``)."""

    started = None
    checked = False

    def __init__(self):
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="npuforge-images-from-nothing-"))
        conf = self.root / "storage.conf"
        conf.write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.root / "graph"}"\n'
            f'runroot = "{self.root / "run"}"\n'
        )
        self.env = {"CONTAINERS_STORAGE_CONF": str(conf)}
        self.log = self.root / "prepare.log"
        prepares = " && ".join(
            f"{sys.executable} -m npuforge prepare {backend} podman --results {self.root}"
            for backend, _ in PODMAN_TOOLCHAINS
        )
        # Its own cache of image markers: the machine's are locked while a job uses an
        # image, and a build here would wait for the other vendor tests (or they for it).
        private = {"NPUFORGE_CACHE": str(self.root / "cache")}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                ["bash", "-c", prepares],
                cwd=REPO,
                env=script_env(**self.env, **private),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @classmethod
    def start(cls):
        if not cls.checked:
            cls.checked = True
            if not any(_unavailable(b, "podman", t) for b, t in PODMAN_TOOLCHAINS):
                cls.started = cls()
        return cls.started

    def wait(self) -> dict:
        """The storage's environment once every image is built (a failed build fails the
        test with the end of its log)."""
        returncode = self.process.wait()
        tail = self.log.read_text(errors="replace")[-3000:]
        assert returncode == 0, f"building the images from nothing failed:\n{tail}"
        return self.env

    @classmethod
    def discard(cls):
        """Stop a build still running, remove the storage's images and the storage."""
        if cls.started is None:
            return
        self, cls.started = cls.started, None
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            self.process.wait()
        env = {**os.environ, **self.env}
        subprocess.run(["podman", "rmi", "--all", "--force"], env=env, capture_output=True)
        graph = str(self.root / "graph")
        with open("/proc/self/mounts") as mounts:
            left = [line.split()[1] for line in mounts if line.split()[1].startswith(graph)]
        for mount in sorted(left, reverse=True):  # a stopped build's layers may stay mounted
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def images_from_nothing() -> dict:
    """The environment of a podman storage whose images were all built from nothing."""
    builder = ImagesFromNothing.start()
    if builder is None:
        pytest.skip("a toolchain cannot run in podman here (see the podman tests' reasons)")
    return builder.wait()


@pytest.fixture(scope="session")
def native_sm8650_release(tmp_path_factory) -> Path:
    """A workflow that built the demo for SM8650 (fp16 and a16w8) in the native QNN venv."""
    reason = _unavailable("qnn", "native", "SM8650")
    if reason:
        pytest.skip(f"qnn native: {reason}")
    workflow = copy_workflow(tmp_path_factory.mktemp("sm8650") / "wf")
    snakemake(workflow, "--config", "target=SM8650", check=True)
    return workflow


@pytest.fixture(scope="session")
def smollm2_workflow(tmp_path_factory) -> Path:
    """One workflow for the trained-model builds: they share its download, dequantized
    checkpoint, tokenizer and held-out text."""
    return copy_workflow(tmp_path_factory.mktemp("smollm2") / "wf")
