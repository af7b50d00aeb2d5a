"""Export a Llama-family checkpoint to static ONNX graphs plus ``export.json``.

The graphs are static: every call processes ``tokens`` positions (AR-N prefill
or AR-1 decode) against a fixed-size KV cache, which is explicit graph I/O (one
K and one V tensor per layer, [batch, kv_heads, cache_len, head_dim]). The
update is mask based, never a shift: the graph takes the whole cache and returns
the whole cache with the new entries written at their absolute positions,
chosen by the one-hot ``cache_write`` input::

    cache_write[b, 0, l, t] = 1 if l == position + t                  # [B, 1, L, T]
    cache_keep = 1 - cache_write.sum(-1)                              # [B, 1, L, 1]
    cache_out = cache * cache_keep + cache_write @ new_entries

so a runner feeds ``cache_out`` back as ``cache`` unchanged. Attention runs over
the updated cache; the additive ``attention_mask`` input hides every slot beyond
the query's own position (stale or empty slots).

Extra graph inputs (roles beyond tokens/embedding/hidden/state/logits), all in
the graph dtype and all built by ``extra_inputs`` / ``host_inputs`` from the
absolute position of the call's first token:

    attention_mask  [batch, 1, tokens, cache_len]   role "mask" (0 or MASK_VALUE)
    rope_cos        [batch, 1, tokens, head_dim]    role "rope_cos"
    rope_sin        [batch, 1, tokens, head_dim]    role "rope_sin"
    cache_write     [batch, 1, cache_len, tokens]   role "cache_write"
    cache_keep      [batch, 1, cache_len, 1]        role "cache_keep"

The graphs hold no integer ops apart from the token Gather. The attention of
layer i is exported under the ONNX name scope ``/layers.{i}/self_attn/`` with
projections ``q_proj``/``k_proj``/``v_proj``/``o_proj``; npuforge.passes.mha_to_sha
relies on that layout.
"""

import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from npuforge import progress
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json
from npuforge.memory import release_memory
from npuforge.models.llama import export_levers
from npuforge.models.llama.config import (
    MASK_VALUE,
    WHOLE_MODEL_OPTIONS,
    LlamaConfig,
    host_inputs,
    load_config,
)
from npuforge.models.llama.model import build_model, load_chunk
from npuforge.models.llama.weights import load_state_dict
from npuforge.onnx_io import OPSET, embedding_entry, save_onnx, split_layers

DEFAULT_PREFILL_TOKENS = 16
# Position-dependent inputs the host computes per call (role -> graph input name).
# Keeping RoPE gathers and the cache-slot one-hot out of the graph leaves only float
# ops inside, which NPUs run without CPU fallback.
HOST_ROLES = {
    "mask": "attention_mask",
    "rope_cos": "rope_cos",
    "rope_sin": "rope_sin",
    "cache_write": "cache_write",
    "cache_keep": "cache_keep",
}


def extra_inputs(export_meta: dict, input_spec: dict, position: int) -> np.ndarray:
    """Value of a llama-specific graph input for a call whose first token is at ``position``."""
    role = input_spec.get("role")
    if role not in HOST_ROLES:
        raise NpuforgeError(f"llama graphs have no input role {role!r} ({input_spec.get('name')})")
    # Positions count the caller's tokens; a kv_prefix sits in the slots before them.
    offset = len(export_meta.get("kv_prefix", {}).get("tokens", ()))
    values = host_inputs(
        LlamaConfig(**export_meta["config"]),
        batch=export_meta["batch"],
        tokens=export_meta["tokens_per_call"],
        cache_len=export_meta["cache_len"],
        position=offset + position,
        dtype=np.dtype(input_spec.get("dtype", "float32")),
        mask_value=export_meta.get("options", {}).get("mask_value", MASK_VALUE),
    )
    return values[role]


