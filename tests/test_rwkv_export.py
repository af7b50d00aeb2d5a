"""RWKV ONNX export: graph contract, chunking, prefill, batch, fp16 fixes, determinism.

Synthetic 4-layer x 256 checkpoints with the World vocabulary size (65536), shared
with tests/test_verify.py through npuforge.models.rwkv.synthetic.cached_synthetic_checkpoint.
"""

import hashlib
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest

from npuforge import models
from npuforge.errors import NpuforgeError
from npuforge.models.rwkv.onnx_export import export_rwkv
from npuforge.models.rwkv.synthetic import cached_synthetic_checkpoint
from npuforge.onnx_io import ALLOWED_OPS, read_embedding_bin
from npuforge.runtime import Fp16EmulationSession, GraphChain
from npuforge.verify import prefill_then_decode, seeded_tokens


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    base = tmp_path_factory.getbasetemp() / "npuforge-synthetic"
    return lambda **args: cached_synthetic_checkpoint(base, **args)


@pytest.fixture(scope="module")
def v7(synth):
    return synth(version=7, seed=1)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, v7):
    """A few v7 exports several tests look at."""
    base = tmp_path_factory.mktemp("exports")
    made = {}

    def get(name, **options):
        if name not in made:
            export_rwkv(v7, base / name, **options)
            made[name] = base / name
        return made[name]

    return get


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_export_json_contract_and_standard_graphs(exports):
    out = exports("c2", chunks=2)
    meta = GraphChain(out).meta
    assert (meta["family"], meta["version"], meta["variant"], meta["chunks"]) == (
        "rwkv",
        7,
        "decode",
        2,
    )
    first, last = meta["graphs"]
    assert first["layers"] == [0, 2] and last["layers"] == [2, 4]
    assert [i["role"] for i in first["inputs"][:1]] == ["tokens"]
    assert first["inputs"][0] == {
        "name": "tokens",
        "shape": [1, 1],
        "dtype": "int64",
        "role": "tokens",
    }
    assert {o["name"] for o in first["outputs"] if o["role"] == "hidden"} == {
        "hidden_out",
        "v_first_out",
    }
    assert {i["name"] for i in last["inputs"] if i["role"] == "hidden"} == {
        "hidden_in",
        "v_first_in",
    }
    assert last["outputs"][0]["name"] == "logits" and last["outputs"][0]["shape"] == [1, 1, 65536]
    for graph in meta["graphs"]:
        outs = {o["name"]: o for o in graph["outputs"]}
        states = [i for i in graph["inputs"] if i["role"] == "state"]
        assert len(states) == 3 * (graph["layers"][1] - graph["layers"][0])
        for state in states:
            assert state["output"] == state["name"] + "_out"
            assert outs[state["output"]]["shape"] == state["shape"]
        model = onnx.load(out / graph["file"])
        onnx.checker.check_model(model)
        assert {n.op_type for n in model.graph.node} <= ALLOWED_OPS
        for value in list(model.graph.input) + list(model.graph.output):
            dims = value.type.tensor_type.shape.dim
            assert all(d.HasField("dim_value") for d in dims), value.name  # static shapes
        graph_inputs = [i.name for i in model.graph.input]
        assert graph_inputs == [i["name"] for i in graph["inputs"]]
        gathers = [n for n in model.graph.node if n.op_type == "Gather"]
        typed = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
        for node in gathers:
            if node.input[1] in typed:
                assert typed[node.input[1]] == onnx.TensorProto.INT64


def test_only_the_first_chunk_hands_v_first_on_and_no_output_is_an_input(exports):
    """RWKV-7's v_first comes from layer 0 and feeds every later layer: the first chunk
    outputs it and each later chunk reads that one output (runtime.run_graph carries it
    across chunks). A middle chunk that passed its v_first_in straight out as before
    (an Identity) stops TPU-MLIR's model_transform (a ranked input returned as an
    unranked result)."""
    graphs = GraphChain(exports("c4", chunks=4)).meta["graphs"]
    handed_on = [{o["name"] for o in g["outputs"] if o["role"] == "hidden"} for g in graphs]
    assert handed_on == [{"hidden_out", "v_first_out"}, {"hidden_out"}, {"hidden_out"}, set()]
    read = [{i["name"] for i in g["inputs"] if i["role"] == "hidden"} for g in graphs]
    assert read == [set()] + [{"hidden_in", "v_first_in"}] * 3
    for graph in graphs:
        model = onnx.load(exports("c4", chunks=4) / graph["file"])
        inputs = {i.name for i in model.graph.input}
        outputs = {o.name for o in model.graph.output}
        passed_through = [
            n.output[0]
            for n in model.graph.node
            if n.op_type == "Identity" and n.input[0] in inputs and n.output[0] in outputs
        ]
        assert not passed_through and not inputs & outputs, graph["file"]


