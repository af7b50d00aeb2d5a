"""Bad input found while planning: one `npuforge:` line naming the problem and the fix,
a non-zero exit, no traceback, and nothing written under results/."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, rknn_stamp, script_env, snakemake

from npuforge.settings import RUN_LOCK

TINY = yaml.safe_load((REPO / "config" / "models.yaml").read_text())["rwkv7-tiny"]


def tiny(**fields):
    return {**TINY, **fields}


def files_for(case, workflow, tmp_path):
    """Write the case's inputs; return the extra command-line arguments."""
    args = []
    if "configfile" in case:
        text = case["configfile"]
        text = text if isinstance(text, str) else yaml.safe_dump(text)
        path = workflow / "extra.yaml"
        path.write_text(text.replace("@TMP@", str(tmp_path)))
        args += ["--configfile", path]
    for name, content in case.get("files", {}).items():
        target = tmp_path / name
        if content is None:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    config = [c.replace("@TMP@", str(tmp_path)) for c in case.get("config", [])]
    return args + (["--config", *config] if config else [])


CASES = {
    "unknown top-level config key": {
        "config": ["modle=rwkv7-tiny"],
        "says": "did you mean 'model'",
    },
    "unknown key in a model overlay": {
        "configfile": {"models": {"rwkv7-tiny": {"contxt_length": 2048}}},
        "config": ["model=rwkv7-tiny"],
        "says": "models.rwkv7-tiny: unknown key 'contxt_length'; did you mean 'context_length'",
    },
    "unknown keys in a new model entry": {
        "configfile": {"models": {"typo": tiny(sha265="ab")}},
        "config": ["model=typo"],
        "says": "models.typo: unknown key 'sha265'",
    },
    "unknown key in a target overlay": {
        "configfile": {"targets": {"onnx": {"verfy": 1}}},
        "config": ["model=rwkv7-tiny"],
        "says": "targets.onnx: unknown key 'verfy'",
    },
    "enum violation in a model entry": {
        "configfile": {"models": {"rwkv7-tiny": {"format": "ggml"}}},
        "config": ["model=rwkv7-tiny"],
        "says": "models.rwkv7-tiny.format: 'ggml' is not one of pth, safetensors, hf, gguf",
    },
    "no calibration samples for a model": {
        "configfile": {"models": {"rwkv7-tiny": {"calibration": {"samples": 0}}}},
        "config": ["model=rwkv7-tiny"],
        "says": "models.rwkv7-tiny.calibration.samples: 0 is less than the minimum of 1",
    },
    "model id with a path separator": {
        "configfile": {"models": {"a/b": tiny()}},
        "config": ["model=a/b"],
        "says": "the id 'a/b' is not allowed",
    },
    "model id with ..": {
        "configfile": {"models": {"../x": tiny()}},
        "config": ["model=../x"],
        "says": "the id '../x' is not allowed",
    },
    "unknown model": {"config": ["model=rwkv9-huge"], "says": "unknown model 'rwkv9-huge'"},
    "unknown target": {"config": ["target=SM9999"], "says": "unknown target 'SM9999'"},
    "unknown precision": {"config": ["precision=int3"], "says": "unknown precision 'int3'"},
    "precision the SoC lacks": {
        "config": ["target=SM8350", "precision=fp16"],
        "says": "does not support precision 'fp16'",
    },
    "empty selection": {"config": ["model=,"], "says": "no model selected"},
    "blank item in a comma list": {
        "config": ["model=rwkv7-demo,,rwkv7-tiny"],
        "says": "model='rwkv7-demo,,rwkv7-tiny' has a blank item; remove the extra comma",
    },
    "results is the filesystem root": {"config": ["results=/"], "says": "is the filesystem root"},
    "results is empty": {"config": ["results="], "says": "config.results is empty"},
    "results under a regular file": {
        "files": {"afile": b"x"},
        "config": ["results=@TMP@/afile/results"],
        "says": "which is a file, not a directory",
    },
    "toolchain runtime unknown": {
        "config": ["toolchain_runtime=bogus"],
        "says": "config.toolchain_runtime: 'bogus' is not one of auto, native, podman, docker",
    },
    "hf revision that is a branch": {
        "configfile": {
            "models": {
                "hfrev": tiny(
                    source={"hf": {"repo": "o/n", "filename": "m.pth", "revision": "main"}},
                    sha256="0" * 64,
                )
            }
        },
        "config": ["model=hfrev"],
        "says": "a pinned commit, never a branch",
    },
    "unquoted all-digit sha256": {
        "configfile": (
            "models:\n  shazero:\n    family: rwkv\n    version: 7\n"
            "    source: {path: /nope.pth}\n    format: pth\n    context_length: 1024\n"
            "    tokenizer: rwkv-world\n    arch: {layers: 2, embed: 64, vocab: 65536}\n"
            f"    sha256: {'0' * 64}\n"
        ),
        "config": ["model=shazero"],
        "says": "YAML read it as a number: quote it",
    },
    "verify tokens zero": {
        "configfile": {"verify": {"tokens": 0}},
        "says": "config.verify.tokens: 0 is less than the minimum of 1",
    },
    "models given as a list": {
        "configfile": {"models": ["rwkv7-tiny"]},
        "says": "config.models: ['rwkv7-tiny'] is not of type object or null",
    },
    "target with an unknown backend": {
        "configfile": {
            "targets": {
                "SM9000": {
                    "backend": "hexagon",
                    "options": {},
                    "precisions": {"fp16": {}},
                    "default_precisions": ["fp16"],
                    "export": {"variants": ["decode"], "dtype": "fp32"},
                    "memory_budget_gb": 8,
                }
            }
        },
        "config": ["target=SM9000"],
        "says": "'hexagon' is not one of onnx, qnn, rknn, tpumlir",
    },
    "tokenizer hf on a single-file checkpoint": {
        "configfile": {"models": {"rwkv7-tiny": {"tokenizer": "hf"}}},
        "config": ["model=rwkv7-tiny"],
        "says": "tokenizer hf ships the checkpoint's tokenizer.json",
    },
    "relative path source": {
        "configfile": {"models": {"rel": tiny(source={"path": "inputs/x.pth"}, sha256="a" * 64)}},
        "config": ["model=rel"],
        "says": "must be an absolute path",
    },
    "gguf outside the llama family": {
        "configfile": {
            "models": {"g": tiny(source={"path": "/x.gguf"}, sha256="a" * 64, format="gguf")}
        },
        "config": ["model=g"],
        "says": "format gguf is read for the llama family only",
    },
    "calibration text missing": {
        "configfile": {"calibration": {"samples": 8, "steps": 32, "seed": 0, "text": "/nope.txt"}},
        "config": ["model=rwkv7-tiny", "target=RK3588", "precision=w8a8"],
        "says": "calibration.text /nope.txt does not exist",
        "needs": "rknn",
    },
    "calibration text directory without .txt": {
        "files": {"texts": None},
        "configfile": {
            "calibration": {"samples": 8, "steps": 32, "seed": 0, "text": "@TMP@/texts"}
        },
        "config": ["model=rwkv7-tiny", "target=RK3588", "precision=w8a8"],
        "says": "holds no .txt files",
        "needs": "rknn",
    },
    "duplicate key in a registry file": {
        "files": {"models.yaml": (REPO / "config/models.yaml").read_bytes() * 2},
        "config": ["models_registry=@TMP@/models.yaml"],
        "says": "duplicate key 'rwkv7-demo' at line",
    },
    "sha256 mismatch on a path source": {
        "files": {"x.pth": b"weights"},
        "configfile": {"models": {"m": tiny(source={"path": "@TMP@/x.pth"}, sha256="b" * 64)}},
        "config": ["model=m"],
        "says": f"but the registry pins {'b' * 64}",
    },
    "path source is a directory, format pth": {
        "files": {"adir": None},
        "configfile": {"models": {"m": tiny(source={"path": "@TMP@/adir"}, sha256="b" * 64)}},
        "config": ["model=m"],
        "says": "is a directory, but the model's format wants a file",
    },
    "path source is a file, format hf": {
        "files": {"x.pth": b"weights"},
        "configfile": {
            "models": {"m": tiny(source={"path": "@TMP@/x.pth"}, sha256="b" * 64, format="hf")}
        },
        "config": ["model=m"],
        "says": "is a file, but format hf wants a model directory",
    },
    "duplicate key in a --configfile": {
        "configfile": (
            "models:\n  rwkv7-tiny: {context_length: 512}\n  rwkv7-tiny: {context_length: 256}\n"
        ),
        "config": ["model=rwkv7-tiny"],
        "says": "duplicate key 'rwkv7-tiny' at line 3",
    },
    "results on a read-only filesystem": {
        "read_only_mount": "ro",
        "config": ["results=@TMP@/ro/results"],
        "says": "is not writable (read-only filesystem or permissions)",
    },
    "docker installed, its daemon not running": {
        "config": ["target=RK3588", "toolchain_runtime=docker"],
        "says": "Cannot connect to the Docker daemon",
        "skip_unless": lambda: docker_without_daemon(),
    },
    "docker not installed": {
        "config": ["target=RK3588", "toolchain_runtime=docker"],
        "env": {"PATH": "/usr/bin:/bin"},
        # Debian's package "docker" is a window manager's dock; the engine is docker.io.
        "says": "container engine 'docker' is not installed: install it (Debian: apt-get "
        "install docker.io)",
        "needs_absent": "docker",
    },
}


