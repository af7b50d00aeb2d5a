"""What the QNN quantizer reads from an fp32 graph, and the rewrites it makes first.

Pure graph work (onnx and numpy, imported where used) for ``qnn_quantizer.py``: which
tensors stay 16 bit, which weight matrices a pattern names, the rewrites the HTP needs
(single-row products of two activations as Mul + ReduceSum, squares as Mul), value
ranges known from the graph's structure (inside max-scaled RMSNorms) and the ranges
that make residual branches cover their stream.
"""

import re

# Op types whose float initializers stay 16 bit: normalisations divide by a
# variance that 8-/4-bit parameters distort (seed 001 keeps them in fp16).
NORM_OP_TYPES = ("LayerNormalization", "GroupNormalization", "InstanceNormalization", "RMSNorm")
# Ops whose second input is a large weight matrix: the only tensors that get the
# low weight bit width.
MATMUL_OP_TYPES = ("MatMul", "Gemm", "Conv")


def sensitive_overrides(model, keep_16bit_tensors, quant_type_16, weight_override=None):
    """Tensor overrides that keep norms, elementwise constants and named tensors at 16 bit.

    Only the weight matrices of MatMul/Gemm/Conv take the low weight bit width
    (``weight_override``, e.g. per output channel, when given); every other
    float initializer (norm scales, decay/mix vectors) and every tensor named in
    ``keep_16bit_tensors`` (the recurrent state path) is 16-bit.
    """
    import onnx

    float_inits = {
        init.name
        for init in model.graph.initializer
        if init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    }
    matmul_weights, conv_weights = set(), set()
    norm_params = set()
    for node in model.graph.node:
        if node.op_type in MATMUL_OP_TYPES and len(node.input) > 1:
            matmul_weights.add(node.input[1])
            if node.op_type == "Conv":
                conv_weights.add(node.input[1])
        if node.op_type in NORM_OP_TYPES:
            norm_params.update(node.input[1:])
    overrides = {}
    for name in sorted(float_inits - matmul_weights):
        overrides[name] = [{"quant_type": quant_type_16}]
    if weight_override is not None:
        for name in sorted(float_inits & matmul_weights):
            overrides[name] = [dict(weight_override)]
            # A Conv kernel's output channels are its axis 0 (a MatMul weight's axis 1).
            if name in conv_weights and "axis" in weight_override:
                overrides[name][0]["axis"] = 0
    graph_tensors = {v.name for v in model.graph.input} | {v.name for v in model.graph.output}
    for node in model.graph.node:
        graph_tensors.update(node.output)
    for name in sorted(set(keep_16bit_tensors) & graph_tensors):
        overrides.setdefault(name, [{"quant_type": quant_type_16}])
    kept_norms = sorted(norm_params & float_inits)
    return overrides, kept_norms


def wide_weights(model, overrides: dict, low_bits: dict, patterns: list) -> dict:
    """The weight matrices (given ``low_bits`` in ``overrides``) that a pattern names:
    {patterns, tensors, parameters (theirs), of_parameters (all weight matrices')}."""
    import math

    low = {
        name
        for name, spec in overrides.items()
        if spec == [low_bits] or spec == [{**low_bits, "axis": 0}]
    }
    sizes = {i.name: math.prod(i.dims) for i in model.graph.initializer if i.name in low}
    tensors = sorted(n for n in sizes if any(re.search(p, n) for p in patterns))
    return {
        "patterns": list(patterns),
        "tensors": tensors,
        "parameters": sum(sizes[n] for n in tensors),
        "of_parameters": sum(sizes.values()),
    }