def _chunk_io(cfg, first, last, *, batch, tokens, cache_len, np_dtype, ext_embedding):
    """(inputs, outputs) specs of one chunk, in graph order, in export.json shape."""
    fdt = str(np.dtype(np_dtype))
    cache_shape = [batch, cfg.num_kv_heads, cache_len, cfg.head_dim]
    if first == 0 and ext_embedding:
        shape = [batch, tokens, cfg.hidden_size]
        inputs = [{"name": "embedding", "shape": shape, "dtype": fdt, "role": "embedding"}]
    elif first == 0:
        inputs = [{"name": "tokens", "shape": [batch, tokens], "dtype": "int64", "role": "tokens"}]
    else:
        shape = [batch, tokens, cfg.hidden_size]
        inputs = [{"name": "hidden_in", "shape": shape, "dtype": fdt, "role": "hidden"}]
    host_shapes = {
        "mask": [batch, 1, tokens, cache_len],
        "rope_cos": [batch, 1, tokens, cfg.head_dim],
        "rope_sin": [batch, 1, tokens, cfg.head_dim],
        "cache_write": [batch, 1, cache_len, tokens],
        "cache_keep": [batch, 1, cache_len, 1],
    }
    inputs += [
        {"name": HOST_ROLES[role], "shape": shape, "dtype": fdt, "role": role}
        for role, shape in host_shapes.items()
    ]
    if last == cfg.num_layers:
        shape = [batch, tokens, cfg.vocab_size]
        outputs = [{"name": "logits", "shape": shape, "dtype": fdt, "role": "logits"}]
    else:
        shape = [batch, tokens, cfg.hidden_size]
        outputs = [{"name": "hidden_out", "shape": shape, "dtype": fdt, "role": "hidden"}]
    for layer in range(first, last):
        for kind in ("k", "v"):
            name = cache_name(layer, kind)
            state = {"name": name, "shape": cache_shape, "dtype": fdt, "role": "state"}
            inputs.append({**state, "output": f"{name}_out"})
            outputs.append({**state, "name": f"{name}_out"})
    return inputs, outputs


def run_from_empty_cache(model, ids: list, cache_len: int, mask_value=MASK_VALUE):
    """(logits, caches) of the torch ``model`` over ``ids`` ([batch][tokens]) from an
    empty KV cache of ``cache_len`` slots."""
    import torch

    cfg = model.cfg
    batch, tokens = len(ids), len(ids[0])
    host = host_inputs(
        cfg, batch=batch, tokens=tokens, cache_len=cache_len, position=0, mask_value=mask_value
    )
    shape = [batch, cfg.num_kv_heads, cache_len, cfg.head_dim]
    caches = [torch.zeros(shape) for _ in range(2 * cfg.num_layers)]
    roles = ("mask", "rope_cos", "rope_sin", "cache_write", "cache_keep")
    with torch.no_grad():
        return model(
            torch.tensor(ids, dtype=torch.int64),
            *(torch.from_numpy(host[r]) for r in roles),
            caches,
        )


class PrefixRows:
    """The KV cache rows of ``prefix`` (token ids every sequence starts with), computed
    in fp32 chunk by chunk: ``feed`` each chunk's model in layer order; ``rows()`` gives,
    for each cache in ``tensors`` order, its slots 0..P-1 ([batch, kv_heads, P,
    head_dim]), float32 LE, concatenated.

    Trained models put a massive activation (|h| ~ 2e4 in SmolLM2) on a sequence's first
    token; quantizers that see it spread every activation range over it. With the first
    tokens' cache computed at export, the graphs never see them. The export takes the
    rows from its weights before it rounds them (GPTQ): no graph computes them, so no
    rounding need reach them, and GPTQ, fitted to the text after the prefix, moves its
    error onto the channels quiet there, which the prefix's massive activation uses
    (SmolLM2, 4-bit groups of 64: top-1 0.594, perplexity +80.6 % with the prefix from the
    rounded weights; 0.719, +17.6 % from the weights before).
    """

    def __init__(self, cfg, prefix, batch, cache_len, mask_value):
        import torch

        self.cfg, self.count, self.cache_len = cfg, len(prefix), cache_len
        self.host = host_inputs(
            cfg,
            batch=batch,
            tokens=self.count,
            cache_len=cache_len,
            position=0,
            mask_value=mask_value,
        )
        self.x = torch.tensor([list(prefix)] * batch, dtype=torch.int64)
        self.parts = []

    def feed(self, model, first: int, last: int):
        """Run layers [first, last) of ``model`` over the prefix, in fp32 (a float16
        model is widened in place and left float32: the round trip is exact)."""
        import torch

        model.float()
        batch, cfg = self.x.shape[0], self.cfg
        shape = [batch, cfg.num_kv_heads, self.cache_len, cfg.head_dim]
        caches = [torch.zeros(shape) for _ in range(2 * (last - first))]
        roles = ("mask", "rope_cos", "rope_sin", "cache_write", "cache_keep")
        with torch.no_grad():
            self.x, caches = model(
                self.x, *(torch.from_numpy(self.host[r]) for r in roles), caches, first, last
            )
        self.parts += [
            np.ascontiguousarray(c[:, :, : self.count, :].numpy(), dtype="<f4").ravel()
            for c in caches
        ]

    def rows(self) -> np.ndarray:
        return np.concatenate(self.parts)


