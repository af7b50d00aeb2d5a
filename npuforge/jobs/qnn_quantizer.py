"""The QNN job's quantizer: an fp32 graph to the Q/DQ model the HTP compiles.

Runs inside the QNN toolchain environment (imported by ``qnn_job.py``). onnxruntime's
static quantizer inserts the Q/DQ nodes, with overrides that keep sensitive tensors at
16 bit (``qnn_graph.py``), ranges measured once over the calibration samples (widened,
or fixed where the graph's structure knows them) and, for a16w4, weights re-encoded in
blocks. onnxruntime's quantizer scans the whole graph per tensor; this module replaces
three of its private functions with indexed ones, which is why it refuses any other
onnxruntime than the one they were written against.
"""

import math
import re
import sys
from pathlib import Path

from qnn_graph import (
    max_scaled_norm_ranges,
    ranges_covering_stream,
    residual_branches,
    row_matmuls_to_mul_reducesum,
    sensitive_overrides,
    squares_to_mul,
    wide_weights,
)
from qnn_log import Progress, log

# Weights of the side matmuls of a group split (npuforge.models.llama.group_offsets, which
# imports torch): group means times group minima or centres, kept 16-bit.
SIDE_MATMULS = r"\.group_offsets\."

# Significant bits a calibrated min/max keeps, rounded outward (snap_outward).
RANGE_BITS = 4

# The quantizer's Q/DQ insertion in progress (set by quantize_graph, counted per tensor).
_QDQ_PROGRESS: Progress | None = None


def _sample_reader(samples: list, inputs: list):
    """A CalibrationDataReader over .npz samples: one dict {input name: path} per sample."""
    import numpy as np

    specs = {item["name"]: item for item in inputs}
    progress = Progress("calibration samples run", len(samples))

    class SampleReader:
        def __init__(self):
            self._iter = iter(samples)

        def get_next(self):
            sample = next(self._iter, None)
            if sample is None:
                return None
            progress.step()
            feed = {}
            for name, path in sample.items():
                item = specs[name]
                with np.load(path) as data:
                    value = data[name].astype(np.dtype(item["dtype"]), copy=False)
                feed[name] = value.reshape(item["shape"])
            return feed

        def rewind(self):
            self._iter = iter(samples)

    return SampleReader()


# The onnxruntime whose private quantizer functions _quantizer_without_quadratic_scans
# replaces (envs/qnn/requirements.lock pins it; a test keeps the two equal). Rewriting
# the Q/DQ insertion instead would mean repeating its per-op rules to the byte.
ONNXRUNTIME_VERSION = "1.31.1"


def onnxruntime_problem(found: str) -> str | None:
    """Why the quantizer cannot run on onnxruntime ``found``, as one line; None if it can."""
    if found == ONNXRUNTIME_VERSION:
        return None
    return (
        f"error: the QNN quantizer replaces private functions of onnxruntime "
        f"{ONNXRUNTIME_VERSION} and this toolchain has onnxruntime {found}: pin "
        f"onnxruntime=={ONNXRUNTIME_VERSION} in envs/qnn/requirements.lock, or port "
        "_quantizer_without_quadratic_scans (npuforge/jobs/qnn_quantizer.py) to it"
    )


def require_onnxruntime() -> None:
    """Raise the one line of ``onnxruntime_problem`` for the onnxruntime installed here."""
    import onnxruntime

    problem = onnxruntime_problem(onnxruntime.__version__)
    if problem:
        raise RuntimeError(problem)


