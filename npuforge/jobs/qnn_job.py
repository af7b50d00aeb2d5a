"""Qualcomm HTP compile job: runs inside the QNN toolchain environment.

    python qnn_job.py <spec.json>

Uses only the standard library, numpy, onnx, onnxruntime and the onnxruntime-qnn
plugin (QAIRT host libraries). It never imports npuforge: everything it needs is
in the spec (absolute paths), written by ``npuforge.backends.qnn``.

Per graph chunk it
  1. for a16w8/a16w4: quantizes the fp32 graph to a QDQ model with the samples
     named in the spec, keeping numerically sensitive tensors at 16 bit (and
     single-row products of two activations as 16-bit Mul + ReduceSum);
  2. creates an ONNX Runtime session with the QNN EP in EP-context mode, which
     compiles the graph into a QNN HTP context binary for the spec's SoC and
     writes ``<name>_ctx.onnx`` + ``<name>_ctx_qnn.bin``; a prefill graph of the
     same chunk joins the decode graph's context (ep.share_ep_contexts);
  3. optionally runs the produced ``_ctx.onnx`` chain on the x86 HTP simulator
     next to onnxruntime CPU on the fp32 source graphs, call by call (a prefill
     call, then decode calls, as the spec lists them with their host-fed inputs
     in ``.npz`` files), and saves both outputs for the caller to compare.
Finally it writes ``result.json`` into the spec's work directory.
"""

import itertools
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

EP_NAME = "QNNExecutionProvider"
# Op types whose float initializers stay 16 bit: normalisations divide by a
# variance that 8-/4-bit parameters distort (seed 001 keeps them in fp16).
NORM_OP_TYPES = ("LayerNormalization", "GroupNormalization", "InstanceNormalization", "RMSNorm")
# Ops whose second input is a large weight matrix: the only tensors that get the
# low weight bit width.
MATMUL_OP_TYPES = ("MatMul", "Gemm", "Conv")
# Weights of the side matmuls of a group split (npuforge.models.llama.group_offsets, which
# imports torch): group means times group minima or centres, kept 16-bit.
SIDE_MATMULS = r"\.group_offsets\."
QAIRT_PATTERN = re.compile(rb"v(\d+\.\d+\.\d+)\.(\d{6,})")


def log(message: str) -> None:
    print(f"[qnn_job] {message}", flush=True)


class Progress:
    """Counts steps of a long phase and logs how far along it is, every ``every`` seconds."""

    def __init__(self, what: str, total: int, every: float = 10.0, bound: bool = False):
        self.what, self.every = what, every
        self.total = f"up to {total}" if bound else str(total)
        self.done, self.started = 0, time.monotonic()
        self._last = self.started

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            log(f"{self.what}: {self.done} of {self.total} after {now - self.started:.0f} s")


# The quantizer's Q/DQ insertion in progress (set by quantize_graph, counted per tensor).
_QDQ_PROGRESS: Progress | None = None


# --------------------------------------------------------------------------- QNN EP


def register_qnn():
    """Register the onnxruntime-qnn plugin once; return (onnxruntime, devices, htp_library)."""
    import onnxruntime as ort
    import onnxruntime_qnn

    try:
        ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
    except Exception as err:  # registering twice in one process is harmless
        if "already registered" not in str(err).lower():
            raise
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise RuntimeError("error: the QNN execution provider exposes no device")
    return ort, devices, onnxruntime_qnn.get_qnn_htp_path()


def provider_options(spec: dict, htp_library: str) -> dict:
    options = {
        "backend_path": htp_library,
        "soc_model": str(spec["soc_model"]),
        "htp_arch": str(spec["htp_arch"]),
        "htp_graph_finalization_optimization_mode": str(spec.get("optimization_mode", 3)),
    }
    if spec.get("vtcm_mb"):
        options["vtcm_mb"] = str(spec["vtcm_mb"])
    if spec["precision"] == "fp16" or spec.get("quantize_op_types"):
        # Float ops (all of them, or those left out of a partly quantized graph) run in fp16.
        options["enable_htp_fp16_precision"] = "1"
    options.update({k: str(v) for k, v in spec.get("extra_provider_options", {}).items()})
    return options


