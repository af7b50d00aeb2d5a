"""Bad input found while planning: one `npuforge:` line naming the problem and the fix,
a non-zero exit, no traceback, and nothing written under results/."""

import os

import pytest
import yaml
from conftest import REPO, snakemake

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
    "results is the filesystem root": {"config": ["results=/"], "says": "is the filesystem root"},
    "results is empty": {"config": ["results="], "says": "config.results is empty"},
    "results under a regular file": {
        "files": {"afile": b"x"},
        "config": ["results=@TMP@/afile/results"],
        "says": "which is a file, not a directory",
    },
    "toolchain runtime unknown": {
        "config": ["toolchain_runtime=bogus"],
        "says": "config.toolchain_runtime: 'bogus' is not one of native, podman, docker",
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
    "docker not installed": {
        "config": ["target=RK3588", "toolchain_runtime=docker"],
        "env": {"PATH": "/usr/bin:/bin"},
        "says": "docker",
        "needs_absent": "docker",
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clean_line(name, workflow, tmp_path):
    import shutil

    from npuforge import toolchain

    case = CASES[name]
    if case.get("needs") and toolchain.unavailable_reason(case["needs"], "native", {
        "target_platform": "rk3588"}):  # fmt: skip
        pytest.skip(f"needs the {case['needs']} toolchain to plan the target")
    env = None
    if "env" in case:
        from conftest import script_env

        env = script_env(**case["env"])
        if case.get("needs_absent") and shutil.which(
            case["needs_absent"], path=case["env"]["PATH"]
        ):
            pytest.skip(f"{case['needs_absent']} is installed under {case['env']['PATH']}")
    args = files_for(case, workflow, tmp_path)
    result = snakemake(workflow, "--dry-run", *args, env=env)
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