def docker_without_daemon():
    """None when a docker CLI is installed and no daemon answers it, else why not."""
    import shutil

    if shutil.which("docker") is None:
        return "docker is not installed here"
    if subprocess.run(["docker", "version"], capture_output=True).returncode == 0:
        return "a docker daemon is running here"
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clean_line(name, workflow, tmp_path):
    import shutil

    from npuforge import toolchain

    case = CASES[name]
    if case.get("needs") and toolchain.unavailable_reason(case["needs"], "native", {
        "target_platform": "rk3588"}):  # fmt: skip
        pytest.skip(f"needs the {case['needs']} toolchain to plan the target")
    if case.get("skip_unless") and case["skip_unless"]():
        pytest.skip(case["skip_unless"]())
    env = None
    if "env" in case:
        from conftest import script_env

        env = script_env(**case["env"])
        if case.get("needs_absent") and shutil.which(
            case["needs_absent"], path=case["env"]["PATH"]
        ):
            pytest.skip(f"{case['needs_absent']} is installed under {case['env']['PATH']}")
    args = files_for(case, workflow, tmp_path)
    if case.get("read_only_mount"):
        mount_point = tmp_path / case["read_only_mount"]
        mount_point.mkdir()
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
        )
        if mount.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {mount.stderr.strip()}")
    try:
        result = snakemake(workflow, "--dry-run", *args, env=env)
    finally:
        if case.get("read_only_mount"):
            subprocess.run(["umount", str(mount_point)], check=True)
    assert result.returncode != 0, result.stdout[-2000:]
    lines = [
        line
        for line in (result.stderr + result.stdout).splitlines()
        if line.strip()
        and not line.startswith(("Using workflow specific profile", "Config file config/config"))
    ]
    assert lines and lines[0].startswith("npuforge: "), "\n".join(lines[:20])
    assert case["says"] in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (workflow / "results").exists()
    assert not os.path.exists(tmp_path / "afile" / "results")


