"""ONNX rewrites that keep an RKNN graph on the NPU and away from compiler bugs.

Found with rknn-toolkit2 2.5.0 (rk3588/rk3576), read from its placement table:

* ``Exp`` is placed on the CPU. ``Elu`` (alpha 1) runs on the NPU, and for
  ``x <= 0`` ``exp(x) = elu(x) + 1`` exactly. RWKV-7's decay is
  ``exp(-c * sigmoid(w))``, whose argument is never positive, so the rewrite
  applies wherever a sign analysis proves ``x <= 0``; other ``Exp`` nodes are
  left alone and counted.
* A ``MatMul`` whose contracted dimension is 1 (an outer product ``[.., M, 1]
  @ [.., 1, N]``) followed by an ``Add`` is fused by the compiler into a
  matmul-with-bias and then turned into an elementwise multiply that silently
  drops the bias: the simulator's results ignore the recurrent state. An outer
  product is an elementwise ``Mul`` with broadcasting, which the compiler keeps
  right, so such MatMuls are rewritten to ``Mul``.

* An L2 normalisation written as ``x / sqrt(clip(sum(x * x), eps))`` puts
  ``Sqrt`` and ``Div`` on the CPU in quantized builds. Written the way
  ``torch.nn.functional.normalize`` exports it, ``x / expand(clip(reducel2(x),
  sqrt(eps)))``, the compiler fuses it into one NPU normalisation op.

All rewrites are exact in real arithmetic; tests check them with onnxruntime.
"""

from pathlib import Path

# Ops whose output is >= 0 for any input.
_NONNEGATIVE_OPS = {"Sigmoid", "Exp", "Softplus", "Relu", "Sqrt", "Abs", "HardSigmoid"}
# Ops that keep the sign of their (first) input elementwise.
_SIGN_PRESERVING = {
    "Identity",
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
    "Expand",
    "Gather",
    "Slice",
    "Cast",
}


def _constant_values(model):
    """name -> numpy array of every initializer and Constant node output."""
    from onnx import numpy_helper

    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


class _SignAnalysis:
    """Conservative sign of tensors: +1 (all >= 0), -1 (all <= 0) or 0 (unknown)."""

    def __init__(self, model):
        self.constants = _constant_values(model)
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.cache = {}

    def sign(self, name: str, depth: int = 0) -> int:
        if name in self.cache:
            return self.cache[name]
        result = self._sign(name, depth)
        self.cache[name] = result
        return result

    def _sign(self, name, depth):
        if name in self.constants:
            value = self.constants[name]
            if value.size and (value >= 0).all():
                return 1
            if value.size and (value <= 0).all():
                return -1
            return 0
        node = self.producer.get(name)
        if node is None or depth > 64:
            return 0
        op = node.op_type
        args = [self.sign(i, depth + 1) for i in node.input if i]
        if op in _NONNEGATIVE_OPS:
            return 1
        if op in _SIGN_PRESERVING:
            return args[0]
        if op == "Neg":
            return -args[0]
        if op in ("Mul", "Div"):
            return args[0] * args[1]
        if op == "Add":
            return args[0] if args[0] == args[1] else 0
        if op == "Sub":
            return args[0] if args[0] == -args[1] else 0
        if op == "Min":
            return -1 if -1 in args else (1 if all(a == 1 for a in args) else 0)
        if op == "Max":
            return 1 if 1 in args else (-1 if all(a == -1 for a in args) else 0)
        if op == "Clip" and len(node.input) >= 3 and node.input[2]:
            upper = self.sign(node.input[2], depth + 1)
            return -1 if upper == -1 else 0
        return 0


def _static_shapes(model):
    """(name -> static shape, name -> ONNX element type) from shape inference."""
    from onnx import shape_inference

    inferred = shape_inference.infer_shapes(model)
    shapes, types = {}, {}
    graph = inferred.graph
    for info in list(graph.value_info) + list(graph.input) + list(graph.output):
        tensor_type = info.type.tensor_type
        types[info.name] = tensor_type.elem_type
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = [d.dim_value for d in dims]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
        types[init.name] = init.data_type
    return shapes, types


