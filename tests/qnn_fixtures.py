"""Small synthetic RWKV-shaped chunked graphs for the QNN backend tests.

Each chunk has the roles of a real export (embedding or hidden in, recurrent
state in/out, hidden or logits out), a LayerNorm, two weight matrices and a
decay vector on the state path, in both a decode (T=1) and a prefill (T>1)
shape with identical initializer names, plus an ``embedding.bin`` in the layout
of npuforge/models/rwkv.py and a calibration directory captured from real runs
of the fp32 chain.
"""

import json
import struct
from pathlib import Path

import numpy as np

EMBED = 64
VOCAB = 256


def _chunk_model(index: int, chunks: int, tokens: int, seed: int):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed + index)
    first, last = index == 0, index == chunks - 1
    inits, nodes = [], []

    def tensor(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        return name

    def matrix(name, rows, cols):
        return tensor(name, rng.standard_normal((rows, cols)) / np.sqrt(rows))

    x = "embedding" if first else "hidden_in"
    state, state_out = f"state_{index}_wkv", f"state_{index}_wkv_out"
    tensor(f"ln{index}_w", 1 + 0.1 * rng.standard_normal(EMBED))
    tensor(f"ln{index}_b", 0.1 * rng.standard_normal(EMBED))
    tensor(f"decay{index}", np.exp(-np.exp(0.5 * rng.standard_normal(EMBED) - 1)))
    inits.append(numpy_helper.from_array(np.array([1, 1, EMBED], np.int64), f"shape{index}"))
    nodes += [
        helper.make_node(
            "LayerNormalization", [x, f"ln{index}_w", f"ln{index}_b"], [f"xn{index}"], axis=-1
        ),
        helper.make_node(
            "MatMul", [f"xn{index}", matrix(f"wk{index}", EMBED, EMBED)], [f"k{index}"]
        ),
        helper.make_node("ReduceMean", [f"k{index}"], [f"km{index}"], axes=[1], keepdims=0),
        helper.make_node("Mul", [state, f"decay{index}"], [f"sd{index}"]),
        helper.make_node("Add", [f"sd{index}", f"km{index}"], [state_out]),
        helper.make_node("Sigmoid", [state_out], [f"g{index}"]),
        helper.make_node(
            "MatMul", [f"g{index}", matrix(f"wo{index}", EMBED, EMBED)], [f"o{index}"]
        ),
        helper.make_node("Reshape", [f"o{index}", f"shape{index}"], [f"o3{index}"]),
        helper.make_node("Add", [x, f"o3{index}"], ["h" if last else "hidden_out"]),
    ]
    outputs = []
    if last:
        tensor("ln_out_w", np.ones(EMBED))
        tensor("ln_out_b", np.zeros(EMBED))
        nodes += [
            helper.make_node("LayerNormalization", ["h", "ln_out_w", "ln_out_b"], ["hn"], axis=-1),
            helper.make_node("MatMul", ["hn", matrix("head", EMBED, VOCAB)], ["logits"]),
        ]
        outputs.append(
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, tokens, VOCAB])
        )
    else:
        outputs.append(
            helper.make_tensor_value_info("hidden_out", TensorProto.FLOAT, [1, tokens, EMBED])
        )
    outputs.append(helper.make_tensor_value_info(state_out, TensorProto.FLOAT, [1, EMBED]))
    inputs = [
        helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, tokens, EMBED]),
        helper.make_tensor_value_info(state, TensorProto.FLOAT, [1, EMBED]),
    ]
    graph = helper.make_graph(nodes, f"chunk{index}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def _io(index: int, chunks: int, tokens: int):
    first, last = index == 0, index == chunks - 1
    x = "embedding" if first else "hidden_in"
    state = f"state_{index}_wkv"
    inputs = [
        {
            "name": x,
            "shape": [1, tokens, EMBED],
            "dtype": "float32",
            "role": "embedding" if first else "hidden",
        },
        {
            "name": state,
            "shape": [1, EMBED],
            "dtype": "float32",
            "role": "state",
            "output": f"{state}_out",
        },
    ]
    head = {"name": "logits", "shape": [1, tokens, VOCAB], "dtype": "float32", "role": "logits"}
    hidden = {
        "name": "hidden_out",
        "shape": [1, tokens, EMBED],
        "dtype": "float32",
        "role": "hidden",
    }
    outputs = [
        head if last else hidden,
        {"name": f"{state}_out", "shape": [1, EMBED], "dtype": "float32", "role": "state"},
    ]
    return inputs, outputs


def write_embedding(path: Path, table: np.ndarray) -> None:
    header = b"NPFEMB\0\0" + struct.pack("<IIQQ", 1, 1, table.shape[0], table.shape[1])
    path.write_bytes(header + np.ascontiguousarray(table, dtype="<f4").tobytes())


def make_export(out_dir, chunks: int = 2, variant: str = "decode", tokens: int = 1, seed: int = 0):
    import onnx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    graphs = []
    for index in range(chunks):
        onnx.save(_chunk_model(index, chunks, tokens, seed), out_dir / f"chunk{index}.onnx")
        inputs, outputs = _io(index, chunks, tokens)
        graphs.append(
            {
                "file": f"chunk{index}.onnx",
                "layers": [index, index + 1],
                "inputs": inputs,
                "outputs": outputs,
            }
        )
    table = np.random.default_rng(seed + 100).standard_normal((VOCAB, EMBED)).astype(np.float32)
    write_embedding(out_dir / "embedding.bin", table)
    meta = {
        "family": "rwkv",
        "version": 7,
        "variant": variant,
        "dtype": "fp32",
        "batch": 1,
        "tokens_per_call": tokens,
        "chunks": chunks,
        "vocab_size": VOCAB,
        "embed_dim": EMBED,
        "n_layers": chunks,
        "options": {"ext_embedding": True},
        "embedding": {"file": "embedding.bin", "dtype": "float32", "rows": VOCAB, "cols": EMBED},
        "graphs": graphs,
    }
    (out_dir / "export.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out_dir


def make_calibration(export_dir, out_dir, samples: int = 24, steps: int = 64, seed: int = 7):
    """Capture every chunk's inputs at sampled steps of a real fp32 run, in the layout of
    npuforge.calibration_formats (chunk{i}/sample{j}.npz and calibration.json)."""
    import onnxruntime as ort

    from npuforge.calibration_formats import LAYOUT, _write_npz

    export_dir, out_dir = Path(export_dir), Path(out_dir)
    meta = json.loads((export_dir / "export.json").read_text())
    sessions = [
        ort.InferenceSession(str(export_dir / g["file"]), providers=["CPUExecutionProvider"])
        for g in meta["graphs"]
    ]
    table = np.fromfile(export_dir / "embedding.bin", dtype="<f4", offset=32).reshape(VOCAB, EMBED)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=steps)
    picked = set(np.linspace(steps // 4, steps - 1, samples).astype(int).tolist())
    state = {}
    files = {i: [] for i in range(len(meta["graphs"]))}
    for step, token in enumerate(tokens):
        hidden = None
        for index, (session, graph) in enumerate(zip(sessions, meta["graphs"], strict=True)):
            feed = {}
            for item in graph["inputs"]:
                if item["role"] == "embedding":
                    feed[item["name"]] = table[token].reshape(item["shape"])
                elif item["role"] == "hidden":
                    feed[item["name"]] = hidden
                else:
                    feed[item["name"]] = state.get(
                        item["name"], np.zeros(item["shape"], np.float32)
                    )
            if step in picked:
                name = f"chunk{index}/sample{len(files[index])}.npz"
                (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
                _write_npz(out_dir / name, {k: np.asarray(v, np.float32) for k, v in feed.items()})
                files[index].append(name)
            names = [o["name"] for o in graph["outputs"]]
            values = dict(zip(names, session.run(names, feed), strict=True))
            for item in graph["inputs"]:
                if item["role"] == "state":
                    state[item["name"]] = values[item["output"]]
            hidden = values.get("hidden_out")
    chunks = [
        {"index": i, "file": g["file"], "inputs": g["inputs"], "npz": files[i]}
        for i, g in enumerate(meta["graphs"])
    ]
    record = {"layout": LAYOUT, "samples": samples, "steps": steps, "seed": seed}
    record.update(tokens=tokens.tolist(), chunks=chunks)
    (out_dir / "calibration.json").write_text(json.dumps(record, indent=2))
    return out_dir
