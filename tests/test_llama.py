"""Llama family: parity of the exported static graphs with transformers."""

import dataclasses
import json

import numpy as np
import pytest
from llama_fixtures import (
    DECODE_STEPS,
    PREFILL,
    TINY_CONFIGS,
    OrtChain,
    make_checkpoint,
    make_q4_1_checkpoint,
    reference_logits,
    run_prefill_then_decode,
)

from npuforge.errors import NpuforgeError
from npuforge.models.llama import config as llama_config
from npuforge.models.llama import model as llama_model
from npuforge.models.llama import onnx_export as llama_export
from npuforge.models.llama import weights as llama_weights

CACHE_LEN = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_ckpt")
    return {kind: make_checkpoint(kind, root / kind, seed=i) for i, kind in enumerate(TINY_CONFIGS)}


@pytest.mark.parametrize(
    "kind, chunks, batch, fp16_fixes",
    [
        ("llama", 2, 1, False),
        ("qwen2", 1, 1, False),
        ("smollm2", 1, 2, False),
        ("qwen3", 2, 1, False),
        ("smollm2", 2, 1, False),
        ("smollm2", 2, 1, True),
        ("qwen3", 1, 1, True),
    ],
)
def test_prefill_then_decode_matches_transformers(
    checkpoints, tmp_path, kind, chunks, batch, fp16_fixes
):
    checkpoint = checkpoints[kind]
    vocab = TINY_CONFIGS[kind]["vocab_size"]
    ids = np.random.default_rng(7).integers(0, vocab, (batch, PREFILL + DECODE_STEPS))
    common = dict(
        dtype="fp32", chunks=chunks, batch=batch, cache_len=CACHE_LEN, fp16_fixes=fp16_fixes
    )
    prefill = llama_export.export_llama(
        checkpoint, tmp_path / "prefill", variant="prefill", tokens=PREFILL, **common
    )
    llama_export.export_llama(checkpoint, tmp_path / "decode", variant="decode", tokens=1, **common)
    assert prefill["chunks"] == chunks and len(prefill["graphs"]) == chunks

    got = run_prefill_then_decode(tmp_path / "prefill", tmp_path / "decode", ids)
    want = reference_logits(checkpoint, ids)
    assert got.shape == want.shape == (batch, PREFILL + DECODE_STEPS, vocab)
    error = np.abs(got - want).max()
    assert error <= 1e-4 * np.abs(want).max(), f"max |diff| {error}"