def write_kv_prefix(directory, rows, cfg, prefix) -> dict:
    """``PrefixRows.rows()`` written as kv_prefix.bin in ``directory``; its record."""
    names = [cache_name(layer, kind) for layer in range(cfg.num_layers) for kind in ("k", "v")]
    path = Path(directory) / "kv_prefix.bin"
    rows.tofile(path)
    return {
        "tokens": list(prefix),
        "file": path.name,
        "sha256": sha256_file(path),
        "dtype": "float32",
        "slots": len(prefix),
        "tensors": names,
    }


def cache_name(layer: int, kind: str) -> str:
    """Graph input name of layer ``layer``'s K (kind "k") or V cache; the output adds _out."""
    return f"cache_{layer}_{kind}"


def _export_chunk(model, first, last, inputs, outputs, scratch):
    """Trace layers [first, last) to ONNX; return the model with canonical names."""
    import onnx
    import torch

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, mask, cos, sin, write, keep, *caches):
            embed = inputs[0]["role"] == "tokens"
            host = (mask, cos, sin, write, keep)
            y, new_caches = self.model(x, *host, list(caches), first, last, embed)
            return (y, *new_caches)

    dtype = next(model.parameters()).dtype
    examples = []
    for spec in inputs:
        if spec["dtype"] == "int64":
            examples.append(torch.zeros(spec["shape"], dtype=torch.int64))
        else:
            examples.append(torch.zeros(spec["shape"], dtype=dtype))
    # The TorchScript exporter keeps module scopes in node names (/layers.{i}/self_attn/...),
    # which the MHA->SHA pass keys on. Past 2 GB it writes one file per tensor, hence
    # the scratch folder.
    scratch.mkdir()
    path = scratch / "chunk.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            Chunk().eval(),
            tuple(examples),
            str(path),
            input_names=[s["name"] for s in inputs],
            output_names=[s["name"] for s in outputs],
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    proto = onnx.load(str(path))
    _canonicalize_names(proto)
    return proto


def _canonicalize_names(proto):
    """Give nodes and weights stable, readable names the MHA->SHA pass can key on.

    The exporter's wrapper adds '/model' to node names ('/model/layers.0/...' becomes
    '/layers.0/...'), and transposed Linear weights arrive as 'onnx::MatMul_<n>';
    they are renamed '<module path>.weight_t' ([in, out]) after the MatMul that reads them.
    """
    graph = proto.graph
    renames = {}
    for node in graph.node:
        if node.name.startswith("/model/"):
            node.name = node.name[len("/model") :]
        if node.op_type == "MatMul" and node.name.endswith(("_proj/MatMul", "offsets/MatMul")):
            weight = node.input[1]
            if weight.startswith("onnx::"):
                module = node.name.strip("/").removesuffix("/MatMul").replace("/", ".")
                renames[weight] = f"{module}.weight_t"
        if node.name == "/lm_head/MatMul" and node.input[1].startswith("onnx::"):
            renames[node.input[1]] = "lm_head.weight_t"
    for init in graph.initializer:
        init.name = renames.get(init.name, init.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)


