"""verify_onnx: exported graphs against BlinkDL's rwkv package, and the report's shape."""

import importlib.util
import json
from pathlib import Path

import pytest

from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError
from npuforge.models.rwkv.onnx_export import export_rwkv
from npuforge.models.rwkv.synthetic import cached_synthetic_checkpoint
from npuforge.verify import verify_export

ROOT = Path(__file__).resolve().parent.parent


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "workflow_scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "npuforge-synthetic"
    return lambda **args: cached_synthetic_checkpoint(base, **args)


# v5/v6: the package applies ln0 in the file's dtype, so the issue compares fp32 files;
# v7 is compared on the default bf16 file.
CASES = {5: {"dtype": "fp32"}, 6: {"dtype": "fp32"}, 7: {}}


@pytest.mark.parametrize("version", [5, 6, 7])
def test_fp32_decode_matches_rwkv_package(tmp_path, synth, version):
    pytest.importorskip("rwkv", reason="BlinkDL's rwkv package is the reference")
    ckpt = synth(version=version, seed=1, **CASES[version])
    export_rwkv(ckpt, tmp_path / "decode", chunks=2)
    report_path = tmp_path / "report.json"
    argv = ["--export", str(tmp_path / "decode"), "--checkpoint", str(ckpt)]
    argv += ["--tokens", "64", "--out", str(report_path)]
    assert run_cli(load_script("verify_onnx").main, argv) == 0
    report = json.loads(report_path.read_text())
    assert report["steps"] == 64 and report["reference"].startswith("rwkv 0.8.32 (BlinkDL")
    assert report["nan_inf"] == 0
    assert report["max_abs_rel"] <= 1e-4, report
    assert report["cosine"] >= 0.99999 and report["top1_agreement"] == 1.0
    assert report["prefill_vs_decode"] is None


def test_wrong_checkpoint_is_caught(tmp_path, synth):
    """The comparison can fail: graphs of one seed against the weights of another."""
    pytest.importorskip("rwkv", reason="BlinkDL's rwkv package is the reference")
    export_rwkv(synth(version=7, seed=1), tmp_path / "decode")
    report = verify_export([tmp_path / "decode"], synth(version=7, seed=5), steps=8)
    assert report["max_abs_rel"] > 0.1 and report["cosine"] < 0.9


def test_fp16_against_fp32_export_with_prefill(tmp_path, synth):
    ckpt = synth(version=7, seed=1)
    export_rwkv(ckpt, tmp_path / "fp32")
    export_rwkv(ckpt, tmp_path / "fp16", dtype="fp16", chunks=2)
    export_rwkv(ckpt, tmp_path / "fp16-prefill", dtype="fp16", variant="prefill", tokens=8)
    report = verify_export(
        [tmp_path / "fp16", tmp_path / "fp16-prefill"],
        steps=20,
        reference=f"onnx-fp32:{tmp_path / 'fp32'}",
    )
    assert report["runtime"].startswith("onnxruntime fp16")
    assert report["nan_inf"] == 0 and report["cosine"] >= 0.999
    assert report["top1_agreement"] >= 0.9
    pvd = report["prefill_vs_decode"]
    assert pvd["prefill_tokens"] == 16 and pvd["compared_steps"] == 20
    assert pvd["nan_inf"] == 0 and pvd["cosine"] >= 0.999


def test_bad_arguments(tmp_path, synth):
    ckpt = synth(version=7, seed=1)
    export_rwkv(ckpt, tmp_path / "prefill", variant="prefill", tokens=4)
    with pytest.raises(NpuforgeError, match="must be a decode export"):
        verify_export([tmp_path / "prefill"], ckpt, steps=4)
    with pytest.raises(NpuforgeError, match="no export.json"):
        verify_export([tmp_path / "missing"], ckpt, steps=4)
    export_rwkv(ckpt, tmp_path / "decode")
    with pytest.raises(NpuforgeError, match="unknown"):
        verify_export([tmp_path / "decode"], ckpt, steps=4, reference="tflite")
    out = tmp_path / "r.json"
    argv = ["--export", str(tmp_path / "missing"), "--checkpoint", str(ckpt), "--out", str(out)]
    assert run_cli(load_script("verify_onnx").main, argv) == 2 and not out.exists()


def test_llama_prefill_then_decode_continues_positions(tmp_path):
    # The KV-cache graphs take position-indexed inputs (mask, RoPE rows, write slots):
    # decode must continue at the prefill's position, not restart at 0.
    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import weights as llama_weights

    dims = dict(layers=2, embed=32, heads=4, kv_heads=2, vocab=64, intermediate=48, seed=5)
    llama_weights.write_synthetic_checkpoint(tmp_path / "ckpt", **dims)
    for variant, tokens in (("decode", 1), ("prefill", 4)):
        llama_export.export_llama(
            tmp_path / "ckpt", tmp_path / variant, variant=variant, tokens=tokens, cache_len=16
        )
    report = verify_export([tmp_path / "decode", tmp_path / "prefill"], tmp_path / "ckpt", steps=12)
    assert report["max_abs_rel"] <= 1e-4 and report["top1_agreement"] == 1.0
    pvd = report["prefill_vs_decode"]
    assert pvd["prefill_tokens"] == 8 and pvd["compared_steps"] == 12
    assert pvd["max_abs_rel"] <= 1e-5, pvd
