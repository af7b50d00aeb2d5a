"""RWKV v5.2 / v6 / v7 as a torch module, one chunk of layers at a time.

``RwkvChunk(spec)`` runs layers ``[first, last)`` over ``T`` tokens of ``B``
sequences per call, every piece of recurrent state an explicit input and output
(``layout.io_specs``): one decode step is ``T = 1``, prefill is ``T > 1`` (the
recurrence is unrolled over T). Its parameters are named as ``layout.param_shapes``
and filled by ``layout.load_weights`` (or streamed by the exporter). Shapes are
static: nothing is read off a tensor. H, N, C are the papers' names: heads, head
size, channels.
"""

import torch
import torch.nn.functional as F
from torch import nn

from npuforge.models.rwkv.layout import GN_EPS, LN_EPS, GraphSpec, param_shapes


class Params(nn.Module):
    """A flat bag of named parameters (dots in names become submodules)."""


class RwkvChunk(nn.Module):
    def __init__(self, spec: GraphSpec, device="cpu"):
        """Uninitialised parameters (``device="meta"``: no memory at all, enough for
        tracing; ``layout.load_weights`` fills a CPU one)."""
        super().__init__()
        cfg = spec.config
        self.spec, self.cfg = spec, cfg
        self.H, self.N, self.C = cfg.n_heads, cfg.head_size, cfg.embed_dim
        self.B, self.T = spec.batch, spec.tokens
        dtype = torch.float16 if spec.dtype == "fp16" else torch.float32
        self.names = list(param_shapes(spec))
        for name, shape in param_shapes(spec).items():
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, Params())
                owner = getattr(owner, part)
            placeholder = torch.empty(shape, dtype=dtype, device=device)
            owner.register_parameter(leaf, nn.Parameter(placeholder, False))
        self.gn_eps = GN_EPS / spec.wkv_scale**2
        self.l2_eps = 1e-12 if spec.dtype == "fp32" else 1e-6

    def p(self, name):
        return self.get_parameter(name)

    # ---- shapes ---------------------------------------------------------------------
    def layer_norm(self, x, weight, bias, eps):
        return F.layer_norm(x, (self.C,), weight=weight, bias=bias, eps=eps)

    def group_norm(self, y, weight, bias, eps):
        # y: [B, T, H, N]: a LayerNormalization over each head's N channels, then the
        # per-channel affine (compilers fuse LayerNormalization and accumulate it wide).
        return F.layer_norm(y, (self.N,), eps=eps) * weight + bias

    def shifted(self, x, shift):
        """The previous token's x for each position: [B, T, C]."""
        if self.T == 1:
            return shift.unsqueeze(1)
        return torch.cat([shift.unsqueeze(1), x[:, :-1]], dim=1)

    def heads_rows(self, x):  # [B, T, C] -> [B, H, T, N]
        return x.reshape(self.B, self.T, self.H, self.N).transpose(1, 2)

    def heads_cols(self, x):  # [B, T, C] -> [B, H, N, T]
        return x.reshape(self.B, self.T, self.H, self.N).permute(0, 2, 3, 1)

    # ---- time mixing ----------------------------------------------------------------
    def tmix_v7(self, i, x, shift, state, v_first):
        B, T, H, N, C = self.B, self.T, self.H, self.N, self.C
        a_ = f"blocks.{i}.att."
        p = lambda k: self.p(a_ + k)  # noqa: E731
        xx = self.shifted(x, shift) - x
        xr, xw, xk = x + xx * p("x_r"), x + xx * p("x_w"), x + xx * p("x_k")
        xv, xa, xg = x + xx * p("x_v"), x + xx * p("x_a"), x + xx * p("x_g")
        r = xr @ p("receptance")
        w = torch.tanh(xw @ p("w1")) @ p("w2")
        k = xk @ p("key")
        v = xv @ p("value")
        a = torch.sigmoid(p("a0") + (xa @ p("a1")) @ p("a2"))
        g = torch.sigmoid(xg @ p("g1")) @ p("g2")
        kk = (k * p("k_k")).reshape(B, T, H, N)
        kk = kk / torch.sqrt(torch.clamp((kk * kk).sum(-1, keepdim=True), min=self.l2_eps))
        kk = kk.reshape(B, T, C)
        k = k * (1 + (a - 1) * p("k_a"))
        if i == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(p("v0") + (xv @ p("v1")) @ p("v2"))
        w = torch.exp(-0.606531 * torch.sigmoid(p("w0") + w))  # 0.606531 = exp(-0.5)

        r_rows, k_cols, v_rows = self.heads_rows(r), self.heads_cols(k), self.heads_rows(v)
        w_cols, kk_rows = self.heads_cols(w), self.heads_rows(-kk)
        kka_cols = self.heads_cols(kk * a)
        ys = []
        for t in range(T):
            s = slice(None) if T == 1 else slice(t, t + 1)
            state = (
                state * w_cols[..., s]
                + kka_cols[..., s] * (kk_rows[:, :, s] @ state)
                + k_cols[..., s] * v_rows[:, :, s]
            )
            ys.append(r_rows[:, :, s] @ state)
        y = ys[0] if T == 1 else torch.cat(ys, dim=2)
        y = y.transpose(1, 2)  # [B, T, H, N]
        y = self.group_norm(y, p("ln_x.weight"), p("ln_x.bias"), self.gn_eps)
        bonus = (r * k).reshape(B, T, H, N) * p("r_k")
        y = y + bonus.sum(-1, keepdim=True) * v.reshape(B, T, H, N)
        return (y.reshape(B, T, C) * g) @ p("output"), state, v_first

    def tmix_v56(self, i, x, shift, state):
        B, T, C, version = self.B, self.T, self.C, self.cfg.version
        a_ = f"blocks.{i}.att."
        p = lambda k: self.p(a_ + k)  # noqa: E731
        prev = self.shifted(x, shift)
        if version == 5:
            d = x - prev
            xk, xv = prev + d * p("mix_k"), prev + d * p("mix_v")
            xr, xg = prev + d * p("mix_r"), prev + d * p("mix_g")
        else:
            sx = prev - x
            xxx = x + sx * p("maa_x")
            mix = {j: torch.tanh(xxx @ p(f"maa_{j}1")) @ p(f"maa_{j}2") for j in "wkvrg"}
            xw = x + sx * (p("maa_w") + mix["w"])
            xk = x + sx * (p("maa_k") + mix["k"])
            xv = x + sx * (p("maa_v") + mix["v"])
            xr = x + sx * (p("maa_r") + mix["r"])
            xg = x + sx * (p("maa_g") + mix["g"])
        r = xr @ p("receptance")
        k = xk @ p("key")
        v = xv @ p("value")
        g = xg @ p("gate")
        g = g * torch.sigmoid(g)
        u = p("first")  # [H, N, 1]
        r_rows, k_cols, v_rows = self.heads_rows(r), self.heads_cols(k), self.heads_rows(v)
        if version == 6:
            w = p("decay") + torch.tanh(xw @ p("decay_w1")) @ p("decay_w2")
            w_cols = self.heads_cols(torch.exp(-torch.exp(w)))
        ys = []
        for t in range(T):
            s = slice(None) if T == 1 else slice(t, t + 1)
            kv = k_cols[..., s] * v_rows[:, :, s]
            ys.append(r_rows[:, :, s] @ (u * kv + state))
            decay = p("decay") if version == 5 else w_cols[..., s]
            state = kv + decay * state
        y = ys[0] if T == 1 else torch.cat(ys, dim=2)
        y = self.group_norm(y.transpose(1, 2), p("ln_x.weight"), p("ln_x.bias"), self.gn_eps)
        return (y.reshape(B, T, C) * g) @ p("output"), state

    # ---- channel mixing -------------------------------------------------------------
    def cmix(self, i, x, shift):
        m_ = f"blocks.{i}.ffn."
        p = lambda k: self.p(m_ + k)  # noqa: E731
        prev = self.shifted(x, shift)
        if self.cfg.version == 7:
            k = x + (prev - x) * p("x_k")
            return torch.relu(k @ p("key")).square() @ p("value")
        if self.cfg.version == 5:
            d = x - prev
            xk, xr = prev + d * p("mix_k"), prev + d * p("mix_r")
        else:
            sx = prev - x
            xk, xr = x + sx * p("mix_k"), x + sx * p("mix_r")
        r = torch.sigmoid(xr @ p("receptance"))
        return r * (torch.relu(xk @ p("key")).square() @ p("value"))

    def forward(self, first, *rest):
        spec, cfg, T = self.spec, self.cfg, self.T
        rest = list(rest)
        if spec.is_first and not spec.ext_embedding:
            x = self.p("emb")[first]
        else:
            x = first
        v_first = rest.pop(0) if (cfg.version == 7 and not spec.is_first) else None
        new_states = []
        for n, i in enumerate(range(*spec.layers)):
            tshift, wkv, cshift = rest[3 * n : 3 * n + 3]
            scale = spec.hidden_scale(i)
            eps = LN_EPS / scale**2
            b = f"blocks.{i}."
            xa = self.layer_norm(x, self.p(b + "ln1.weight"), self.p(b + "ln1.bias"), eps)
            if cfg.version == 7:
                out, wkv, v_first = self.tmix_v7(i, xa, tshift, wkv, v_first)
            else:
                out, wkv = self.tmix_v56(i, xa, tshift, wkv)
            x = x + out
            xf = self.layer_norm(x, self.p(b + "ln2.weight"), self.p(b + "ln2.bias"), eps)
            x = x + self.cmix(i, xf, cshift)
            if spec.halves_after(i):
                x = x * 0.5
            new_states += [xa[:, T - 1], wkv, xf[:, T - 1]]
        outputs = []
        if spec.is_last:
            if spec.last_token_logits:
                x = x[:, T - 1 :]
            scale = spec.hidden_scale(cfg.n_layers)
            eps = LN_EPS / scale**2
            x = self.layer_norm(x, self.p("ln_out.weight"), self.p("ln_out.bias"), eps)
            outputs.append(x @ self.p("head"))
        else:
            outputs.append(x)
            if cfg.version == 7 and spec.is_first:
                outputs.append(v_first)
        return tuple(outputs + new_states)
