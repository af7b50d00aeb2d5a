"""The RWKV v5.2 / v6 / v7 layout: checkpoint keys, graph I/O and export-ready weights.

* ``RwkvConfig`` and ``config_from_shapes``: the official BlinkDL key names and
  shapes ("x052", "x060", "x070") and how version and dimensions are read off
  them. ``expected_shapes(cfg)`` is the whole layout (synthetic checkpoints are
  generated from it, loading validates against it).
* ``GraphSpec`` and ``io_specs``: everything that fixes one chunk graph, and its
  inputs and outputs (every piece of recurrent state explicit, static shapes).
* ``prepared_tensor``/``prepared_blocks``: checkpoint tensors as the module's
  parameters, one at a time (transposed to ``x @ W`` form, ln0 folded into the
  embedding, v5 decay pre-exponentiated, fp16 scales folded in), so an exporter
  can stream them without holding the model twice.

Tensors are row vectors: activations are ``[B, T, C]``, matrices ``[in, out]``.
The wkv state of every version is ``[B, H, N, N]`` indexed (head, key, value);
the shift states are ``[B, C]`` and hold the last token's layer-normed input.

fp16 fixes, exact in real arithmetic, powers of two only:

* wkv scale ``s = sk * sv``: key weights are divided by ``sk`` and value weights
  by ``sv``, so ``k v^T``, the wkv state and the wkv output are ``s`` times
  smaller. The group norm that follows gets ``eps / s^2`` (so it is unchanged)
  and v7's bonus term gets ``r_k * s``. The exported wkv state is therefore in
  units of ``1/s``; it only ever travels between our own graphs.
* hidden rescale every ``R`` layers: the residual stream is halved after every
  ``R``-th layer and the block output weights of layer ``i`` are divided by
  ``2**(i // R)`` (as BlinkDL's ``rwkv`` package does for fp16). Layer norms
  are scale invariant; their ``eps`` is divided by the square of the scale.
* v7's ``k_k`` (it only feeds the L2-normalised ``kk``) is divided by ``s`` too,
  so the sum of squares inside the normalisation stays in range.
"""

import math
from dataclasses import dataclass, field

from npuforge.errors import NpuforgeError

VERSION_TAGS = {5: "x052", 6: "x060", 7: "x070"}
LN_EPS = 1e-5
GN_EPS = 64e-5


@dataclass(frozen=True)
class RwkvConfig:
    version: int
    n_layers: int
    embed_dim: int
    n_heads: int
    head_size: int
    vocab_size: int
    ffn_dim: int
    lora: dict = field(default_factory=dict)


def default_lora(version: int, embed_dim: int) -> dict:
    """LoRA ranks the official training code picks for an embedding size."""
    c = embed_dim

    def round32(x):
        return max(32, int(round(x / 32) * 32))

    if version == 7:
        return {
            "decay": round32(1.8 * c**0.5),
            "aaa": round32(1.8 * c**0.5),
            "mv": round32(1.3 * c**0.5),
            "gate": round32(0.6 * c**0.8),
        }
    if version == 6:
        return {"mix": 32 if c < 4096 else 64, "decay": 64 if c < 4096 else 128}
    return {}