# Context generation only prepares and serialises the graph: loading it into the
# x86 HTP simulator in the same session runs threads beside the serialiser that
# make the uninitialised padding differ run to run (see compile_chunks).
GENERATION_OPTIONS = {"enable_htp_prepare_only": "1"}


def _graph_folder(links: Path, source: Path, ctx_path: Path) -> str:
    """A fixed relative name for the source's folder (a symlink in ``links``).

    ONNX Runtime hashes the external-initializer folder into the EP partition
    (QNN graph) name compiled into the binary; from bytes it hashes no model
    path. Named after the context file, relative to ``links``, it is the same
    wherever the build (or a16w8's temporary QDQ directory) is, and differs
    between the graphs that share one context, as their names must.
    """
    link = links / ctx_path.stem
    link.symlink_to(source.parent, target_is_directory=True)
    return link.name


_LINK_DIRS = itertools.count()


def generate_contexts(ort, devices, options: dict, graphs: list, share: bool) -> None:
    """Compile each (source, ctx_path) in order; with ``share`` they form one context."""
    previous = os.getcwd()
    # A fixed name in the stage, not a random temporary one: its path reaches QAIRT.
    links = Path(previous, f"graph-links-{next(_LINK_DIRS)}")
    links.mkdir()
    try:
        for position, (source, ctx_path) in enumerate(graphs):
            source, ctx_path = Path(os.path.abspath(source)), Path(os.path.abspath(ctx_path))
            so = ort.SessionOptions()
            so.log_severity_level = 3
            # One thread: no pool whose scheduling could reorder allocations.
            so.intra_op_num_threads = 1
            so.inter_op_num_threads = 1
            so.add_session_config_entry("ep.context_enable", "1")
            so.add_session_config_entry("ep.context_file_path", str(ctx_path))
            so.add_session_config_entry("ep.context_embed_mode", "0")
            # A graph the HTP cannot take whole must fail here, not run half on the CPU.
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
            if share:
                so.add_session_config_entry("ep.share_ep_contexts", "1")
                if position == len(graphs) - 1:
                    so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
            so.add_session_config_entry(
                "session.model_external_initializers_file_folder_path",
                _graph_folder(Path(links), source, ctx_path),
            )
            so.add_provider_for_devices(devices, {**options, **GENERATION_OPTIONS})
            # Minutes for a big graph: the job's watcher repeats this line until it ends.
            log(f"generating the HTP context of {source.name}")
            model = source.read_bytes()
            os.chdir(links)
            try:
                ort.InferenceSession(model, so)
            finally:
                os.chdir(previous)
            # No seconds: this process's clock counts reads (job_stage.fixed_clock).
            log(f"context for {source.name} -> {ctx_path.name}")
    finally:
        shutil.rmtree(links)


def simulator_session(ort, devices, options: dict, ctx_path: str):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_provider_for_devices(devices, options)
    return ort.InferenceSession(str(ctx_path), so)


def cpu_session(ort, path: str):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------- quantization


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


def _quantizer_without_quadratic_scans() -> None:
    """Give onnxruntime's quantizer and calibrator their lookups without full scans.

    For every activation it puts Q/DQ on, ``ONNXModel.replace_input_of_all_nodes``
    calls a Python function per graph node, and ``find_by_name`` builds a list of
    every initializer before taking the first: on SmolLM2's 7,099-node graph the
    two took 89 % of the Q/DQ insertion (py-spy). Same results, in the same order:
    only nodes holding the input are visited (an index of consumers), and names are
    looked up in an index of each long list. The replacement also counts the tensors
    done, for the log. The min/max calibrator's graph augmentation is rebuilt in one
    pass (see below).
    """
    import onnxruntime.quantization as package
    from onnxruntime.quantization import calibrate, onnx_model, quant_utils

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
    covered, measured = {}, None
    if range_margin or cover_stream:
        measured = _measured_ranges(model_path, samples, inputs, work)
        ranges = _widened_ranges(measured, range_margin)
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