def test_tanh_silu_export_is_the_same_model_without_a_sigmoid(checkpoints, tmp_path):
    """tanh_silu writes each MLP's SiLU as x * (1/2 + tanh(x/2) / 2): the same logits as
    transformers, no Sigmoid in the graphs, and the choice recorded in export.json."""
    import onnx

    checkpoint = checkpoints["smollm2"]
    ids = np.random.default_rng(7).integers(
        0, TINY_CONFIGS["smollm2"]["vocab_size"], (1, PREFILL + 4)
    )
    common = dict(dtype="fp32", chunks=2, batch=1, cache_len=CACHE_LEN, fp16_fixes=True)
    for variant, tokens in (("prefill", PREFILL), ("decode", 1)):
        meta = llama_export.export_llama(
            checkpoint, tmp_path / variant, variant=variant, tokens=tokens, tanh_silu=True, **common
        )
        assert meta["options"]["tanh_silu"] is True
        for graph in meta["graphs"]:
            ops = [n.op_type for n in onnx.load(tmp_path / variant / graph["file"]).graph.node]
            layers = graph["layers"][1] - graph["layers"][0]
            assert "Sigmoid" not in ops and ops.count("Tanh") == layers
    got = run_prefill_then_decode(tmp_path / "prefill", tmp_path / "decode", ids)
    want = reference_logits(checkpoint, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    plain = llama_export.export_llama(checkpoint, tmp_path / "plain", variant="decode", **common)
    assert plain["options"]["tanh_silu"] is False
    graph = onnx.load(tmp_path / "plain" / plain["graphs"][0]["file"]).graph
    assert "Sigmoid" in [n.op_type for n in graph.node]


def test_fp16_safe_norm_is_exact_and_survives_massive_activations():
    import torch

    torch.manual_seed(0)
    plain = llama_model.RMSNorm(64, 1e-5)
    safe = llama_model.RMSNorm(64, 1e-5, fp16_safe=True)
    with torch.no_grad():
        plain.weight.copy_(torch.rand(64) + 0.5)
        safe.weight.copy_(plain.weight)
    x = torch.randn(3, 4, 64)
    x[0, 0, 5] = 2.2e4  # SmolLM2-135M's hidden state reaches 21,743 on its first token
    x[1] *= 1e-3  # a quiet row: the pre-scale must not push it into fp16's subnormals
    want = plain(x)
    assert torch.allclose(safe(x), want, rtol=1e-6, atol=1e-6)

    with torch.no_grad():
        plain_fp16 = plain.half()(x.half()).float()
        safe_fp16 = safe.half()(x.half()).float()
    # The plain form squares 2.2e4 (past fp16's 65,504): that row's output is lost.
    assert not torch.allclose(plain_fp16[0, 0], want[0, 0], rtol=0.05, atol=0.05)
    assert torch.allclose(safe_fp16, want, rtol=0.01, atol=0.01)


def test_ext_embedding_and_fp16_exports(checkpoints, tmp_path):
    checkpoint = checkpoints["llama"]
    ids = np.random.default_rng(11).integers(0, TINY_CONFIGS["llama"]["vocab_size"], (1, 24))
    common = {"variant": "decode", "cache_len": 24, "chunks": 2}
    plain = llama_export.export_llama(checkpoint, tmp_path / "plain", dtype="fp32", **common)
    ext = llama_export.export_llama(
        checkpoint, tmp_path / "ext", dtype="fp32", ext_embedding=True, **common
    )
    half = llama_export.export_llama(checkpoint, tmp_path / "half", dtype="fp16", **common)
    assert plain["tokens_per_call"] == 1 and plain["embedding"] is None
    assert ext["embedding"]["rows"] == TINY_CONFIGS["llama"]["vocab_size"]
    assert ext["graphs"][0]["inputs"][0]["role"] == "embedding"
    assert {s["dtype"] for s in half["graphs"][0]["inputs"][1:]} == {"float16"}

    def decode(export_dir):
        state, chain = {}, OrtChain(export_dir)
        return np.concatenate([chain(ids[:, p : p + 1], p, state) for p in range(24)], axis=1)

    want = decode(tmp_path / "plain")
    np.testing.assert_allclose(decode(tmp_path / "ext"), want, rtol=0, atol=1e-5)
    got = decode(tmp_path / "half").astype(np.float32)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_llama3_rope_scaling_matches_transformers(checkpoints):
    import torch

    checkpoint = checkpoints["llama3"]
    cfg = llama_config.load_config(checkpoint)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.tie_word_embeddings
    # The scaled frequencies must differ from plain RoPE, or this test proves nothing.
    plain = llama_config.rope_inv_freq(
        llama_config.LlamaConfig(**{**cfg.__dict__, "rope_scaling": None})
    )
    assert not np.allclose(plain, llama_config.rope_inv_freq(cfg))

    model = llama_model.build_model(cfg, llama_weights.load_state_dict(checkpoint), cache_len=40)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 40))
    caches = [torch.zeros(1, cfg.num_kv_heads, 40, cfg.head_dim) for _ in range(2)]
    host = llama_export.host_inputs(cfg, batch=1, tokens=40, cache_len=40, position=0)
    with torch.no_grad():
        got, _ = model(
            torch.from_numpy(ids),
            *(torch.from_numpy(host[role]) for role in ("mask", "rope_cos", "rope_sin")),
            torch.from_numpy(host["cache_write"]),
            torch.from_numpy(host["cache_keep"]),
            caches,
        )
    want = reference_logits(checkpoint, ids)
    assert np.abs(got.numpy() - want).max() <= 1e-4 * np.abs(want).max()


