"""Quantization fixtures and levers: the permuted twin, exact rotations, GPTQ rounding."""

import json

import numpy as np
import pytest
from llama_fixtures import TINY_CONFIGS, make_checkpoint, make_q4_1_checkpoint, reference_logits

from npuforge.errors import NpuforgeError
from npuforge.models.llama import permute


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_ckpt")
    return {kind: make_checkpoint(kind, root / kind, seed=i) for i, kind in enumerate(TINY_CONFIGS)}


def _tensors(directory):
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "smollm2", "qwen3"])
def test_permuted_twin_computes_the_same_logits_from_other_weights(checkpoints, tmp_path, kind):
    """GQA with an untied lm_head (llama), q/k/v biases (qwen2), a tied lm_head (smollm2)
    and q/k norms (qwen3): transformers gives the twin's logits within float32 rounding,
    and every tensor a permutation reaches has changed."""
    source = checkpoints[kind]
    record = permute.permute_checkpoint(source, tmp_path / "twin", seed=3)
    ids = np.random.default_rng(1).integers(0, TINY_CONFIGS[kind]["vocab_size"], (2, 24))
    want, got = reference_logits(source, ids), reference_logits(tmp_path / "twin", ids)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    before, after = _tensors(source), _tensors(tmp_path / "twin")
    assert before.keys() == after.keys()
    for name, value in before.items():
        # RoPE pairs positions within a head: q/k rows (and a Qwen3 q/k norm) stay.
        stays = any(part in name for part in ("q_proj.bias", "k_proj.bias", "q_norm", "k_norm"))
        moved = not np.array_equal(value, after[name])
        assert moved != stays, name
        assert np.array_equal(np.sort(value, axis=None), np.sort(after[name], axis=None)), name
    assert (
        record["seed"] == 3
        and record["permutations"]["ffn"] == TINY_CONFIGS[kind]["num_hidden_layers"]
    )
    config = json.loads((tmp_path / "twin" / "config.json").read_text())
    assert config == json.loads((source / "config.json").read_text())


def test_permuted_twin_of_a_q4_1_checkpoint_leaves_its_grid(tmp_path):
    """The point of the twin: a dequantized Q4_1 checkpoint's projections lie on a 4-bit
    grid, the twin's on none (here groups of 8: o_proj's columns move within a head of
    16, and a group holding whole heads would keep its values); the same seed gives the
    same bytes."""
    import torch

    from npuforge.models.llama.group_offsets import on_grid

    group = 8
    source = make_q4_1_checkpoint("llama", tmp_path / "ckpt", group=group)
    permute.permute_checkpoint(source, tmp_path / "a", seed=0)
    permute.permute_checkpoint(source, tmp_path / "b", seed=0)
    permute.permute_checkpoint(source, tmp_path / "c", seed=1)
    original, twin = _tensors(source), _tensors(tmp_path / "a")
    projections = [name for name in original if name.endswith("_proj.weight")]
    assert all(on_grid(torch.from_numpy(original[name]), group) for name in projections)
    assert not any(on_grid(torch.from_numpy(twin[name]), group) for name in projections)
    same = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert same == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert same != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_write_twin_checks_its_pin_and_leaves_nothing_behind(checkpoints, tmp_path):
    source = {"permuted": {"model": "m", "seed": 0}}
    record = permute.write_twin(
        checkpoints["smollm2"], source, None, tmp_path / "twin", tmp_path / "twin.json"
    )
    assert json.loads((tmp_path / "twin.json").read_text()) == record
    assert record["source"] == source and len(record["sha256"]) == 64
    assert (tmp_path / "twin" / "permutation.json").is_file()
    with pytest.raises(NpuforgeError, match="hashes to .* the registry pins 0000") as err:
        permute.write_twin(
            checkpoints["smollm2"], source, "0" * 64, tmp_path / "x", tmp_path / "x.json"
        )
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.json").exists()
    permute.write_twin(checkpoints["smollm2"], source, record["sha256"], tmp_path / "y",
                       tmp_path / "y.json")  # fmt: skip