# --------------------------------------------------------------------------- verification


def run_calls(sessions: dict, chains: dict, calls: list, what: str = "calls run") -> dict:
    """Run a chunked recurrent graph chain call by call, as the spec's ``calls`` list them.

    ``chains[variant][i]`` lists chunk i's inputs ({name, role, output?, shape, dtype})
    and outputs; ``sessions[variant][i]`` runs it. Per input role: state (fed from the
    output it names, carried across calls and variants; zeros first, unless the call's
    feeds hold it: a kv_prefix's starting state), hidden (the
    previous chunk's output of the same stem: ``hidden_in`` <- ``hidden_out``,
    ``v_first_in`` <- ``v_first_out``); anything else is host-fed, read from the
    call's feeds file under ``chunk{i}/{name}``. Returns every other output as rows
    of one token each (``[tokens, ...]``), calls concatenated.
    """
    import numpy as np

    state = {}
    collected = {}
    progress = Progress(what, len(calls))
    for call in calls:
        chain, chain_sessions = chains[call["variant"]], sessions[call["variant"]]
        with np.load(call["feeds"]) as stored:
            host = dict(stored)
        hidden = {}
        for index, (session, chunk) in enumerate(zip(chain_sessions, chain, strict=True)):
            feed = {}
            for item in chunk["inputs"]:
                name, role = item["name"], item["role"]
                if role == "state" and f"chunk{index}/{name}" in host:
                    feed[name] = host[f"chunk{index}/{name}"]  # a starting state (kv_prefix)
                elif role == "state":
                    default = np.zeros(item["shape"], dtype=np.dtype(item["dtype"]))
                    feed[name] = state.get(name, default)
                elif role == "hidden":
                    stem = name[: -len("_in")] if name.endswith("_in") else name
                    feed[name] = hidden[f"{stem}_out"]
                elif f"chunk{index}/{name}" in host:
                    feed[name] = host[f"chunk{index}/{name}"]
                else:
                    raise RuntimeError(
                        f"error: the verification feeds lack chunk {index} input '{name}' "
                        f"(role '{role}'); regenerate the spec with this npuforge"
                    )
            names = [out["name"] for out in chunk["outputs"]]
            values = dict(zip(names, session.run(names, feed), strict=True))
            for item in chunk["inputs"]:
                if item["role"] == "state":
                    state[item["name"]] = values[item["output"]]
            hidden = {}
            for out in chunk["outputs"]:
                value = values[out["name"]]
                if out["role"] == "hidden":
                    hidden[out["name"]] = value
                elif out["role"] != "state":
                    # [B, T, ...] -> T rows: prefill and decode calls line up token by token.
                    rows = np.moveaxis(value, 1, 0).reshape(value.shape[1], -1)
                    collected.setdefault(out["name"], []).append(rows)
        progress.step()
    return {name: np.concatenate(arrays) for name, arrays in collected.items()}


# --------------------------------------------------------------------------- binary facts


def qairt_version(binary_path: str) -> str | None:
    """The QAIRT build recorded inside a QNN context binary (e.g. '2.51.0.260929181845')."""
    with open(binary_path, "rb") as handle:
        head = handle.read(1 << 20)
    match = QAIRT_PATTERN.search(head)
    return f"{match.group(1).decode()}.{match.group(2).decode()}" if match else None


def describe_ctx(ctx_path: str) -> dict:
    import onnx

    model = onnx.load(str(ctx_path), load_external_data=False)
    nodes = list(model.graph.node)
    attrs = {}
    for node in nodes:
        if node.op_type == "EPContext":
            for attr in node.attribute:
                if attr.name in ("ep_cache_context", "ep_sdk_version", "partition_name"):
                    attrs.setdefault(attr.name, []).append(attr.s.decode())
    return {
        "nodes": len(nodes),
        "epcontext_nodes": sum(node.op_type == "EPContext" for node in nodes),
        "other_nodes": sorted({node.op_type for node in nodes if node.op_type != "EPContext"}),
        "binaries": sorted(set(attrs.get("ep_cache_context", []))),
        "ep_sdk_version": sorted(set(attrs.get("ep_sdk_version", []))),
    }