def test_export_json_describes_graph_io(checkpoints, tmp_path):
    import onnx

    meta = llama_export.export_llama(
        checkpoints["qwen2"], tmp_path / "out", variant="decode", tokens=1, chunks=2, cache_len=32
    )
    assert json.loads((tmp_path / "out" / "export.json").read_text()) == meta
    assert (meta["family"], meta["arch"], meta["tokens_per_call"]) == ("llama", "qwen2", 1)
    assert [g["layers"] for g in meta["graphs"]] == [[0, 1], [1, 2]]
    first, last = meta["graphs"]
    roles = [spec["role"] for spec in first["inputs"]]
    host_roles = ["mask", "rope_cos", "rope_sin", "cache_write", "cache_keep"]
    assert roles == ["tokens", *host_roles, "state", "state"]
    assert [spec["role"] for spec in last["outputs"]] == ["logits", "state", "state"]
    assert first["outputs"][0]["name"] == "hidden_out" and last["inputs"][0]["name"] == "hidden_in"
    cache = first["inputs"][6]
    assert cache["shape"] == [1, 2, 32, 8] and cache["output"] == "cache_0_k_out"
    for graph in meta["graphs"]:
        proto = onnx.load(str(tmp_path / "out" / graph["file"]))
        shapes = {
            v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*proto.graph.input, *proto.graph.output]
        }
        for spec in graph["inputs"] + graph["outputs"]:
            assert shapes[spec["name"]] == spec["shape"]
        assert [v.name for v in proto.graph.input] == [s["name"] for s in graph["inputs"]]
        # Position bookkeeping lives on the host: no integer compares or table gathers.
        ops = [n.op_type for n in proto.graph.node]
        assert "Equal" not in ops and ops.count("Gather") == (graph["layers"][0] == 0)


def test_extra_inputs_mask_rope_and_cache_write(checkpoints):
    cfg = llama_config.load_config(checkpoints["llama"])  # head_dim 16
    meta = {"batch": 2, "tokens_per_call": 3, "cache_len": 6, "config": dataclasses.asdict(cfg)}

    def value(role, dtype="float32"):
        return llama_export.extra_inputs(meta, {"name": role, "dtype": dtype, "role": role}, 2)

    mask = value("mask")
    assert mask.shape == (2, 1, 3, 6) and mask.dtype == np.float32
    # token at absolute position 2 sees slots 0..2; position 4 sees 0..4
    assert (mask[0, 0] == 0).tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, True, True, False],
    ]
    write = value("cache_write")
    assert write.shape == (2, 1, 6, 3)
    assert write[1, 0].T.tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]]
    assert value("cache_keep")[0, 0, :, 0].tolist() == [1, 1, 0, 0, 0, 1]
    cos, sin = value("rope_cos"), value("rope_sin", "float16")
    assert cos.shape == (2, 1, 3, 16) and sin.dtype == np.float16
    # position 3, frequency pair 1: angle 3 * theta^(-2/16)
    angle = 3 * cfg.rope_theta ** (-2 / 16)
    assert cos[0, 0, 1, 1] == pytest.approx(np.cos(angle), abs=1e-6)
    assert cos[0, 0, 1, 9] == cos[0, 0, 1, 1]  # halves duplicated, HF layout
    assert float(sin[0, 0, 1, 1]) == pytest.approx(np.sin(angle), abs=1e-3)
    with pytest.raises(NpuforgeError, match="exceeds the exported cache"):
        llama_export.extra_inputs(meta, {"name": "attention_mask", "role": "mask"}, 4)
    with pytest.raises(NpuforgeError, match="no input role 'position'"):
        llama_export.extra_inputs(meta, {"name": "position_ids", "role": "position"}, 0)


def test_inspect_llama(checkpoints):
    info = llama_weights.inspect_llama(checkpoints["smollm2"])
    c = TINY_CONFIGS["smollm2"]
    assert info["tied"] is True and info["kv_heads"] == 1 and info["head_dim"] == 8
    assert (info["dtype"], info["vocab_size"], info["n_heads"]) == ("fp32", c["vocab_size"], 4)
    e, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], 3
    attention = e * e * 2 + 2 * e * 8  # q, o and one kv head of k, v
    expected = v * e + n * (attention + 3 * e * f + 2 * e) + e
    assert info["n_params"] == expected
    assert llama_weights.inspect_llama(checkpoints["llama"])["tied"] is False


