"""The QNN execution provider: contexts, sessions and the calls that verify them.

Runs inside the QNN toolchain environment (imported by ``qnn_job.py`` as a sibling
module): registers the onnxruntime-qnn plugin, writes HTP context binaries through ONNX
Runtime's EP-context generation, opens sessions on the x86 HTP simulator and on the
CPU, runs a chunked graph chain call by call, and reads back what a context records.
"""

import itertools
import os
import re
import shutil
import time
from pathlib import Path

from qnn_log import Progress, log

EP_NAME = "QNNExecutionProvider"
QAIRT_PATTERN = re.compile(rb"v(\d+\.\d+\.\d+)\.(\d{6,})")


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
# make the uninitialised padding differ run to run (see qnn_job.compile_chunks).
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


def run_calls(
    sessions: dict, chains: dict, calls: list, what: str = "calls run", seconds: dict | None = None
) -> dict:
    """Run a chunked recurrent graph chain call by call, as the spec's ``calls`` list them.

    ``chains[variant][i]`` lists chunk i's inputs ({name, role, output?, shape, dtype})
    and outputs; ``sessions[variant][i]`` runs it. Per input role: state (fed from the
    output it names, carried across calls and variants; zeros first, unless the call's
    feeds hold it: a kv_prefix's starting state), hidden (the latest earlier chunk's
    output of the same stem: ``hidden_in`` <- ``hidden_out``, ``v_first_in`` <- the first
    chunk's ``v_first_out``); anything else is host-fed, read from the call's feeds file
    under ``chunk{i}/{name}``. Returns every other output as rows
    of one token each (``[tokens, ...]``), calls concatenated. ``seconds``, when given,
    gains each variant's wall time (where a simulator's time goes: per call, per token).
    """
    import numpy as np

    state = {}
    collected = {}
    progress = Progress(what, len(calls))
    for call in calls:
        started = time.monotonic()
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
            for out in chunk["outputs"]:
                value = values[out["name"]]
                if out["role"] == "hidden":
                    hidden[out["name"]] = value
                elif out["role"] != "state":
                    # [B, T, ...] -> T rows: prefill and decode calls line up token by token.
                    rows = np.moveaxis(value, 1, 0).reshape(value.shape[1], -1)
                    collected.setdefault(out["name"], []).append(rows)
        if seconds is not None:
            variant = call["variant"]
            seconds[variant] = seconds.get(variant, 0.0) + time.monotonic() - started
        progress.step()
    return {name: np.concatenate(arrays) for name, arrays in collected.items()}


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
