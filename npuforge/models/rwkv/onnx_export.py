"""Export an RWKV checkpoint to chunked ONNX graphs plus ``export.json``.

How the export works, and why it is cheap in memory:

1. Each chunk's torch module (``model.RwkvChunk``) is built with *uninitialised*
   parameters on the meta device and traced once by the TorchScript exporter with
   ``export_params=False``, so the graph comes out with every weight as a named
   graph input and no weight data at all.
2. Those inputs become initializers whose values are computed from the
   checkpoint one tensor at a time (``layout.prepared_tensor``: transpose, folds,
   cast) and streamed straight into the output file
   (``npuforge.onnx_io.write_model_streaming``). At no point is a second copy of
   the model in memory.

The result is byte-deterministic: same checkpoint + options -> same sha256.
``embedding.bin`` rows already have ln0 applied.
"""

import io
from pathlib import Path

from npuforge import progress
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, write_json
from npuforge.models.rwkv import layout
from npuforge.models.rwkv.checkpoint import load
from npuforge.onnx_io import (
    ALLOWED_OPS,
    OPSET,
    PROTOBUF_LIMIT,
    _split_params,
    embedding_entry,
    split_layers,
    write_model_streaming,
)


def default_rescale_every(n_layers: int) -> int:
    """Halve the residual stream about four times over the depth (6 for 24 layers)."""
    return max(1, -(-n_layers // 4))


def trace_chunk(spec):
    """Trace one chunk to an ONNX ModelProto with weights as named graph inputs."""
    import warnings

    import onnx
    import torch

    from npuforge.models.rwkv.model import RwkvChunk

    # Traced on the meta device: shapes only, no weight memory and no arithmetic.
    module = RwkvChunk(spec, device="meta").eval()
    inputs, outputs = layout.io_specs(spec)
    args = []
    for item in inputs:
        dtype = getattr(torch, item["dtype"])
        args.append(torch.zeros(item["shape"], dtype=dtype, device="meta"))
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        # The TorchScript exporter gives plain standard ops with int64 indices and
        # deterministic names; the dynamo exporter is slower and its output less stable.
        torch.onnx.export(
            module,
            tuple(args),
            buffer,
            dynamo=False,
            export_params=False,
            # Weights stay named graph inputs; this also skips the initializer
            # de-duplication pass, which would read (meta) tensor values.
            keep_initializers_as_inputs=True,
            do_constant_folding=True,
            opset_version=OPSET,
            input_names=[i["name"] for i in inputs],
            output_names=[o["name"] for o in outputs],
        )
    model = onnx.load_from_string(buffer.getvalue())
    del module
    bad = sorted({n.op_type for n in model.graph.node} - ALLOWED_OPS)
    if bad:
        raise NpuforgeError(f"export: graph uses non-standard ops {bad}; this is a bug")
    model.producer_name = "npuforge"
    model.producer_version = "0.1"
    return model, inputs, outputs


def export_rwkv(
    checkpoint,
    out_dir,
    variant="decode",
    tokens=None,
    chunks=1,
    layers_per_chunk=None,
    dtype="fp32",
    batch=1,
    ext_embedding=False,
    fp16_fixes=True,
    rescale_every=None,
    wkv_scale=None,
    last_token_logits=False,
    external_data=None,
) -> dict:
    """Export an RWKV checkpoint; returns the export.json content."""
    import numpy as np

    if variant not in ("decode", "prefill"):
        raise NpuforgeError(f"--variant {variant!r} is unknown; use decode or prefill")
    if dtype not in ("fp32", "fp16"):
        raise NpuforgeError(f"--dtype {dtype!r} is unknown; use fp32 or fp16")
    if tokens is None:
        tokens = 1 if variant == "decode" else 16
    if variant == "decode" and tokens != 1:
        raise NpuforgeError("--tokens must be 1 for a decode graph; use --variant prefill")
    if tokens < 1 or batch < 1:
        raise NpuforgeError("--tokens and --batch must be at least 1")
    ckpt = load(checkpoint)
    cfg = ckpt.config
    # The NPUs compute fp32 graphs in fp16 at their fp16 precisions (HTP, RKNN,
    # TPU-MLIR) and the fixes are exact in fp32: they follow fp16_fixes, not dtype.
    fixes = bool(fp16_fixes)
    if rescale_every is None:
        rescale_every = default_rescale_every(cfg.n_layers) if fixes else 0
    if wkv_scale is None:
        wkv_scale = 8.0 if fixes else 1.0
    k_scale, v_scale = layout.fp16_scales(float(wkv_scale))
    np_dtype = np.float16 if dtype == "fp16" else np.float32

    def prepare(spec, name):
        for block in layout.prepared_blocks(ckpt, spec, name):
            yield block.contiguous().numpy().astype(np_dtype, copy=False)
        ckpt.release_touched()

    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        graphs = []
        embedding = None
        if ext_embedding:
            table = layout.prepared_embedding(ckpt).numpy().astype(np_dtype)
            embedding = embedding_entry(tmp, table)
            ckpt.release_touched()
        ranges = split_layers(cfg.n_layers, chunks, layers_per_chunk)
        for index, layers in enumerate(ranges):
            progress.stage(
                f"export {variant}: chunk {index + 1} of {len(ranges)} (layers {layers})",
                done=index,
                total=len(ranges),
            )
            spec = layout.GraphSpec(
                config=cfg,
                layers=layers,
                tokens=tokens,
                batch=batch,
                dtype=dtype,
                ext_embedding=ext_embedding,
                last_token_logits=last_token_logits,
                rescale_every=rescale_every,
                wkv_k_scale=k_scale,
                wkv_v_scale=v_scale,
            )
            model, inputs, outputs = trace_chunk(spec)
            params = _split_params(model, list(layout.param_shapes(spec)))
            weight_bytes = sum(
                int(np.prod(d)) * np.dtype(np_dtype).itemsize for d, _ in params.values()
            )
            external = bool(external_data) or (
                external_data is None and weight_bytes > PROTOBUF_LIMIT - (64 << 20)
            )
            name = f"chunk{index}.onnx"
            hashes = write_model_streaming(
                model, params, lambda n, s=spec: prepare(s, n), tmp / name, external
            )
            graph = {
                "file": name,
                "sha256": hashes[name],
                "layers": list(layers),
                "inputs": inputs,
                "outputs": outputs,
            }
            if external:
                data_name = name + ".data"
                graph["external_data"] = {"file": data_name, "sha256": hashes[data_name]}
            graphs.append(graph)
        progress.clear()
        meta = {
            "family": "rwkv",
            "version": cfg.version,
            "variant": variant,
            "dtype": dtype,
            "batch": batch,
            "tokens_per_call": tokens,
            "chunks": chunks,
            "vocab_size": cfg.vocab_size,
            "embed_dim": cfg.embed_dim,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "head_size": cfg.head_size,
            "options": {
                "ext_embedding": bool(ext_embedding),
                "fp16_fixes": fixes,
                "rescale_every": rescale_every,
                "wkv_scale": float(wkv_scale),
                "last_token_logits": bool(last_token_logits),
                "external_data": any("external_data" in g for g in graphs),
                "opset": OPSET,
            },
            "embedding": embedding,
            "checkpoint": {"file": Path(checkpoint).name, "bytes": Path(checkpoint).stat().st_size},
            "graphs": graphs,
        }
        write_json(tmp / "export.json", meta)
    return meta
