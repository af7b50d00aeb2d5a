"""The Llama-family decoder in plain torch, in the spirit of nanoGPT's model.py.

``Llama`` is the whole decoder; ``forward`` runs layers [first, last) of one chunk
over ``T`` tokens against an explicit KV cache that it updates by mask (see
``npuforge.models.llama.onnx_export``). The position-dependent tensors (mask, RoPE rows,
cache write/keep slots) come in as inputs, computed by the host.
"""

import torch
from torch import nn

from npuforge.errors import NpuforgeError
from npuforge.models.llama.config import LlamaConfig, load_config
from npuforge.models.llama.weights import load_state_dict

# Floor of the fp16-safe norm's divisor: keeps eps / m**2 below 0.05 in fp16.
SAFE_NORM_FLOOR = 2.0**-6


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, fp16_safe=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp16_safe = fp16_safe

    def forward(self, x):
        if self.fp16_safe:
            # rms(x) = m * rms(x / m) for any m > 0. With m = max |x| every square lies in
            # [0, 1] and their mean in [1/n, 1], so fp16 neither overflows (trained models'
            # hidden states reach |x| ~ 2e4, whose square is far past 65504) nor goes
            # subnormal; eps scales by 1 / m**2 to keep the result exact. y * y, not
            # y.pow(2): onnxruntime fuses Pow-ReduceMean-Add-Sqrt into a norm whose
            # epsilon must be a constant, and then drops this one.
            m = x.abs().amax(-1, keepdim=True).clamp(min=SAFE_NORM_FLOOR)
            y = x / m
            variance = (y * y).mean(-1, keepdim=True)
            return self.weight * (y * torch.rsqrt(variance + self.eps / m / m))
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        e, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(e, self.heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(e, self.kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(e, self.kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * d, e, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, write, keep, mask, k_cache, v_cache):
        b, t, _ = x.shape
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, h, d)
        k = self.k_proj(x).view(b, t, kv, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, KV, T, D]
        v = self.v_proj(x).view(b, t, kv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Mask-based cache update: clear the written slots, add the new rows there.
        k_cache = k_cache * keep + torch.matmul(write, k)
        v_cache = v_cache * keep + torch.matmul(write, v)
        # GQA without repeating K/V: the G query heads sharing a kv head are
        # stacked along the token axis, [B, KV, G*T, D].
        length = k_cache.shape[2]
        q = (q * d**-0.5).reshape(b, kv, (h // kv) * t, d)
        scores = torch.matmul(q, k_cache.transpose(2, 3)).view(b, h, t, length) + mask
        probs = torch.softmax(scores, dim=-1).view(b, kv, (h // kv) * t, length)
        out = torch.matmul(probs, v_cache).view(b, h, t, d).transpose(1, 2)
        return self.o_proj(out.reshape(b, t, h * d)), k_cache, v_cache


def tanh_silu(x):
    """silu(x) = x * sigmoid(x) = x * (1/2 + tanh(x/2) / 2), exactly. The QNN HTP runs a
    Sigmoid that follows a MatMul in a coarser fp16 kernel than it runs a lone Sigmoid or
    a Tanh (SmolLM2-135M's gate_proj on the simulator: relative error 5.1e-3 as
    silu(x W), 4.2e-4 in this form)."""
    return x * (0.5 + 0.5 * torch.tanh(0.5 * x))


class KroneckerRotation(nn.Module):
    """x -> x (A kron B) for x [..., a * b]: two small constant matmuls in place of one
    of (a b)^2 weights. With x read as a * b rows Z, x (A kron B) is A^T Z B."""

    def __init__(self, left: torch.Tensor, right: torch.Tensor):
        super().__init__()
        self.left = nn.Parameter(left, requires_grad=False)
        self.right = nn.Parameter(right, requires_grad=False)
        self.sizes = (int(left.shape[0]), int(right.shape[0]))

    def forward(self, x):
        a, b = self.sizes
        if a == 1:
            return x @ self.right
        # Sizes read from x trace to constants: a static Reshape (see GroupOffsetLinear).
        z = x.reshape(*x.shape[:-1], a, b) @ self.right
        # A^T Z as (Z^T A)^T: the constant stays the second operand of its MatMul.
        z = (z.transpose(-1, -2) @ self.left).transpose(-1, -2)
        return z.reshape(x.shape)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tanh_form: bool = False):
        super().__init__()
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(e, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(e, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, e, bias=cfg.mlp_bias)
        self.activation = tanh_silu if tanh_form else nn.functional.silu
        # An online rotation of down_proj's input (npuforge.models.llama.rotation).
        self.down_rotation = None

    def forward(self, x):
        h = self.activation(self.gate_proj(x)) * self.up_proj(x)
        if self.down_rotation is not None:
            h = self.down_rotation(h)
        return self.down_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, fp16_safe: bool, tanh_silu: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp16_safe)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp16_safe)
        self.mlp = MLP(cfg, tanh_silu)

    def forward(self, x, cos, sin, write, keep, mask, k_cache, v_cache):
        a, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, write, keep, mask, k_cache, v_cache
        )
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class Llama(nn.Module):
    """The whole decoder; ``forward`` runs layers [first, last) of a chunk.

    ``fp16_safe``: the norms of the residual stream take the overflow-free form (see
    ``RMSNorm``); the q/k norms of Qwen3 see projections, not the stream, and keep theirs.
    ``tanh_silu``: the MLPs' SiLU in its tanh form (see ``tanh_silu``).
    """

    def __init__(
        self, cfg: LlamaConfig, cache_len: int, fp16_safe: bool = False, tanh_silu: bool = False
    ):
        super().__init__()
        self.cfg, self.cache_len = cfg, cache_len
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, fp16_safe, tanh_silu) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp16_safe)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x, mask, cos, sin, write, keep, caches, first=0, last=None, embed=None):
        """One call of layers [first, last); the position-dependent inputs come from
        ``host_inputs`` (mask [B,1,T,L], cos/sin [B,1,T,D], write [B,1,L,T], keep [B,1,L,1]).

        x: token ids [B, T] when ``embed`` (default: first == 0), else hidden [B, T, E].
        caches: [k_0, v_0, k_1, v_1, ...] for layers first..last-1.
        Returns (hidden or logits, updated caches in the same order).
        """
        last = self.cfg.num_layers if last is None else last
        if first == 0 if embed is None else embed:
            x = self.embed_tokens(x)
        new_caches = []
        for offset, layer in enumerate(self.layers[first:last]):
            x, k, v = layer(x, cos, sin, write, keep, mask, *caches[2 * offset : 2 * offset + 2])
            new_caches += [k, v]
        if last == self.cfg.num_layers:
            x = self.lm_head(self.norm(x))
        return x, new_caches