# --------------------------------------------------------------------------- main


def qdq_path(spec: dict, chunk: dict, graph: dict) -> Path:
    return Path(spec["work_dir"]) / f"chunk{chunk['index']}_{graph['variant']}" / "qdq.onnx"


def quantize_chunk(spec: dict, chunk: dict) -> dict:
    """Write each graph's Q/DQ model (qdq_path); return the quantization records."""
    quantization = {}
    for graph in chunk["graphs"]:
        started = time.monotonic()
        quantization[graph["variant"]] = quantize_graph(
            graph["model"],
            str(qdq_path(spec, chunk, graph)),
            spec["precision"],
            graph["calibration"],
            graph["inputs"],
            chunk.get("keep_16bit_tensors", []),
            graph.get("input_ranges"),
            float(spec.get("range_margin", 0.0)),
            spec.get("quantize_op_types"),
            spec.get("weights_16bit"),
            bool(spec.get("cover_stream", False)),
            spec.get("weight_block_size"),
            spec.get("weights_8bit"),
        )
        seconds = time.monotonic() - started
        log(f"quantized chunk {chunk['index']} {graph['variant']} in {seconds:.1f} s")
    return quantization


def compile_chunk(spec: dict, chunk: dict) -> dict:
    """Compile one chunk's graphs (its Q/DQ models if quantized) into one HTP context."""
    ort, devices, htp_library = register_qnn()
    options = provider_options(spec, htp_library)
    out_dir = Path(spec["out_dir"])
    work_dir = Path(spec["work_dir"])
    index = chunk["index"]
    compiled = []
    for graph in chunk["graphs"]:
        source = graph["model"] if spec["precision"] == "fp16" else qdq_path(spec, chunk, graph)
        compiled.append((str(source), out_dir / graph["ctx_file"]))
    generate_contexts(ort, devices, options, compiled, share=len(compiled) > 1)
    ctx = {graph["variant"]: describe_ctx(out_dir / graph["ctx_file"]) for graph in chunk["graphs"]}
    binaries = sorted({b for info in ctx.values() for b in info["binaries"]})
    for variant, info in ctx.items():
        if info["epcontext_nodes"] == 0 or info["other_nodes"]:
            raise RuntimeError(
                f"error: chunk {index} {variant} did not compile whole into the HTP context "
                f"(left on the CPU: {info['other_nodes']})"
            )
    twins = {}
    if len(compiled) > 1:
        # QAIRT 2.51's x86 simulator cannot load a multi-graph (weight-shared)
        # context, so each graph is also compiled alone, from the same source
        # and options, for the simulator check; these are not shipped.
        for graph, (source, _) in zip(chunk["graphs"], compiled, strict=True):
            twin = work_dir / "simulate" / graph["ctx_file"]
            twin.parent.mkdir(parents=True, exist_ok=True)
            generate_contexts(ort, devices, options, [(source, twin)], share=False)
            twins[graph["variant"]] = str(twin)
    import job_stage  # only now: the binaries are written (see job_stage.py)

    return {
        "index": index,
        "binaries": binaries,
        "qairt": {b: qairt_version(out_dir / b) for b in binaries},
        "ctx": ctx,
        "simulate_ctx": twins,
        "heap": job_stage.heap_settings(),
    }


