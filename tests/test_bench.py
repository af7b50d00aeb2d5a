"""On-device benchmarks over adb (npuforge.bench, rule bench_device): the adb command
lines as data, the one-line stop without adb or a device, and a whole run against a
stand-in adb that runs the "device" side on this machine."""

import json
import os
import stat
import sys
import textwrap

import pytest
from conftest import copy_workflow, script_env, snakemake

from npuforge import bench
from npuforge.errors import NpuforgeError


def test_adb_command_lines(tmp_path):
    bundle = tmp_path / "rwkv7-demo" / "RK3588" / "fp16"
    commands = bench.adb_commands(
        "0123abcd", bundle, prompt="Hi 'there'", max_new_tokens=16, python="python3",
        root="/data/local/tmp/npuforge", report_out=tmp_path / "r.json",
    )  # fmt: skip
    where = "/data/local/tmp/npuforge/fp16"
    assert commands == [
        ["adb", "-s", "0123abcd", "shell", f"rm -rf {where} && mkdir -p /data/local/tmp/npuforge"],
        ["adb", "-s", "0123abcd", "push", str(bundle), "/data/local/tmp/npuforge"],
        [
            "adb", "-s", "0123abcd", "shell",
            f"cd {where} && python3 run.py --prompt 'Hi '\"'\"'there'\"'\"'' "
            "--max-new-tokens 16 --report bench_report.json",
        ],
        ["adb", "-s", "0123abcd", "pull", f"{where}/bench_report.json", str(tmp_path / "r.json")],
        ["adb", "-s", "0123abcd", "shell", f"rm -rf {where}"],
    ]  # fmt: skip


@pytest.mark.parametrize("spec", ["", "0123", "ssh:host", "adb:", "adb:a b"])
def test_bad_device_specs(spec):
    if spec:
        with pytest.raises(NpuforgeError, match="adb:SERIAL"):
            bench.parse_device(spec)
    assert bench.device_problem(spec)


class Listed:
    def __init__(self, stdout):
        self.stdout = stdout


@pytest.mark.parametrize(
    "which,listing,expected",
    [
        (None, "", "needs adb on PATH"),
        ("/usr/bin/adb", "List of devices attached\n", "not connected (adb devices lists: none)"),
        ("/usr/bin/adb", "List of devices attached\nother\tdevice\n", "lists: other"),
        ("/usr/bin/adb", "List of devices attached\nSER1\tunauthorized\n", "is unauthorized"),
        ("/usr/bin/adb", "List of devices attached\nSER1\tdevice\n", None),
    ],
)
def test_device_problem_names_what_is_missing(which, listing, expected):
    problem = bench.device_problem(
        "adb:SER1", which=lambda name: which, run=lambda *a, **k: Listed(listing)
    )
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "\n" not in problem


def test_bench_device_without_adb_stops_before_any_job(workflow):
    # Only the interpreter's directory on PATH: no adb.
    env = script_env(PATH=os.path.dirname(sys.executable))
    result = snakemake(workflow, "bench_device", "--config", "device=adb:SER1", env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("npuforge:")]
    assert lines == [
        "npuforge: bench_device needs adb on PATH (Android platform-tools); none found"
    ]
    assert "rule fetch" not in result.stdout + result.stderr
    assert not (workflow / "results" / "models").exists()


FAKE_ADB = textwrap.dedent(
    """\
    #!{python}
    # A stand-in adb: one attached "device" whose shell and storage are this machine.
    import shutil, subprocess, sys
    args = sys.argv[1:]
    if args == ["devices"]:
        print("List of devices attached\\nFAKE1\\tdevice")
        sys.exit(0)
    assert args[:2] == ["-s", "FAKE1"], args
    verb, rest = args[2], args[3:]
    if verb == "shell":
        sys.exit(subprocess.run(["sh", "-c", rest[0]]).returncode)
    if verb == "push":
        shutil.copytree(rest[0], rest[1] + "/" + rest[0].rstrip("/").split("/")[-1])
    elif verb == "pull":
        shutil.copyfile(rest[0], rest[1])
    else:
        sys.exit("unknown verb " + verb)
    """
)


@pytest.mark.slow
def test_bench_device_runs_the_bundle_runner_and_collects_its_figures(tmp_path):
    workflow = copy_workflow(tmp_path / "wf")
    tools = tmp_path / "tools"
    tools.mkdir()
    adb = tools / "adb"
    adb.write_text(FAKE_ADB.format(python=sys.executable))
    adb.chmod(adb.stat().st_mode | stat.S_IEXEC)
    env = script_env(PATH=f"{tools}{os.pathsep}{os.environ['PATH']}")
    remote = tmp_path / "device"
    settings = tmp_path / "bench.yaml"
    settings.write_text(
        json.dumps(
            {"bench": {"prompt": "Hello", "max_new_tokens": 8, "python": sys.executable,
                       "remote_root": str(remote)}}
        )
    )  # fmt: skip
    snakemake(
        workflow, "bench_device", "--configfile", settings, "--config", "device=adb:FAKE1",
        env=env, check=True,
    )  # fmt: skip
    record = json.loads(
        (workflow / "results" / "bench" / "rwkv7-demo" / "onnx" / "fp32.json").read_text()
    )
    assert record["device"] == {"kind": "adb", "serial": "FAKE1"}
    assert record["tokens_per_s"] > 0 and record["time_to_first_token_s"] > 0
    assert record["peak_rss_mb"] > 0
    assert len(record["runner_report"]["tokens"]) == 8
    assert record["commands"][1].startswith("adb -s FAKE1 push ")
    assert list(remote.iterdir()) == []  # cleaned up on the device
