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


def test_hadamard_orders_are_hadamard_and_cover_the_families_sizes():
    import math

    from npuforge import hadamard

    built = [n for n in range(1, 260) if hadamard.has_hadamard(n)]
    for n in built:
        h = hadamard.hadamard(n)
        assert set(np.unique(h)) <= {-1, 1} and np.array_equal(h @ h.T, n * np.eye(n)), n
    # Every multiple of 4 below 52 (52 needs Paley over 25, a prime power).
    assert [n for n in range(4, 52, 4) if n not in built] == []
    assert not hadamard.has_hadamard(6) and not hadamard.has_hadamard(52)
    # SmolLM2 (576, 1536, head_dim 64), Qwen2-0.5B (896, 4864), Qwen3-0.6B (1024, 3072).
    for n in (576, 1536, 64, 896, 4864, 1024, 3072):
        assert hadamard.has_hadamard(n), n
    a, b = hadamard.kronecker_split(1536)
    assert a * b == 1536 and hadamard.has_hadamard(a) and hadamard.has_hadamard(b)
    assert a + b < 2 * math.isqrt(1536) + 20
    with pytest.raises(NpuforgeError, match="no Hadamard matrix of order 6 is built here") as err:
        hadamard.hadamard(6)
    assert "\n" not in str(err.value)
    rng = np.random.default_rng(0)
    for n, kind in ((48, "hadamard"), (6, "random orthogonal"), (52, "random orthogonal")):
        matrix, got = hadamard.orthogonal(n, rng)
        assert got == kind and np.allclose(matrix @ matrix.T, np.eye(n), atol=1e-12)


ROTATION_CASES = [
    # (kind, chunks, fp16_fixes, kv_prefix, tanh_silu, sha)
    ("llama", 2, False, (), False, True),  # GQA, untied lm_head, the MHA->SHA pass
    ("qwen2", 1, True, (), True, False),  # q/k/v biases
    ("smollm2", 2, True, (1,), True, True),  # tied lm_head, one KV head, a kv_prefix
    ("qwen3", 1, True, (2, 5), False, False),  # q/k norms, head_dim apart from hidden / heads
]


def _assert_prefill_then_decode_matches(checkpoint, tmp_path, vocab, kv_prefix, positions):
    """The exports in tmp_path/p (an 8-token prefill) and tmp_path/d (decode), run through
    onnxruntime over ``positions`` random tokens, give transformers' logits after the
    kv_prefix, within 1e-4 of the largest."""
    from npuforge.runtime import GraphChain

    ids = np.random.default_rng(2).integers(0, vocab, (1, positions))
    chain, decode = GraphChain(tmp_path / "p"), GraphChain(tmp_path / "d")
    got = [chain.step(ids[:, :8])]
    decode.state, decode.position = chain.state, chain.position
    steps = [decode.step(ids[:, p : p + 1]) for p in range(8, positions)]
    got = np.concatenate(got + steps, axis=1)
    lead = np.array([list(kv_prefix)], dtype=np.int64).reshape(1, -1)
    want = reference_logits(checkpoint, np.concatenate([lead, ids], axis=1))[:, len(kv_prefix) :]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("kind, chunks, fp16_fixes, kv_prefix, tanh_silu, sha", ROTATION_CASES)
def test_rotated_export_matches_transformers(
    checkpoints, tmp_path, kind, chunks, fp16_fixes, kv_prefix, tanh_silu, sha
):
    """A rotated export is the same function: prefill then decode through onnxruntime
    against transformers (after the kv_prefix, computed at export by the rotated model),
    with the fp16-safe norm, tanh_silu, chunks and the MHA->SHA pass as given."""
    import onnx

    from npuforge.models.llama import onnx_export as llama_export

    checkpoint, vocab = checkpoints[kind], TINY_CONFIGS[kind]["vocab_size"]
    common = dict(
        dtype="fp32", chunks=chunks, batch=1, cache_len=64, fp16_fixes=fp16_fixes, sha=sha,
        kv_prefix=kv_prefix, tanh_silu=tanh_silu, rotate={"seed": 4},
    )  # fmt: skip
    prefill = llama_export.export_llama(
        checkpoint, tmp_path / "p", variant="prefill", tokens=8, **common
    )
    llama_export.export_llama(checkpoint, tmp_path / "d", variant="decode", tokens=1, **common)
    record = prefill["rotation"]
    assert prefill["options"]["rotate"] == 4 and record["hidden"]["kind"] == "hadamard"
    _assert_prefill_then_decode_matches(checkpoint, tmp_path, vocab, kv_prefix, 40)
    # The online rotation runs in every layer's graph, as constant matmuls.
    layers = TINY_CONFIGS[kind]["num_hidden_layers"]
    rotations = [
        node.name
        for graph in prefill["graphs"]
        for node in onnx.load(str(tmp_path / "p" / graph["file"])).graph.node
        if "/mlp/down_rotation/" in node.name and node.op_type == "MatMul"
    ]
    assert len(rotations) == 2 * layers