def row_matmuls_to_mul_reducesum(model) -> tuple[list[str], list[str]]:
    """Rewrite ``MatMul(a[..., 1, K], b[..., K, N])`` of two activations in place.

    The HTP computes a MatMul of two 16-bit activations about as if its second
    input were cut to 8 bits: on the demo RWKV-7 the wkv read-out ``r @ state``
    agreed with the CPU on the same QDQ graph at cosine 0.993 (8-bit emulation
    of the state matches the simulator at 0.9994), and the logits fell to 0.990.
    A single-row product is the same sum as ``ReduceSum(transpose(a) * b, -2)``,
    which the HTP computes at 16 bit. Returns the rewritten node names, and those of
    MatMuls of two activations left alone because a shape did not infer.
    """
    import numpy as np
    from onnx import helper, numpy_helper, shape_inference

    inferred = shape_inference.infer_shapes(model)
    shapes = {}
    for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    initializers = {init.name for init in model.graph.initializer}
    nodes, rewritten, unshaped = [], [], []
    for node in model.graph.node:
        a, b = (list(node.input) + ["", ""])[:2]
        sa, sb = shapes.get(a), shapes.get(b)
        of_activations = node.op_type == "MatMul" and not {a, b} & initializers
        known = sa and sb and len(sa) >= 2 and len(sb) >= 2 and sa[-2] is not None
        if of_activations and not known:
            unshaped.append(node.name or node.output[0])
        if not (of_activations and known and sa[-2] == 1):
            nodes.append(node)
            continue
        name = node.name or node.output[0]
        perm = list(range(len(sa) - 2)) + [len(sa) - 1, len(sa) - 2]
        axis = f"{name}_reduce_axis"
        model.graph.initializer.append(numpy_helper.from_array(np.array([-2], np.int64), axis))
        column, terms = f"{name}_column", f"{name}_terms"
        nodes += [
            helper.make_node("Transpose", [a], [column], name=column, perm=perm),
            helper.make_node("Mul", [column, b], [terms], name=terms),
            helper.make_node("ReduceSum", [terms, axis], list(node.output), name=f"{name}_sum"),
        ]
        rewritten.append(name)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten, unshaped


def squares_to_mul(model) -> list[str]:
    """Rewrite ``Pow(x, 2)`` as ``Mul(x, x)`` in place; returns the rewritten node names.

    The quantizer treats a Constant node's output as an activation: the exponent 2
    becomes a uint16 code whose range_margin-widened scale dequantizes it to
    2.0000305, and onnxruntime's Pow of a negative base to a non-integer power is
    NaN. On SmolLM2 that dropped the squares of every negative element inside the
    RMSNorms (a16w8 CPU proxy: top-1 0.22, perplexity +15,600 %). A 16-bit Mul
    has no exponent to quantize.
    """
    import numpy as np

    constants = _constant_values(model)
    rewritten = []
    for node in model.graph.node:
        exponent = node.input[1] if node.op_type == "Pow" and len(node.input) > 1 else None
        if exponent in constants and np.all(constants[exponent] == 2):
            node.op_type = "Mul"
            node.input[1] = node.input[0]
            rewritten.append(node.name or node.output[0])
    # Constant nodes nothing reads any more (the exponents) would still be quantized.
    read = {name for node in model.graph.node for name in node.input}
    unused = [n for n in model.graph.node if n.op_type == "Constant" and n.output[0] not in read]
    for node in unused:
        model.graph.node.remove(node)
    return rewritten


