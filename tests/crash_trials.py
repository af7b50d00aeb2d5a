"""Kill-and-resume trials of whole workflow runs (used by tests and bench/reliability.py).

A trial starts a build in its own process group, SIGKILLs the whole group at a
seeded random moment, reruns the same command (after ``snakemake --unlock``: a
killed run leaves Snakemake's directory lock behind), and compares every release
file with a clean build's bytes.

Fetch trials (``run_fetch_trials``) build a model whose checkpoint comes from a
loopback Hugging Face hub that serves it slowly, and kill the build while the
download is under way (or just after, while fetch copies and checks it).
"""

import contextlib
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from conftest import REPO, copy_workflow, script_env


@dataclass
class Trial:
    target: str
    kill_at: float
    stage: str
    resumed: bool
    identical: bool
    leftovers: list
    partial_downloads: list = field(default_factory=list)  # fetch trials: HF cache
    differs: list = field(default_factory=list)  # release files whose bytes differ


def snakemake_cmd(*args):
    return [sys.executable, "-m", "snakemake", "--cores", "2", *map(str, args)]


def release_digests(results: Path, part: str = "release") -> dict:
    """sha256 of every file under ``results/<part>``."""
    root = results / part
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(results: Path) -> list:
    """Temporary files a killed job left where a later run would find them (logs aside)."""
    return sorted(
        str(p.relative_to(results))
        for p in results.rglob(".*.tmp")
        if "logs" not in p.relative_to(results).parts
    )


def partial_downloads(hf_home: Path) -> list:
    """Partial downloads a killed fetch left in the Hugging Face cache. huggingface_hub
    names each download's temporary file uniquely and never resumes from one, so no later
    run trusts them; they only take space."""
    return sorted(str(p.relative_to(hf_home)) for p in hf_home.rglob("*.incomplete"))


