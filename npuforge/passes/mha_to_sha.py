"""MHA -> SHA: split multi-head attention into per-head single-head attention.

Qualcomm HTP runs single-head attention (SHA) much better than one batched
multi-head MatMul; exporting MHA and converting afterwards keeps the source
model simple (seed 003, ExecuTorch's convert_mha_to_sha). The per-layer KV
cache stays one combined tensor per layer: the pass slices it per kv head
inside the graph and concatenates the updated heads back, so the graph keeps
2 x n_layers cache inputs and outputs.

The pass matches exactly the attention that npuforge.models.llama exports under
the node scope ``/layers.{i}/self_attn/``::

    q = rope(Transpose(Reshape(x @ Wq (+ bq), [B,T,H,D]) (-> RMSNorm)))  # likewise k; v: no rope
    k_out = k_cache * keep + write @ k           v_out = v_cache * keep + write @ v
    p = Softmax(Reshape(Reshape(q * scale, [B,KV,G*T,D]) @ Transpose(k_out), [B,H,T,L]) + mask)
    o_proj(Reshape(Transpose(Reshape(Reshape(p, [B,KV,G*T,L]) @ v_out, [B,H,T,D])), [B,T,H*D]))

and rewrites it as, for each query head h with kv head g = h // G::

    q_h = rope(x @ Wq[:, h] (+ bq[h])) * scale         (per-head projections, [B,T,D])
    k_g = rope(x @ Wk[:, g] (+ bk[g]))                  v_g = x @ Wv[:, g] (+ bv[g])
    (Qwen3: an RMSNorm over head_dim between projection and rope, kept per head)
    kc_g = Slice(k_cache, g) * keep + write @ k_g       (likewise v; k_out = Concat_g kc_g)
    (one token, T = 1: write * k_g, the same product broadcast: no MatMul of inner dim 1;
    several: (k_g^T @ write^T)^T, the one-hot the MatMul's second input)
    o_h = Softmax(q_h @ kc_g^T + mask) @ vc_g           o_proj input = Concat_h o_h

Every node of the attention scope must be accounted for by the match; anything
else raises NpuforgeError instead of being skipped.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from npuforge.errors import NpuforgeError

_Q_PROJ = re.compile(r"^/layers\.(\d+)/self_attn/q_proj/MatMul$")


# --------------------------------------------------------------------------- slicing
# Two small functions carry all head bookkeeping; tests swap in broken variants
# to prove the checks catch a mis-sliced head.


def head_columns(weight: np.ndarray, bias, head: int, head_dim: int):
    """Columns of a [in, heads*head_dim] projection (and its bias) that belong to ``head``."""
    cols = slice(head * head_dim, (head + 1) * head_dim)
    return weight[:, cols], None if bias is None else bias[cols]


def kv_head_of(head: int, group_size: int) -> int:
    """The kv head a query head reads under grouped-query attention (HF repeat_kv order)."""
    return head // group_size


# --------------------------------------------------------------------------- graph index


class _Graph:
    def __init__(self, graph):
        from onnx import numpy_helper

        self.graph = graph
        self.by_name = {n.name: n for n in graph.node}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.inits = {i.name: i for i in graph.initializer}
        self.inputs = {v.name for v in graph.input}
        self.outputs = {v.name for v in graph.output}
        self._numpy = numpy_helper

    def const(self, name: str, what: str) -> np.ndarray:
        """Value of an initializer or Constant-node output; raise if it is computed."""
        if name in self.inits:
            return self._numpy.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return self._numpy.to_array(attr.t)
        raise _Mismatch(f"{what} ({name}) is not a constant")


class _Mismatch(Exception):
    """The graph departs from the expected attention pattern (message says where)."""


def _attr(node, name, default=None):
    from onnx import helper

    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


@dataclass
class _LayerMatch:
    layer: int
    x: str
    weights: dict  # "q"/"k"/"v" -> (weight [in, out], bias or None)
    norms: dict  # "q"/"k"/"v" -> per-head RMSNorm {weight, eps, two, one} or None
    cos: str
    sin: str
    scale: np.ndarray
    write: str
    keep: str
    mask: str
    caches: dict  # "k"/"v" -> (input name, output name)
    o_input: str
    dims: dict  # B, T, H, KV, D, L
    nodes: list = field(default_factory=list)


class _Matcher:
    """Walks one layer's attention from its q_proj MatMul, recording every node it explains."""

    def __init__(self, g: _Graph, layer: int):
        self.g, self.layer, self.nodes = g, layer, []
        self.scope = f"/layers.{layer}/self_attn/"

    def take(self, node, op_type: str, what: str):
        if node is None or node.op_type != op_type:
            found = "nothing" if node is None else f"{node.op_type} {node.name!r}"
            raise _Mismatch(f"expected {op_type} for {what}, found {found}")
        self.nodes.append(node)
        return node

    def only_consumer(self, tensor: str, op_type: str, what: str):
        users = self.g.consumers.get(tensor, [])
        if len(users) != 1:
            raise _Mismatch(f"{what}: {tensor} has {len(users)} consumers, expected 1")
        return self.take(users[0], op_type, what)

    def other_input(self, node, known: str, what: str) -> str:
        ins = list(node.input)
        if len(ins) != 2 or known not in ins:
            raise _Mismatch(f"{what}: {node.name} does not read {known}")
        return ins[1] if ins[0] == known else ins[0]

    def reshape_to(self, node, expected: list[int] | None, what: str) -> list[int]:
        shape = [int(v) for v in self.g.const(node.input[1], f"{what} shape")]
        if expected is not None and shape != expected:
            raise _Mismatch(f"{what}: reshape to {shape}, expected {expected}")
        return shape

    def transpose(self, tensor: str, perm: list[int], what: str) -> str:
        node = self.only_consumer(tensor, "Transpose", what)
        if list(_attr(node, "perm", [])) != perm:
            raise _Mismatch(f"{what}: perm {list(_attr(node, 'perm', []))}, expected {perm}")
        return node.output[0]

    def projection(self, kind: str, x: str | None):
        """x @ W (+ b) -> Reshape [B,T,heads,D] (-> RMSNorm) -> Transpose.

        Returns (x, W, b, norm or None, transposed tensor, head shape).
        """
        name = f"{self.scope}{kind}_proj/MatMul"
        mm = self.take(self.g.by_name.get(name), "MatMul", name)
        if x is not None and mm.input[0] != x:
            raise _Mismatch(f"{name} reads {mm.input[0]}, not the attention input {x}")
        if mm.input[1] not in self.g.inits:
            raise _Mismatch(f"{name}: weight {mm.input[1]} is not an initializer")
        weight = self.g.const(mm.input[1], f"{kind}_proj weight")
        out, bias = mm.output[0], None
        users = self.g.consumers.get(out, [])
        if len(users) == 1 and users[0].op_type == "Add":
            add = self.take(users[0], "Add", f"{kind}_proj bias")
            bias = self.g.const(self.other_input(add, out, f"{kind}_proj bias"), "bias")
            out = add.output[0]
        reshape = self.only_consumer(out, "Reshape", f"{kind} head split")
        shape = self.reshape_to(reshape, None, f"{kind} head split")
        if len(shape) != 4 or shape[2] * shape[3] != weight.shape[1]:
            raise _Mismatch(f"{kind} head split to {shape} does not fit weight {weight.shape}")
        split, norm = reshape.output[0], None
        norm_scope = f"{self.scope}{kind}_norm/"
        if any(n.name.startswith(norm_scope) for n in self.g.consumers.get(split, [])):
            split, norm = self.head_norm(split, shape[3], f"{kind}_norm")
        heads = self.transpose(split, [0, 2, 1, 3], f"{kind} heads transpose")
        return mm.input[0], weight, bias, norm, heads, shape

    def head_norm(self, tensor: str, head_dim: int, what: str):
        """Qwen3's RMSNorm over head_dim: w * (t * 1 / sqrt(mean(t^2) + eps)) -> (out, norm)."""
        users = self.g.consumers.get(tensor, [])
        if sorted(n.op_type for n in users) != ["Mul", "Pow"]:
            raise _Mismatch(f"{what}: expected Pow + Mul (RMSNorm) after {tensor}")
        power = self.take(next(n for n in users if n.op_type == "Pow"), "Pow", what)
        two = self.g.const(power.input[1], f"{what} exponent")
        if power.input[0] != tensor or two.size != 1 or float(two) != 2.0:
            raise _Mismatch(f"{what}: Pow is not a square of the heads")
        mean = self.only_consumer(power.output[0], "ReduceMean", what)
        axes = _attr(mean, "axes")
        if axes is None and len(mean.input) > 1:
            axes = self.g.const(mean.input[1], f"{what} axes").tolist()
        if list(axes or []) not in ([-1], [3]) or _attr(mean, "keepdims", 1) != 1:
            raise _Mismatch(f"{what}: mean is not over head_dim with keepdims")
        add = self.only_consumer(mean.output[0], "Add", what)
        eps = self.g.const(self.other_input(add, mean.output[0], what), f"{what} eps")
        root = self.only_consumer(add.output[0], "Sqrt", what)
        inverse = self.only_consumer(root.output[0], "Div", what)
        one = self.g.const(inverse.input[0], f"{what} numerator")
        if inverse.input[1] != root.output[0] or one.size != 1 or float(one) != 1.0:
            raise _Mismatch(f"{what}: Div is not 1 / sqrt(...)")
        scaled = self.only_consumer(inverse.output[0], "Mul", what)
        if scaled is not next(n for n in users if n.op_type == "Mul"):
            raise _Mismatch(f"{what}: the normalised product does not read the heads")
        self.other_input(scaled, tensor, what)
        weighted = self.only_consumer(scaled.output[0], "Mul", what)
        weight = self.g.const(self.other_input(weighted, scaled.output[0], what), f"{what} weight")
        if weight.shape != (head_dim,):
            raise _Mismatch(f"{what}: weight shape {weight.shape}, expected ({head_dim},)")
        norm = {"weight": weight, "eps": eps, "two": two, "one": one}
        return weighted.output[0], norm

    def rope(self, tensor: str, head_dim: int, what: str):
        """t * cos + rotate_half(t) * sin -> (rotated, cos, sin)."""
        users = self.g.consumers.get(tensor, [])
        muls = [n for n in users if n.op_type == "Mul"]
        slices = [n for n in users if n.op_type == "Slice"]
        if len(users) != 3 or len(muls) != 1 or len(slices) != 2:
            raise _Mismatch(f"{what}: expected Mul + 2 Slice (RoPE) after {tensor}")
        mul_cos = self.take(muls[0], "Mul", f"{what} cos")
        cos = self.other_input(mul_cos, tensor, f"{what} cos")
        half = head_dim // 2
        by_start = {}
        for node in slices:
            self.take(node, "Slice", f"{what} rotate_half")
            start = int(self.g.const(node.input[1], "slice start")[0])
            end = int(self.g.const(node.input[2], "slice end")[0])
            axis = int(self.g.const(node.input[3], "slice axis")[0]) if len(node.input) > 3 else 0
            if axis not in (-1, 3) or (start, min(end, head_dim)) not in (
                (0, half),
                (half, head_dim),
            ):
                raise _Mismatch(f"{what}: slice [{start}:{end}] on axis {axis} is not a RoPE half")
            by_start[start] = node
        if set(by_start) != {0, half}:
            raise _Mismatch(f"{what}: rotate_half slices do not cover both halves")
        neg = self.only_consumer(by_start[half].output[0], "Neg", f"{what} rotate_half")
        concat = self.only_consumer(neg.output[0], "Concat", f"{what} rotate_half")
        if list(concat.input) != [neg.output[0], by_start[0].output[0]]:
            raise _Mismatch(f"{what}: rotate_half concatenates in the wrong order")
        if _attr(concat, "axis") not in (-1, 3):
            raise _Mismatch(f"{what}: rotate_half concat axis {_attr(concat, 'axis')}")
        mul_sin = self.only_consumer(concat.output[0], "Mul", f"{what} sin")
        sin = self.other_input(mul_sin, concat.output[0], f"{what} sin")
        add = self.only_consumer(mul_cos.output[0], "Add", f"{what} sum")
        self.other_input(add, mul_sin.output[0], f"{what} sum")
        return add.output[0], cos, sin

    def cache_update(self, new: str, write: str | None, what: str):
        """cache * keep + write @ new -> (write, keep, cache input, cache output)."""
        mm = self.only_consumer(new, "MatMul", f"{what} cache write")
        if mm.input[1] != new or (write is not None and mm.input[0] != write):
            raise _Mismatch(f"{what}: cache write MatMul has unexpected operands")
        add = self.only_consumer(mm.output[0], "Add", f"{what} cache update")
        mul = self.take(
            self.g.producer.get(self.other_input(add, mm.output[0], what)), "Mul", f"{what} keep"
        )
        cache = next((i for i in mul.input if i in self.g.inputs), None)
        if cache is None or add.output[0] not in self.g.outputs:
            raise _Mismatch(f"{what}: cache update does not go from a graph input to an output")
        return mm.input[0], self.other_input(mul, cache, what), cache, add.output[0]

    def match(self) -> _LayerMatch:
        x, wq, bq, q_norm, q, q_shape = self.projection("q", None)
        _, wk, bk, k_norm, k, k_shape = self.projection("k", x)
        _, wv, bv, v_norm, v, v_shape = self.projection("v", x)
        if v_norm is not None or (q_norm is None) != (k_norm is None):
            raise _Mismatch("head norms must be on both q and k and not on v")
        b, t, h, d = q_shape
        kv = k_shape[2]
        if k_shape != [b, t, kv, d] or v_shape != k_shape or h % kv:
            raise _Mismatch(f"q/k/v head shapes {q_shape}, {k_shape}, {v_shape} disagree")
        q, cos, sin = self.rope(q, d, "q RoPE")
        k, k_cos, k_sin = self.rope(k, d, "k RoPE")
        if (k_cos, k_sin) != (cos, sin):
            raise _Mismatch("q and k use different RoPE tables")
        write, keep, k_cache, k_out = self.cache_update(k, None, "k")
        _, v_keep, v_cache, v_out = self.cache_update(v, write, "v")
        if v_keep != keep:
            raise _Mismatch("k and v caches use different keep masks")
        length = self._cache_length(k_cache)

        scale_mul = self.only_consumer(q, "Mul", "q scale")
        scale = self.g.const(self.other_input(scale_mul, q, "q scale"), "q scale")
        if scale.size != 1:
            raise _Mismatch(f"q scale has {scale.size} elements, expected a scalar")
        grouped = self.only_consumer(scale_mul.output[0], "Reshape", "q grouping")
        group = h // kv
        self.reshape_to(grouped, [b, kv, group * t, d], "q grouping")
        k_t = self._consumer_of(k_out, "Transpose", "k transpose")
        if list(_attr(k_t, "perm", [])) != [0, 1, 3, 2]:
            raise _Mismatch("k cache transpose is not [0, 1, 3, 2]")
        scores = self.only_consumer(grouped.output[0], "MatMul", "scores")
        if list(scores.input) != [grouped.output[0], k_t.output[0]]:
            raise _Mismatch("scores MatMul does not read q and the transposed k cache")
        ungroup = self.only_consumer(scores.output[0], "Reshape", "scores per head")
        self.reshape_to(ungroup, [b, h, t, length], "scores per head")
        masked = self.only_consumer(ungroup.output[0], "Add", "attention mask")
        mask = self.other_input(masked, ungroup.output[0], "attention mask")
        if mask not in self.g.inputs:
            raise _Mismatch(f"attention mask {mask} is not a graph input")
        softmax = self.only_consumer(masked.output[0], "Softmax", "softmax")
        if _attr(softmax, "axis", -1) not in (-1, 3):
            raise _Mismatch("softmax is not over the cache axis")
        regroup = self.only_consumer(softmax.output[0], "Reshape", "probs grouping")
        self.reshape_to(regroup, [b, kv, group * t, length], "probs grouping")
        pv = self.only_consumer(regroup.output[0], "MatMul", "probs @ v")
        if list(pv.input) != [regroup.output[0], v_out]:
            raise _Mismatch("probs MatMul does not read the updated v cache")
        heads = self.only_consumer(pv.output[0], "Reshape", "output heads")
        self.reshape_to(heads, [b, h, t, d], "output heads")
        merged = self.transpose(heads.output[0], [0, 2, 1, 3], "output transpose")
        merge = self.only_consumer(merged, "Reshape", "head merge")
        self.reshape_to(merge, [b, t, h * d], "head merge")
        o_proj = self.g.consumers.get(merge.output[0], [])
        if [n.name for n in o_proj] != [f"{self.scope}o_proj/MatMul"]:
            raise _Mismatch("merged heads do not feed o_proj/MatMul")
        return _LayerMatch(
            layer=self.layer,
            x=x,
            weights={"q": (wq, bq), "k": (wk, bk), "v": (wv, bv)},
            norms={"q": q_norm, "k": k_norm, "v": None},
            cos=cos,
            sin=sin,
            scale=scale.reshape(()),
            write=write,
            keep=keep,
            mask=mask,
            caches={"k": (k_cache, k_out), "v": (v_cache, v_out)},
            o_input=merge.output[0],
            dims={"B": b, "T": t, "H": h, "KV": kv, "D": d, "L": length},
            nodes=self.nodes,
        )

    def _consumer_of(self, tensor, op_type, what):
        found = [n for n in self.g.consumers.get(tensor, []) if n.op_type == op_type]
        if len(found) != 1:
            raise _Mismatch(f"{what}: expected one {op_type} reading {tensor}")
        return self.take(found[0], op_type, what)

    def _cache_length(self, cache: str) -> int:
        for value in self.g.graph.input:
            if value.name == cache:
                dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
                if len(dims) == 4 and dims[2] > 0:
                    return dims[2]
        raise _Mismatch(f"cache input {cache} has no static [B, KV, L, D] shape")