def test_rejects_unsupported_config(checkpoints, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(NpuforgeError, match="model_type 'gpt2'"):
        llama_config.load_config(folder)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NpuforgeError, match="no \\*.safetensors"):
        llama_export.export_llama(folder, tmp_path / "out", variant="decode", tokens=1, cache_len=8)
    assert not (tmp_path / "out").exists()
    with pytest.raises(NpuforgeError, match="decode variant takes 1 token"):
        llama_export.export_llama(folder, tmp_path / "out", variant="decode", tokens=4)


def test_synthetic_checkpoint_runs_through_graph_chain(tmp_path):
    from npuforge.fileio import sha256_file
    from npuforge.runtime import GraphChain

    dims = dict(layers=2, embed=32, heads=4, kv_heads=2, vocab=50, intermediate=48, arch="qwen2")
    info = llama_weights.write_synthetic_checkpoint(tmp_path / "a", seed=3, **dims)
    llama_weights.write_synthetic_checkpoint(tmp_path / "b", seed=3, **dims)
    for name in ("config.json", "model.safetensors"):
        assert sha256_file(tmp_path / "a" / name) == sha256_file(tmp_path / "b" / name)
    assert (info["arch"], info["kv_heads"], info["tied"]) == ("qwen2", 2, False)

    # Four consecutive AR-8 prefill calls: positions and cache writes advance per call.
    llama_export.export_llama(
        tmp_path / "a", tmp_path / "x", variant="prefill", tokens=8, cache_len=32
    )
    ids = np.random.default_rng(0).integers(0, 50, (1, 32))
    got = GraphChain(tmp_path / "x").run(ids)
    want = llama_weights.reference_logits(tmp_path / "a", ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_export_is_deterministic_and_external_data_loads(checkpoints, tmp_path):
    from npuforge.runtime import GraphChain

    options = {"variant": "decode", "cache_len": 16, "chunks": 2, "sha": True}
    first = llama_export.export_llama(checkpoints["qwen2"], tmp_path / "a", **options)
    again = llama_export.export_llama(checkpoints["qwen2"], tmp_path / "b", **options)
    assert [g["sha256"] for g in first["graphs"]] == [g["sha256"] for g in again["graphs"]]

    external = llama_export.export_llama(
        checkpoints["qwen2"], tmp_path / "c", external_data=True, **options
    )
    for graph in external["graphs"]:
        data = tmp_path / "c" / graph["external_data"]["file"]
        assert data.is_file() and data.stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "chunk0.onnx",
        "chunk0.onnx.data",
        "chunk1.onnx",
        "chunk1.onnx.data",
        "export.json",
    ]
    ids = np.random.default_rng(1).integers(0, TINY_CONFIGS["qwen2"]["vocab_size"], (1, 16))
    np.testing.assert_array_equal(
        GraphChain(tmp_path / "c").run(ids), GraphChain(tmp_path / "a").run(ids)
    )


def test_config_layouts_old_and_new(tmp_path):
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    layouts = {
        # transformers < 5: rope_theta and rope_scaling at the top level
        "old": {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}},
        # transformers >= 5: one rope_parameters dict
        "new": {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", **scaling}},
    }
    for name, extra in layouts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**base, **extra}))
        cfg = llama_config.load_config(tmp_path / name)
        assert (cfg.rope_theta, cfg.rope_scaling["factor"]) == (5e5, 8.0)
        assert (cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias) == (2, 4, False)

    (tmp_path / "linear").mkdir()
    linear = {**base, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "linear" / "config.json").write_text(json.dumps(linear))
    with pytest.raises(NpuforgeError, match="RoPE type 'linear'"):
        llama_config.load_config(tmp_path / "linear")