def test_results_under_the_home_directory_is_expanded_not_a_directory_named_tilde(
    tmp_path, monkeypatch
):
    from npuforge.settings import results_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    assert results_dir("~/npu-out") == f"{tmp_path}/npu-out"
    assert results_dir("~/npu-out/") == f"{tmp_path}/npu-out"


# --------------------------------------------------------------------------- found by jobs
# Bad inputs only a job can find (the checkpoint's bytes, the hub, the machine's limits,
# a crashing vendor compiler). Each runs the workflow for real and asserts the same three
# things: a non-zero exit, the first error line the user sees is npuforge's own (ahead of
# Snakemake's report of the failed job) and names the problem and the fix, no traceback;
# and nothing under results/ that a later run would trust beyond the outputs of the jobs
# that did succeed (listed per case), no temporaries.

MARKER = "PWNED"
ERROR_LINE = re.compile(r"^(npuforge:|error:|Error\b|Traceback|\w*(Error|Exception)\b)")


def synthetic_pth(path, **dims):
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    spec = {"version": 7, "layers": 2, "embed": 64, "vocab": 65536, "head_size": 32, "seed": 1}
    write_synthetic_checkpoint(path, **(spec | dims), fmt="pth")
    return path.read_bytes()


def small_pth(path):
    import torch

    torch.save({"emb.weight": torch.zeros(16, 8), "head.weight": torch.zeros(16, 8)}, path)
    return path.read_bytes()