def _outlier_checkpoint(source, out):
    """``source`` with one residual channel 60x the rest after every norm, as trained
    models have, saved as a checkpoint of its own."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    for layer in model.model.layers:
        layer.input_layernorm.weight.data[3] *= 60
        layer.post_attention_layernorm.weight.data[3] *= 60
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("kind", ["qwen2", "smollm2"])
def test_rotation_keeps_the_logits_and_spreads_the_outliers(checkpoints, tmp_path, kind):
    """The rotated model's matmul inputs and weights have no channel far above the rest,
    where the plain model's q_proj inputs have one; down_proj's input is rotated too."""
    from npuforge.models.llama import config as llama_config
    from npuforge.models.llama import model as llama_model
    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import rotation, smoothing
    from npuforge.models.llama import weights as llama_weights

    checkpoint = _outlier_checkpoint(checkpoints[kind], tmp_path / "outlier")
    cfg = llama_config.load_config(checkpoint)
    model = llama_model.build_model(cfg, llama_weights.load_state_dict(checkpoint), 64)
    vocab = cfg.vocab_size
    sequences = np.random.default_rng(3).integers(0, vocab, (4, 24)).tolist()

    def run(tokens):
        return llama_export.run_from_empty_cache(model, [tokens], 64)[0].numpy()

    def spread(ranges, name):
        return float(ranges[name].max() / ranges[name].median())

    before = run(sequences[0])
    plain = smoothing.activation_ranges(model, sequences, [], 64, run)
    block = model.layers[0]
    folded = (block.mlp.gate_proj.weight * block.post_attention_layernorm.weight).detach()
    weight_spread = float(folded.abs().amax(0).max() / folded.abs().amax(0).median())
    record = rotation.rotate(model, seed=0)
    rotated = smoothing.activation_ranges(model, sequences, [], 64, run)
    after = run(sequences[0])
    assert np.abs(after - before).max() <= 1e-5 * np.abs(before).max()
    for name in ("layers.0.self_attn.q_proj", "layers.1.mlp.gate_proj"):
        assert spread(plain, name) > 10 and spread(rotated, name) < 4, name
    # The norm's outlier folded into the weights is spread over every input column too.
    columns = model.layers[0].mlp.gate_proj.weight.detach().abs().amax(0)
    assert float(columns.max() / columns.median()) < 3 and weight_spread > 10
    assert record["down_proj_input"]["factors"][0] * record["down_proj_input"]["factors"][1] == (
        cfg.intermediate_size
    )
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()


def test_input_ranges_are_each_projections_input_extremes_at_the_positions_asked(checkpoints):
    import torch

    from npuforge.models.llama import config as llama_config
    from npuforge.models.llama import model as llama_model
    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import weights as llama_weights
    from npuforge.models.llama.rounding import input_ranges

    cfg = llama_config.load_config(checkpoints["qwen2"])
    model = llama_model.build_model(cfg, llama_weights.load_state_dict(checkpoints["qwen2"]), 64)
    calls = np.random.default_rng(5).integers(0, cfg.vocab_size, (3, 12)).tolist()
    seen = []
    hook = model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda _module, args: seen.append(args[0].detach().clone())
    )

    def run(tokens):
        llama_export.run_from_empty_cache(model, [tokens], 64)

    with torch.no_grad():
        every = input_ranges(model, calls, run)
        last = input_ranges(model, calls, run, names={"down_proj"}, positions=-1)
    hook.remove()
    full, final = torch.cat(seen[:3], dim=1), torch.cat([x[:, -1] for x in seen[3:]])
    assert every["1.down_proj"] == (float(full.min()), float(full.max()))
    assert last["1.down_proj"] == (float(final.min()), float(final.max()))
    assert set(last) == {f"{i}.down_proj" for i in range(cfg.num_layers)}
    assert len(every) == 7 * cfg.num_layers and every["0.q_proj"][0] < 0


def test_rotate_is_a_per_precision_export_option_refused_beside_smoothquant():
    from npuforge.models import llama

    model = {"context_length": 64}
    export = {"rotate": {"w8a8": 7, "a16w4": 0}, "smoothquant": {"a16w8": 0.5}}
    assert llama.export_options(model, export, "w8a8")["rotate"] == {"seed": 7}
    assert "rotate" not in llama.export_options(model, export, "fp16")
    export["smoothquant"]["w8a8"] = 0.5
    with pytest.raises(NpuforgeError, match="smoothquant and export.rotate both name w8a8"):
        llama.export_options(model, export, "w8a8")


def _correlated_problem(seed, rows, columns, samples=200):
    """A weight and the Hessian X^T X of correlated inputs X."""
    import torch

    rng = np.random.default_rng(seed)
    mix = np.eye(columns) + 0.3 * rng.standard_normal((columns, columns))
    x = rng.standard_normal((samples, columns)) @ mix
    return torch.from_numpy(rng.standard_normal((rows, columns))), torch.from_numpy(x.T @ x)


def _greedy_obs(w, h, bits, group, symmetric, damp, act_order=False, integer_zero=False):
    """An independent GPTQ: round the columns one by one (left to right, or by falling
    diag(H)); after each, move its error onto the columns left by the exact inverse of
    their own sub-Hessian (OBS), row by row. Grids as the module's: drawn from the row
    (group) when its first column comes (with act_order: from the weights as given),
    extremes pinned to the end levels."""
    w, h = np.array(w, dtype=np.float64), np.array(h, dtype=np.float64)
    h = h + damp * np.mean(np.diag(h)) * np.eye(len(h))
    rows, columns = w.shape
    width = group or columns
    order = list(range(columns))
    if act_order:
        order = [int(i) for i in np.argsort(-np.diag(h), kind="stable")]

    def span_of(values, first):
        if symmetric:
            top = 2 ** (bits - 1) - 1
            at = int(np.abs(values).argmax())
            pins = {first + at: -top if values[at] < 0 else top}
            return -top, top, 0.0, np.abs(values).max() / top, pins
        top = 2**bits - 1
        if integer_zero:  # the range holds 0, which lies on a level
            low, high = min(values.min(), 0.0), max(values.max(), 0.0)
            step = (high - low) / top
            pins = {first + int(values.argmin()): 0} if values.min() < 0 else {}
            if values.max() > 0:
                pins[first + int(values.argmax())] = top
            return 0, top, -np.round(-low / step) * step, step, pins
        pins = {first + int(values.argmin()): 0, first + int(values.argmax()): top}
        return 0, top, values.min(), (values.max() - values.min()) / top, pins

    out = np.zeros_like(w)
    for r in range(rows):
        row, spans = w[r].copy(), {}
        if act_order:
            spans = {g: span_of(row[g : g + width], g) for g in range(0, columns, width)}
        for k, c in enumerate(order):
            first = c - c % width
            if not act_order and c == first:
                spans[first] = span_of(row[first : first + width], first)
            low, high, offset, step, pins = spans[first]
            level = pins.get(c, np.clip(np.round((row[c] - offset) / step), low, high))
            out[r, c] = offset + level * step
            rest = order[k:]
            inverse = np.linalg.inv(h[np.ix_(rest, rest)])
            row[rest] -= (row[c] - out[r, c]) / inverse[0, 0] * inverse[0]
    return out


@pytest.mark.parametrize(
    "bits, group, symmetric, act_order, integer_zero",
    [(4, None, False, False, False), (4, 8, False, False, False), (3, None, True, False, False),
     (8, 8, True, False, False), (4, 8, False, True, False), (8, None, True, True, False),
     (8, None, False, False, True), (4, 8, False, True, True)],
)  # fmt: skip
def test_gptq_is_the_obs_update_column_by_column(bits, group, symmetric, act_order, integer_zero):
    import torch

    from npuforge.quantization import WeightGrid, gptq, round_to_nearest, rounding_loss

    w, h = _correlated_problem(0, rows=5, columns=24)
    if integer_zero:  # rows of one sign too: their zero side has no extreme to pin
        w[0], w[1] = w[0].abs(), -w[1].abs()
    grid = WeightGrid(bits, group, symmetric, integer_zero)
    got = gptq(w, h, grid, damp=0.01, act_order=act_order).numpy()
    want = _greedy_obs(w.numpy(), h.numpy(), bits, group, symmetric, 0.01, act_order, integer_zero)
    assert np.abs(got - want).max() < 1e-9
    nearest = round_to_nearest(w, grid)
    # On these problems GPTQ's loss is 0.43-0.87 of round-to-nearest's.
    assert rounding_loss(w, torch.from_numpy(got), h) < 0.9 * rounding_loss(w, nearest, h)


def test_gptq_against_the_best_rounding_of_a_tiny_matrix():
    """2 x 3 weights, 4-bit symmetric per row: an exhaustive search over all 15^3 grid
    assignments of each row gives the least ||X W^T - X Q^T||. GPTQ's greedy column order
    is not that optimum; on these problems it lies between it and round-to-nearest, and
    below round-to-nearest on some."""
    import itertools

    import torch

    from npuforge.quantization import WeightGrid, gptq, round_to_nearest, rounding_loss

    grid = WeightGrid(4, symmetric=True)
    levels = torch.tensor(list(itertools.product(range(-7, 8), repeat=3)), dtype=torch.float64)
    better = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        mix = np.array([[1.0, 0.9, 0.0], [0.0, 0.5, 0.8], [0.0, 0.0, 0.4]])
        x = rng.standard_normal((32, 3)) @ mix
        w, h = torch.from_numpy(rng.standard_normal((2, 3))), torch.from_numpy(x.T @ x)
        best = 0.0
        for row, step in enumerate(w.abs().amax(1) / 7):
            delta = w[row][None, :] - levels * step
            best += float(torch.einsum("ni,ij,nj->n", delta, h, delta).min())
        rounded = gptq(w, h, grid, damp=0.0)
        assert round_to_nearest(rounded, grid).equal(rounded)  # on the grid
        error = rounding_loss(w, rounded, h)
        nearest = rounding_loss(w, round_to_nearest(w, grid), h)
        assert best <= error + 1e-12 and error <= nearest + 1e-12
        better += error < 0.97 * nearest
    assert better >= 3


def test_gptq_with_an_identity_hessian_rounds_to_nearest():
    import torch

    from npuforge.quantization import WeightGrid, gptq, round_to_nearest

    w = torch.from_numpy(np.random.default_rng(1).standard_normal((6, 64)))
    for grid in (WeightGrid(4, 32), WeightGrid(8), WeightGrid(4, symmetric=True)):
        assert gptq(w, torch.eye(64, dtype=torch.float64), grid).equal(round_to_nearest(w, grid))


@pytest.mark.parametrize(
    "grid_args, most",
    [((4, 32), 0.75), ((4, None, True), 0.97), ((3, 8), 0.65), ((8, None, False, True), 1.0)],
)  # fmt: skip
def test_a_searched_range_rounds_with_less_error_and_the_backend_derives_it_again(grid_args, most):
    """Heavy-tailed rows (Student's t, 2 degrees of freedom): the searched range rounds
    every row (group) with no more squared error than its full range, and the whole matrix
    with at most ``most`` of it (measured 0.70, 0.95, 0.59; 8 bits keep the full range:
    a clipped tail costs more than 256 levels lose). The exported rows span the narrowed
    grid exactly, so a backend deriving its grid from their extremes rounds them to
    themselves, by nearest and by GPTQ alike."""
    import dataclasses

    import torch

    from npuforge.quantization import WeightGrid, gptq, round_to_nearest

    full = WeightGrid(*grid_args)
    searched = dataclasses.replace(full, search_range=True)
    _, h = _correlated_problem(3, rows=12, columns=64)
    w = torch.from_numpy(np.random.default_rng(3).standard_t(2, size=(12, 64)))
    plain, narrowed = round_to_nearest(w, full), round_to_nearest(w, searched)
    width = full.group or 64
    error_plain = ((plain - w) ** 2).reshape(12, -1, width).sum(-1)
    error_narrowed = ((narrowed - w) ** 2).reshape(12, -1, width).sum(-1)
    assert (error_narrowed <= error_plain + 1e-12).all()
    assert error_narrowed.sum() <= most * error_plain.sum()
    for rounded in (narrowed, gptq(w, h, searched)):
        assert (round_to_nearest(rounded, full) - rounded).abs().max() < 1e-9
    assert searched.describe().endswith("range searched")
    if most < 1:
        assert not gptq(w, h, searched).equal(gptq(w, h, full))


def test_a_searched_range_weighs_each_input_by_its_energy():
    """Two inputs of a 4-bit row, one carrying 1000x the other's energy: the range is
    chosen for the loud input's error, not the sum of both."""
    import torch

    from npuforge.quantization import WeightGrid, _Span

    row = torch.tensor([[0.0, 0.37, 1.0, -1.0, 0.5, 0.2, -0.66, 0.9]], dtype=torch.float64)
    grid = WeightGrid(4, search_range=True)
    energy = torch.ones(8, dtype=torch.float64)
    even = _Span(row, grid, importance=energy).round_all(row)
    energy[1] = 1000.0
    loud = _Span(row, grid, importance=energy).round_all(row)
    assert abs(loud[0, 1] - 0.37) < abs(even[0, 1] - 0.37)


def _tpu_mlir_w4_group(weight, group):
    """TPU-MLIR's W4F16 group quantizer (A16MatMul's per-group parameters), dequantized:
    per group, scale max(max - min, 1e-5) / 15, integer zero point clamp(-round(min /
    scale), 0, 15), levels clamp(round(w / scale) + zp, 0, 15)."""
    blocks = weight.reshape(-1, group).astype(np.float32)
    low, high = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    scale = np.maximum(high - low, np.float32(1e-5)) / np.float32(15)
    zero = np.clip(-np.round(low / scale), 0, 15)
    levels = np.clip(np.round(blocks / scale) + zero, 0, 15)
    return ((levels - zero) * scale).reshape(weight.shape)


def _rknn_w8_channel(weight):
    """rknn-toolkit2 2.5.0's rk3588 w8a8 weights, dequantized, as measured (docs/
    quantization.md): per output row, 256 levels over [min(w, 0), max(w, 0)], an integer
    zero point round(-min / step), round to nearest."""
    low = np.minimum(weight.min(1, keepdims=True), 0)
    high = np.maximum(weight.max(1, keepdims=True), 0)
    step = (high - low) / 255
    zero = np.round(-low / step)
    return (np.clip(np.round(weight / step) + zero, 0, 255) - zero) * step


def test_gptq_weights_survive_each_backends_own_rounding():
    """What each backend does to an export of GPTQ's weights: QNN's per-channel int8
    (onnxruntime's symmetric quantizer) and its int4 blocks of a block_centres export
    (the QNN quantizer's block_steps), TPU-MLIR's W4F16 groups of a group_offsets export. Each
    gives back GPTQ's weights (to float32 rounding)."""
    import onnx
    import torch
    from onnxruntime.quantization.quant_utils import quantize_data

    from npuforge.jobs import qnn_quantizer
    from npuforge.models.llama.group_offsets import GroupOffsetLinear
    from npuforge.quantization import WeightGrid, gptq

    w, h = _correlated_problem(2, rows=16, columns=128)

    def requantized_rows(weight):
        moved = 0
        for row in weight:
            zero, scale, steps = quantize_data(row, onnx.TensorProto.INT8, symmetric=True)
            moved += zero != 0 or np.abs(steps * scale - row).max() > 1e-6 * np.abs(row).max()
        return moved

    grid = WeightGrid(8, symmetric=True)
    assert requantized_rows(gptq(w, h, grid).float().numpy()) == 0
    # The same without the pins: the feedback moved some rows' largest weight off its
    # end level, so onnxruntime derives another scale and rounds the row again.
    assert requantized_rows(gptq(w, h, grid, pin=False).float().numpy()) > 0

    # RKNN's per-channel int8 (and onnxruntime's asymmetric uint8, the same derivation).
    w[0], w[1] = w[0].abs(), -w[1].abs()
    grid = WeightGrid(8, integer_zero=True)
    rknn = gptq(w, h, grid).numpy()
    assert np.abs(_rknn_w8_channel(rknn) - rknn).max() <= 1e-9 * np.abs(rknn).max()
    zero, scale, steps = quantize_data(rknn[2], onnx.TensorProto.UINT8, symmetric=False)
    assert np.abs((steps.astype(np.float64) - zero) * scale - rknn[2]).max() < 1e-6
    loose = gptq(w, h, grid, pin=False).numpy()
    assert np.abs(_rknn_w8_channel(loose) - loose).max() > 1e-3 * np.abs(loose).max()

    four = gptq(w, h, WeightGrid(4, 32)).float()
    for centred in (False, True):
        linear = torch.nn.Linear(128, 16, bias=False)
        linear.weight.data = four.clone()
        split = GroupOffsetLinear(linear, 32, centred=centred)
        main = split.weight.detach().numpy()
        if centred:  # QNN: signed int4 blocks of 32 inputs per output column, [in, out]
            steps, scale = qnn_quantizer.block_steps(main.T, 32, 4)
            back = (steps.reshape(4, 32, 16) * scale[:, None, :]).reshape(128, 16).T
        else:  # TPU-MLIR: each group's minimum moved out, so its zero point is 0
            back = _tpu_mlir_w4_group(main, 32)
        assert np.abs(back - main).max() <= 1e-5 * np.abs(main).max()


def test_gptq_export_lands_every_projection_on_the_backends_grid(checkpoints, tmp_path, capsys):
    """gptq with group_offsets of the same group (TPU-MLIR W4F16), after a rotation:
    every projection lies on a 4-bit grid of its groups, which the group_offsets record
    counts; with block_centres (QNN int4 blocks) only the MLP is rounded; 8-bit per
    channel survives onnxruntime's symmetric int8; the record names grid and text."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization.quant_utils import quantize_data

    from npuforge.models.llama import onnx_export as llama_export

    checkpoint, layers = checkpoints["smollm2"], TINY_CONFIGS["smollm2"]["num_hidden_layers"]
    common = dict(variant="decode", dtype="fp32", cache_len=64, fp16_fixes=True, kv_prefix=[1])
    # A short text (bytes as tokens: this checkpoint has no tokenizer) keeps the test quick.
    text = tmp_path / "text.txt"
    text.write_text("The keeper writes three lines in the logbook every evening. " * 6)
    four = {"bits": 4, "group": 16, "symmetric": False, "text": str(text)}
    meta = llama_export.export_llama(
        checkpoint, tmp_path / "g", rotate={"seed": 0}, gptq=four, group_offsets={"group": 16},
        **common,
    )  # fmt: skip
    assert meta["group_offsets"] == {"group": 16, "matmuls": 7 * layers, "on_4bit_grid": 7 * layers}
    # A decoder's rounding takes minutes at real sizes: the log names each layer done.
    assert f"GPTQ: layer {layers} of {layers} rounded" in capsys.readouterr().out
    assert meta["gptq"]["grid"] == "4-bit asymmetric, groups of 16"
    assert meta["gptq"]["text"]["tokenizer"]["kind"] == "bytes" and meta["rotation"]
    plain = llama_export.export_llama(
        checkpoint, tmp_path / "p", rotate={"seed": 0}, group_offsets={"group": 16}, **common
    )
    assert plain["group_offsets"]["on_4bit_grid"] == 0
    # The kv_prefix's rows come from the weights before GPTQ rounds them.
    assert meta["kv_prefix"]["sha256"] == plain["kv_prefix"]["sha256"]

    meta = llama_export.export_llama(
        checkpoint, tmp_path / "b", gptq=four, block_centres={"group": 16}, **common
    )
    assert meta["gptq"]["projections"] == ["down_proj", "gate_proj", "up_proj"]
    assert meta["block_centres"]["on_4bit_grid"] == 3 * layers

    eight = {"bits": 8, "symmetric": True, "text": str(text)}
    meta = llama_export.export_llama(checkpoint, tmp_path / "e", gptq=eight, **common)
    graph = onnx.load(str(tmp_path / "e" / meta["graphs"][0]["file"])).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    projections = [name for name in weights if name.endswith("_proj.weight_t")]
    assert len(projections) == 7 * layers
    for name in projections:
        for column in weights[name].T:  # [in, out]: one output channel per column
            zero, scale, steps = quantize_data(column, onnx.TensorProto.INT8, symmetric=True)
            assert np.abs(steps * scale - column).max() <= 1e-6 * np.abs(column).max(), name

    # Only the projections named (QNN a16w8 keeps q/k/v/o int16): the rest as exported.
    mlp = {**eight, "projections": ["gate_proj", "up_proj", "down_proj"]}
    meta = llama_export.export_llama(checkpoint, tmp_path / "m", gptq=mlp, **common)
    assert meta["gptq"]["projections"] == ["down_proj", "gate_proj", "up_proj"]
    graph = onnx.load(str(tmp_path / "m" / meta["graphs"][0]["file"])).graph
    rounded = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    meta = llama_export.export_llama(checkpoint, tmp_path / "n", **common)
    graph = onnx.load(str(tmp_path / "n" / meta["graphs"][0]["file"])).graph
    exported = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for name in projections:
        if "mlp" in name:
            assert not np.array_equal(rounded[name], exported[name]), name
            column = rounded[name][:, 0]
            zero, scale, steps = quantize_data(column, onnx.TensorProto.INT8, symmetric=True)
            assert np.abs(steps * scale - column).max() <= 1e-6 * np.abs(column).max(), name
        else:
            assert np.array_equal(rounded[name], exported[name]), name


GPTQ_DIGEST = """
import hashlib, sys
import numpy as np
from npuforge.models.llama import rounding
from npuforge.models.llama.config import load_config
from npuforge.models.llama.model import build_model
from npuforge.models.llama.weights import load_state_dict
from npuforge.quantization import WeightGrid
cfg = load_config(sys.argv[1])
model = build_model(cfg, load_state_dict(sys.argv[1]), 256)
rng = np.random.default_rng(0)
texts = [list(rng.integers(0, cfg.vocab_size, 128)) for _ in range(8)]
rounding.round_decoder(model, texts, [1], WeightGrid(4, 16), "gptq")
digest = hashlib.sha256()
for name, value in sorted(model.layers.state_dict().items()):
    digest.update(value.numpy().tobytes())
print(digest.hexdigest())
"""
# The CPU kernels' plainest paths: torch's unvectorised ones, MKL's and oneDNN's SSE4.
PLAIN_KERNELS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
}


def digests_on_both_kernels(script: str, checkpoint) -> set:
    """The last line ``script`` prints for ``checkpoint``, run on this host's kernels and
    on the plainest ones."""
    import os
    import subprocess
    import sys

    digests = set()
    for caps in ({}, PLAIN_KERNELS):
        run = subprocess.run(
            [sys.executable, "-c", script, str(checkpoint)],
            env={**os.environ, **caps},
            capture_output=True,
            text=True,
            check=True,
        )
        digests.add(run.stdout.strip().splitlines()[-1])
    return digests


def test_gptq_rounds_the_same_on_any_hosts_kernels(checkpoints):
    """GPTQ on this host's vectorised kernels and on the plainest ones gives the same
    weights: its Hessians come from a float64 forward, where the kernels' last-bit
    differences (float32: enough to flip roundings that cascade through the error
    feedback; on SmolLM2's twin, top-1 0.76-0.875 between hosts) stay far below any
    rounding boundary."""
    assert len(digests_on_both_kernels(GPTQ_DIGEST, checkpoints["llama"])) == 1


SAMPLED_DIGEST = """
import sys
from npuforge.models.llama import sampling
from npuforge.models.llama.config import load_config
from npuforge.models.llama.model import build_model
from npuforge.models.llama.weights import load_state_dict
cfg = load_config(sys.argv[1])
model = build_model(cfg, load_state_dict(sys.argv[1]), 64)
documents = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
print(sampling.digest(sampling.generate(model, documents, 3, 24, [1], seed=0)))
"""


def test_sampled_calibration_opens_with_the_documents_and_is_the_same_on_any_host(checkpoints):
    """The sequences the model samples for GPTQ: each opens with its document's first
    tokens (cycled), has the length asked, leaves the model's float32 weights as they
    were, follows its seed, and is drawn in float64, so the host's kernels (which move
    float32 logits' last bits) do not change a token."""
    import torch

    from npuforge.models.llama import sampling
    from npuforge.models.llama.config import load_config
    from npuforge.models.llama.model import build_model
    from npuforge.models.llama.weights import load_state_dict

    checkpoint = checkpoints["qwen2"]
    cfg = load_config(checkpoint)
    model = build_model(cfg, load_state_dict(checkpoint), 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    documents = [list(range(5, 14)), [20, 21, 22]]
    drawn = sampling.generate(model, documents, 3, 24, [1], seed=0)
    assert [len(row) for row in drawn] == [24, 24, 24]
    assert drawn[0][:8] == documents[0][:8] and drawn[2][:8] == documents[0][:8]
    assert drawn[1][:3] == [20, 21, 22]
    assert all(0 <= t < cfg.vocab_size for row in drawn for t in row)
    assert drawn[0] != drawn[2]  # same opening, own draws
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name
    again = sampling.generate(model, documents, 3, 24, [1], seed=0)
    assert again == drawn
    assert sampling.generate(model, documents, 3, 24, [1], seed=1) != drawn
    assert len(digests_on_both_kernels(SAMPLED_DIGEST, checkpoint)) == 1


def test_a_gptq_export_records_the_sequences_it_sampled(checkpoints, tmp_path):
    from npuforge.models.llama import onnx_export as llama_export

    text = tmp_path / "text.txt"
    text.write_text("The keeper writes three lines in the logbook every evening. " * 3)
    eight = {"bits": 8, "symmetric": True, "text": str(text)}
    common = dict(variant="decode", dtype="fp32", cache_len=32, kv_prefix=[1])
    checkpoint = checkpoints["smollm2"]
    plain = llama_export.export_llama(checkpoint, tmp_path / "p", gptq=eight, **common)
    meta = llama_export.export_llama(
        checkpoint, tmp_path / "g", gptq={**eight, "generated": 2}, **common
    )
    sampled = meta["gptq"]["generated"]
    assert sampled["sequences"] == 2 and sampled["tokens_each"] == 31
    assert meta["gptq"]["sequences"] == plain["gptq"]["sequences"] + 2
    assert meta["gptq"]["positions"] == plain["gptq"]["positions"] + 2 * 31
    assert "generated" not in plain["gptq"]


def test_gptq_option_matches_its_grid_to_the_export_split():
    from npuforge.models import llama

    model = {"context_length": 64}
    export = {"gptq": {"w4f16": {"bits": 4, "group": 32}}, "group_offsets": {"w4f16": 32}}
    got = llama.export_options(model, export, "w4f16")["gptq"]
    assert got == {"bits": 4, "group": 32, "symmetric": False}
    export["group_offsets"]["w4f16"] = 64
    with pytest.raises(NpuforgeError, match="splits groups of 64: give gptq"):
        llama.export_options(model, export, "w4f16")
    export = {"gptq": {"a16w8": {"bits": 8}, "a16w4": {"bits": 4}}}
    assert llama.export_options(model, export, "a16w8")["gptq"]["symmetric"] is True
    with pytest.raises(NpuforgeError, match="give a group"):
        llama.export_options(model, export, "a16w4")
    export = {"gptq": {"w8a8": {"bits": 8, "symmetric": False, "integer_zero": True}}}
    assert llama.export_options(model, export, "w8a8")["gptq"]["integer_zero"] is True
    assert "search_range" not in llama.export_options(model, export, "w8a8")["gptq"]
    export["gptq"]["w8a8"]["search_range"] = True
    assert llama.export_options(model, export, "w8a8")["gptq"]["search_range"] is True
    export["gptq"]["w8a8"]["generated"] = 64
    assert llama.export_options(model, export, "w8a8")["gptq"]["generated"] == 64
    export["gptq"]["w8a8"]["generated"] = "many"
    with pytest.raises(NpuforgeError, match="generated must be a count of sequences"):
        llama.export_options(model, export, "w8a8")
    export["gptq"]["w8a8"]["generated"] = 0
    export["gptq"]["w8a8"]["projections"] = ["down_proj", "gate_proj"]
    got = llama.export_options(model, export, "w8a8")["gptq"]["projections"]
    assert got == ["gate_proj", "down_proj"]  # in the order a layer runs them
    export["gptq"]["w8a8"]["projections"] = ["gate_proj", "mlp"]
    with pytest.raises(NpuforgeError, match=r"projections \['mlp'\] are not decoder"):
        llama.export_options(model, export, "w8a8")
    del export["gptq"]["w8a8"]["projections"]
    export["gptq"]["w8a8"]["symmetric"] = True
    with pytest.raises(NpuforgeError, match="integer_zero is an asymmetric grid"):
        llama.export_options(model, export, "w8a8")


def test_fake_quantized_activations_round_as_onnxruntimes_uint8():
    """The torch bench's per-tensor activation quantizer is onnxruntime's asymmetric uint8
    (range widened to hold 0, integer zero point): zero stays exactly zero, so a matmul
    of quantized inputs gains no offset summed over its inputs."""
    import onnx
    import torch
    from onnxruntime.quantization.quant_utils import compute_scale_zp, quantize_nparray

    from npuforge.quantization import fake_quantize_tensor

    x = np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32) * 3
    x[0, :5] = 0.0
    for low, high in ((-2.0, 40.0), (0.5, 7.0), (-9.0, -1.0), (-46.3, 1886.5)):
        zero, scale = compute_scale_zp(
            np.float32(low), np.float32(high), np.uint8(0), np.uint8(255)
        )
        expected = (
            quantize_nparray(onnx.TensorProto.UINT8, x, scale, zero).astype(np.float64) - zero
        ) * scale
        got = fake_quantize_tensor(torch.from_numpy(x), low, high).numpy()
        assert np.abs(got - expected).max() <= 1e-6 * max(abs(low), abs(high))
        assert np.all(got[0, :5] == 0.0)


def test_a_gptq_build_is_gated_against_the_export_before_rounding(checkpoints, tmp_path):
    """A binary that computes exactly the GPTQ'd export's fp32 graphs: against its own
    export it is perfect, which hides GPTQ's change; with the unrounded export as
    reference the gate sees it, and ``against_export`` keeps the own-export figures."""
    from npuforge.backends import base, gate
    from npuforge.backends.rknn import Options
    from npuforge.models.llama import onnx_export as llama_export

    checkpoint = checkpoints["llama"]
    text = tmp_path / "text.txt"
    text.write_text("The keeper writes three lines in the logbook every evening. " * 6)
    common = dict(variant="decode", dtype="fp32", cache_len=64, fp16_fixes=True)
    four = {"bits": 4, "group": 16, "symmetric": False, "text": str(text)}
    llama_export.export_llama(checkpoint, tmp_path / "rounded", gptq=four, **common)
    llama_export.export_llama(checkpoint, tmp_path / "plain", **common)
    exports = base.load_exports([tmp_path / "rounded"], "rknn")
    schedule = base.verification_schedule(exports, 24)
    ids = np.random.default_rng(0).integers(0, TINY_CONFIGS["llama"]["vocab_size"], 25)
    text_record = {"ids": ids.tolist(), "text": {"source": "random ids"}}
    compiled = base.reference_logits(exports, schedule, ids)

    def request(references):
        return base.CompileRequest(
            exports=[tmp_path / "rounded"], references=references, target="RK3588",
            options=Options(target_platform="rk3588"), precision="w8a8", out_dir=tmp_path / "out",
        )  # fmt: skip

    own = gate.verify(request(()), {}, schedule, text_record, compiled, compiled, runner="t")
    assert own["top1_agreement"] == 1.0 and own["perplexity"]["delta"] == 0.0
    assert "against_export" not in own
    record = gate.verify(
        request([tmp_path / "plain"]), {}, schedule, text_record, compiled, compiled, runner="t"
    )
    plain = base.reference_logits(base.load_exports([tmp_path / "plain"], "rknn"), schedule, ids)
    assert record["perplexity"]["reference"] == round(gate.perplexity(plain[:24], ids[1:]), 5)
    assert record["perplexity"]["delta"] != 0.0 and record["cosine"] < 1.0
    assert record["against_export"]["perplexity"]["delta"] == 0.0
    # This binary is its own export, so the rounding at export is the whole loss.
    rounding = record["rounding_at_export"]
    assert rounding["perplexity"]["delta"] == record["perplexity"]["delta"] != 0.0
    assert rounding["top1_agreement"] == record["top1_agreement"]
    assert "rounding_at_export" not in own
    assert record["reference"].endswith("before rounding at export")
    # A failed gate's one line says how far the binary is from its own rounded export.
    failed = {**record, "passed": False, "failures": ["logits cosine 0.9 < 1.0"]}
    own_figures = (
        r"against the build.s own rounded export: top-1 1.0, cosine [\d.]+, perplexity \+0.00%"
        r"; the rounding at export alone \(its fp32 graphs\): top-1 [\d.]+, perplexity [+-]"
    )
    with pytest.raises(NpuforgeError, match=own_figures):
        gate.check_gate("RK3588", "w8a8", failed, "try fp16")
    with pytest.raises(NpuforgeError, match="give one per export"):
        request([tmp_path / "plain", tmp_path / "rounded"])


def test_awq_picks_the_scale_with_the_least_output_error_on_the_inputs():
    # One input channel 50x the others: scaling its weights up before rounding (and the
    # input down) takes most of the output's rounding error away. The Gram-matrix loss
    # best_scale minimises is the error of X W^T computed directly, alpha by alpha.
    import torch

    from npuforge.models.llama import awq
    from npuforge.quantization import WeightGrid, round_to_nearest

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator, dtype=torch.float64)
    x[:, 5] *= 50
    weight = torch.randn(24, 32, generator=generator, dtype=torch.float64)
    grid = WeightGrid(4, 16)
    scale, alpha, loss, plain = awq.best_scale([weight], x.T @ x, x.abs().mean(0), grid)

    def direct(a):
        s = x.abs().mean(0) ** a
        s = s / (s.max() * s.min()).sqrt()
        rounded = round_to_nearest(weight * s, grid) / s
        return float(((x @ weight.T - x @ rounded.T) ** 2).sum())

    losses = {a: direct(a) for a in awq.ALPHAS}
    assert alpha == min(losses, key=losses.get) > 0
    assert loss == pytest.approx(losses[alpha], rel=1e-9)
    assert plain == pytest.approx(losses[0.0], rel=1e-9) and loss < 0.5 * plain


@pytest.mark.parametrize("kind", ["llama", "qwen2", "smollm2", "qwen3"])
def test_awq_keeps_the_logits_and_its_rounded_model_errs_less(checkpoints, tmp_path, kind):
    """Scales folded into the norms and up_proj's rows change no fp32 logit; rounded to
    4 bits, the scaled model is closer to fp32 than the model rounded as it came."""
    import copy

    import torch

    from npuforge.models.llama import awq, rounding
    from npuforge.models.llama import config as llama_config
    from npuforge.models.llama import model as llama_model
    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import weights as llama_weights
    from npuforge.quantization import WeightGrid

    checkpoint = _outlier_checkpoint(checkpoints[kind], tmp_path / "outlier")
    cfg = llama_config.load_config(checkpoint)
    model = llama_model.build_model(cfg, llama_weights.load_state_dict(checkpoint), 64)
    rng = np.random.default_rng(5)
    calibration = rng.integers(0, cfg.vocab_size, (6, 40)).tolist()
    heldout = rng.integers(0, cfg.vocab_size, 48).tolist()

    def logits(m):
        return llama_export.run_from_empty_cache(m, [heldout], 64)[0].numpy()

    fp32 = logits(model)
    grid = WeightGrid(4, 16)
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        record = awq.scale_decoder(scaled, calibration, [1], grid)
    assert np.abs(logits(scaled) - fp32).max() <= 1e-5 * np.abs(fp32).max()
    errors = record["output_error"]
    assert errors["scaled and rounded"] < errors["rounded"]
    for m in (model, scaled):
        rounding.round_decoder(m, [], [1], grid, "nearest")
    assert np.abs(logits(scaled) - fp32).mean() < np.abs(logits(model) - fp32).mean()


@pytest.mark.parametrize(
    "kind, rotate, kv_prefix, sha",
    [("qwen2", None, (), False), ("smollm2", {"seed": 4}, (1,), True)],
)
def test_awq_export_matches_transformers_and_records_its_scales(
    checkpoints, tmp_path, kind, rotate, kv_prefix, sha
):
    """An export with AWQ scales (after a rotation, with a kv_prefix and the MHA->SHA pass
    as given) is the same function in fp32, decode after prefill through onnxruntime."""
    from npuforge.models.llama import onnx_export as llama_export

    checkpoint, vocab = checkpoints[kind], TINY_CONFIGS[kind]["vocab_size"]
    text = tmp_path / "text.txt"  # short: keeps the test quick
    text.write_text("The keeper writes three lines in the logbook every evening. " * 6)
    scales = {"bits": 4, "group": 16, "symmetric": False, "text": str(text)}
    common = dict(
        dtype="fp32", chunks=2, batch=1, cache_len=64, kv_prefix=kv_prefix, sha=sha,
        rotate=rotate, awq=scales,
    )  # fmt: skip
    prefill = llama_export.export_llama(
        checkpoint, tmp_path / "p", variant="prefill", tokens=8, **common
    )
    llama_export.export_llama(checkpoint, tmp_path / "d", variant="decode", tokens=1, **common)
    record = prefill["awq"]
    assert prefill["options"]["awq"] == "4-bit asymmetric, groups of 16" == record["grid"]
    assert record["text"]["documents"] == 1
    assert record["groups"].endswith("(down_proj reads a rotation)") == bool(rotate)
    _assert_prefill_then_decode_matches(checkpoint, tmp_path, vocab, kv_prefix, 24)


def test_awq_is_a_per_precision_export_option_on_the_backends_grid():
    from npuforge.models import llama

    model = {"context_length": 64}
    export = {"awq": {"a16w4": {"bits": 4, "group": 32, "symmetric": True}}, "rotate": {"a16w4": 1}}
    options = llama.export_options(model, export, "a16w4")
    assert options["awq"] == {"bits": 4, "group": 32, "symmetric": True} and options["rotate"]
    assert "awq" not in llama.export_options(model, export, "a16w8")
    with pytest.raises(NpuforgeError, match="export.awq for w4f16: 4-bit weights per output"):
        llama.export_options(model, {"awq": {"w4f16": {"bits": 4}}}, "w4f16")
    export = {"awq": {"w8a8": {"bits": 8}}, "smoothquant": {"w8a8": 0.5}}
    with pytest.raises(NpuforgeError, match="smoothquant and export.awq both name w8a8"):
        llama.export_options(model, export, "w8a8")