# --------------------------------------------------------------------------- emission


class _Emitter:
    def __init__(self, prefix: str, float_dtype):
        self.prefix, self.float_dtype = prefix, float_dtype
        self.nodes, self.inits, self.names = [], [], set()

    def const(self, name: str, value) -> str:
        from onnx import numpy_helper

        full = f"{self.prefix}{name}"
        if full not in self.names:  # shared shape/index constants are made once
            self.names.add(full)
            self.inits.append(numpy_helper.from_array(np.asarray(value), full))
        return full

    def ints(self, name: str, values) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def op(self, op_type: str, inputs: list[str], name: str, output: str | None = None, **attrs):
        from onnx import helper

        out = output or f"{self.prefix}{name}"
        self.nodes.append(
            helper.make_node(op_type, inputs, [out], name=f"{self.prefix}{name}", **attrs)
        )
        return out


def _emit_sha(m: _LayerMatch, float_dtype, opset: int) -> _Emitter:
    dims = m.dims
    b, t, h, kv, d, length = (dims[k] for k in ("B", "T", "H", "KV", "D", "L"))
    group = h // kv
    e = _Emitter(f"/layers.{m.layer}/self_attn/sha/", float_dtype)
    cos = e.op("Reshape", [m.cos, e.ints("btd", [b, t, d])], "cos")
    sin = e.op("Reshape", [m.sin, e.ints("btd", [b, t, d])], "sin")
    write = e.op("Reshape", [m.write, e.ints("blt", [b, length, t])], "write")
    keep = e.op("Reshape", [m.keep, e.ints("bl1", [b, length, 1])], "keep")
    # The HTP cuts a MatMul's second 16-bit activation to about 8 bits: several rows are
    # written as (rows^T @ write^T)^T, where that input is the one-hot, exact in 8 bits.
    write_t = write if t == 1 else e.op("Transpose", [write], "write_t", perm=[0, 2, 1])
    mask = e.op("Reshape", [m.mask, e.ints("btl", [b, t, length])], "mask")
    first_half = (e.ints("zero", [0]), e.ints("half", [d // 2]))
    second_half = (e.ints("half", [d // 2]), e.ints("full", [d]))
    last_axis = e.ints("last_axis", [-1])
    scale = e.const("scale", m.scale.astype(float_dtype))

    def project(kind: str, head: int, rope: bool) -> str:
        weight, bias = m.weights[kind]
        w_h, b_h = head_columns(weight, bias, head, d)
        tag = f"{kind}{head}"
        out = e.op("MatMul", [m.x, e.const(f"{tag}_proj.weight_t", w_h)], f"{tag}_proj")
        if b_h is not None:
            out = e.op("Add", [out, e.const(f"{tag}_proj.bias", b_h)], f"{tag}_bias")
        norm = m.norms[kind]
        if norm is not None:  # the same weights for every head: made once per layer
            square = e.op("Pow", [out, e.const(f"{kind}_norm.two", norm["two"])], f"{tag}_sq")
            if opset >= 18:
                mean = e.op("ReduceMean", [square, last_axis], f"{tag}_mean", keepdims=1)
            else:
                mean = e.op("ReduceMean", [square], f"{tag}_mean", axes=[-1], keepdims=1)
            var = e.op("Add", [mean, e.const(f"{kind}_norm.eps", norm["eps"])], f"{tag}_var")
            root = e.op("Sqrt", [var], f"{tag}_root")
            one = e.const(f"{kind}_norm.one", norm["one"])
            inverse = e.op("Div", [one, root], f"{tag}_inv")
            normed = e.op("Mul", [out, inverse], f"{tag}_normed")
            weight = e.const(f"{kind}_norm.weight", norm["weight"])
            out = e.op("Mul", [weight, normed], f"{tag}_norm")
        if not rope:
            return out
        lo = e.op("Slice", [out, *first_half, last_axis], f"{tag}_lo")
        hi = e.op("Slice", [out, *second_half, last_axis], f"{tag}_hi")
        rotated = e.op("Concat", [e.op("Neg", [hi], f"{tag}_neg"), lo], f"{tag}_rot", axis=-1)
        return e.op(
            "Add",
            [e.op("Mul", [out, cos], f"{tag}_cos"), e.op("Mul", [rotated, sin], f"{tag}_sin")],
            f"{tag}_rope",
        )

    updated = {"k": [], "v": []}
    for g in range(kv):
        new = {"k": project("k", g, rope=True), "v": project("v", g, rope=False)}
        for kind in ("k", "v"):
            cache = m.caches[kind][0]
            head = e.op(
                "Slice",
                [
                    cache,
                    e.ints(f"kv{g}_start", [g]),
                    e.ints(f"kv{g}_end", [g + 1]),
                    e.ints("axis1", [1]),
                ],
                f"{kind}cache{g}_slice",
            )
            head = e.op("Reshape", [head, e.ints("bld", [b, length, d])], f"{kind}cache{g}")
            kept = e.op("Mul", [head, keep], f"{kind}cache{g}_keep")
            # One token: the one-hot column times the new row, broadcast (no MatMul of
            # inner dimension 1; docs/backends/qnn.md).
            if t == 1:
                written = e.op("Mul", [write, new[kind]], f"{kind}cache{g}_write")
            else:
                rows_t = e.op("Transpose", [new[kind]], f"{kind}{g}_rows_t", perm=[0, 2, 1])
                written_t = e.op("MatMul", [rows_t, write_t], f"{kind}cache{g}_write")
                written = e.op("Transpose", [written_t], f"{kind}cache{g}_written", perm=[0, 2, 1])
            updated[kind].append(e.op("Add", [kept, written], f"{kind}cache{g}_new"))
    for kind in ("k", "v"):
        cache_out = m.caches[kind][1]
        parts = [
            e.op("Reshape", [u, e.ints("b1ld", [b, 1, length, d])], f"{kind}cache{g}_4d")
            for g, u in enumerate(updated[kind])
        ]
        e.op("Concat", parts, f"{kind}cache_concat", output=cache_out, axis=1)
    keys_t = [
        e.op("Transpose", [u], f"kcache{g}_t", perm=[0, 2, 1]) for g, u in enumerate(updated["k"])
    ]

    outputs = []
    for head in range(h):
        g = kv_head_of(head, group)
        q = e.op("Mul", [project("q", head, rope=True), scale], f"q{head}_scaled")
        scores = e.op("MatMul", [q, keys_t[g]], f"head{head}_scores")
        masked = e.op("Add", [scores, mask], f"head{head}_masked")
        probs = e.op("Softmax", [masked], f"head{head}_probs", axis=-1)
        outputs.append(e.op("MatMul", [probs, updated["v"][g]], f"head{head}_out"))
    e.op("Concat", outputs, "heads_concat", output=m.o_input, axis=-1)
    return e


# --------------------------------------------------------------------------- driver


def _remove_dead(graph) -> None:
    live = {o.name for o in graph.output}
    kept = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = [i for i in graph.initializer if i.name in live]
    del graph.initializer[:]
    graph.initializer.extend(used)


def _topological(graph) -> None:
    """Reorder nodes so every input is produced before use (Kahn's algorithm)."""
    known = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    nodes = list(graph.node)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output}
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in set(node.input) - known:
            if name not in producer:
                raise NpuforgeError(f"MHA->SHA left {name!r} without a producer; this is a bug")
            waiting[index] += 1
            users.setdefault(producer[name], []).append(index)
    # A heap of indices keeps the original order wherever it is already valid,
    # so the output is deterministic.
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for user in users.get(index, []):
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(nodes):
        raise NpuforgeError("MHA->SHA produced a cyclic graph; this is a bug in the pass")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def attention_layers(model) -> list[int]:
    """Layer indices whose attention the pass recognises by name (q_proj MatMul)."""
    return sorted(int(match.group(1)) for n in model.graph.node if (match := _Q_PROJ.match(n.name)))


def convert(model, inplace: bool = False):
    """Return ``model`` with every layer's attention split into single heads.

    A copy unless ``inplace`` (saves one copy of the weights on large graphs); on an
    NpuforgeError an in-place model may be left half-converted.
    """
    import onnx

    if inplace:
        out = model
    else:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    graph = out.graph
    layers = attention_layers(out)
    if not layers:
        raise NpuforgeError(
            "MHA->SHA found no '/layers.N/self_attn/q_proj/MatMul' node; "
            "the pass only understands graphs exported by npuforge.models.llama"
        )
    g = _Graph(graph)
    matches = []
    for layer in layers:
        try:
            match = _Matcher(g, layer).match()
        except _Mismatch as err:
            raise NpuforgeError(f"MHA->SHA cannot convert layer {layer}: {err}") from None
        scope = f"/layers.{layer}/self_attn/"
        explained = {id(n) for n in match.nodes}
        extra = [
            n.name
            for n in graph.node
            if n.name.startswith(scope)
            and n.op_type != "Constant"
            and id(n) not in explained
            and not n.name.startswith(f"{scope}o_proj/")
        ]
        if extra:
            raise NpuforgeError(
                f"MHA->SHA cannot convert layer {layer}: unrecognised nodes {extra[:3]} in its "
                "attention; re-export with npuforge.models.llama or extend the pass"
            )
        matches.append(match)

    float_dtype = matches[0].weights["q"][0].dtype
    opset = next(o.version for o in out.opset_import if o.domain in ("", "ai.onnx"))
    removed = {id(n) for m in matches for n in m.nodes}
    kept = [n for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    for match in matches:
        emitted = _emit_sha(match, float_dtype, opset)
        graph.node.extend(emitted.nodes)
        graph.initializer.extend(emitted.inits)
    _topological(graph)
    _remove_dead(graph)  # needs topological order: one backward sweep
    if sum(len(t.raw_data) for t in graph.initializer) > 1_800_000_000:
        return out  # the checker serializes the model, which protobuf cannot past 2 GiB
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError as err:
        raise NpuforgeError(
            f"MHA->SHA produced an invalid graph: {str(err).splitlines()[0]}"
        ) from None
    return out


def convert_file(src, dst) -> None:
    """Load ``src``, convert it and write ``dst`` atomically (may be the same path)."""
    import onnx

    from npuforge.fileio import atomic_path

    model = onnx.load(str(src))
    converted = convert(model)
    dst = Path(dst)
    with atomic_path(dst) as tmp:
        # Protobuf cannot hold 2 GB; large graphs keep their weights in <file>.data.
        large = converted.ByteSize() > 1_800_000_000
        onnx.save(
            converted,
            str(tmp),
            save_as_external_data=large,
            location=f"{dst.name}.data" if large else None,
        )