def default_ffn_dim(version: int, embed_dim: int) -> int:
    return 4 * embed_dim if version == 7 else int((embed_dim * 3.5) // 32 * 32)


def expected_shapes(cfg: RwkvConfig) -> dict:
    """Every key of an official checkpoint of this config, with its shape."""
    c, h, n, v, f = cfg.embed_dim, cfg.n_heads, cfg.head_size, cfg.vocab_size, cfg.ffn_dim
    vec = (1, 1, c)
    shapes = {"emb.weight": (v, c), "blocks.0.ln0.weight": (c,), "blocks.0.ln0.bias": (c,)}
    for i in range(cfg.n_layers):
        b, att, ffn = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        for ln in ("ln1", "ln2"):
            shapes[f"{b}{ln}.weight"] = (c,)
            shapes[f"{b}{ln}.bias"] = (c,)
        shapes[f"{att}ln_x.weight"] = (c,)
        shapes[f"{att}ln_x.bias"] = (c,)
        for name in ("receptance", "key", "value", "output"):
            shapes[f"{att}{name}.weight"] = (c, c)
        if cfg.version == 5:
            for mix in ("k", "v", "r", "g"):
                shapes[f"{att}time_mix_{mix}"] = vec
            shapes[f"{att}time_decay"] = (h, n)
            shapes[f"{att}time_faaaa"] = (h, n)
            shapes[f"{att}gate.weight"] = (c, c)
        elif cfg.version == 6:
            dm, dd = cfg.lora["mix"], cfg.lora["decay"]
            for mix in ("x", "w", "k", "v", "r", "g"):
                shapes[f"{att}time_maa_{mix}"] = vec
            shapes[f"{att}time_maa_w1"] = (c, 5 * dm)
            shapes[f"{att}time_maa_w2"] = (5, dm, c)
            shapes[f"{att}time_decay"] = vec
            shapes[f"{att}time_decay_w1"] = (c, dd)
            shapes[f"{att}time_decay_w2"] = (dd, c)
            shapes[f"{att}time_faaaa"] = (h, n)
            shapes[f"{att}gate.weight"] = (c, c)
        else:
            for mix in ("r", "w", "k", "v", "a", "g"):
                shapes[f"{att}x_{mix}"] = vec
            for lora, rank in (("w", "decay"), ("a", "aaa"), ("v", "mv")):
                shapes[f"{att}{lora}0"] = vec
                shapes[f"{att}{lora}1"] = (c, cfg.lora[rank])
                shapes[f"{att}{lora}2"] = (cfg.lora[rank], c)
            shapes[f"{att}g1"] = (c, cfg.lora["gate"])
            shapes[f"{att}g2"] = (cfg.lora["gate"], c)
            shapes[f"{att}k_k"] = vec
            shapes[f"{att}k_a"] = vec
            shapes[f"{att}r_k"] = (h, n)
        if cfg.version == 7:
            shapes[f"{ffn}x_k"] = vec
        else:
            key = "time_mix" if cfg.version == 5 else "time_maa"
            shapes[f"{ffn}{key}_k"] = vec
            shapes[f"{ffn}{key}_r"] = vec
            shapes[f"{ffn}receptance.weight"] = (c, c)
        shapes[f"{ffn}key.weight"] = (f, c)
        shapes[f"{ffn}value.weight"] = (c, f)
    shapes["ln_out.weight"] = (c,)
    shapes["ln_out.bias"] = (c,)
    shapes["head.weight"] = (v, c)
    return shapes


def _need(shapes, key, source, ndim):
    if key not in shapes:
        raise NpuforgeError(f"{source}: missing key {key!r}; the checkpoint is incomplete")
    if len(shapes[key]) != ndim:
        raise NpuforgeError(
            f"{source}: key {key!r} has shape {list(shapes[key])}, expected {ndim} dimensions; "
            "the checkpoint is damaged or not an official layout"
        )
    return shapes[key]


def config_from_shapes(shapes: dict, source: str = "checkpoint") -> RwkvConfig:
    """Detect version and dimensions from key names/shapes; validate every key."""
    if "blocks.0.att.r_k" in shapes:
        version = 7
    elif "blocks.0.att.time_maa_x" in shapes:
        version = 6
    elif "blocks.0.att.time_mix_g" in shapes and "blocks.0.att.time_faaaa" in shapes:
        version = 5
    else:
        raise NpuforgeError(
            f"{source}: unknown layout, not an RWKV-5.2 (x052), RWKV-6 (x060) or RWKV-7 (x070) "
            "checkpoint; use an official BlinkDL checkpoint"
        )
    vocab, embed = _need(shapes, "emb.weight", source, 2)
    layer_ids = {int(k.split(".")[1]) for k in shapes if k.startswith("blocks.")}
    n_layers = max(layer_ids) + 1
    heads_key = "blocks.0.att.r_k" if version == 7 else "blocks.0.att.time_faaaa"
    n_heads, head_size = _need(shapes, heads_key, source, 2)
    ffn_dim = _need(shapes, "blocks.0.ffn.key.weight", source, 2)[0]
    lora = {}
    if version == 7:
        probe = 1 if n_layers > 1 else 0
        lora["decay"] = _need(shapes, "blocks.0.att.w1", source, 2)[1]
        lora["aaa"] = _need(shapes, "blocks.0.att.a1", source, 2)[1]
        lora["mv"] = _need(shapes, f"blocks.{probe}.att.v1", source, 2)[1]
        lora["gate"] = _need(shapes, "blocks.0.att.g1", source, 2)[1]
    elif version == 6:
        lora["mix"] = _need(shapes, "blocks.0.att.time_maa_w1", source, 2)[1] // 5
        lora["decay"] = _need(shapes, "blocks.0.att.time_decay_w1", source, 2)[1]
    cfg = RwkvConfig(version, n_layers, embed, n_heads, head_size, vocab, ffn_dim, lora)
    if n_heads * head_size != embed:
        raise NpuforgeError(
            f"{source}: {n_heads} heads x {head_size} != embedding {embed}; the checkpoint is "
            "not a consistent RWKV layout"
        )
    expected = expected_shapes(cfg)
    # Official v7 files keep layer 0's unused v0/v1/v2; accept them absent too.
    optional = {f"blocks.0.att.v{j}" for j in range(3)} if version == 7 else set()
    for key, shape in expected.items():
        if key not in shapes:
            if key in optional:
                continue
            raise NpuforgeError(f"{source}: missing key {key!r}; the checkpoint is incomplete")
        if tuple(shapes[key]) != tuple(shape):
            raise NpuforgeError(
                f"{source}: key {key!r} has shape {list(shapes[key])}, expected {list(shape)}; "
                "the checkpoint is damaged or mixes layouts"
            )
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise NpuforgeError(
            f"{source}: unexpected key {extra[0]!r} (+{len(extra) - 1} more) for RWKV-{version} "
            f"({VERSION_TAGS[version]}); variants such as state-tuned or DeepEmbed models are "
            "not supported"
        )
    return cfg


@dataclass(frozen=True)
class GraphSpec:
    """Everything that fixes one chunk graph's structure."""

    config: RwkvConfig
    layers: tuple  # (first, last) layer indices, last exclusive
    tokens: int = 1  # T, tokens per call
    batch: int = 1
    dtype: str = "fp32"
    ext_embedding: bool = False
    last_token_logits: bool = False
    rescale_every: int = 0  # 0: never halve the residual stream
    wkv_k_scale: float = 1.0
    wkv_v_scale: float = 1.0

    @property
    def is_first(self):
        return self.layers[0] == 0

    @property
    def is_last(self):
        return self.layers[1] == self.config.n_layers

    def hidden_scale(self, layer: int) -> float:
        """Factor by which the residual stream is smaller than the true one, in ``layer``."""
        return 2.0 ** (layer // self.rescale_every) if self.rescale_every else 1.0

    def halves_after(self, layer: int) -> bool:
        return bool(self.rescale_every) and (layer + 1) % self.rescale_every == 0

    @property
    def wkv_scale(self):
        return self.wkv_k_scale * self.wkv_v_scale


def state_shapes(cfg: RwkvConfig, batch: int) -> list:
    """(suffix, shape) of one layer's recurrent state tensors."""
    c, h, n = cfg.embed_dim, cfg.n_heads, cfg.head_size
    return [("tmix_shift", (batch, c)), ("wkv", (batch, h, n, n)), ("cmix_shift", (batch, c))]


def io_specs(spec: GraphSpec):
    """(inputs, outputs): lists of dicts name/shape/dtype/role[/output] in graph order."""
    cfg, b, t = spec.config, spec.batch, spec.tokens
    fdt = "float16" if spec.dtype == "fp16" else "float32"
    c = cfg.embed_dim
    inputs, outputs = [], []
    if spec.is_first and not spec.ext_embedding:
        inputs.append({"name": "tokens", "shape": [b, t], "dtype": "int64", "role": "tokens"})
    elif spec.is_first:
        inputs.append({"name": "embedding", "shape": [b, t, c], "dtype": fdt, "role": "embedding"})
    else:
        inputs.append({"name": "hidden_in", "shape": [b, t, c], "dtype": fdt, "role": "hidden"})
    if cfg.version == 7 and not spec.is_first:
        inputs.append({"name": "v_first_in", "shape": [b, t, c], "dtype": fdt, "role": "hidden"})
    if spec.is_last:
        logit_t = 1 if spec.last_token_logits else t
        outputs.append(
            {
                "name": "logits",
                "shape": [b, logit_t, cfg.vocab_size],
                "dtype": fdt,
                "role": "logits",
            }
        )
    else:
        outputs.append({"name": "hidden_out", "shape": [b, t, c], "dtype": fdt, "role": "hidden"})
        # v_first is made by layer 0 and read by every later chunk: only the first chunk
        # hands it on (a middle chunk passing its input straight out stops TPU-MLIR).
        if cfg.version == 7 and spec.is_first:
            outputs.append(
                {"name": "v_first_out", "shape": [b, t, c], "dtype": fdt, "role": "hidden"}
            )
    for i in range(*spec.layers):
        for suffix, shape in state_shapes(cfg, b):
            name = f"state_{i}_{suffix}"
            inputs.append(
                {
                    "name": name,
                    "shape": list(shape),
                    "dtype": fdt,
                    "role": "state",
                    "output": f"{name}_out",
                }
            )
            outputs.append(
                {"name": f"{name}_out", "shape": list(shape), "dtype": fdt, "role": "state"}
            )
    return inputs, outputs


# --------------------------------------------------------------------------------------------
# Parameters of the export graph: names, shapes and how to make them from the checkpoint.


def param_shapes(spec: GraphSpec) -> dict:
    """Graph parameter name -> shape, in the order the module registers them."""
    cfg = spec.config
    c, h, n, f, v = cfg.embed_dim, cfg.n_heads, cfg.head_size, cfg.ffn_dim, cfg.vocab_size
    shapes = {}
    if spec.is_first and not spec.ext_embedding:
        shapes["emb"] = (v, c)
    for i in range(*spec.layers):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            shapes[p + ln + ".weight"] = (c,)
            shapes[p + ln + ".bias"] = (c,)
        a = p + "att."
        if cfg.version == 5:
            for mix in ("k", "v", "r", "g"):
                shapes[a + "mix_" + mix] = (c,)
            shapes[a + "decay"] = (h, n, 1)
            shapes[a + "first"] = (h, n, 1)
        elif cfg.version == 6:
            dm, dd = cfg.lora["mix"], cfg.lora["decay"]
            for mix in ("x", "w", "k", "v", "r", "g"):
                shapes[a + "maa_" + mix] = (c,)
            for j in "wkvrg":
                shapes[a + f"maa_{j}1"] = (c, dm)
                shapes[a + f"maa_{j}2"] = (dm, c)
            shapes[a + "decay"] = (c,)
            shapes[a + "decay_w1"] = (c, dd)
            shapes[a + "decay_w2"] = (dd, c)
            shapes[a + "first"] = (h, n, 1)
        else:
            for mix in ("r", "w", "k", "v", "a", "g"):
                shapes[a + "x_" + mix] = (c,)
            loras = [("w", "decay"), ("a", "aaa")] + ([("v", "mv")] if i > 0 else [])
            for lora, rank in loras:
                shapes[a + lora + "0"] = (c,)
                shapes[a + lora + "1"] = (c, cfg.lora[rank])
                shapes[a + lora + "2"] = (cfg.lora[rank], c)
            shapes[a + "g1"] = (c, cfg.lora["gate"])
            shapes[a + "g2"] = (cfg.lora["gate"], c)
            shapes[a + "k_k"] = (c,)
            shapes[a + "k_a"] = (c,)
            shapes[a + "r_k"] = (h, n)
        names = ("receptance", "key", "value", "output") + (("gate",) if cfg.version < 7 else ())
        for name in names:
            shapes[a + name] = (c, c)
        shapes[a + "ln_x.weight"] = (h, n)
        shapes[a + "ln_x.bias"] = (h, n)
        m = p + "ffn."
        if cfg.version == 7:
            shapes[m + "x_k"] = (c,)
        else:
            shapes[m + "mix_k"] = (c,)
            shapes[m + "mix_r"] = (c,)
            shapes[m + "receptance"] = (c, c)
        shapes[m + "key"] = (c, f)
        shapes[m + "value"] = (f, c)
    if spec.is_last:
        shapes["ln_out.weight"] = (c,)
        shapes["ln_out.bias"] = (c,)
        shapes["head"] = (c, v)
    return shapes


def prepared_embedding(ckpt):
    """ln0(emb.weight) in float32: what the first layer sees for each token id."""
    import torch.nn.functional as F

    c = ckpt.config.embed_dim
    return F.layer_norm(
        ckpt.float32("emb.weight"),
        (c,),
        weight=ckpt.float32("blocks.0.ln0.weight"),
        bias=ckpt.float32("blocks.0.ln0.bias"),
        eps=LN_EPS,
    )


def prepared_tensor(ckpt, spec: GraphSpec, name: str):
    """The float32 value of graph parameter ``name``, computed from the checkpoint."""
    import torch

    cfg = spec.config
    if name == "emb":
        return prepared_embedding(ckpt)
    if name == "head":
        return ckpt.float32("head.weight").t()
    if name.startswith("ln_out."):
        return ckpt.float32(name)
    _, layer, part, rest = name.split(".", 3)
    i = int(layer)
    src = f"blocks.{i}.{part}."
    shape = param_shapes(spec)[name]
    if part in ("ln1", "ln2"):
        return ckpt.float32(f"blocks.{i}.{part}.{rest}")
    out_scale = 1.0 / spec.hidden_scale(i)

    def w(key):
        return ckpt.float32(src + key)

    def wt(key):
        # Transpose in the (narrow) source dtype, then widen: ~4x faster than a strided
        # widening copy. Always a fresh tensor (a transposed matrix is never contiguous).
        return ckpt[src + key].t().contiguous().to(torch.float32)

    if rest in ("receptance", "gate") or (part == "ffn" and rest == "key"):
        return wt(rest + ".weight")
    if rest == "key" or rest == "value":
        if part == "ffn":
            return wt("value.weight").mul_(out_scale)
        scale = spec.wkv_k_scale if rest == "key" else spec.wkv_v_scale
        return wt(rest + ".weight").div_(scale)
    if rest == "output":
        return wt("output.weight").mul_(out_scale)
    if rest.startswith("ln_x."):
        return w(rest).reshape(shape)
    if cfg.version == 7:
        if rest == "r_k":
            return w("r_k") * spec.wkv_scale
        if rest == "k_k":
            # k_k only feeds the L2-normalised kk (scale invariant): shrinking it keeps
            # the sum of squares inside fp16 range.
            return w("k_k").reshape(shape) / spec.wkv_scale
        return w(rest).reshape(shape)
    # v5 / v6
    if part == "ffn":
        return w(("time_mix_" if cfg.version == 5 else "time_maa_") + rest[len("mix_") :]).reshape(
            shape
        )
    if rest.startswith("mix_"):
        return w("time_mix_" + rest[len("mix_") :]).reshape(shape)
    if rest == "first":
        return w("time_faaaa").reshape(shape)
    if rest == "decay":
        if cfg.version == 5:
            return torch.exp(-torch.exp(w("time_decay"))).reshape(shape)
        return w("time_decay").reshape(shape)
    if rest.startswith("maa_") and len(rest) == 6 and rest[-1] in "12":
        j = "wkvrg".index(rest[4])
        dm = cfg.lora["mix"]
        if rest[-1] == "1":
            return w("time_maa_w1")[:, j * dm : (j + 1) * dm].contiguous()
        return w("time_maa_w2")[j].contiguous()
    if rest.startswith("maa_"):
        return w("time_maa_" + rest[len("maa_") :]).reshape(shape)
    if rest in ("decay_w1", "decay_w2"):
        return w("time_" + rest)
    raise KeyError(name)


def prepared_blocks(ckpt, spec: GraphSpec, name: str, max_bytes: int = 32 << 20):
    """``prepared_tensor(name)`` as consecutive float32 row blocks of bounded size.

    The embedding and the head are the only large tensors (vocab x embed); they are
    produced a slice at a time so an export never holds them whole in float32.
    """
    import torch
    import torch.nn.functional as F

    c, v = spec.config.embed_dim, spec.config.vocab_size
    if name == "emb":
        rows = max(1, max_bytes // (4 * c))
        weight, bias = ckpt.float32("blocks.0.ln0.weight"), ckpt.float32("blocks.0.ln0.bias")
        emb = ckpt["emb.weight"]
        for start in range(0, v, rows):
            block = emb[start : start + rows].float()
            yield F.layer_norm(block, (c,), weight=weight, bias=bias, eps=LN_EPS)
    elif name == "head":
        rows = max(1, max_bytes // (4 * v))
        head = ckpt["head.weight"]
        for start in range(0, c, rows):
            yield head[:, start : start + rows].t().contiguous().to(torch.float32)
    else:
        yield prepared_tensor(ckpt, spec, name)


def load_weights(module, ckpt):
    """Fill a built chunk's parameters from the checkpoint (for running it in torch)."""
    import torch

    with torch.no_grad():
        for name in module.names:
            param = module.get_parameter(name)
            param.copy_(prepared_tensor(ckpt, module.spec, name).to(param.dtype))
    return module


def fp16_scales(wkv_scale: float):
    """Split a power-of-two wkv scale between k and v (8 -> k/2, v/4)."""
    m = round(math.log2(wkv_scale))
    if 2.0**m != wkv_scale or m < 0:
        raise NpuforgeError(f"wkv scale {wkv_scale} is not a power of two >= 1; use 1, 2, 4, 8 ...")
    return 2.0 ** (m // 2), 2.0 ** (m - m // 2)