def export_llama(
    checkpoint_dir,
    out_dir,
    *,
    variant: str,
    tokens: int | None = None,
    dtype: str = "fp32",
    chunks: int = 1,
    layers_per_chunk: list | None = None,
    batch: int = 1,
    cache_len: int | None = None,
    sha: bool = False,
    ext_embedding: bool = False,
    external_data: bool | None = None,
    mask_value: float = MASK_VALUE,
    fp16_fixes: bool = False,
    tanh_silu: bool = False,
    kv_prefix: tuple = (),
    smoothquant: dict | None = None,
    group_offsets: dict | None = None,
    block_centres: dict | None = None,
    rotate: dict | None = None,
    awq: dict | None = None,
    gptq: dict | None = None,
) -> dict:
    """Write chunk{i}.onnx + export.json (docs/interfaces.md) for one static graph variant.

    variant "decode" is AR-1 (tokens must be 1); "prefill" is AR-N with N = tokens
    (default DEFAULT_PREFILL_TOKENS). layers_per_chunk: each chunk's layer count where the
    memory plan gives them (else split evenly). ext_embedding=True writes embedding.bin
    (npuforge.onnx_io layout) and the first chunk takes rows of it (role "embedding").
    cache_len defaults to min(max_position_embeddings, 2048). sha=True applies the
    MHA->SHA pass (npuforge.passes.mha_to_sha) to every chunk. external_data: weights
    in chunkN.onnx.data (None: only past the 2 GB protobuf limit). mask_value: the
    additive mask of hidden slots, recorded in export.json for the runner. fp16_fixes:
    the residual stream's norms in a form whose fp16 arithmetic cannot overflow (exact in
    fp32; for SoCs that compute in fp16 whatever the graph dtype, e.g. the Qualcomm HTP).
    tanh_silu: the MLPs' SiLU as x * (1/2 + tanh(x/2) / 2), the same function, which the
    Qualcomm HTP computes in fp16 ten times closer than a Sigmoid after a MatMul.
    kv_prefix: token ids every sequence starts with; their KV cache rows are computed
    here in fp32 and shipped as the graphs' starting state (``PrefixRows``).
    smoothquant: {"alpha": a, "text": calibration text path ("" for the project's)}:
    SmoothQuant scales folded into the weights (``npuforge.models.llama.smoothing``).
    group_offsets: {"group": g}: each decoder matmul's per-group weight minima moved into
    a side matmul (``npuforge.models.llama.group_offsets``), for 4-bit group quantizers.
    block_centres: {"group": g}: the MLP matmuls' per-group centres moved into a side
    matmul, for symmetric 4-bit block quantizers.
    rotate: {"seed": s}: the model rotated exactly (``npuforge.models.llama.rotation``):
    norms folded, the residual stream, V per head and down_proj's input (online, a
    constant matmul in the graph) rotated by seeded Hadamard or orthogonal matrices.
    awq: {"bits", "group", "symmetric", "text"}: AWQ scales for that grid, searched on the
    calibration text and folded into the norms and up_proj (``npuforge.models.llama.awq``),
    after any rotation: the same function in fp32.
    gptq: {"bits", "group", "symmetric", "integer_zero", "search_range", "text",
    "generated"}: the decoder projections (with block_centres: the MLP's, the ones a block
    quantizer takes) rounded by GPTQ (``npuforge.models.llama.rounding``) onto that grid
    from the calibration text, plus ``generated`` sequences the model samples itself
    (``npuforge.models.llama.sampling``), after any rotation and before any split.
    """
    import torch

    if variant not in ("decode", "prefill"):
        raise NpuforgeError(f"variant must be decode or prefill, got {variant!r}")
    if tokens is None:
        tokens = 1 if variant == "decode" else DEFAULT_PREFILL_TOKENS
    if variant == "decode" and tokens != 1:
        raise NpuforgeError(f"the decode variant takes 1 token per call, got tokens={tokens}")
    if tokens < 1 or batch < 1:
        raise NpuforgeError(f"tokens and batch must be positive, got {tokens} and {batch}")
    dtypes = {"fp32": (torch.float32, np.float32), "fp16": (torch.float16, np.float16)}
    if dtype not in dtypes:
        raise NpuforgeError(f"dtype must be fp32 or fp16 for llama exports, got {dtype!r}")
    torch_dtype, np_dtype = dtypes[dtype]

    cfg = load_config(checkpoint_dir)
    cache_len = cache_len or min(cfg.max_position_embeddings, 2048)
    if tokens > cache_len:
        raise NpuforgeError(f"tokens per call ({tokens}) exceed cache_len ({cache_len})")
    kv_prefix = [int(t) for t in kv_prefix or ()]
    if kv_prefix and not (
        len(kv_prefix) < cache_len and all(0 <= t < cfg.vocab_size for t in kv_prefix)
    ):
        raise NpuforgeError(
            f"kv_prefix {kv_prefix} must be fewer than cache_len ({cache_len}) token ids below "
            f"the vocabulary size ({cfg.vocab_size}); fix the model's export.kv_prefix"
        )
    if smoothquant and rotate:
        raise NpuforgeError(
            "smoothquant and rotate both apply to this precision; a rotation already spreads "
            "the outliers SmoothQuant moves: keep the precision in one of them"
        )
    if smoothquant and awq:
        raise NpuforgeError(
            "smoothquant and awq both apply to this precision; both fold input-channel "
            "scales into the norms: keep the precision in one of them"
        )
    # Smoothing needs fp32 activations, the offsets and rotations fp32 weights: the model
    # is cast after. They change the whole model at once, so it is loaded whole; a plain
    # export reads one chunk's weights at a time.
    split_options = {"group_offsets": group_offsets, "block_centres": block_centres}
    levers = {
        "smoothquant": smoothquant, "rotate": rotate, "awq": awq, "gptq": gptq, **split_options
    }  # fmt: skip
    whole = any(levers[name] for name in WHOLE_MODEL_OPTIONS)
    build = {"cache_len": cache_len, "fp16_safe": fp16_fixes, "tanh_silu": tanh_silu}
    prefix_rows = PrefixRows(cfg, kv_prefix, batch, cache_len, mask_value) if kv_prefix else None
    model = smoothed = rotated = scaled = rounded = None
    split = {}
    if whole:
        progress.stage(f"export {variant}: loading the whole model (its levers change all of it)")
        model = build_model(cfg, load_state_dict(checkpoint_dir, torch.float32), **build)
        if smoothquant:
            smoothed = export_levers.smoothquant(
                model, checkpoint_dir, smoothquant, kv_prefix, cache_len,
                run=lambda ids: run_from_empty_cache(model, [ids], cache_len),
            )  # fmt: skip
        if rotate:
            from npuforge.models.llama.rotation import rotate as rotate_model

            rotated = rotate_model(model, int(rotate["seed"]))
        if awq:
            scaled = export_levers.awq(model, checkpoint_dir, awq, kv_prefix)
        if prefix_rows:
            prefix_rows.feed(model, 0, cfg.num_layers)
        if gptq:
            mlp_only = bool(block_centres)
            rounded = export_levers.gptq(model, checkpoint_dir, gptq, kv_prefix, mlp_only)
        from npuforge.models.llama.group_offsets import split_group_offsets

        split = {
            option: split_group_offsets(model, int(chosen["group"]), option)
            for option, chosen in split_options.items()
            if chosen
        }
        model = model.to(torch_dtype)
    ranges = split_layers(cfg.num_layers, chunks, layers_per_chunk)

    graphs, embedding = [], None
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for index, (first, last) in enumerate(ranges):
            progress.stage(
                f"export {variant}: chunk {index + 1} of {len(ranges)} (layers {first}-{last - 1})",
                done=index,
                total=len(ranges),
            )
            chunk = model
            if not whole:
                chunk = load_chunk(checkpoint_dir, cfg, first, last, torch_dtype, **build)
                if prefix_rows:
                    prefix_rows.feed(chunk, first, last)
                chunk = chunk.to(torch_dtype)
            if ext_embedding and index == 0:
                table = chunk.embed_tokens.weight.detach().numpy().astype(np_dtype)
                embedding = embedding_entry(tmp, table)
                del table
            inputs, outputs = _chunk_io(
                cfg,
                first,
                last,
                batch=batch,
                tokens=tokens,
                cache_len=cache_len,
                np_dtype=np_dtype,
                ext_embedding=ext_embedding,
            )
            scratch = tmp / f".scratch{index}"
            proto = _export_chunk(chunk, first, last, inputs, outputs, scratch)
            del chunk
            if sha:
                from npuforge.passes import mha_to_sha

                proto = mha_to_sha.convert(proto, inplace=True)
            path = tmp / f"chunk{index}.onnx"
            external = save_onnx(proto, path, external_data)
            del proto
            shutil.rmtree(scratch)
            release_memory()
            graph = {
                "file": path.name,
                "sha256": sha256_file(path),
                "layers": [first, last],
                "inputs": inputs,
                "outputs": outputs,
            }
            if external:
                graph["external_data"] = external
            graphs.append(graph)
        progress.clear()
        prefix = None
        if prefix_rows:
            prefix = write_kv_prefix(tmp, prefix_rows.rows(), cfg, kv_prefix)
        meta = {
            "family": "llama",
            "arch": cfg.model_type,
            "variant": variant,
            "dtype": dtype,
            "batch": batch,
            "tokens_per_call": tokens,
            "cache_len": cache_len,
            "chunks": len(ranges),
            "vocab_size": cfg.vocab_size,
            "embed_dim": cfg.hidden_size,
            "n_layers": cfg.num_layers,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "config": asdict(cfg),
            "options": {
                "sha": sha,
                "ext_embedding": ext_embedding,
                "mask_value": float(mask_value),
                "fp16_fixes": bool(fp16_fixes),
                "tanh_silu": bool(tanh_silu),
                "opset": OPSET,
            },
            "embedding": embedding,
            "graphs": graphs,
        }
        if prefix:
            meta["kv_prefix"] = prefix
        if smoothed:
            meta["smoothquant"] = smoothed
            meta["options"]["smoothquant"] = smoothed["alpha"]
        if rotated:
            meta["rotation"] = rotated
            meta["options"]["rotate"] = rotated["seed"]
        if scaled:
            meta["awq"] = scaled
            meta["options"]["awq"] = scaled["grid"]
        if rounded:
            meta["gptq"] = rounded
            meta["options"]["gptq"] = rounded["grid"]
        for option, record in split.items():
            meta[option] = record
            meta["options"][option] = record["group"]
        write_json(tmp / "export.json", meta)
    return meta
