"""Checkpoint loading, inspection and synthetic checkpoints (small models, seconds)."""

import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError
from npuforge.models.rwkv.checkpoint import inspect as inspect_checkpoint
from npuforge.models.rwkv.checkpoint import load as load_checkpoint
from npuforge.models.rwkv.synthetic import (
    make_config,
    synthetic_state_dict,
    write_synthetic_checkpoint,
)

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"layers": 2, "embed": 128, "vocab": 500, "head_size": 32}


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "workflow_scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    paths = {}
    for version in (5, 6, 7):
        paths[version] = base / f"v{version}.pth"
        write_synthetic_checkpoint(paths[version], version=version, seed=1, **SMALL)
    return paths


@pytest.mark.parametrize("version", [5, 6, 7])
def test_inspect_detects_version_and_dimensions(small, version):
    info = inspect_checkpoint(small[version])
    assert info["version"] == version
    assert (info["n_layers"], info["embed_dim"], info["vocab_size"]) == (2, 128, 500)
    assert (info["head_size"], info["n_heads"]) == (32, 4)
    assert info["dtype"] == "bf16"
    assert info["sha256"] == sha(small[version])
    expected_lora = {
        5: {},
        6: {"mix": 32, "decay": 64},
        7: {"decay": 32, "aaa": 32, "mv": 32, "gate": 32},
    }
    assert info["lora_ranks"] == expected_lora[version]
    ffn = {5: 448, 6: 448, 7: 512}[version]
    assert info["ffn_dim"] == ffn
    cfg = make_config(version, 2, 128, 500, 32)
    assert info["n_params"] == sum(t.numel() for t in synthetic_state_dict(cfg).values())


def test_official_key_names_and_dtype():
    state = synthetic_state_dict(make_config(7, 1, 64, 10, 32), seed=0)
    official = ["emb.weight", "blocks.0.ln0.weight", "blocks.0.att.r_k", "blocks.0.att.x_r"]
    official += ["blocks.0.att.w1", "blocks.0.ffn.x_k", "head.weight", "ln_out.bias"]
    assert set(official) <= set(state)
    assert tuple(state["blocks.0.att.x_r"].shape) == (1, 1, 64)
    assert tuple(state["blocks.0.att.r_k"].shape) == (2, 32)
    assert tuple(state["blocks.0.ffn.key.weight"].shape) == (256, 64)
    assert {str(t.dtype) for t in state.values()} == {"torch.bfloat16"}
    v6 = synthetic_state_dict(make_config(6, 1, 64, 10, 32), seed=0)
    assert tuple(v6["blocks.0.att.time_maa_w2"].shape) == (5, 32, 64)
    assert tuple(v6["blocks.0.att.time_faaaa"].shape) == (2, 32)


def test_synthetic_is_deterministic_and_seeded(tmp_path):
    args = dict(version=7, seed=3, **SMALL)
    write_synthetic_checkpoint(tmp_path / "a.pth", **args)
    write_synthetic_checkpoint(tmp_path / "b.pth", **args)
    write_synthetic_checkpoint(tmp_path / "c.pth", **{**args, "seed": 4})
    assert sha(tmp_path / "a.pth") == sha(tmp_path / "b.pth")
    assert sha(tmp_path / "a.pth") != sha(tmp_path / "c.pth")
    write_synthetic_checkpoint(tmp_path / "a.safetensors", fmt="safetensors", **args)
    write_synthetic_checkpoint(tmp_path / "b.safetensors", fmt="safetensors", **args)
    assert sha(tmp_path / "a.safetensors") == sha(tmp_path / "b.safetensors")
    pth, st = load_checkpoint(tmp_path / "a.pth"), load_checkpoint(tmp_path / "a.safetensors")
    assert pth.config == st.config
    for name, tensor in pth.tensors.items():
        assert tensor.equal(st.tensors[name]), name


def test_stress_changes_only_the_stressed_weights():
    cfg = make_config(7, 2, 64, 10, 32)
    plain, stress = (
        synthetic_state_dict(cfg, seed=0),
        synthetic_state_dict(cfg, seed=0, stress=True),
    )
    changed = {k for k in plain if not plain[k].equal(stress[k])}
    assert any(".att.key." in k for k in changed) and any(".ffn.value." in k for k in changed)
    assert not any(k.startswith(("emb", "head")) for k in changed)


