"""Llama-family SHA graphs through the real QNN EP: HTP contexts verified on the simulator.

The graphs take host-fed inputs besides the embedding and the KV caches (mask,
RoPE rows, cache write/keep slots). The compile step precomputes them with the
family's own code and hands them to the toolchain job as files; the simulator's
logits are gated against npuforge's own runner, so a feed the job gets wrong
fails the build (the corrupted-feed cases show it can).
"""

import numpy as np
import pytest
from test_qnn import SM8650, compile_qnn, qnn_stamp  # noqa: F401  (the toolchain fixture)

from npuforge.backends import base
from npuforge.errors import NpuforgeError
from npuforge.models.llama import onnx_export as llama_export
from npuforge.models.llama import weights as llama_weights

# The registry's llama-tiny (Qwen2-style: QKV bias, GQA 4/2), in two chunks so the
# second chunk's own mask/RoPE inputs and the hidden hand-over are exercised too.
TINY = {"layers": 2, "embed": 64, "heads": 4, "kv_heads": 2, "vocab": 512, "intermediate": 128}
CACHE_LEN = 40  # 32 verification steps fit


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_qnn")
    checkpoint = root / "checkpoint"
    llama_weights.write_synthetic_checkpoint(checkpoint, arch="qwen2", seed=0, **TINY)
    common = {"chunks": 2, "cache_len": CACHE_LEN, "sha": True, "ext_embedding": True}
    llama_export.export_llama(checkpoint, root / "decode", variant="decode", **common)
    llama_export.export_llama(checkpoint, root / "prefill", variant="prefill", tokens=8, **common)
    return root


def _compile(exports, stamp, name, prefill=False):
    dirs = [exports / "decode"] + ([exports / "prefill"] if prefill else [])
    out = exports / name
    return out, compile_qnn(dirs, None, "SM8650", SM8650, "fp16", stamp, out)


@pytest.mark.toolchain
def test_sha_llama_fp16_verifies_on_the_htp_simulator(exports, qnn_stamp):  # noqa: F811
    import onnx

    out, manifest = _compile(exports, qnn_stamp, "fp16")
    figures = manifest["verification"]
    assert figures["passed"] and figures["positions"] == 32 and figures["calls"] == {"decode": 32}
    assert figures["nan_inf"] == 0 and figures["cosine"] >= 0.9999
    assert figures["top1_agreement"] == 1.0
    # The job's own CPU run saw the same inputs as npuforge's runner.
    assert figures["toolchain_cpu_max_abs_rel"] < 1e-5
    for chunk in (0, 1):
        graph = onnx.load(out / f"chunk{chunk}_ctx.onnx", load_external_data=False).graph
        assert [node.op_type for node in graph.node] == ["EPContext"]
        names = {value.name for value in graph.input}
        assert set(llama_export.HOST_ROLES.values()) <= names
        assert {f"cache_{chunk}_k", f"cache_{chunk}_v"} <= names  # one layer per chunk


@pytest.mark.toolchain
def test_prefill_then_decode_shares_one_context_and_verifies(exports, qnn_stamp):  # noqa: F811
    out, manifest = _compile(exports, qnn_stamp, "fp16-prefill", prefill=True)
    figures = manifest["verification"]
    # One 8-token prefill call, then decode calls to 32 tokens: 32 compared rows.
    assert figures["calls"] == {"decode": 24, "prefill": 1} and figures["positions"] == 32
    assert figures["passed"] and figures["cosine"] >= 0.9999
    for chunk in manifest["options"]["chunks"]:
        assert chunk["weight_sharing"]["one_context"]


def _corrupting(role, original):
    """base.write_call_feeds, with ``role``'s inputs replaced by wrong values."""

    def wrong(meta, spec, position):
        if role == "mask":
            return np.zeros(spec["shape"], dtype=spec["dtype"])  # every slot visible
        return llama_export.extra_inputs(meta, spec, position + 1)  # off by one position

    def write(exports, schedule, tokens, work_dir):
        calls = original(exports, schedule, tokens, work_dir)
        decode = exports["decode"].meta
        specs = {
            f"chunk{index}/{item['name']}": item
            for index, graph in enumerate(decode["graphs"])
            for item in graph["inputs"]
            if item["role"] == role
        }
        assert len(specs) == 2  # one per chunk
        for call in calls:
            with np.load(call["feeds"]) as stored:
                arrays = dict(stored)
            for key, item in specs.items():
                arrays[key] = wrong(decode, item, call["position"])
            np.savez(call["feeds"], **arrays)
        return calls

    return write


