"""MHA->SHA pass: equivalence, single-head attention, unchanged cache I/O, and loud failures.

Passes are fragile (seed 003's reviewer), so the checks here are themselves
tested: deliberately mis-sliced variants of the pass must be caught.
"""

import numpy as np
import onnx
import pytest
from llama_fixtures import (
    DECODE_STEPS,
    PREFILL,
    TINY_CONFIGS,
    make_checkpoint,
    reference_logits,
    run_prefill_then_decode,
)

from npuforge.errors import NpuforgeError
from npuforge.models.llama import onnx_export as llama_export
from npuforge.passes import mha_to_sha

CACHE_LEN = 64


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """MHA exports: Qwen2-style (bias, 6 heads / 2 kv heads) prefill in 2 chunks, a
    SmolLM2-like (4 heads / 1 kv head) decode graph with batch 2, and a Qwen3-style
    (q/k RMSNorm) prefill."""
    root = tmp_path_factory.mktemp("sha")
    qwen = make_checkpoint("qwen2", root / "qwen2", seed=1)
    smol = make_checkpoint("smollm2", root / "smollm2", seed=2)
    qwen3 = make_checkpoint("qwen3", root / "qwen3", seed=3)
    common = {"dtype": "fp32", "cache_len": CACHE_LEN}
    metas = {
        "qwen2-prefill": llama_export.export_llama(
            qwen, root / "qp", variant="prefill", tokens=PREFILL, chunks=2, **common
        ),
        "smollm2-decode": llama_export.export_llama(
            smol, root / "sd", variant="decode", tokens=1, batch=2, **common
        ),
        "qwen3-prefill": llama_export.export_llama(
            qwen3, root / "q3", variant="prefill", tokens=4, **common
        ),
    }
    dirs = {
        "qwen2-prefill": root / "qp",
        "smollm2-decode": root / "sd",
        "qwen3-prefill": root / "q3",
    }
    return {
        key: (metas[key], [onnx.load(str(dirs[key] / g["file"])) for g in metas[key]["graphs"]])
        for key in metas
    } | {"checkpoints": {"qwen2": qwen, "smollm2": smol, "qwen3": qwen3}}


def random_feeds(meta, graph, seed=0):
    """Random caches and hidden states; positions/mask for a call part-way into the cache."""
    rng = np.random.default_rng(seed)
    position = 5
    feeds = {}
    for spec in graph["inputs"]:
        if spec["role"] == "tokens":
            feeds[spec["name"]] = rng.integers(0, meta["vocab_size"], spec["shape"])
        elif spec["role"] in ("hidden", "state"):
            feeds[spec["name"]] = rng.standard_normal(spec["shape"]).astype(np.float32)
        else:
            feeds[spec["name"]] = llama_export.extra_inputs(meta, spec, position)
    return feeds


def run(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], session.run(None, feeds), strict=True))


def multi_head_matmuls(model, meta):
    """Attention MatMuls (both operands computed) whose work covers more than one head.

    A single-head MatMul has batch dims multiplying to the batch size and an output of
    [tokens, cache_len] (scores), [tokens, head_dim] (probs @ v) or [head_dim, cache_len]
    (cache write, transposed). Per-head projections (weights inside self_attn) must be
    head_dim wide.
    """
    batch, t, length, d = (
        meta["batch"],
        meta["tokens_per_call"],
        meta["cache_len"],
        meta["head_dim"],
    )
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    shapes = {
        v.name: [dim.dim_value for dim in v.type.tensor_type.shape.dim]
        for v in [*inferred.value_info, *inferred.input, *inferred.output]
    }
    weights = {i.name: i for i in model.graph.initializer}
    offenders = []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        if node.input[1] in weights:
            is_attention_proj = "/self_attn/" in node.name and "/o_proj/" not in node.name
            if is_attention_proj and shapes[node.output[0]][-1] != d:
                offenders.append(node.name)
            continue
        out = shapes[node.output[0]]
        single = int(np.prod(out[:-2])) == batch and tuple(out[-2:]) in {
            (t, length),
            (t, d),
            (d, length),
        }
        if not single:
            offenders.append(node.name)
    return offenders