def test_chunks_one_two_four_agree(exports):
    tokens = seeded_tokens(65536, 1, 24)
    one = GraphChain(exports("c1")).run(tokens)
    two = GraphChain(exports("c2", chunks=2)).run(tokens)
    four = GraphChain(exports("c4e", chunks=4, ext_embedding=True)).run(tokens)
    # Uneven chunks, as a memory plan gives them when the head weighs on the last one.
    uneven = exports("c3u", chunks=3, layers_per_chunk=[2, 1, 1])
    assert [g["layers"] for g in GraphChain(uneven).meta["graphs"]] == [[0, 2], [2, 3], [3, 4]]
    assert relative(two, one) <= 1e-5
    assert relative(four, one) <= 1e-5
    assert relative(GraphChain(uneven).run(tokens), one) <= 1e-5
    assert np.abs(one).max() > 1.0  # the model is not trivially silent


def test_prefill_then_decode_matches_decode(exports):
    tokens = seeded_tokens(65536, 1, 40)
    decode = exports("c1")
    alone = GraphChain(decode).run(tokens)
    full = prefill_then_decode(
        exports("p16", variant="prefill", tokens=16, chunks=2), decode, tokens, alone
    )
    assert full["prefill_tokens"] == 32 and full["compared_steps"] == 40
    assert full["max_abs_rel"] <= 1e-4
    last = prefill_then_decode(
        exports("p16last", variant="prefill", tokens=16, last_token_logits=True),
        decode,
        tokens,
        alone,
    )
    assert last["compared_steps"] == 2 + 8 and last["max_abs_rel"] <= 1e-4
    meta = GraphChain(exports("p16last", variant="prefill", tokens=16, last_token_logits=True)).meta
    assert meta["graphs"][-1]["outputs"][0]["shape"] == [1, 1, 65536]
    # A shifted comparison must fail: the check can tell wrong logits apart.
    assert relative(alone[:, 1:], alone[:, :-1]) > 1e-2


def test_batch_rows_are_independent(tmp_path, v7, exports):
    export_rwkv(v7, tmp_path / "b2", batch=2)
    tokens = seeded_tokens(65536, 2, 12)
    both = GraphChain(tmp_path / "b2").run(tokens)
    single = GraphChain(exports("c1"))
    for row in range(2):
        single.reset()
        assert relative(both[row : row + 1], single.run(tokens[row : row + 1])) <= 1e-5
    with pytest.raises(NpuforgeError, match="batch"):
        single.reset(batch=2)


def test_export_is_byte_deterministic_and_external_data_works(tmp_path, v7, exports):
    options = dict(chunks=2, dtype="fp16", ext_embedding=True, external_data=True)
    export_rwkv(v7, tmp_path / "a", **options)
    export_rwkv(v7, tmp_path / "b", **options)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "chunk0.onnx.data" in files and "embedding.bin" in files
    for name in files:
        a, b = (tmp_path / "a" / name).read_bytes(), (tmp_path / "b" / name).read_bytes()
        assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest(), name
    assert (tmp_path / "a" / "chunk0.onnx").stat().st_size < 100_000  # weights are outside
    inline = tmp_path / "inline"
    export_rwkv(v7, inline, chunks=2, dtype="fp16", ext_embedding=True)
    tokens = seeded_tokens(65536, 1, 8)
    external_logits = GraphChain(tmp_path / "a", session_factory=Fp16EmulationSession).run(tokens)
    inline_logits = GraphChain(inline, session_factory=Fp16EmulationSession).run(tokens)
    assert np.array_equal(external_logits, inline_logits)


def test_embedding_bin_layout(exports, v7):
    import torch

    from npuforge.models.rwkv.checkpoint import load as load_checkpoint

    path = exports("c4e", chunks=4, ext_embedding=True) / "embedding.bin"
    raw = path.read_bytes()
    magic, version, code, rows, cols = struct.unpack_from("<8sIIQQ", raw)
    assert (magic, version, code, rows, cols) == (b"NPFEMB\0\0", 1, 1, 65536, 256)
    table = np.frombuffer(raw, dtype="<f4", offset=32).reshape(rows, cols)
    ckpt = load_checkpoint(v7)
    emb = torch.nn.functional.layer_norm(
        ckpt["emb.weight"].float(),
        (256,),
        ckpt["blocks.0.ln0.weight"].float(),
        ckpt["blocks.0.ln0.bias"].float(),
    )
    assert np.allclose(table, emb.numpy(), atol=1e-6)
    assert np.array_equal(read_embedding_bin(path), table)