class Payload:
    """Runs a shell command when unpickled: a hostile checkpoint's code."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def hostile_pth(path, marker):
    import torch

    torch.save({"emb.weight": torch.zeros(16, 8), "evil": Payload(f"touch {marker}")}, path)
    return path.read_bytes()


def safetensors_bytes(header: dict | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def tiny_gguf(path, architecture):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def path_model(tmp, file, data: bytes, fmt="pth", **fields):
    """A registry entry whose path: source ``tmp/file`` holds ``data``."""
    (tmp / file).write_bytes(data)
    return tiny(
        source={"path": str(tmp / file)},
        sha256=hashlib.sha256(data).hexdigest(),
        format=fmt,
        **fields,
    )


def fake_toolchain(cache: Path, job: str) -> Path:
    """A native rknn toolchain in ``cache`` whose python answers versions.py and runs the
    compile job as ``job`` (a shell snippet; "$@" is the real command line)."""
    from npuforge import toolchain

    venv = cache / "toolchains" / f"rknn-native-{toolchain.env_hash('rknn')}"
    (venv / "bin").mkdir(parents=True)
    (venv / ".complete").write_text("ok\n")
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/bash\n"
        'case "$1" in\n'
        '  *versions.py) echo \'{"rknn-toolkit2": "2.5.0"}\' ;;\n'
        f"  *) {job} ;;\n"
        "esac\n"
    )
    python.chmod(0o755)
    return venv


def real_rknn_python(tmp_path):
    """The rknn venv's python, built from the lock where none is yet (on a fresh machine
    this test runs before any RK3588 build); skips where rknn cannot run."""
    stamp, reason = rknn_stamp(tmp_path)
    if stamp is None:
        pytest.skip(reason)
    return Path(json.loads(stamp.read_text())["python"])


RUN_CASES = {
    "missing path source": {
        "model": lambda tmp: tiny(source={"path": f"{tmp}/nope.pth"}, sha256="a" * 64),
        "says": "does not exist",
    },
    "truncated pth": {
        "model": lambda tmp: path_model(tmp, "t.pth", synthetic_pth(tmp / "full.pth")[:400_000]),
        "says": "not a zip-format torch checkpoint",
    },
    "garbage bytes named pth": {
        "model": lambda tmp: path_model(tmp, "g.pth", os.urandom(4096)),
        "says": "not a zip-format torch checkpoint",
    },
    "zero-length checkpoint": {
        "model": lambda tmp: path_model(tmp, "z.pth", b""),
        "says": "is empty",
    },
    "pickle with code": {
        "model": lambda tmp: path_model(tmp, "e.pth", hostile_pth(tmp / "evil.pth", tmp / MARKER)),
        "says": "refused to load, the pickle carries code",
        "not_says": "weights_only=False",
    },
    "safetensors header not JSON": {
        "model": lambda tmp: path_model(
            tmp, "h.safetensors", safetensors_bytes(b"{not json", b"\0" * 64), "safetensors"
        ),
        "says": "unreadable safetensors header",
    },
    "safetensors offsets past the end": {
        "model": lambda tmp: path_model(
            tmp,
            "o.safetensors",
            safetensors_bytes(
                {"emb.weight": {"dtype": "F32", "shape": [16, 8], "data_offsets": [0, 512]}},
                b"\0" * 64,
            ),
            "safetensors",
        ),
        "says": "lies outside the file",
    },
    "format safetensors for a torch checkpoint": {
        "model": lambda tmp: path_model(tmp, "f.pth", synthetic_pth(tmp / "f0.pth"), "safetensors"),
        "says": "it is a torch zip checkpoint: set format: pth",
    },
    "checkpoint dims disagree with arch": {
        "model": lambda tmp: path_model(
            tmp,
            "d.pth",
            synthetic_pth(tmp / "d0.pth"),
            arch={"layers": 3, "embed": 64, "vocab": 65536, "head_size": 32},
        ),
        "says": "arch",
    },
    "gguf of an unsupported architecture": {
        "model": lambda tmp: {
            "family": "llama",
            "source": {"path": f"{tmp}/m.gguf"},
            "sha256": hashlib.sha256(tiny_gguf(tmp / "m.gguf", "mamba")).hexdigest(),
            "format": "gguf",
            "context_length": 64,
            "tokenizer": "none",
            "arch": {"layers": 1, "embed": 4, "vocab": 8},
        },
        "says": "mamba",
    },
    "hf offline with nothing cached": {
        "model": lambda tmp: tiny(
            source={"hf": {"repo": "o/n", "filename": "m.pth", "revision": "1" * 40}},
            sha256="a" * 64,
        ),
        "env": lambda tmp: {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf_home")},
        "says": "unset HF_HUB_OFFLINE",
        "empty": ["hf_home"],
    },
    "file size limit hit mid-write": {
        "model": lambda tmp: TINY,
        "ulimit": "ulimit -f 5000",
        "says": "File too large; raise the file size limit (ulimit -f)",
    },
    "disk full": {
        "model": lambda tmp: TINY,
        "tmpfs_mb": 6,
        "says": "No space left on device; free disk space",
    },
    "vendor compiler crashes": {
        "model": lambda tmp: TINY,
        "target": "RK3588",
        "toolchain": 'echo "rknn compiler: building graph"; kill -SEGV $$',
        "says": "crashed (signal SIGSEGV)",
    },
    "vendor job out of memory (ulimit -v)": {
        "model": lambda tmp: TINY,
        "target": "RK3588",
        "toolchain": 'ulimit -v 400000; exec "@RKNN@" "$@"',
        "needs_rknn": True,
        "says": "compile_mem_mb",
    },
}


def first_error_line(output: str) -> str:
    for line in output.splitlines():
        if ERROR_LINE.match(line):
            return line
    return ""


def finished_outputs(log: str, results: Path) -> set:
    """The outputs of the jobs Snakemake reports as finished, relative to ``results``."""
    outputs = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:\n)", log):
        job = re.search(r"^\s+jobid: (\d+)$", block, re.M)
        out = re.search(r"^\s+output: (.*)$", block, re.M)
        if job and out:
            outputs[job.group(1)] = out.group(1).split(", ")
    done = set(re.findall(r"Finished jobid: (\d+)", log))
    prefix = f"{results}/"
    return {
        path.removeprefix(prefix)
        for job in done
        for path in outputs.get(job, [])
        if path.startswith(prefix)
    }


def untrusted(found: set, finished: set) -> set:
    """Files under results/ that no finished job wrote (a directory output covers its files)."""
    return {f for f in found if not any(f == d or f.startswith(f"{d}/") for d in finished)}


# Bookkeeping no later job reads: per-job logs, and the wall time / memory records
# (Snakemake's benchmark files) of jobs that finished.
BOOKKEEPING = ("logs", "benchmarks")


def results_files(results: Path) -> set:
    return {
        p.relative_to(results).as_posix()
        for p in results.rglob("*")
        if p.is_file() and p.relative_to(results).parts[0] not in BOOKKEEPING and p.name != RUN_LOCK
    }


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.toolchain] if case.get("needs_rknn") else [])
        for name, case in sorted(RUN_CASES.items())
    ],
)
def test_bad_input_found_by_a_job_is_one_clean_line(name, workflow, tmp_path):
    case = RUN_CASES[name]
    tmp = tmp_path / "inputs"
    tmp.mkdir()
    extra = {"HOME": str(tmp_path / "home"), "NPUFORGE_CACHE": str(tmp_path / "cache")}
    if case.get("needs_rknn"):
        rknn = real_rknn_python(tmp_path)
        case = {**case, "toolchain": case["toolchain"].replace("@RKNN@", str(rknn))}
    if "toolchain" in case:
        fake_toolchain(tmp_path / "cache", case["toolchain"])
    model = case["model"](tmp)
    (workflow / "extra.yaml").write_text(yaml.safe_dump({"models": {"bad": model}}))
    results = tmp_path / "results"
    mounted = False
    if case.get("tmpfs_mb"):
        results.mkdir()
        mount = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={case['tmpfs_mb']}m", "tmpfs", str(results)],
            capture_output=True,
            text=True,
        )
        if mount.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.strip()}")
        mounted = True
    env = script_env(**extra, **(case["env"](tmp) if "env" in case else {}))
    command = [
        sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "extra.yaml",
        "--config", "model=bad", f"target={case.get('target', 'onnx')}", f"results={results}",
    ]  # fmt: skip
    if "ulimit" in case:
        command = ["bash", "-c", f'{case["ulimit"]}; exec "$@"', "bash", *command]
    try:
        result = subprocess.run(command, cwd=workflow, env=env, capture_output=True, text=True)
        found = results_files(results)
        temporaries = [str(p) for p in results.rglob("*.tmp")]
    finally:
        if mounted:
            subprocess.run(["umount", str(results)], check=True)
    output = result.stderr + result.stdout
    assert result.returncode != 0, output[-3000:]
    line = first_error_line(result.stderr)
    assert line.startswith("npuforge: "), output[-4000:]
    assert case["says"] in line, line
    assert not case.get("not_says") or case["not_says"] not in line, line
    assert "Traceback" not in output, output[-4000:]
    assert temporaries == []
    assert untrusted(found, finished_outputs(result.stderr, results)) == set(), found
    assert not any(f.startswith(("compile/", "release/")) for f in found), found
    for directory in case.get("empty", []):
        assert not any(p.is_file() for p in (tmp / directory).rglob("*")), directory
    assert not (tmp / MARKER).exists(), "the pickle's code ran"