def clean_build(workdir: Path, config: list, args=(), env=None, prepare=None, part="release"):
    wf = copy_workflow(workdir / "clean")
    if prepare:
        prepare(wf)
    start = time.monotonic()
    result = subprocess.run(
        snakemake_cmd(*args, "--config", *config, f"results={wf / 'results'}"),
        cwd=wf,
        env=env(wf) if env else script_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return release_digests(wf / "results", part), time.monotonic() - start


def running_rules(log_text: str) -> str:
    """The rules whose jobs had started and not finished when the run was killed."""
    started = dict(
        (job, rule)
        for rule, job in re.findall(r"^(?:localrule|rule) (\w+):\n(?:.*\n)*?\s+jobid: (\d+)",
                                    log_text, re.M)
    )  # fmt: skip
    finished = set(re.findall(r"Finished jobid: (\d+)", log_text))
    running = sorted({rule for job, rule in started.items() if job not in finished})
    return ",".join(running) or ("planning" if not started else "between jobs")


def wait_for(condition, proc, timeout: float) -> float:
    """Seconds until ``condition()`` held (polled), or until the build ended."""
    start = time.monotonic()
    while not condition() and proc.poll() is None and time.monotonic() - start < timeout:
        time.sleep(0.02)
    return time.monotonic() - start


def kill_trial(
    workdir: Path, config: list, kill_at: float, reference: dict, name: str,
    *, args=(), env=None, prepare=None, started=None, label=None, part="release",
) -> Trial:  # fmt: skip
    """Kill ``kill_at`` seconds after the start (or after ``started(wf)`` first holds)."""
    wf = copy_workflow(workdir / name)
    if prepare:
        prepare(wf)
    environ = env(wf) if env else script_env()
    results = wf / "results"
    cmd = snakemake_cmd(*args, "--config", *config, f"results={results}")
    log = wf / "killed-run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=wf, env=environ, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        waited = wait_for(lambda: started(wf), proc, 600) if started else 0.0
        try:
            proc.wait(timeout=kill_at)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stage = running_rules(log.read_text(errors="replace"))
    subprocess.run(snakemake_cmd(*args, "--unlock", "--config", *config, f"results={results}"),
                   cwd=wf, env=environ, capture_output=True)  # fmt: skip
    rerun = subprocess.run(cmd, cwd=wf, env=environ, capture_output=True, text=True)
    resumed = rerun.returncode == 0
    digests = release_digests(results, part) if resumed else {}
    differs = sorted(k for k in {*reference, *digests} if reference.get(k) != digests.get(k))
    target = label or config[1].split("=", 1)[1]
    trial = Trial(target, round(waited + kill_at, 2), stage, resumed, resumed and not differs,
                  leftovers(results), differs=differs)  # fmt: skip
    if not resumed:
        trial.differs = [f"rerun failed: {(rerun.stderr or rerun.stdout).strip()[-300:]}"]
    return trial


def run_trials(workdir: Path, config: list, count: int, seed: int, on_trial=None) -> list[Trial]:
    """``count`` kills at seeded moments spread over a clean build's duration."""
    reference, duration = clean_build(workdir, config)
    rng = random.Random(seed)
    trials = []
    for index in range(count):
        kill_at = rng.uniform(0.3, max(0.6, duration * 0.97))
        name = f"trial{index}-{config[1].split('=', 1)[1]}"
        trials.append(kill_trial(workdir, config, kill_at, reference, name))
        discard_if_clean(trials[-1], workdir / name)
        if on_trial:
            on_trial(trials[-1])
    return trials


def discard_if_clean(trial: Trial, trial_dir: Path) -> None:
    """A trial that resumed cleanly needs no evidence kept (a build is ~100 MB)."""
    if trial.identical and not trial.leftovers:
        shutil.rmtree(trial_dir, ignore_errors=True)


# The fetch trials' model: rwkv7-tiny's weights, downloaded from the loopback hub.
SLOW_REPO = "npuforge-test/slow-tiny"
SLOW_FILE = "rwkv-tiny.pth"
DOWNLOAD_S = 2.0  # how long the throttled hub takes to send the checkpoint


def slow_hub_handler(data: bytes):
    """The loopback hub of tests/test_fetch.py, sending file bodies in 64 pieces over
    ``DOWNLOAD_S`` seconds, so that a kill can land inside the download."""
    from test_fetch import REPO_FILES, HubHandler

    REPO_FILES[SLOW_REPO] = {SLOW_FILE: data}
    piece = max(1, len(data) // 64)

    class SlowHub(HubHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            body = self._resolve()
            if body is None:
                return
            with contextlib.suppress(OSError):  # the killed client hung up
                for start in range(0, len(body), piece):
                    self.wfile.write(body[start : start + piece])
                    time.sleep(DOWNLOAD_S / 64)

    return SlowHub


def run_fetch_trials(
    workdir: Path, count: int, seed: int, whole_build=True, on_trial=None
) -> list[Trial]:
    """``count`` kills of an onnx build whose checkpoint downloads from the loopback hub,
    each at a seeded moment between the start of the download and shortly after its end
    (the fetch then copies the file into results/ and checks its sha256). With
    ``whole_build`` False the runs stop after the fetch (``--until fetch``) and the
    fetched checkpoint and record are compared instead of the release (CI: seconds)."""
    from test_fetch import COMMIT, REPO_FILES, hf_env, loopback_server

    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    tiny = yaml.safe_load((REPO / "config" / "models.yaml").read_text())["rwkv7-tiny"]
    workdir.mkdir(parents=True, exist_ok=True)
    source = workdir / "tiny.pth"
    write_synthetic_checkpoint(source, **tiny["source"]["synthetic"], fmt="pth")
    data = source.read_bytes()
    entry = {
        **tiny,
        "source": {"hf": {"repo": SLOW_REPO, "filename": SLOW_FILE, "revision": COMMIT}},
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    config = ["model=tiny-hf", "target=onnx"]
    args = ("--configfile", "hub-model.yaml")
    part = "release" if whole_build else "models"
    if not whole_build:
        args += ("--until", "fetch")
    try:
        with loopback_server(slow_hub_handler(data)) as url:

            def prepare(wf):
                (wf / "hub-model.yaml").write_text(yaml.safe_dump({"models": {"tiny-hf": entry}}))

            def env(wf):
                return hf_env(wf, url)

            def downloading(wf):
                return any((wf / "hf_home").rglob("*.incomplete"))

            reference, _ = clean_build(workdir, config, args, env, prepare, part)
            assert reference, f"the clean build wrote nothing under results/{part}"
            rng = random.Random(seed)
            trials = []
            for index in range(count):
                trial = kill_trial(
                    workdir, config, rng.uniform(0.0, DOWNLOAD_S * 1.25), reference,
                    f"trial{index}-hf", args=args, env=env, prepare=prepare,
                    started=downloading, label="onnx/hf", part=part,
                )  # fmt: skip
                trial.partial_downloads = partial_downloads(
                    workdir / f"trial{index}-hf" / "hf_home"
                )
                discard_if_clean(trial, workdir / f"trial{index}-hf")
                trials.append(trial)
                if on_trial:
                    on_trial(trial)
    finally:
        REPO_FILES.pop(SLOW_REPO, None)
    return trials