def _save(path, state):
    import torch

    with open(path, "wb") as handle:
        torch.save(state, handle)


class Payload:
    """Pickles as a call; a weights-only loader must refuse it."""

    def __reduce__(self):
        import os

        return (os.getcwd, ())


def bad_checkpoints(tmp_path, small):
    import torch

    good = load_checkpoint(small[7]).tensors
    cases = {}
    cases["unknown layout"] = tmp_path / "unknown.pth"
    _save(cases["unknown layout"], {"model.embed.weight": torch.zeros(4, 4)})
    cases["missing key"] = tmp_path / "missing.pth"
    _save(cases["missing key"], {k: v for k, v in good.items() if k != "blocks.1.att.key.weight"})
    cases["mis-shaped key"] = tmp_path / "misshaped.pth"
    _save(cases["mis-shaped key"], {**good, "blocks.1.ffn.key.weight": torch.zeros(7, 128)})
    cases["truncated"] = tmp_path / "truncated.pth"
    data = Path(small[7]).read_bytes()
    cases["truncated"].write_bytes(data[: len(data) // 2])
    cases["code in pickle"] = tmp_path / "code.pth"
    _save(cases["code in pickle"], {"emb.weight": torch.zeros(2, 2), "hook": Payload()})
    cases["truncated safetensors"] = tmp_path / "truncated.safetensors"
    write_synthetic_checkpoint(tmp_path / "full.safetensors", fmt="safetensors", **SMALL)
    data = (tmp_path / "full.safetensors").read_bytes()
    cases["truncated safetensors"].write_bytes(data[: len(data) - 1000])
    return cases


def test_bad_inputs_give_one_line_errors_and_no_output(tmp_path, small, capsys):
    inspect_cli = load_script("inspect_checkpoint")
    export_cli = load_script("export_onnx")
    for label, path in bad_checkpoints(tmp_path, small).items():
        assert zipfile.is_zipfile(path) or label.startswith("truncated") or path.suffix != ".pth"
        out = tmp_path / f"{path.stem}.json"
        args = ["--checkpoint", str(path), "--family", "rwkv", "--out", str(out)]
        assert run_cli(inspect_cli.main, args) == 2, label
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, (label, err)
        assert not out.exists(), label
        out_dir = tmp_path / f"{path.stem}-export"
        options = '{"family": "rwkv", "variant": "decode"}'
        args = ["--checkpoint", str(path), "--options", options, "--out-dir", str(out_dir)]
        code = run_cli(export_cli.main, args)
        assert code == 2 and not out_dir.exists(), label
        capsys.readouterr()
    with pytest.raises(NpuforgeError, match="carries code"):
        load_checkpoint(tmp_path / "code.pth")
    with pytest.raises(NpuforgeError, match="missing key 'blocks.1.att.key.weight'"):
        load_checkpoint(tmp_path / "missing.pth")
    with pytest.raises(NpuforgeError, match=r"expected \[512, 128\]"):
        load_checkpoint(tmp_path / "misshaped.pth")
    with pytest.raises(NpuforgeError, match="unknown layout"):
        load_checkpoint(tmp_path / "unknown.pth")
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_exit_code_and_info_json(tmp_path, small):
    out = tmp_path / "info.json"
    assert (
        run_cli(
            load_script("inspect_checkpoint").main,
            ["--checkpoint", str(small[6]), "--family", "rwkv", "--out", str(out)],
        )
        == 0
    )
    assert json.loads(out.read_text())["version"] == 6
    # One real process: the exit status a shell sees.
    script = ROOT / "workflow_scripts" / "inspect_checkpoint.py"
    missing = tmp_path / "nope.pth"
    bad = subprocess.run(
        [
            sys.executable,
            str(script),
            "--checkpoint",
            str(missing),
            "--family",
            "rwkv",
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not found" in bad.stderr
    assert not (tmp_path / "x.json").exists()