@pytest.mark.parametrize("version, steps", [(7, 256), (6, 128), (5, 128)])
def test_fp16_fixes_prevent_overflow_on_stress_checkpoint(tmp_path, synth, version, steps):
    # A 4096-token vocabulary keeps 256 fp16-emulated steps cheap; the overflow comes
    # from the blocks, not from the vocabulary size.
    stress = synth(version=version, seed=2, stress=True, vocab=4096)
    tokens = seeded_tokens(4096, 1, steps)
    export_rwkv(stress, tmp_path / "fp32")
    export_rwkv(stress, tmp_path / "fixed", dtype="fp16")
    export_rwkv(stress, tmp_path / "unfixed", dtype="fp16", fp16_fixes=False)
    reference = GraphChain(tmp_path / "fp32").run(tokens)[0]
    fixed = GraphChain(tmp_path / "fixed", session_factory=Fp16EmulationSession).run(tokens)[0]
    unfixed = GraphChain(tmp_path / "unfixed", session_factory=Fp16EmulationSession).run(tokens)[0]
    assert np.isfinite(reference).all()
    assert np.isfinite(fixed).all(), "fp16 export with fixes produced NaN/inf"
    cosine = (
        (fixed * reference).sum(-1)
        / np.linalg.norm(fixed, axis=-1)
        / np.linalg.norm(reference, axis=-1)
    )
    assert cosine.min() >= 0.999
    assert not np.isfinite(unfixed).all(), (
        "stress checkpoint no longer overflows fp16 without fixes"
    )


def test_fp32_graphs_carry_the_fp16_fixes_the_npus_compute_them_with(tmp_path, synth):
    # The HTP, RKNN and TPU-MLIR compute an fp32 graph in fp16 at their fp16 precisions:
    # its weights must be the fp16 graph's (fixes folded in), and still exact in fp32.
    stress = synth(version=7, seed=2, stress=True, vocab=4096)
    export_rwkv(stress, tmp_path / "fp32")
    export_rwkv(stress, tmp_path / "fp16", dtype="fp16")
    export_rwkv(stress, tmp_path / "plain", fp16_fixes=False)
    fixed = GraphChain(tmp_path / "fp32").meta["options"]
    assert fixed["fp16_fixes"] and fixed["rescale_every"] == 1 and fixed["wkv_scale"] == 8.0
    assert GraphChain(tmp_path / "plain").meta["options"]["rescale_every"] == 0

    def weights(name):
        graph = onnx.load(tmp_path / name / "chunk0.onnx").graph
        return {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}

    full, half, plain = weights("fp32"), weights("fp16"), weights("plain")
    assert full.keys() == half.keys() and len(full) > 10
    for name, value in full.items():
        assert np.array_equal(value.astype(np.float16), half[name]), name
    assert any(not np.array_equal(full[name], plain[name]) for name in full)
    tokens = seeded_tokens(4096, 1, 16)
    with_fixes = GraphChain(tmp_path / "fp32").run(tokens)[0]
    without = GraphChain(tmp_path / "plain").run(tokens)[0]
    assert relative(with_fixes, without) < 1e-4


def test_the_family_comes_from_the_registry_and_foreign_options_are_refused(tmp_path, v7):
    with pytest.raises(NpuforgeError, match="unknown model family 'gpt2'"):
        models.export("gpt2", v7, tmp_path / "out", {"variant": "decode"})
    with pytest.raises(NpuforgeError, match="'sha' does not apply to the rwkv family"):
        models.export("rwkv", v7, tmp_path / "out", {"variant": "decode", "sha": True})
    assert not (tmp_path / "out").exists()


def test_bad_options_leave_no_output(tmp_path, v7):
    for options in (
        dict(chunks=5),
        dict(variant="decode", tokens=4),
        dict(wkv_scale=3, dtype="fp16"),
    ):
        with pytest.raises(NpuforgeError):
            export_rwkv(v7, tmp_path / "out", **options)
        assert not (tmp_path / "out").exists()
    assert not [p for p in Path(tmp_path).iterdir()]


def test_external_data_chosen_past_the_protobuf_limit(tmp_path, v7, exports, monkeypatch):
    import npuforge.models.rwkv.onnx_export as export_module

    # Pretend protobuf's limit is 96 MB: the 4 x 256 graphs (~140 MB fp32) cross it.
    monkeypatch.setattr(export_module, "PROTOBUF_LIMIT", 96 << 20)
    meta = export_rwkv(v7, tmp_path / "auto")
    assert meta["options"]["external_data"] is True
    assert (tmp_path / "auto" / "chunk0.onnx.data").stat().st_size > 96 << 20
    monkeypatch.undo()
    inline = GraphChain(exports("c1"))
    assert inline.meta["options"]["external_data"] is False
    tokens = seeded_tokens(65536, 1, 4)
    assert np.array_equal(GraphChain(tmp_path / "auto").run(tokens), inline.run(tokens))