def chunk_env(environ: dict) -> dict:
    """Heap settings on top of ``environ`` (other GLIBC_TUNABLES kept; see job_stage.py)."""
    from job_stage import MALLOC_PERTURB, MMAP_THRESHOLD, TCACHE_OFF

    pinned = [TCACHE_OFF, MMAP_THRESHOLD]
    names = tuple(t.split("=")[0] + "=" for t in pinned)
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    tunables = [t for t in tunables if not t.startswith(names)]
    return dict(
        environ,
        MALLOC_PERTURB_=environ.get("MALLOC_PERTURB_") or MALLOC_PERTURB,
        GLIBC_TUNABLES=":".join(tunables + pinned),
        MALLOC_ARENA_MAX="1",
        # Python's own allocations (set and dict order) must repeat too.
        PYTHONHASHSEED="0",
    )


def staged_chunk_spec(spec: dict, chunk: dict) -> tuple[dict, dict]:
    """(spec of one chunk with stage-relative paths, {link name: real directory}).

    Sources are reached as ``in{k}/<file>``, graph k's calibration samples as
    ``cal{k}/<file>``; the chunk writes into ``out`` and ``work`` in the stage.
    """
    links, graphs = {}, []
    for k, graph in enumerate(chunk["graphs"]):
        graph = dict(graph)
        model = Path(graph["model"]).resolve()
        links[f"in{k}"] = str(model.parent)
        graph["model"] = f"in{k}/{model.name}"
        samples = graph.get("calibration")
        if samples:
            folders = {str(Path(p).resolve().parent) for sample in samples for p in sample.values()}
            if len(folders) != 1:
                raise RuntimeError(
                    f"error: chunk {chunk['index']}'s samples span {len(folders)} folders"
                )
            links[f"cal{k}"] = folders.pop()
            graph["calibration"] = [
                {name: f"cal{k}/{Path(path).name}" for name, path in sample.items()}
                for sample in samples
            ]
        graphs.append(graph)
    staged = {k: v for k, v in spec.items() if k not in ("chunks", "verify")}
    staged.update(out_dir="out", work_dir="work", chunks=[{**chunk, "graphs": graphs}])
    return staged, links


def _compile_staged(spec: dict, chunk: dict, job_stage) -> dict:
    """Compile one chunk in a fresh process from its stage; copy its outputs back."""
    import shutil

    staged, links = staged_chunk_spec(spec, chunk)
    stage, python, lock = job_stage.make_stage(
        "qnn", staged, links, [str(Path(__file__).resolve()), job_stage.__file__]
    )
    try:
        os.mkdir(os.path.join(stage, "out"))
        os.mkdir(os.path.join(stage, "work"))
        command = [python, Path(__file__).name, "spec.json", "--chunk", str(chunk["index"])]
        quantization = {}
        if spec["precision"] != "fp16":
            # Its own process on the real clock: quantization logs progress over minutes.
            env = job_stage.fixed_environment(stage, chunk_env({}))
            if job_stage.run_relayed([*command, "--quantize"], env=env, cwd=stage) != 0:
                raise RuntimeError(f"error: quantizing chunk {chunk['index']} failed (see above)")
            record = Path(stage, "work", f"chunk{chunk['index']}_quantization.json")
            quantization = json.loads(record.read_text())
        clock = job_stage.fixed_clock(stage)
        env = job_stage.fixed_environment(stage, chunk_env(clock))
        started = time.monotonic()
        # One CPU: QAIRT's prepare threads then neither size by the machine nor race.
        returncode = job_stage.run_relayed(
            command, env=env, cwd=stage, preexec_fn=job_stage.one_cpu
        )
        seconds = time.monotonic() - started
        if returncode != 0:
            raise RuntimeError(f"error: compiling chunk {chunk['index']} failed (see above)")
        log(f"chunk {chunk['index']} compiled in {seconds:.1f} s")
        out_dir, work_dir = Path(spec["out_dir"]), Path(spec["work_dir"])
        for produced in sorted(Path(stage, "out").iterdir()):
            shutil.copyfile(produced, out_dir / produced.name)
        result = json.loads(Path(stage, "work", f"chunk{chunk['index']}_result.json").read_text())
        result.update(quantization=quantization, context_seconds=round(seconds, 3))
        for variant, twin in sorted(result.get("simulate_ctx", {}).items()):
            # The simulator-only twins (see compile_chunk) go where verify() reads them.
            for produced in Path(stage, twin).parent.iterdir():
                (work_dir / "simulate").mkdir(exist_ok=True)
                shutil.copyfile(produced, work_dir / "simulate" / produced.name)
            result["simulate_ctx"][variant] = str(work_dir / "simulate" / Path(twin).name)
        result["site_packages"] = job_stage.site_packages_mode(stage)
        return result
    finally:
        job_stage.remove_stage(stage)
        os.close(lock)