def _constant_values(model) -> dict:
    """Name -> numpy value of every inline initializer (weights left in external data are
    not read) and Constant node output."""
    from onnx import TensorProto, numpy_helper

    values = {
        init.name: numpy_helper.to_array(init)
        for init in model.graph.initializer
        if init.data_location != TensorProto.EXTERNAL
    }
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def _reduces_last_axis_only(node, constants: dict, rank: int | None) -> bool:
    import numpy as np

    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None and len(node.input) > 1 and node.input[1] in constants:
        axes = [int(v) for v in np.ravel(constants[node.input[1]])]
    if not axes or len(axes) != 1:
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def max_scaled_norm_ranges(model) -> dict:
    """Exact value ranges of the tensors inside RMSNorms computed as ``y = x / max|x|``.

    The fp16-safe RMSNorm of the llama export (``npuforge/models/llama/model.py``)
    divides a row by its own max |x| first, so what follows is bounded whatever the
    text: y in [-1, 1], y*y and its mean in [0, 1] (the mean >= 1/n), the mean plus
    the eps term eps/m^2 (<= 1 once m >= the clamp floor), its sqrt, its inverse in
    [0, sqrt(n)] and y times that inverse, a row divided by its rms, in
    [-sqrt(n), sqrt(n)]. Calibration text cannot know these: on SmolLM2 the
    samples' max of mean(y*y) was 0.011 where held-out text reached 0.018, and the
    clipped mean over-scaled whole rows. Returns ``{tensor: (rmin, rmax)}``.
    """
    import math

    import numpy as np
    from onnx import shape_inference

    constants = _constant_values(model)
    inferred = shape_inference.infer_shapes(model)
    dims = {}
    for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        shape = value.type.tensor_type.shape.dim
        dims[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in shape]
    producer = {out: node for node in model.graph.node for out in node.output}
    consumers = {}
    for node in model.graph.node:
        for name in dict.fromkeys(node.input):
            consumers.setdefault(name, []).append(node)

    def is_constant(name, value):
        return name in constants and np.allclose(constants[name], value)

    def followers(name, op_type):
        return [n for n in consumers.get(name, []) if n.op_type == op_type]

    ranges = {}
    for div in model.graph.node:
        if div.op_type != "Div":
            continue
        x, m = div.input[0], div.input[1]
        source = producer.get(m)
        if source is not None and source.op_type in ("Clip", "Max"):
            source = producer.get(source.input[0])
        if source is None or source.op_type != "ReduceMax":
            continue
        absolute = producer.get(source.input[0])
        if absolute is None or absolute.op_type != "Abs" or absolute.input[0] != x:
            continue
        shape = dims.get(x)
        rank = len(shape) if shape else None
        if not _reduces_last_axis_only(source, constants, rank):
            continue
        y = div.output[0]
        ranges[y] = (-1.0, 1.0)
        n = shape[-1] if shape and shape[-1] else None
        squares = [
            node.output[0]
            for node in consumers.get(y, [])
            if (node.op_type == "Pow" and node.input[0] == y and is_constant(node.input[1], 2))
            or (node.op_type == "Mul" and list(node.input) == [y, y])
        ]
        for square in squares:
            ranges[square] = (0.0, 1.0)
            for mean in followers(square, "ReduceMean"):
                if not _reduces_last_axis_only(mean, constants, rank):
                    continue
                ranges[mean.output[0]] = (0.0, 1.0)
                if n is None:
                    continue
                for add in followers(mean.output[0], "Add"):
                    ranges[add.output[0]] = (0.0, 2.0)
                    for sqrt in followers(add.output[0], "Sqrt"):
                        ranges[sqrt.output[0]] = (0.0, math.sqrt(2.0))
                        inverses = followers(sqrt.output[0], "Reciprocal") + [
                            node
                            for node in followers(sqrt.output[0], "Div")
                            if node.input[1] == sqrt.output[0] and is_constant(node.input[0], 1)
                        ]
                        for inverse in inverses:
                            ranges[inverse.output[0]] = (0.0, math.sqrt(n))
                            for mul in followers(inverse.output[0], "Mul"):
                                if y in mul.input:
                                    ranges[mul.output[0]] = (-math.sqrt(n), math.sqrt(n))
    return ranges


def residual_branches(model) -> list[tuple[str, str]]:
    """``(stream, branch)`` of every Add that adds a projection's output (a MatMul/Gemm
    with an initializer weight: attention's o_proj, the MLP's down_proj) to another
    activation: the residual stream and what a layer adds to it."""
    initializers = {init.name for init in model.graph.initializer}
    constants = {
        out for node in model.graph.node if node.op_type == "Constant" for out in node.output
    }
    producer = {out: node for node in model.graph.node for out in node.output}
    pairs = []
    for node in model.graph.node:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        for branch, stream in (node.input, reversed(node.input)):
            maker = producer.get(branch)
            projection = (
                maker is not None
                and maker.op_type in ("MatMul", "Gemm")
                and maker.input[1] in initializers
            )
            if projection and stream not in initializers and stream not in constants:
                pairs.append((stream, branch))
                break
    return pairs


def ranges_covering_stream(ranges: dict, pairs: list) -> dict:
    """Each branch's range widened to [-M, M], M the largest |value| of the stream it is
    added to: a token whose MLP makes or erases a massive activation the calibration
    never saw (SmolLM2 layer 2 at a held-out " the": 568 against a calibrated
    [-15, 15]) is then not clipped, and the branch's 16-bit step is no coarser than
    the stream's own."""
    import numpy as np

    covered = {}
    for stream, branch in pairs:
        if stream not in ranges or branch not in ranges:
            continue
        reach = max(abs(float(ranges[stream]["rmin"])), abs(float(ranges[stream]["rmax"])))
        covered[branch] = {
            "rmin": np.float32(min(float(ranges[branch]["rmin"]), -reach)),
            "rmax": np.float32(max(float(ranges[branch]["rmax"]), reach)),
        }
    return covered