def _l2_normalize_match(node, producer, constants, shapes):
    """For ``x / sqrt(clip(reducesum(x * x, axes), eps))``: (x, axes, eps), else None."""
    import numpy as np

    if node.op_type != "Div":
        return None
    x = node.input[0]
    sqrt = producer.get(node.input[1])
    if sqrt is None or sqrt.op_type != "Sqrt":
        return None
    clip = producer.get(sqrt.input[0])
    if clip is None or clip.op_type != "Clip" or len(clip.input) < 2:
        return None
    if len(clip.input) > 2 and clip.input[2]:
        return None
    eps = constants.get(clip.input[1])
    reduce = producer.get(clip.input[0])
    if eps is None or eps.size != 1 or float(eps) < 0 or reduce is None:
        return None
    if reduce.op_type != "ReduceSum" or len(reduce.input) < 2:
        return None
    square = producer.get(reduce.input[0])
    if square is None or square.op_type != "Mul" or list(square.input) != [x, x]:
        return None
    keepdims = next((a.i for a in reduce.attribute if a.name == "keepdims"), 1)
    axes = constants.get(reduce.input[1])
    if keepdims != 1 or axes is None or x not in shapes:
        return None
    return x, [int(a) for a in np.ravel(axes)], float(np.sqrt(float(eps)))


def rewrite_for_rknn(model):
    """Rewrite a loaded ONNX model in place; return a report of what changed."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    signs = _SignAnalysis(model)
    shapes, types = _static_shapes(model)
    nodes = []
    report = {"exp_to_elu": 0, "exp_kept": 0, "outer_matmul_to_mul": 0, "l2_normalize": 0}
    ones = {}  # ONNX element type -> name of a scalar 1 of that type
    for node in model.graph.node:
        match = _l2_normalize_match(node, signs.producer, signs.constants, shapes)
        if match is not None:
            x, axes, floor = match
            base = node.name or node.output[0]
            norm, clipped, expanded = base + "_l2", base + "_l2_clip", base + "_l2_expand"
            model.graph.initializer.extend(
                [
                    numpy_helper.from_array(np.array(floor, np.float32), base + "_l2_floor"),
                    numpy_helper.from_array(np.array(shapes[x], np.int64), base + "_l2_shape"),
                ]
            )
            nodes += [
                helper.make_node("ReduceL2", [x], [norm], name=norm, axes=axes, keepdims=1),
                helper.make_node("Clip", [norm, base + "_l2_floor"], [clipped], name=clipped),
                helper.make_node(
                    "Expand", [clipped, base + "_l2_shape"], [expanded], name=expanded
                ),
                helper.make_node("Div", [x, expanded], list(node.output), name=base),
            ]
            report["l2_normalize"] += 1
            continue
        if node.op_type == "Exp" and signs.sign(node.input[0]) == -1:
            elem = types.get(node.input[0], TensorProto.FLOAT)
            if elem not in ones:
                ones[elem] = f"rknn_graph_one_{elem}"
                dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
                model.graph.initializer.append(
                    numpy_helper.from_array(np.array(1.0, dtype), ones[elem])
                )
            one_name = ones[elem]
            elu = node.output[0] + "_elu"
            nodes.append(
                helper.make_node(
                    "Elu", [node.input[0]], [elu], name=(node.name or elu) + "_elu", alpha=1.0
                )
            )
            nodes.append(
                helper.make_node(
                    "Add", [elu, one_name], list(node.output), name=(node.name or elu) + "_plus1"
                )
            )
            report["exp_to_elu"] += 1
            continue
        if node.op_type == "Exp":
            report["exp_kept"] += 1
        if node.op_type == "MatMul":
            a, b = shapes.get(node.input[0]), shapes.get(node.input[1])
            if a and b and len(a) >= 2 and len(b) >= 2 and a[-1] == 1 and b[-2] == 1:
                node.op_type = "Mul"
                report["outer_matmul_to_mul"] += 1
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_dead_nodes(model)
    return report


def _drop_dead_nodes(model):
    """Remove nodes whose outputs nobody reads (the old Sqrt/Clip/ReduceSum chains)."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(list(model.graph.node)):
        if any(out in needed for out in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    used = needed
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def rewrite_file(src, dst) -> dict:
    """Load ``src``, rewrite it for RKNN, save to ``dst`` (weights inline); the report."""
    import onnx

    model = onnx.load(str(src))
    report = rewrite_for_rknn(model)
    onnx.checker.check_model(model)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    # Protobuf cannot hold 2 GB: large chunks keep their weights in a side file.
    large = model.ByteSize() > 2**31 - 2**24
    onnx.save(
        model,
        str(dst),
        save_as_external_data=large,
        location=Path(dst).name + ".data" if large else None,
    )
    return report