def sha_problems(meta, graph, before, after) -> list[str]:
    """Everything wrong with ``after`` as the SHA form of ``before`` (empty list: all good)."""
    problems = []
    io_before = ([i.name for i in before.graph.input], [o.name for o in before.graph.output])
    io_after = ([i.name for i in after.graph.input], [o.name for o in after.graph.output])
    if io_before != io_after:
        problems.append(f"graph I/O changed: {io_after}")
    caches = [s for s in graph["inputs"] if s["role"] == "state"]
    layers = graph["layers"][1] - graph["layers"][0]
    cache_inputs = [n for n in io_after[0] if n in {s["name"] for s in caches}]
    if len(cache_inputs) != 2 * layers:
        problems.append(f"{len(cache_inputs)} cache inputs for {layers} layers")
    try:
        offenders = multi_head_matmuls(after, meta)
    except Exception as err:  # an ill-formed rewrite is a failure, not a crash of the check
        return [*problems, f"shape inference failed: {err}"]
    if offenders:
        problems.append(f"MatMuls spanning more than one head: {offenders[:4]}")
    for seed in range(2):
        feeds = random_feeds(meta, graph, seed)
        want = run(before, feeds)
        try:
            got = run(after, feeds)
        except Exception as err:
            return [*problems, f"converted graph does not run: {err}"]
        for name, value in want.items():
            error = np.abs(got[name] - value).max() / np.abs(value).max()
            if not error <= 1e-5:
                problems.append(f"{name} differs by {error:.2e} relative")
    return problems


CASES = ["qwen2-prefill", "smollm2-decode", "qwen3-prefill"]


@pytest.mark.parametrize("case", CASES)
def test_sha_is_equivalent_and_single_head(exports, case):
    meta, models = exports[case]
    for graph, before in zip(meta["graphs"], models, strict=True):
        after = mha_to_sha.convert(before)
        assert sha_problems(meta, graph, before, after) == []
        # The single-head check has teeth: the MHA graph itself fails it.
        assert multi_head_matmuls(before, meta)
        heads, kv = meta["heads"], meta["kv_heads"]
        layers = graph["layers"][1] - graph["layers"][0]
        n_softmax = sum(n.op_type == "Softmax" for n in after.graph.node)
        assert n_softmax == heads * layers
        slices = [n for n in after.graph.node if n.op_type == "Slice" and "cache" in n.name]
        assert len(slices) == 2 * kv * layers
        # The HTP cuts a MatMul's second 16-bit activation to about 8 bits: a decode graph
        # writes its one row per KV head with a Mul, never a MatMul of inner dimension 1;
        # a prefill graph's MatMul takes the one-hot (exact in 8 bits) as that input.
        writes = [n for n in after.graph.node if n.name.endswith("_write")]
        assert len(writes) == 2 * kv * layers
        producers = {out: n for n in after.graph.node for out in n.output}
        for node in writes:
            if meta["tokens_per_call"] == 1:
                assert node.op_type == "Mul"
            else:
                assert node.op_type == "MatMul"
                one_hot = producers[node.input[1]]
                assert one_hot.op_type == "Transpose" and one_hot.name.endswith("write_t")


def shifted_head_columns(weight, bias, head, head_dim):
    """Broken slicing: every projection takes the next head's columns."""
    heads = weight.shape[1] // head_dim
    return ORIGINAL_HEAD_COLUMNS(weight, bias, (head + 1) % heads, head_dim)


def double_width_head_columns(weight, bias, head, head_dim):
    """Broken slicing: a 'head' two heads wide (wraps to the first head at the end)."""
    cols = np.r_[head * head_dim : (head + 1) * head_dim]
    cols = np.concatenate([cols, (cols + head_dim) % weight.shape[1]])
    return weight[:, cols], None if bias is None else bias[cols]


ORIGINAL_HEAD_COLUMNS = mha_to_sha.head_columns


