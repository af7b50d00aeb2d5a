"""On-device benchmarks over adb: push a release bundle, run its run.py, collect the report.

    snakemake bench_device --config device=adb:SERIAL target=RK3588 ...

The adb command lines are data (``adb_commands``), so they are tested without a device.
Before any job, ``device_problem`` says in one line what is missing (adb, the device).
The device needs what the bundle's run.py needs (manifest ``runner``): a Python 3.10+
with numpy and the bundle's runtime (rknnlite on Rockchip boards; onnxruntime-qnn for
QNN bundles on devices that have it). Figures come from run.py's own report: tokens/s,
time to first token and the runner process's peak resident memory.
"""

import json
import shlex
import shutil
import subprocess
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, write_json

DEVICE_KINDS = ("adb",)
REMOTE_ROOT = "/data/local/tmp/npuforge"
REPORT = "bench_report.json"


def parse_device(spec) -> str:
    """The adb serial of ``device=adb:SERIAL``."""
    kind, _, serial = str(spec or "").partition(":")
    if kind not in DEVICE_KINDS or not serial or any(c.isspace() for c in serial):
        raise NpuforgeError(
            f"device={spec!r}: give the device as adb:SERIAL (the serial from 'adb devices')"
        )
    return serial


def device_problem(spec, which=shutil.which, run=subprocess.run) -> str | None:
    """One line naming what is missing for benchmarking on ``spec``, or None."""
    if not spec:
        return "bench_device needs a device: --config device=adb:SERIAL (see 'adb devices')"
    try:
        serial = parse_device(spec)
    except NpuforgeError as err:
        return str(err)
    adb = which("adb")
    if adb is None:
        return "bench_device needs adb on PATH (Android platform-tools); none found"
    try:
        listed = run([adb, "devices"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"'adb devices' failed ({err}); check adb"
    states = {}
    for line in listed.stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0]] = parts[1]
    if serial not in states:
        seen = ", ".join(sorted(states)) or "none"
        return f"device {serial} is not connected (adb devices lists: {seen})"
    if states[serial] != "device":
        return f"device {serial} is {states[serial]}, not ready; authorize or reconnect it"
    return None


def remote_dir(bundle_name: str, root: str = REMOTE_ROOT) -> str:
    return f"{root.rstrip('/')}/{bundle_name}"


def adb_commands(
    serial: str,
    bundle,
    *,
    prompt: str,
    max_new_tokens: int,
    python: str = "python3",
    root: str = REMOTE_ROOT,
    report_out,
) -> list[list[str]]:
    """The adb command lines of one benchmark, in order: make the directory, push the
    bundle, run run.py there (greedy, the report to a file), pull the report, clean up."""
    bundle = Path(bundle)
    where = remote_dir(bundle.name, root)
    adb = ["adb", "-s", serial]
    run = " ".join(
        [
            "cd",
            shlex.quote(where),
            "&&",
            shlex.quote(python),
            "run.py",
            "--prompt",
            shlex.quote(prompt),
            "--max-new-tokens",
            str(int(max_new_tokens)),
            "--report",
            REPORT,
        ]
    )
    return [
        [*adb, "shell", f"rm -rf {shlex.quote(where)} && mkdir -p {shlex.quote(root)}"],
        [*adb, "push", str(bundle), root],
        [*adb, "shell", run],
        [*adb, "pull", f"{where}/{REPORT}", str(report_out)],
        [*adb, "shell", f"rm -rf {shlex.quote(where)}"],
    ]


def bench_device(
    *,
    device: str,
    bundle,
    out,
    prompt: str,
    max_new_tokens: int,
    python: str = "python3",
    root: str = REMOTE_ROOT,
    run=subprocess.run,
) -> dict:
    """Run the benchmark; write ``out`` (JSON) with the device's figures."""
    serial = parse_device(device)
    bundle = Path(bundle)
    manifest = read_json(bundle / "manifest.json")
    if not (bundle / "run.py").is_file():
        raise NpuforgeError(f"{bundle} has no run.py; repackage it with this npuforge")
    with atomic_path(out) as tmp:
        pulled = Path(f"{tmp}.report")
        commands = adb_commands(
            serial, bundle, prompt=prompt, max_new_tokens=max_new_tokens, python=python,
            root=root, report_out=pulled,
        )  # fmt: skip
        for command in commands:
            result = run(command, capture_output=True, text=True)
            if result.returncode != 0:
                lines = (result.stderr or result.stdout).strip().splitlines()
                raise NpuforgeError(
                    f"{' '.join(command[:4])} ... failed on {serial}: "
                    f"{lines[-1] if lines else 'exit ' + str(result.returncode)}"
                )
        try:
            report = json.loads(pulled.read_text(encoding="utf-8"))
        finally:
            pulled.unlink(missing_ok=True)
        record = {
            "model": manifest["model"]["id"],
            "target": manifest["target"]["id"],
            "precision": manifest["precision"],
            "device": {"kind": "adb", "serial": serial},
            "device_figures": True,
            "tokens_per_s": report.get("tokens_per_s"),
            "time_to_first_token_s": report.get("time_to_first_token_s"),
            "peak_rss_mb": report.get("peak_rss_mb"),
            "runner_report": report,
            "commands": [" ".join(shlex.quote(part) for part in c) for c in commands],
        }
        write_json(tmp, record)
    return record