def compile_chunks(spec: dict, spec_path: str) -> dict:
    """Compile every chunk in a fresh pinned process from its own stage (job_stage.py
    explains why), generating contexts prepare-only (GENERATION_OPTIONS): no simulator
    threads run beside the serialiser."""
    Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
    work_dir = Path(spec["work_dir"])
    work_dir.mkdir(parents=True, exist_ok=True)
    import job_stage

    job_stage.disable_aslr()  # inherited by the chunk processes
    chunks = [_compile_staged(spec, chunk, job_stage) for chunk in spec["chunks"]]
    _, _, htp_library = register_qnn()
    options = provider_options(spec, htp_library)
    return {
        "provider_options": {k: v for k, v in options.items() if k != "backend_path"},
        "generation_options": GENERATION_OPTIONS,
        "chunks": chunks,
    }


def verify(spec: dict, result: dict) -> dict:
    import numpy as np

    verify_spec = spec["verify"]
    ort, devices, htp_library = register_qnn()
    options = provider_options(spec, htp_library)
    out_dir = Path(spec["out_dir"])
    chains = verify_spec["chains"]
    calls = verify_spec["calls"]
    reference = {v: [cpu_session(ort, c["source"]) for c in chain] for v, chain in chains.items()}
    ref_out = run_calls(reference, chains, calls, "CPU fp32 calls run")
    del reference
    started = time.monotonic()
    twins = {chunk["index"]: chunk.get("simulate_ctx") or {} for chunk in result["chunks"]}
    compiled = {
        variant: [
            simulator_session(
                ort, devices, options, twins[i].get(variant) or out_dir / chunk["ctx_file"]
            )
            for i, chunk in enumerate(chain)
        ]
        for variant, chain in chains.items()
    }
    sim_out = run_calls(compiled, chains, calls, "HTP simulator calls run")
    seconds = time.monotonic() - started
    arrays = {f"reference/{k}": v for k, v in ref_out.items()}
    arrays.update({f"compiled/{k}": v.astype(np.float32) for k, v in sim_out.items()})
    np.savez(verify_spec["outputs"], **arrays)
    variants = [call["variant"] for call in calls]
    log(
        f"simulated {len(calls)} calls ({variants.count('prefill')} prefill, "
        f"{variants.count('decode')} decode) in {seconds:.1f} s"
    )
    return {
        "steps": int(verify_spec["steps"]),
        "calls": {v: variants.count(v) for v in sorted(set(variants))},
        "simulator_seconds": round(seconds, 3),
        "outputs": verify_spec["outputs"],
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 3, 4) or (len(argv) > 1 and argv[1] != "--chunk"):
        print("usage: qnn_job.py <spec.json> [--chunk N [--quantize]]", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    if len(argv) > 1:
        chunk = next(c for c in spec["chunks"] if c["index"] == int(argv[2]))
        if argv[3:] == ["--quantize"]:
            kind, result = "quantization", quantize_chunk(spec, chunk)
        else:
            kind, result = "result", compile_chunk(spec, chunk)
        out = Path(spec["work_dir"]) / f"chunk{chunk['index']}_{kind}.json"
        out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        return 0
    result = compile_chunks(spec, argv[0])
    if spec.get("verify"):
        result["verification"] = verify(spec, result)
    result_path = Path(spec["work_dir"]) / "result.json"
    result_path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    log(f"wrote {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