@pytest.mark.parametrize(
    "target, broken, symptom",
    [
        ("head_columns", shifted_head_columns, "differs by"),
        ("head_columns", double_width_head_columns, "shape inference failed"),
        ("kv_head_of", lambda head, group: (head // group + 1) % 2, "differs by"),  # wrong kv head
    ],
)
def test_checks_catch_a_mis_sliced_head(exports, monkeypatch, target, broken, symptom):
    meta, models = exports["qwen2-prefill"]
    monkeypatch.setattr(mha_to_sha, target, broken)
    after = mha_to_sha.convert(models[0])
    problems = sha_problems(meta, meta["graphs"][0], models[0], after)
    assert any(symptom in problem for problem in problems), problems


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_export_with_sha_matches_transformers(exports, tmp_path, kind):
    checkpoint = exports["checkpoints"][kind]
    common = {"dtype": "fp32", "cache_len": CACHE_LEN, "sha": True}
    meta = llama_export.export_llama(
        checkpoint, tmp_path / "p", variant="prefill", tokens=PREFILL, **common
    )
    llama_export.export_llama(checkpoint, tmp_path / "d", variant="decode", tokens=1, **common)
    assert meta["options"]["sha"] is True
    ids = np.random.default_rng(5).integers(0, TINY_CONFIGS[kind]["vocab_size"], (1, 64))
    assert ids.shape[1] == PREFILL + DECODE_STEPS
    got = run_prefill_then_decode(tmp_path / "p", tmp_path / "d", ids)
    want = reference_logits(checkpoint, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def without_node(model, predicate):
    edited = onnx.ModelProto()
    edited.CopyFrom(model)
    kept = [n for n in edited.graph.node if not predicate(n)]
    del edited.graph.node[:]
    edited.graph.node.extend(kept)
    return edited


def test_fails_loudly_on_graphs_it_does_not_understand(exports):
    _, models = exports["smollm2-decode"]
    model = models[0]

    no_attention = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Relu", ["x"], ["y"], name="/relu")],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
    )
    with pytest.raises(NpuforgeError, match="found no"):
        mha_to_sha.convert(no_attention)

    # Softmax over the wrong axis is a different computation, not something to split.
    wrong_axis = onnx.ModelProto()
    wrong_axis.CopyFrom(model)
    softmax = next(n for n in wrong_axis.graph.node if n.op_type == "Softmax")
    softmax.attribute[0].i = 2
    with pytest.raises(NpuforgeError, match="softmax is not over the cache axis"):
        mha_to_sha.convert(wrong_axis)

    # An extra node inside the attention scope must not be silently dropped.
    extra = onnx.ModelProto()
    extra.CopyFrom(model)
    relu = onnx.helper.make_node(
        "Relu", ["attention_mask"], ["unused"], name="/layers.0/self_attn/Relu"
    )
    extra.graph.node.append(relu)
    with pytest.raises(NpuforgeError, match="unrecognised nodes"):
        mha_to_sha.convert(extra)

    # No RoPE on k: the pattern does not hold.
    no_rope = without_node(model, lambda n: n.name == "/layers.0/self_attn/Neg_1")
    with pytest.raises(NpuforgeError, match="layer 0"):
        mha_to_sha.convert(no_rope)


def test_convert_file_roundtrip(exports, tmp_path):
    _, models = exports["smollm2-decode"]
    src = tmp_path / "mha.onnx"
    onnx.save(models[0], str(src))
    mha_to_sha.convert_file(src, tmp_path / "sha.onnx")
    converted = onnx.load(str(tmp_path / "sha.onnx"))
    assert not mha_to_sha.attention_layers(converted) or all(
        "sha" in n.name
        for n in converted.graph.node
        if "/self_attn/" in n.name and "o_proj" not in n.name
    )
    with pytest.raises(NpuforgeError):
        mha_to_sha.convert_file(tmp_path / "sha.onnx", tmp_path / "again.onnx")
    assert not (tmp_path / "again.onnx").exists()