def chunk_modules(cfg: LlamaConfig, first: int, last: int) -> set[str]:
    """Top-level module names (``layers.{i}``, ``embed_tokens``, ``norm``, ``lm_head``)
    whose weights a chunk of layers [first, last) runs: the table in the first chunk,
    the norm and head in the last (a tied head is the table)."""
    names = {f"layers.{i}" for i in range(first, last)}
    if first == 0:
        names.add("embed_tokens")
    if last == cfg.num_layers:
        names |= {"norm", "lm_head"} | ({"embed_tokens"} if cfg.tie_word_embeddings else set())
    return names


def checkpoint_module(name: str) -> str:
    """The top-level module a checkpoint tensor belongs to (``model.layers.3.mlp...``:
    ``layers.3``)."""
    parts = name.removeprefix("model.").split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def build_model(
    cfg: LlamaConfig,
    state_dict: dict,
    cache_len: int,
    fp16_safe: bool = False,
    tanh_silu: bool = False,
    layers: tuple[int, int] | None = None,
):
    """A Llama torch module in eval mode with the checkpoint's weights loaded.

    ``layers=(first, last)``: only what that chunk runs (``chunk_modules``) is expected
    in ``state_dict``; every other layer, the table or the head is an empty module, so a
    chunk of a large model holds its own weights only. Its forward and ONNX graph are
    those of the whole model's over the same layers.
    """
    # Built on the meta device and given the checkpoint tensors themselves (assign=True):
    # no random init, no second copy of the weights.
    with torch.device("meta"):
        model = Llama(cfg, cache_len, fp16_safe, tanh_silu)
    kept = chunk_modules(cfg, *layers) if layers else None
    weights = {k.removeprefix("model."): v for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights and (kept is None or "lm_head" in kept):
        raise NpuforgeError("checkpoint has no lm_head.weight and config says untied embeddings")
    expected = {
        k
        for k in model.state_dict()
        if not (cfg.tie_word_embeddings and k == "lm_head.weight")
        and (kept is None or checkpoint_module(k) in kept)
    }
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    # Some checkpoints store derived rotary buffers; they are recomputed here.
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise NpuforgeError(
            f"checkpoint tensors do not match the {cfg.model_type} layout "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); "
            "check config.json belongs to these weights"
        )
    model.load_state_dict({k: weights[k] for k in expected}, strict=False, assign=True)
    if kept is not None:
        for index in range(cfg.num_layers):
            if f"layers.{index}" not in kept:
                model.layers[index] = nn.Module()
        for name in ("embed_tokens", "norm", "lm_head"):
            if name not in kept:
                setattr(model, name, nn.Module())
    if cfg.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.embed_tokens.weight
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise NpuforgeError("llama model has unloaded parameters; this is a bug")
    return model.eval()


def load_chunk(checkpoint_dir, cfg: LlamaConfig, first: int, last: int, dtype, **options):
    """``build_model`` of layers [first, last) read from the checkpoint tensor by tensor:
    the memory of one chunk, not of the model."""
    kept = chunk_modules(cfg, first, last)
    state_dict = load_state_dict(
        checkpoint_dir, dtype, wanted=lambda name: checkpoint_module(name) in kept
    )
    return build_model(cfg, state_dict, layers=(first, last), **options)


def load_llama(checkpoint_dir, cache_len: int):
    cfg = load_config(checkpoint_dir)
    return build_model(cfg, load_state_dict(checkpoint_dir), cache_len)