def _quantizer_without_quadratic_scans() -> None:
    """Give onnxruntime's quantizer and calibrator their lookups without full scans.

    For every activation it puts Q/DQ on, ``ONNXModel.replace_input_of_all_nodes``
    calls a Python function per graph node, and ``find_by_name`` builds a list of
    every initializer before taking the first: on SmolLM2's 7,099-node graph the
    two took 89 % of the Q/DQ insertion (py-spy). Same results, in the same order:
    only nodes holding the input are visited (an index of consumers), and names are
    looked up in an index of each long list. The replacement also counts the tensors
    done, for the log. The min/max calibrator's graph augmentation is rebuilt in one
    pass (see below). Refuses any other onnxruntime (``onnxruntime_problem``), whose
    internals these replacements would silently get wrong.
    """
    import onnxruntime.quantization as package
    from onnxruntime.quantization import calibrate, onnx_model, quant_utils

    require_onnxruntime()
    original = quant_utils.find_by_name
    if getattr(original, "npuforge_fast", False):
        return

    def find_by_name(item_name, item_list):
        if len(item_list) < 64:
            return next((item for item in item_list if item.name == item_name), None)
        # A name index per list (the graph's initializers, which only grow), kept up
        # to date with the items appended since; the list is held so its id stays its own.
        entry = _NAME_INDEX.get(id(item_list))
        if entry is None or entry[0] is not item_list or len(item_list) < entry[2]:
            entry = _NAME_INDEX[id(item_list)] = [item_list, {}, 0]
        index = entry[1]
        for item in item_list[entry[2] :]:
            index.setdefault(item.name, item)
        entry[2] = len(item_list)
        return index.get(item_name)

    def replace_input_of_all_nodes(self, old_input_name, new_input_name):
        if _QDQ_PROGRESS is not None:
            _QDQ_PROGRESS.step()
        consumers = _consumers(self)
        for node in consumers.pop(old_input_name, []):
            if old_input_name in node.input:
                onnx_model.ONNXModel.replace_node_input(node, old_input_name, new_input_name)
                consumers.setdefault(new_input_name, []).append(node)

    find_by_name.npuforge_fast = True
    onnx_model.ONNXModel.replace_input_of_all_nodes = replace_input_of_all_nodes
    calibrate.MinMaxCalibrater.augment_graph = _augment_graph_in_one_pass
    # Modules bind the helper by name at import: rebind it in those loaded so far;
    # later imports take the new one from quant_utils.
    quant_utils.find_by_name = find_by_name
    for name, module in list(sys.modules.items()):
        if name.startswith(package.__name__) and getattr(module, "find_by_name", None) is original:
            module.find_by_name = find_by_name


_NAME_INDEX = {}


def _consumers(model) -> dict:
    """Input name -> the nodes of ``model`` (an ``ONNXModel``) that read it: indexed once,
    then only the nodes appended since (the quantizer appends Q/DQ nodes, removes none)."""
    nodes = model.model.graph.node
    index, seen = getattr(model, "_npuforge_consumers", ({}, 0))
    if len(nodes) < seen:
        index, seen = {}, 0
    for node in nodes[seen:]:
        for name in dict.fromkeys(node.input):
            index.setdefault(name, []).append(node)
    model._npuforge_consumers = (index, len(nodes))
    return index


def _augment_graph_in_one_pass(self) -> None:
    """``MinMaxCalibrater.augment_graph`` (onnxruntime 1.31) without its per-tensor scans.

    Per calibrated tensor, onnxruntime rebuilds a dict of every value_info and inserts
    a ReduceMin and a ReduceMax (each followed by a Reshape to [-1]) before the first
    node reading the tensor, found by a scan: quadratic, 10+ minutes on SmolLM2. This
    builds the same nodes, in the same places and order (the ReduceMax pair lands
    before the ReduceMin pair, as the scan finds the ReduceMin first), and the same
    graph outputs, in one pass over the graph.
    """
    import uuid

    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    graph = self.model.graph
    tensors, _ = self.select_tensors_to_calibrate(self.model)
    reshape_shape_name = str(uuid.uuid4())
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), reshape_shape_name))
    value_infos = {vi.name: vi for vi in graph.value_info}
    value_infos.update({o.name: o for o in graph.output})
    value_infos.update({i.name: i for i in graph.input})
    first_reader = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            first_reader.setdefault(name, index)
    inserted = {}  # node index (or None: the end) -> new nodes, in order

    def reduce_pair(tensor_name, op_type):
        reduce_output = f"{tensor_name}_{op_type}"
        intermediate = reduce_output + "_Reshape"
        reduce = helper.make_node(
            op_type, [tensor_name], [intermediate], keepdims=1, name=reduce_output
        )
        if tensor_name not in value_infos:
            raise ValueError(
                f"Unable to guess tensor type for tensor {tensor_name!r}, "
                "running shape inference before quantization may resolve this issue."
            )
        info = value_infos[tensor_name].type.tensor_type
        if self.per_channel:
            axes = [0, *range(2, len(info.shape.dim))]
            version = next(
                o.version for o in self.model.opset_import if onnx.defs.has(op_type, o.domain)
            )
            if version < 18:
                reduce.attribute.append(helper.make_attribute("axes", axes))
            else:
                axes_name = str(uuid.uuid4())
                graph.initializer.append(
                    numpy_helper.from_array(np.array(axes, np.int64), axes_name)
                )
                reduce.input.append(axes_name)
        reshape = helper.make_node(
            "Reshape", [intermediate, reshape_shape_name], [reduce_output], name=intermediate
        )
        graph.output.append(helper.make_tensor_value_info(reduce_output, info.elem_type, [None]))
        return [reduce, reshape]

    for tensor in tensors:
        low, high = reduce_pair(tensor, "ReduceMin"), reduce_pair(tensor, "ReduceMax")
        inserted.setdefault(first_reader.get(tensor), []).extend(high + low)
    nodes = []
    for index, node in enumerate(graph.node):
        nodes.extend(inserted.get(index, ()))
        nodes.append(node)
    nodes.extend(inserted.get(None, ()))
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(
        self.model, self.augmented_model_path, save_as_external_data=self.use_external_data_format
    )


