"""Run an export directory's chunk graphs over a token sequence.

``GraphChain`` reads ``export.json`` and feeds each graph by the role of each
input (docs/interfaces.md):

* ``tokens``: the int64 token ids of this call, ``[B, T]``;
* ``embedding``: rows of ``embedding.bin`` looked up here (``--ext-embedding``);
* ``hidden``: an input ``<base>_in`` takes the latest earlier chunk's output
  ``<base>_out`` in this call (``hidden_in``/``hidden_out`` from the chunk before;
  RWKV-7's ``v_first_in`` from the first chunk's ``v_first_out``);
* ``state``: after ``reset``, zeros or the export's ``kv_prefix`` rows
  (``initial_state``); afterwards the output the input names;
* any other role: ``npuforge.models.<family>.extra_inputs(meta, input_spec, position)``
  (``host_feeds`` builds the tokens, embedding and family inputs of one call).

Sessions come from ``session_factory(onnx_path)`` (default: onnxruntime on the
CPU), so a backend can substitute its own (QNN EP, a simulator). The ``capture``
callback receives ``(chunk_index, feeds)`` before each graph runs; calibration
uses it to record real inputs.
"""

import tempfile
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import read_json


def onnxruntime_session(onnx_path, threads: int = 1):
    """A CPU onnxruntime session (one thread: deterministic and polite on shared machines)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # No fusions: fused kernels (SkipLayerNormalization...) compute fp16 graphs in fp32
    # internally and would hide overflows an NPU running the plain graph would hit.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


def host_feeds(meta: dict, graph: dict, tokens, position: int, embedding=None) -> dict:
    """The inputs of one graph call that come from the host rather than another graph.

    ``tokens`` (int ``[B, T]``) feed the ``tokens`` role, rows of ``embedding`` (the
    export's ``embedding.bin`` table) the ``embedding`` role, and every other role but
    ``state``/``hidden`` comes from ``npuforge.models.<family>.extra_inputs`` for a
    call whose first token sits at ``position``. Backends that run graphs elsewhere
    (a vendor simulator) precompute their feeds with this, so every runner feeds the
    same values.
    """
    import numpy as np

    tokens = np.asarray(tokens, dtype=np.int64)
    feeds = {}
    for spec in graph["inputs"]:
        role, name = spec["role"], spec["name"]
        if role in ("state", "hidden"):
            continue
        if role == "tokens":
            feeds[name] = tokens
        elif role == "embedding":
            if embedding is None:
                raise NpuforgeError(
                    f"input '{name}' takes embedding rows but the export has no embedding.bin; "
                    "re-export with --ext-embedding"
                )
            feeds[name] = np.asarray(embedding[tokens], dtype=spec["dtype"])
        else:
            from npuforge import models

            value = models.family(meta["family"]).extra_inputs(meta, spec, position)
            feeds[name] = np.asarray(value, dtype=spec["dtype"])
    return feeds


def initial_state(export_dir, meta: dict) -> dict:
    """Every state input of an export at the start of a sequence: zeros, with the
    ``kv_prefix`` rows (a llama export's precomputed first tokens) in their slots."""
    import numpy as np

    from npuforge.fileio import sha256_file

    state = {}
    for graph in meta["graphs"]:
        for spec in graph["inputs"]:
            if spec["role"] == "state":
                state[spec["name"]] = np.zeros(spec["shape"], dtype=spec["dtype"])
    prefix = meta.get("kv_prefix")
    if not prefix:
        return state
    path = Path(export_dir) / prefix["file"]
    if not path.is_file() or sha256_file(path) != prefix["sha256"]:
        raise NpuforgeError(f"{path}: missing or not the file export.json names; re-run the export")
    rows = np.fromfile(path, dtype="<f4")
    offset, slots = 0, int(prefix["slots"])
    for name in prefix["tensors"]:
        if name not in state:
            raise NpuforgeError(f"kv_prefix names {name!r}, which no graph takes; re-export")
        batch, heads, _, width = state[name].shape
        size = batch * heads * slots * width
        block = rows[offset : offset + size].reshape(batch, heads, slots, width)
        state[name][:, :, :slots, :] = block
        offset += size
    return state


def run_graph(session, meta, graph, tokens, position, embedding, carried, state, capture=None):
    """One graph of one call: its feeds (the host's, ``carried`` hidden outputs of the
    earlier chunks, ``state``), run on ``session``; ``state`` takes the graph's new
    state in place. Returns (``carried`` with this graph's hidden outputs added, its
    logits or None). ``capture(feeds)`` sees the feeds."""
    feeds = host_feeds(meta, graph, tokens, position, embedding)
    for spec in graph["inputs"]:
        role, name = spec["role"], spec["name"]
        if role == "hidden":
            feeds[name] = carried[name[: -len("_in")] + "_out"]
        elif role == "state":
            feeds[name] = state[name]
    if capture is not None:
        capture(feeds)
    names = [o["name"] for o in graph["outputs"]]
    results = dict(zip(names, session.run(names, feeds), strict=True))
    for spec in graph["inputs"]:
        if spec["role"] == "state":
            state[spec["name"]] = results[spec["output"]]
    handed_on, logits = dict(carried), None
    for spec in graph["outputs"]:
        if spec["role"] == "hidden":
            handed_on[spec["name"]] = results[spec["name"]]
        elif spec["role"] == "logits":
            logits = results[spec["name"]]
    return handed_on, logits


def run_chunk_by_chunk(exports: dict, calls, open_session=None, capture=None, label="graphs"):
    """The logits of each of ``calls`` (``(variant, tokens [B, T])`` in order), the state
    and position carried from call to call (across variants too) as a ``GraphChain``
    carries them: one list entry per call, the last chunk's logits output.

    One graph's session is open at a time. Each run of consecutive calls of one variant
    (a segment: the prefill calls, then the decode calls) goes chunk by chunk: chunk i runs
    every call of the segment and is dropped before chunk i + 1 opens, so the run holds one
    chunk (plus the hidden states between chunks, calls x tokens x embed) however many
    chunks the export has. Calls are independent across chunks given the previous chunk's
    hidden output and the chunk's own state, so the logits are those of a call-by-call
    run; the next segment starts from the state the last one left, by name, whatever
    either export's chunking.

    ``exports``: variant -> (export directory, its export.json). ``open_session(meta,
    onnx_path)``: default onnxruntime on the CPU. ``capture(variant, chunk, feeds)`` sees
    every graph's feeds, each chunk's in call order.
    """
    import numpy as np

    from npuforge import progress
    from npuforge.memory import release_memory
    from npuforge.onnx_io import read_embedding_bin

    if open_session is None:

        def open_session(meta, onnx_path):
            return onnxruntime_session(onnx_path)

    segments, position = [], 0
    for number, (variant, tokens) in enumerate(calls):
        meta = exports[variant][1]
        expected = (int(meta["batch"]), int(meta["tokens_per_call"]))
        if tuple(np.shape(tokens)) != expected:
            raise NpuforgeError(
                f"a {variant} call got tokens of shape {list(np.shape(tokens))}, its graphs "
                f"take {list(expected)}"
            )
        if not segments or segments[-1][0] != variant:
            segments.append((variant, []))
        segments[-1][1].append((number, np.asarray(tokens, dtype=np.int64), position))
        position += expected[1]

    logits, state, serving = [None] * len(calls), None, None
    for variant, segment in segments:
        directory, meta = Path(exports[variant][0]), exports[variant][1]
        start = initial_state(directory, meta)
        if state is not None:
            missing = sorted(set(start) - set(state))
            if missing:
                raise NpuforgeError(
                    f"the {serving} export lacks state {missing[0]!r} that the {variant} "
                    "export takes; export both from one checkpoint"
                )
            start = {name: state[name].astype(value.dtype) for name, value in start.items()}
        state, serving = start, variant
        embedding = None
        if meta.get("embedding"):
            embedding = read_embedding_bin(directory / meta["embedding"]["file"])
        carried = [{} for _ in segment]
        graphs = meta["graphs"]
        for index, graph in enumerate(graphs):
            what = f"{label}: {variant} chunk {index + 1} of {len(graphs)}"
            progress.stage(what, index, len(graphs))
            session = open_session(meta, directory / graph["file"])
            seen = None
            if capture is not None:

                def seen(feeds, variant=variant, index=index):
                    capture(variant, index, feeds)

            for slot, (number, tokens, first) in enumerate(segment):
                carried[slot], found = run_graph(
                    session, meta, graph, tokens, first, embedding, carried[slot], state, seen
                )
                if found is not None:
                    logits[number] = np.asarray(found, dtype=np.float32)
            session = None  # release this graph before the next loads
            release_memory()
    return logits


class GraphChain:
    def __init__(self, export_dir, session_factory=None, capture=None):
        import numpy as np

        self.dir = Path(export_dir)
        meta_path = self.dir / "export.json"
        if not meta_path.is_file():
            raise NpuforgeError(f"{self.dir}: no export.json; run export_onnx.py first")
        self.meta = read_json(meta_path)
        self.graphs = self.meta["graphs"]
        factory = session_factory or onnxruntime_session
        self.sessions = [factory(self.dir / g["file"]) for g in self.graphs]
        self.capture = capture
        self.embedding = None
        if self.meta.get("embedding"):
            from npuforge.onnx_io import read_embedding_bin

            self.embedding = read_embedding_bin(self.dir / self.meta["embedding"]["file"])
        self._np = np
        self._start = initial_state(self.dir, self.meta)
        self.reset()

    @property
    def tokens_per_call(self) -> int:
        return int(self.meta["tokens_per_call"])

    @property
    def batch(self) -> int:
        return int(self.meta["batch"])

    def reset(self, batch=None):
        """Every recurrent state to its start (``initial_state``), the position to 0."""
        if batch is not None and int(batch) != self.batch:
            raise NpuforgeError(
                f"graphs were exported for batch {self.batch}, not {batch}; re-export with "
                f"--batch {batch}"
            )
        self.position = 0
        self.state = {name: value.copy() for name, value in self._start.items()}

    def step(self, tokens):
        """Run one call of ``T`` tokens (``tokens``: int ``[B, T]``); return the logits."""
        np = self._np
        tokens = np.asarray(tokens, dtype=np.int64)
        expected = (self.batch, self.tokens_per_call)
        if tokens.shape != expected:
            raise NpuforgeError(
                f"step() got tokens of shape {list(tokens.shape)}, the graphs take {list(expected)}"
            )
        carried = {}
        logits = None
        for index, (graph, session) in enumerate(zip(self.graphs, self.sessions, strict=True)):
            capture = None
            if self.capture is not None:

                def capture(feeds, index=index):
                    self.capture(index, feeds)

            carried, found = run_graph(
                session, self.meta, graph, tokens, self.position, self.embedding,
                carried, self.state, capture,
            )  # fmt: skip
            logits = found if found is not None else logits
        self.position += self.tokens_per_call
        return np.asarray(logits, dtype=np.float32)

    def run(self, tokens):
        """Feed a ``[B, S]`` sequence (S a multiple of T) call by call; concatenated logits."""
        np = self._np
        tokens = np.asarray(tokens, dtype=np.int64)
        t = self.tokens_per_call
        if tokens.ndim != 2 or tokens.shape[1] % t:
            raise NpuforgeError(f"sequence length {tokens.shape[-1]} is not a multiple of {t}")
        return np.concatenate(
            [self.step(tokens[:, i : i + t]) for i in range(0, tokens.shape[1], t)], axis=1
        )


class Fp16EmulationSession:
    """Runs an fp16 graph the way an fp16 NPU stores it: every intermediate rounded to fp16.

    onnxruntime's CPU provider has few fp16 kernels; it computes most fp16 nodes in
    fp32 and drops the casts in between, so an fp16 graph that overflows on an NPU can
    look clean there. This session rewrites the graph to fp32 arithmetic with a
    Cast(fp16) -> Cast(fp32) pair after every node: each op accumulates wide, as NPU
    kernels do, but every tensor it writes is fp16 (overflow -> inf), as NPU memory is.
    """

    def __init__(self, onnx_path, threads: int = 1):
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        # Shapes inferred before the weights load (a graph past 2 GB cannot be serialised
        # for inference); the weights then come from the graph's own external data.
        model = onnx.load(str(onnx_path), load_external_data=False)
        model = onnx.shape_inference.infer_shapes(model)
        onnx.load_external_data_for_model(model, str(Path(onnx_path).parent))
        graph = model.graph
        half, full = TensorProto.FLOAT16, TensorProto.FLOAT
        fp16_values = {
            v.name
            for v in list(graph.value_info) + list(graph.input) + list(graph.output)
            if v.type.tensor_type.elem_type == half
        }
        self.input_types = {v.name: v.type.tensor_type.elem_type for v in graph.input}
        self.output_types = {v.name: v.type.tensor_type.elem_type for v in graph.output}
        for value in list(graph.input) + list(graph.output):
            if value.type.tensor_type.elem_type == half:
                value.type.tensor_type.elem_type = full
        del graph.value_info[:]
        for init in graph.initializer:
            if init.data_type == half:
                init.CopyFrom(
                    numpy_helper.from_array(
                        numpy_helper.to_array(init).astype("float32"), init.name
                    )
                )
        nodes = []
        graph_outputs = {o.name for o in graph.output}
        for node in graph.node:
            for attr in node.attribute:
                if attr.name == "to" and attr.i == half:
                    attr.i = full
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == half:
                    attr.t.CopyFrom(
                        numpy_helper.from_array(numpy_helper.to_array(attr.t).astype("float32"))
                    )
            renamed = []
            for index, out in enumerate(node.output):
                if out in fp16_values:
                    raw = f"{out}__wide"
                    node.output[index] = raw
                    renamed.append((raw, out))
            nodes.append(node)
            for raw, out in renamed:
                nodes.append(helper.make_node("Cast", [raw], [f"{out}__h"], to=half))
                nodes.append(helper.make_node("Cast", [f"{out}__h"], [out], to=full))
        del graph.node[:]
        graph.node.extend(nodes)
        del graph_outputs
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        # Widened to fp32 the weights double: saved with external data in a scratch
        # directory (a proto past 2 GB cannot be serialised), the session loads from there.
        with tempfile.TemporaryDirectory(prefix="npuforge-fp16-emulation-") as scratch:
            path = Path(scratch) / "graph.onnx"
            onnx.save_model(
                model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                location="graph.onnx.data", size_threshold=1024,
            )  # fmt: skip
            del model, graph
            self.session = ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )

    def run(self, output_names, feeds):
        import numpy as np

        wide = {k: (v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in feeds.items()}
        results = self.session.run(output_names, wide)
        return [
            r.astype(np.float16) if self.output_types.get(n) == 10 else r
            for n, r in zip(output_names, results, strict=True)
        ]