@pytest.mark.toolchain
@pytest.mark.parametrize("role", ["mask", "rope_cos", "rope_sin"])
def test_wrong_host_feeds_fail_the_gate(exports, qnn_stamp, monkeypatch, role):  # noqa: F811
    monkeypatch.setattr(base, "write_call_feeds", _corrupting(role, base.write_call_feeds))
    with pytest.raises(NpuforgeError, match="simulator check over 32 positions .* failed"):
        _compile(exports, qnn_stamp, f"wrong-{role}")
    assert not (exports / f"wrong-{role}").exists()


def test_llama_calibration_covers_the_first_positions(exports, tmp_path):
    """Position-dependent graphs are calibrated from position 0 on, with the real feeds.

    The first positions attend over one or two slots and reach activation ranges
    later ones never do: sampled from a quarter of the run on only, SM8650 a16w8
    verified at cosine 0.956 (worst step: position 0), with this at 0.99902.
    """
    from npuforge.calibration import make_calibration_samples

    steps = 32
    record = make_calibration_samples(
        exports / "decode", tmp_path / "cal", samples=8, steps=steps, seed=0
    )
    captured = [run["capture_step"] for run in record["runs"]]
    assert min(captured) < steps // 4 and max(captured) < steps
    meta = base.load_exports([exports / "decode"], "qnn")["decode"].meta
    for index in (0, 1):
        inputs = record["chunks"][index]["inputs"]
        for item in inputs:
            if item["role"] not in ("mask", "rope_cos", "rope_sin", "cache_write", "cache_keep"):
                continue
            for j, position in enumerate(captured):
                with np.load(tmp_path / "cal" / f"chunk{index}" / f"sample{j}.npz") as data:
                    got = data[item["name"]]
                np.testing.assert_array_equal(got, llama_export.extra_inputs(meta, item, position))


# The backend's own EP setup (qnn_session: register_qnn, provider_options, simulator_session).
HTP_RUN = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import qnn_session

ort, devices, htp_library = qnn_session.register_qnn()
spec = {"soc_model": 57, "htp_arch": 75, "precision": "fp16"}
options = qnn_session.provider_options(spec, htp_library)
x = np.load(sys.argv[2])
for model in sys.argv[3:]:
    session = qnn_session.simulator_session(ort, devices, options, model)
    np.save(model + ".out.npy", session.run(None, {"x": x})[0])
"""


@pytest.mark.toolchain
def test_the_htp_computes_silu_after_a_matmul_ten_times_closer_in_its_tanh_form(
    qnn_stamp,  # noqa: F811
    tmp_path,
):
    """Why SM8650's Llama fp16 export takes tanh_silu: in fp16 the HTP simulator runs a
    Sigmoid that follows a MatMul far coarser than fp16 rounding, and the same SiLU
    written with a Tanh close to it (SmolLM2-135M's gate_proj: 5.1e-3 against 4.2e-4)."""
    import json
    import subprocess

    import onnx
    import torch

    from npuforge.backends import qnn
    from npuforge.models.llama import model as llama_model

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 1, 576)) * 0.4).astype(np.float32)  # gate inputs to ~4
    linear = torch.nn.Linear(576, 1536, bias=False)
    linear.weight.data = torch.from_numpy((rng.standard_normal((1536, 576)) * 0.12).astype("f4"))
    np.save(tmp_path / "x.npy", x)

    class GateActivation(torch.nn.Module):
        def __init__(self, activation):
            super().__init__()
            self.gate_proj, self.activation = linear, activation

        def forward(self, t):
            return self.activation(self.gate_proj(t))

    forms = {"sigmoid": torch.nn.functional.silu, "tanh": llama_model.tanh_silu}
    models = {name: tmp_path / f"{name}.onnx" for name in forms}
    with torch.no_grad():
        for name, activation in forms.items():
            torch.onnx.export(
                GateActivation(activation),
                (torch.from_numpy(x),),
                models[name],
                input_names=["x"],
                dynamo=False,
            )
    ops = {n: {node.op_type for node in onnx.load(p).graph.node} for n, p in models.items()}
    assert "Sigmoid" in ops["sigmoid"] and "Sigmoid" not in ops["tanh"] and "Tanh" in ops["tanh"]
    python = json.loads(qnn_stamp.read_text())["python"]
    ran = subprocess.run(
        [python, "-c", HTP_RUN, qnn.JOB_SCRIPT.parent, tmp_path / "x.npy", *models.values()],
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    gate = x.astype(np.float64) @ linear.weight.detach().numpy().T.astype(np.float64)
    want = gate / (1 + np.exp(-gate))
    error = {}
    for name, path in models.items():
        got = np.load(f"{path}.out.npy").astype(np.float64)
        error[name] = np.linalg.norm(got - want) / np.linalg.norm(want)
    # fp16 rounding of the inputs alone costs ~2e-4.
    assert error["sigmoid"] > 2e-3 and error["tanh"] < 1e-3, error