def _measured_ranges(model_path: str, samples: list, inputs: list, work: Path):
    """onnxruntime's min/max calibration of every activation over the samples."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    calibrator = create_calibrator(
        model_path,
        augmented_model_path=str(work / "augmented.onnx"),
        calibrate_method=CalibrationMethod.MinMax,
        use_external_data_format=True,
        providers=["CPUExecutionProvider"],
    )
    calibrator.collect_data(_sample_reader(samples, inputs))
    measured = calibrator.compute_data()
    calibrator.clear_collected_data()
    return measured


def snap_outward(value: float, up: bool, bits: int = RANGE_BITS) -> float:
    """``value`` rounded to ``bits`` significant bits: up (towards +inf) or down.

    The same samples' min/max differ in their last bits from host to host, because
    onnxruntime's and torch's CPU kernels take other paths per instruction set (AVX-512
    or AVX2: MLAS's Softmax, MKL's sgemm behind an export's ``kv_prefix``), and so did
    every 16-bit scale of the Q/DQ model and the compiled context's figures. On this grid
    a bound moves only when such a difference straddles a step: on SmolLM2-135M none of
    16,728 bounds did, where 82 % of the raw ranges differed. It costs at most 1/8 of a
    range (0.17 of 16 bits).
    """
    if value == 0.0 or not math.isfinite(value):
        return value
    step = math.ldexp(1.0, math.frexp(abs(value))[1] - bits)
    return (math.ceil(value / step) if up else math.floor(value / step)) * step


def _snap_measured(measured) -> None:
    """Put every measured min/max on the ``RANGE_BITS`` grid, outward, in place: the
    ranges the job widens and the ones the quantizer reads from its cache alike.

    Each range first takes in zero, as onnxruntime's quantizer does anyway: a tensor's
    positive minimum (an Abs inside a norm: 2.9e-5 on one host, 7.0e-5 on another) is
    where hosts differ most, and it would still reach the widened maximum's span.
    """
    import numpy as np

    for data in measured.data.values():
        low, high = data.range_value
        low, high = min(float(np.min(low)), 0.0), max(float(np.max(high)), 0.0)
        data.lowest = np.array(snap_outward(low, up=False), np.float32)
        data.highest = np.array(snap_outward(high, up=True), np.float32)


def _widened_ranges(measured, margin: float) -> dict:
    """Measured min/max of every activation, widened by ``margin`` of its span.

    A few calibration samples rarely reach a recurrent model's extremes; at 16
    bits, giving up a fraction of a bit of resolution for headroom costs far
    less than clipping the steps the samples did not see.
    """
    import numpy as np

    ranges = {}
    for name, data in measured.data.items():
        rmin, rmax = data.range_value
        rmin, rmax = float(np.min(rmin)), float(np.max(rmax))
        span = max(rmax - rmin, 1e-6)
        # Widen only away from zero: a tensor that never goes negative (a Relu's
        # output, whose range the quantizer folds into the op before it) must
        # keep its zero floor, or the clamp it stands for disappears.
        ranges[name] = {
            "rmin": np.float32(rmin - margin * span if rmin < 0 else rmin),
            "rmax": np.float32(rmax + margin * span if rmax > 0 else rmax),
        }
    return ranges


def _quantize(model_path: str, target: str, config, measured, work: Path) -> None:
    """onnxruntime's quantize_static with ``config``. Given ranges already measured
    over the same samples and graph, it reads them from its calibration cache instead
    of running every sample a second time (the same min/max, so the same bytes)."""
    from onnxruntime.quantization.calibrate import save_tensors_data
    from onnxruntime.quantization.quantize import quantize_static

    cache = None
    if measured is not None:
        cache = work / "measured_ranges.json"
        save_tensors_data(measured, cache)
    try:
        quantize_static(
            model_path,
            target,
            config.calibration_data_reader,
            calibration_cache_path=cache,
            calibrate_method=config.calibrate_method,
            quant_format=config.quant_format,
            activation_type=config.activation_type,
            weight_type=config.weight_type,
            op_types_to_quantize=config.op_types_to_quantize,
            nodes_to_quantize=config.nodes_to_quantize,
            nodes_to_exclude=config.nodes_to_exclude,
            per_channel=config.per_channel,
            reduce_range=config.reduce_range,
            use_external_data_format=config.use_external_data_format,
            calibration_providers=config.calibration_providers,
            extra_options=config.extra_options,
        )
    finally:
        if cache is not None:
            cache.unlink(missing_ok=True)


def pack_int4(values) -> bytes:
    """Signed 4-bit values, two per byte, the first in the low nibble (ONNX INT4)."""
    import numpy as np

    flat = np.asarray(values, np.int8).ravel()
    if flat.size % 2:
        flat = np.append(flat, np.int8(0))
    return ((flat[0::2] & 0x0F) | ((flat[1::2] & 0x0F) << 4)).astype(np.uint8).tobytes()


def block_steps(weight, block: int, bits: int):
    """A MatMul weight [in, out] as signed steps [in, out] and float32 scales
    [in / block, out]: one scale per block of inputs and output column, zero point 0.
    int4 spans its whole signed range (max(-min / 8, max / 7)), so a block already on
    a centred 16-level grid (export option block_centres) is kept exactly; int8 spans
    -127..127 (max |w| / 127), GGUF Q8_0's own grid, which it keeps exactly."""
    import numpy as np

    rows, cols = weight.shape
    blocks = weight.astype(np.float64).reshape(rows // block, block, cols)
    if bits == 4:
        low, high, scale = -8, 7, np.maximum(-blocks.min(1) / 8, blocks.max(1) / 7)
    else:
        low, high, scale = -127, 127, np.abs(blocks).max(1) / 127
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    steps = np.clip(np.round(blocks / scale[:, None, :]), low, high)
    return steps.astype(np.int8).reshape(rows, cols), scale


def quantize_weights_in_blocks(qdq_path: str, float_path: str, block: int) -> list[str]:
    """Re-encode the int4 and int8 MatMul weights of the Q/DQ model at ``qdq_path``
    block-wise from the float weights of ``float_path``: DequantizeLinear with
    ``block_size`` (opset 21), which the QNN EP hands the HTP as block quantization (a
    float scale per block, zero point 0). onnxruntime's static quantizer has no
    block-wise form. Returns the re-encoded weights' names."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.INT8: 8}
    model = onnx.load(qdq_path)
    floats = {i.name: i for i in onnx.load(float_path).graph.initializer}
    inits = {i.name: i for i in model.graph.initializer}
    weight_inputs = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"}
    done = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.output[0] not in weight_inputs:
            continue
        quantized = inits.get(node.input[0])
        source = floats.get(node.input[0].removesuffix("_quantized"))
        if quantized is None or quantized.data_type not in bits or source is None:
            continue
        if len(source.dims) != 2 or source.dims[0] % block:
            continue
        width = bits[quantized.data_type]
        steps, scale = block_steps(numpy_helper.to_array(source), block, width)
        zeros = np.zeros(scale.shape, np.int8)
        for name, values in ((node.input[0], steps), (node.input[2], zeros)):
            tensor = onnx.TensorProto(name=name, data_type=quantized.data_type, dims=values.shape)
            tensor.raw_data = pack_int4(values) if width == 4 else values.tobytes()
            inits[name].CopyFrom(tensor)
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(scale, node.input[1]))
        # ONNX's own DequantizeLinear (opset 21) takes block_size; onnxruntime's contrib
        # one (com.microsoft, which its quantizer may write) does not.
        node.domain = ""
        del node.attribute[:]
        node.attribute.extend(
            [onnx.helper.make_attribute("axis", 0), onnx.helper.make_attribute("block_size", block)]
        )
        done.append(source.name)
    if done:
        onnx_opset = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
        onnx_opset.version = max(onnx_opset.version, 21)
        data = Path(qdq_path).name + ".data"
        (Path(qdq_path).parent / data).unlink(missing_ok=True)
        onnx.save(model, qdq_path, save_as_external_data=True, location=data)
    return done


def quantize_graph(
    source: str,
    target: str,
    precision: str,
    samples: list,
    inputs: list,
    keep_16bit_tensors: list,
    input_ranges: dict | None = None,
    range_margin: float = 0.0,
    op_types: list | None = None,
    weights_16bit: list | None = None,
    cover_stream: bool = False,
    weight_block_size: int | None = None,
    weights_8bit: list | None = None,
) -> dict:
    """fp32 ONNX -> QDQ ONNX for the QNN HTP (A16W8 or A16W4); weight matrices whose
    name a ``weights_16bit`` regex matches are int16 instead, and A16W4's whose name a
    ``weights_8bit`` regex matches int8; with ``cover_stream``, residual branches get
    ranges that cover their stream (``ranges_covering_stream``); with
    ``weight_block_size``, A16W4's int4 and int8 weights take a scale per block of inputs."""
    import numpy as np
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.execution_providers.qnn import (
        get_qnn_qdq_config,
        qnn_preprocess_model,
    )

    _quantizer_without_quadratic_scans()

    # The preprocessor and quantizer leave external-data files beside their
    # outputs: give them a directory of their own.
    work = Path(target).parent
    work.mkdir(parents=True, exist_ok=True)
    preprocessed = work / "preprocessed.onnx"
    # Fuses decomposed LayerNorm/GELU etc. into ops the HTP runs natively.
    changed = qnn_preprocess_model(
        source,
        str(preprocessed),
        save_as_external_data=True,
        external_data_location=preprocessed.name + ".data",
    )
    model_path = str(preprocessed) if changed else source
    # Without external data loaded, weights stay references: shapes infer at any size.
    model = onnx.load(model_path, load_external_data=False)
    squares = squares_to_mul(model)
    norm_ranges = max_scaled_norm_ranges(model)
    row_matmuls, unshaped = row_matmuls_to_mul_reducesum(model)
    if unshaped:
        log(
            f"warning: {len(unshaped)} MatMuls of two activations have no inferred shape "
            f"(first: {unshaped[0]}) and stay MatMuls, which the HTP computes at about 8 bits"
        )
    if row_matmuls or squares:
        rewritten = work / "rewritten.onnx"
        onnx.load_external_data_for_model(model, str(Path(model_path).parent))
        onnx.save(
            model,
            str(rewritten),
            save_as_external_data=True,
            location=rewritten.name + ".data",
        )
        model_path = str(rewritten)
    weight_type = {"a16w8": QuantType.QInt8, "a16w4": QuantType.QInt4}[precision]
    # Weight matrices [in, out] quantized per output column, symmetric: the HTP's
    # per-channel scheme, and what keeps 8- and 4-bit errors near each column's range.
    per_column = {"quant_type": weight_type, "axis": 1, "symmetric": True}
    overrides, kept_norms = sensitive_overrides(
        model, keep_16bit_tensors, QuantType.QUInt16, weight_override=per_column
    )
    patterns = list(weights_16bit or [])
    if any(re.search(SIDE_MATMULS, init.name) for init in model.graph.initializer):
        patterns.append(SIDE_MATMULS)
    wide = wide_weights(model, overrides, per_column, patterns)
    for name in wide["tensors"]:
        overrides[name] = [{**overrides[name][0], "quant_type": QuantType.QInt16}]
    eight = None
    if precision == "a16w4":
        eight = wide_weights(model, overrides, per_column, list(weights_8bit or []))
        for name in eight["tensors"]:
            overrides[name] = [{**overrides[name][0], "quant_type": QuantType.QInt8}]
    # Measured here in every case, so that every range the quantizer uses is snapped.
    measured = _measured_ranges(model_path, samples, inputs, work)
    _snap_measured(measured)
    ranges = _widened_ranges(measured, range_margin)
    covered = {}
    if cover_stream:
        covered = ranges_covering_stream(ranges, residual_branches(model))
        ranges.update(covered)
    for name, bounds in ranges.items():
        overrides.setdefault(name, [{"quant_type": QuantType.QUInt16, **bounds}])
    # Fixed ranges, not calibrated (and not widened): an input known to span one
    # (embedding rows come from one table) is encoded over all of it, not over the rows
    # the samples happened to hit; inside a max-scaled RMSNorm the ranges are exact.
    fixed = {**(input_ranges or {}), **norm_ranges}
    for name, (rmin, rmax) in sorted(fixed.items()):
        bounds = {"rmin": np.float32(rmin), "rmax": np.float32(rmax)}
        overrides[name] = [{"quant_type": QuantType.QUInt16, **bounds}]
    config = get_qnn_qdq_config(
        model_path,
        _sample_reader(samples, inputs),
        activation_type=QuantType.QUInt16,
        weight_type=weight_type,
        per_channel=True,
        init_overrides=overrides,
        weight_symmetric=True,
        op_types_to_quantize=list(op_types) if op_types else None,
    )
    config.use_external_data_format = True
    global _QDQ_PROGRESS
    # One replace_input_of_all_nodes call per quantized tensor: activations and weights.
    tensors = len(model.graph.initializer) + sum(len(n.output) for n in model.graph.node)
    _QDQ_PROGRESS = Progress("tensors given Q/DQ", tensors, bound=True)
    log(f"inserting Q/DQ into {len(model.graph.node)} nodes")
    try:
        _quantize(model_path, target, config, measured, work)
    finally:
        _QDQ_PROGRESS = None
        _NAME_INDEX.clear()
    blocked = []
    if weight_block_size and precision == "a16w4":
        log(f"re-encoding int4/int8 weights in blocks of {weight_block_size} inputs")
        blocked = quantize_weights_in_blocks(target, model_path, int(weight_block_size))
    granularity = "per output channel, symmetric"
    if blocked:
        widths = "int4 and int8" if eight and eight["tensors"] else "int4"
        granularity = f"{widths} in blocks of {weight_block_size} inputs per output channel"
    return {
        "source": source,
        "qdq_model": target,
        "preprocessed": bool(changed),
        "activation_type": "uint16",
        "weight_type": "int8" if precision == "a16w8" else "int4",
        "weight_granularity": granularity,
        "weights_in_blocks": len(blocked),
        "weights_16bit": wide,
        "weights_8bit": eight,
        "samples": len(samples),
        # Significant bits of each calibrated min/max (snap_outward).
        "range_bits": RANGE_BITS,
        "kept_16bit": sorted(
            k for k, v in overrides.items() if v[0]["quant_type"] == QuantType.QUInt16
        ),
        "norm_parameters_kept_16bit": kept_norms,
        "norm_tensors_with_exact_ranges": len(norm_ranges),
        "residual_branches_covering_stream": len(covered),
        "squares_as_mul": len(squares),
        # Two-activation MatMuls the HTP would run at 16x8 bits, now 16-bit Mul + ReduceSum.
        "row_matmuls_as_mul_reducesum": row_matmuls,
        "matmuls_of_activations_unshaped": unshaped,
    }