@pytest.mark.parametrize("kind, chunks, batch", [("smollm2", 2, 2), ("qwen3", 1, 1)])
def test_kv_prefix_state_continues_the_sequence_transformers_runs(
    checkpoints, tmp_path, kind, chunks, batch
):
    """Graphs that start from a kv_prefix give the logits of the prefixed sequence."""
    from npuforge.runtime import GraphChain

    checkpoint, vocab = checkpoints[kind], TINY_CONFIGS[kind]["vocab_size"]
    prefix = [3, vocab - 1]
    ids = np.random.default_rng(5).integers(0, vocab, (batch, 20))
    for variant, tokens in (("prefill", 4), ("decode", 1)):
        meta = llama_export.export_llama(
            checkpoint, tmp_path / variant, variant=variant, tokens=tokens, dtype="fp32",
            chunks=chunks, batch=batch, cache_len=32, fp16_fixes=True, kv_prefix=prefix,
        )  # fmt: skip
        assert meta["kv_prefix"]["tokens"] == prefix and meta["kv_prefix"]["slots"] == 2
    prefill, decode = GraphChain(tmp_path / "prefill"), GraphChain(tmp_path / "decode")
    got = [prefill.step(ids[:, :4])]
    decode.state, decode.position = prefill.state, prefill.position
    got += [decode.step(ids[:, p : p + 1]) for p in range(4, 20)]
    want = reference_logits(checkpoint, np.concatenate([np.tile(prefix, (batch, 1)), ids], 1))
    got = np.concatenate(got, axis=1)
    assert np.abs(got - want[:, 2:]).max() <= 1e-4 * np.abs(want).max()
    # Without the prefix the same ids give other logits: the state is not ignored.
    assert np.abs(reference_logits(checkpoint, ids) - got).max() > 1e-2 * np.abs(want).max()


def test_kv_prefix_is_refused_when_it_does_not_fit(checkpoints, tmp_path):
    with pytest.raises(NpuforgeError, match="kv_prefix .* fewer than cache_len"):
        llama_export.export_llama(
            checkpoints["llama"], tmp_path / "x", variant="decode", cache_len=2, kv_prefix=[1, 2]
        )
    assert not (tmp_path / "x").exists()


def _outlier_model(checkpoint):
    """The checkpoint's torch model with one stream channel 100x the rest after every norm,
    as trained models have (the channel SmolLM2's massive activations live in)."""
    import torch

    cfg = llama_config.load_config(checkpoint)
    model = llama_model.build_model(cfg, llama_weights.load_state_dict(checkpoint), CACHE_LEN)
    with torch.no_grad():
        for block in model.layers:
            block.input_layernorm.weight[1] *= 100
            block.post_attention_layernorm.weight[1] *= 100
    return model


def _spread(ranges, name):
    """How far the largest input channel of a linear layer stands above the median one."""
    values = ranges[name]
    return float(values.max() / values.median())


@pytest.mark.parametrize("kind", ["qwen2", "smollm2", "qwen3"])
def test_smoothquant_keeps_the_logits_and_evens_the_activation_channels(checkpoints, kind):
    from npuforge.models.llama import smoothing

    checkpoint, vocab = checkpoints[kind], TINY_CONFIGS[kind]["vocab_size"]
    model = _outlier_model(checkpoint)
    sequences = np.random.default_rng(3).integers(0, vocab, (4, 24)).tolist()
    ids = np.random.default_rng(4).integers(0, vocab, 20).tolist()

    def run(tokens):
        llama_export.run_from_empty_cache(model, [tokens], CACHE_LEN)

    def logits():
        return llama_export.run_from_empty_cache(model, [[0, *ids]], CACHE_LEN)[0].numpy()

    before = logits()
    ranges = smoothing.activation_ranges(model, sequences, [0], CACHE_LEN - 1, run)
    summary = smoothing.smooth(model, ranges, 0.7)
    after_ranges = smoothing.activation_ranges(model, sequences, [0], CACHE_LEN - 1, run)
    after = logits()
    assert np.abs(after - before).max() <= 1e-4 * np.abs(before).max()
    for name in ("layers.0.self_attn.q_proj", "layers.1.mlp.gate_proj"):
        assert _spread(ranges, name) > 20
        assert _spread(after_ranges, name) < _spread(ranges, name) / 5
    # v_proj's rows are rescaled too (o_proj's inputs).
    assert summary["channels"] == model.cfg.num_layers * (
        2 * model.cfg.hidden_size + model.cfg.num_kv_heads * model.cfg.head_dim
    )
    with pytest.raises(NpuforgeError, match="alpha must lie in"):
        smoothing.smooth(model, ranges, 1.5)


def _matmul_inputs_of_unknown_shape(path) -> list[str]:
    """MatMul inputs whose shape ONNX shape inference cannot give: a backend pass that
    keys on shapes (the QNN job's row-MatMul rewrite) would skip those MatMuls."""
    import onnx
    from onnx import shape_inference

    model = onnx.load(str(path), load_external_data=False)
    inferred = shape_inference.infer_shapes(model).graph
    shaped = {
        v.name
        for v in [*inferred.value_info, *inferred.input, *inferred.output]
        if v.type.tensor_type.shape.dim
        and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)
    }
    weights = {i.name for i in model.graph.initializer}
    return [
        name
        for node in model.graph.node
        if node.op_type == "MatMul"
        for name in node.input
        if name not in shaped and name not in weights
    ]


def test_group_offsets_keep_the_logits_and_start_each_group_at_zero(tmp_path):
    """Each projection's per-group minima move into a side matmul: the graphs still
    match transformers, every group of the main weight starts at exactly 0, and the
    export counts the projections that lay on a 4-bit grid (all of a Q4_1 checkpoint's,
    none of a random one's)."""
    import onnx
    from onnx import numpy_helper

    checkpoint, vocab = make_q4_1_checkpoint("smollm2", tmp_path / "ckpt"), 72
    common = dict(dtype="fp32", chunks=1, batch=1, cache_len=CACHE_LEN, fp16_fixes=True)
    offsets = {"group": 32}
    prefill = llama_export.export_llama(
        checkpoint, tmp_path / "p", variant="prefill", tokens=PREFILL, group_offsets=offsets,
        **common,
    )  # fmt: skip
    llama_export.export_llama(
        checkpoint, tmp_path / "d", variant="decode", tokens=1, group_offsets=offsets, **common
    )
    # 3 layers x 7 projections, all on the grid.
    assert prefill["group_offsets"] == {"group": 32, "matmuls": 21, "on_4bit_grid": 21}
    assert prefill["options"]["group_offsets"] == 32
    ids = np.random.default_rng(5).integers(0, vocab, (1, PREFILL + DECODE_STEPS))
    got = run_prefill_then_decode(tmp_path / "p", tmp_path / "d", ids)
    want = reference_logits(checkpoint, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()

    graph = onnx.load(str(tmp_path / "p" / "chunk0.onnx")).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    down = weights["layers.1.mlp.down_proj.weight_t"]  # [in 64, out 32]
    groups = down.T.reshape(32, 2, 32)
    assert np.all(groups.min(-1) == 0) and groups.max() > 0
    side = weights["layers.1.mlp.down_proj.group_offsets.weight_t"]  # [in 64 / 32, out 32]
    assert side.shape == (2, 32) and np.abs(side).max() > 0
    sides = [n.name for n in graph.node if n.name.endswith("/group_offsets/MatMul")]
    assert len(sides) == 21
    assert _matmul_inputs_of_unknown_shape(tmp_path / "d" / "chunk0.onnx") == []

    random = llama_export.export_llama(
        make_checkpoint("smollm2", tmp_path / "random"), tmp_path / "r", variant="decode",
        tokens=1, group_offsets=offsets, **common,
    )  # fmt: skip
    assert random["group_offsets"]["on_4bit_grid"] == 0
    with pytest.raises(NpuforgeError, match="not a multiple of the group 48") as err:
        llama_export.export_llama(
            checkpoint, tmp_path / "x", variant="decode", tokens=1, group_offsets={"group": 48},
            **common,
        )  # fmt: skip
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


def test_block_centres_keep_the_logits_and_centre_each_mlp_group_on_a_signed_4bit_grid(
    tmp_path,
):
    """Each MLP projection's per-group centres move into a side matmul: the graphs still
    match transformers, every group of a Q4_1 checkpoint's main weight spans exactly
    -8..7 steps of (max - min) / 15 (a signed 4-bit grid with zero point 0), and the
    attention projections (which the MHA->SHA pass splits per head) are left whole."""
    import onnx
    from onnx import numpy_helper

    checkpoint, vocab = make_q4_1_checkpoint("smollm2", tmp_path / "ckpt"), 72
    common = dict(dtype="fp32", chunks=1, batch=1, cache_len=CACHE_LEN, fp16_fixes=True)
    centres = {"group": 32}
    prefill = llama_export.export_llama(
        checkpoint, tmp_path / "p", variant="prefill", tokens=PREFILL, block_centres=centres,
        **common,
    )  # fmt: skip
    llama_export.export_llama(
        checkpoint, tmp_path / "d", variant="decode", tokens=1, block_centres=centres, **common
    )
    # 3 layers x 3 MLP projections, all on the grid.
    assert prefill["block_centres"] == {"group": 32, "matmuls": 9, "on_4bit_grid": 9}
    assert prefill["options"]["block_centres"] == 32 and "group_offsets" not in prefill
    ids = np.random.default_rng(6).integers(0, vocab, (1, PREFILL + DECODE_STEPS))
    got = run_prefill_then_decode(tmp_path / "p", tmp_path / "d", ids)
    want = reference_logits(checkpoint, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()

    graph = onnx.load(str(tmp_path / "p" / "chunk0.onnx")).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    groups = weights["layers.1.mlp.down_proj.weight_t"].T.reshape(32, 2, 32)
    step = (groups.max(-1) - groups.min(-1)) / 15
    steps = groups / step[..., None]
    assert np.abs(steps - np.round(steps)).max() < 1e-3
    assert (np.round(steps).min(-1) == -8).all() and (np.round(steps).max(-1) == 7).all()
    sides = [n.name for n in graph.node if n.name.endswith("/group_offsets/MatMul")]
    assert len(sides) == 9 and all("/mlp/" in name for name in sides)
    assert "layers.1.self_attn.q_proj.weight_t" in weights
    # The side matmuls' group means keep every later tensor's shape (the next layers'
    # attention products included).
    assert _matmul_inputs_of_unknown_shape(tmp_path / "d" / "chunk0.onnx") == []


def test_smoothquant_export_matches_transformers_and_records_its_text(checkpoints, tmp_path):
    checkpoint, vocab = checkpoints["qwen2"], TINY_CONFIGS["qwen2"]["vocab_size"]
    common = dict(dtype="fp32", chunks=2, batch=1, cache_len=CACHE_LEN, fp16_fixes=True)
    smooth = {"alpha": 0.7, "text": ""}
    prefill = llama_export.export_llama(
        checkpoint, tmp_path / "p", variant="prefill", tokens=PREFILL, smoothquant=smooth, **common
    )
    llama_export.export_llama(
        checkpoint, tmp_path / "d", variant="decode", tokens=1, smoothquant=smooth, **common
    )
    plain = llama_export.export_llama(
        checkpoint, tmp_path / "plain", variant="prefill", tokens=PREFILL, **common
    )
    record = prefill["smoothquant"]
    assert record["alpha"] == 0.7 and record["text"]["documents"] >= 1
    assert len(record["text"]["sha256"]) == 64 and record["text"]["tokenizer"]["kind"] == "bytes"
    assert prefill["options"]["smoothquant"] == 0.7 and "smoothquant" not in plain["options"]
    # Other weights, the same function.
    assert prefill["graphs"][0]["sha256"] != plain["graphs"][0]["sha256"]
    ids = np.random.default_rng(9).integers(0, vocab, (1, PREFILL + DECODE_STEPS))
    got = run_prefill_then_decode(tmp_path / "p", tmp_path / "d", ids)
    want = reference_logits(checkpoint, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
