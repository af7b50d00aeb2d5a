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

This module is the job's main (chunks, stages, verification); beside it, imported as
top-level modules: ``qnn_quantizer.py`` (step 1, with its graph rules in
``qnn_graph.py``), ``qnn_session.py`` (the QNN EP: steps 2 and 3), ``qnn_log.py``
and ``job_stage.py``.
"""

import json
import os
import sys
import time
from pathlib import Path

from qnn_log import log
from qnn_quantizer import quantize_graph, require_onnxruntime
from qnn_session import (
    GENERATION_OPTIONS,
    cpu_session,
    describe_ctx,
    generate_contexts,
    provider_options,
    qairt_version,
    register_qnn,
    run_calls,
    simulator_session,
)

# A JSON file {variant: [.npz per held-out step]} for the quantizing process.
LAYER_ERROR_ENV = "NPUFORGE_QNN_LAYER_ERROR_INPUTS"


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
        analysed = layer_error_inputs(graph["variant"])
        if analysed:
            quantization[graph["variant"]]["layer_error"] = layer_error_table(
                spec, chunk, graph, analysed
            )
    return quantization


def layer_error_inputs(variant: str) -> list:
    """The held-out steps' input files of this chunk's ``variant`` graph (absolute), as the
    job passed them to the quantizing process."""
    listing = os.environ.get(LAYER_ERROR_ENV)
    return json.loads(Path(listing).read_text()).get(variant, []) if listing else []


def layer_error_table(spec: dict, chunk: dict, graph: dict, inputs: list) -> dict:
    """The Q/DQ model's per-layer error against the fp32 graph on the held-out steps'
    inputs (qnn_layer_error.py); after the Q/DQ model is written, so it cannot change it."""
    import numpy as np
    from qnn_layer_error import analyse

    samples = []
    for path in inputs:
        with np.load(path) as data:
            samples.append({name: data[name] for name in data.files})
    qdq = qdq_path(spec, chunk, graph)
    log(f"layer error: chunk {chunk['index']} {graph['variant']}, {len(samples)} held-out steps")
    started = time.monotonic()
    rows = analyse(
        graph["model"],
        str(qdq),
        samples,
        qdq.parent / "layer_error",
        htp=lambda model, feeds: run_on_simulator(spec, model, feeds),
    )
    log(f"layer error: {len(rows)} nodes in {time.monotonic() - started:.1f} s")
    return {"samples": len(samples), "layers": rows}


def run_on_simulator(spec: dict, model_path: str, samples: list) -> list[dict]:
    """``model_path`` compiled alone for the spec's HTP and run on its simulator, once per
    sample; every output by name. For analysis only: the context is not kept."""
    from qnn_layer_error import run_samples

    ort, devices, htp_library = register_qnn()
    options = provider_options(spec, htp_library)
    ctx = Path(model_path).with_name(Path(model_path).stem + "_ctx.onnx")
    generate_contexts(ort, devices, options, [(model_path, ctx)], share=False)
    return run_samples(simulator_session(ort, devices, options, ctx), samples)


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
        # Only the quantizing process reads them (LAYER_ERROR_ENV): the compiling process
        # sees the same spec with or without the analysis, so its bytes cannot follow it.
        graph.pop("layer_error_inputs", None)
        graphs.append(graph)
    staged = {k: v for k, v in spec.items() if k not in ("chunks", "verify")}
    staged.update(out_dir="out", work_dir="work", chunks=[{**chunk, "graphs": graphs}])
    return staged, links


def job_files() -> list[str]:
    """What a chunk process imports from its stage: this job's modules (qnn_*.py) and
    job_stage.py."""
    here = Path(__file__).resolve().parent
    return [str(path) for path in sorted(here.glob("qnn_*.py"))] + [str(here / "job_stage.py")]


def _compile_staged(spec: dict, chunk: dict, job_stage) -> dict:
    """Compile one chunk in a fresh process from its stage; copy its outputs back."""
    import shutil

    staged, links = staged_chunk_spec(spec, chunk)
    stage, python, lock = job_stage.make_stage("qnn", staged, links, job_files())
    try:
        os.mkdir(os.path.join(stage, "out"))
        os.mkdir(os.path.join(stage, "work"))
        command = [python, Path(__file__).name, "spec.json", "--chunk", str(chunk["index"])]
        quantization = {}
        if spec["precision"] != "fp16":
            # Its own process on the real clock: quantization logs progress over minutes.
            env = job_stage.fixed_environment(stage, chunk_env({}))
            analysed = {
                g["variant"]: [str(Path(p).resolve()) for p in g["layer_error_inputs"]]
                for g in chunk["graphs"]
                if g.get("layer_error_inputs")
            }
            if analysed:
                listing = Path(spec["work_dir"]).resolve() / f"chunk{chunk['index']}_analysed.json"
                listing.write_text(json.dumps(analysed))
                env[LAYER_ERROR_ENV] = str(listing)
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
        written = sorted(Path(stage, "out").iterdir())
        for produced in written:
            shutil.copyfile(produced, out_dir / produced.name)
        result = json.loads(Path(stage, "work", f"chunk{chunk['index']}_result.json").read_text())
        result.update(quantization=quantization, context_seconds=round(seconds, 3))
        result["out_files"] = [produced.name for produced in written]
        for variant, twin in sorted(result.get("simulate_ctx", {}).items()):
            # The simulator-only twins (see compile_chunk) go where verify() reads them.
            for produced in Path(stage, twin).parent.iterdir():
                (work_dir / "simulate").mkdir(exist_ok=True)
                shutil.copyfile(produced, work_dir / "simulate" / produced.name)
            # Relative: the caller may keep this chunk's files and reuse them elsewhere.
            result["simulate_ctx"][variant] = f"simulate/{Path(twin).name}"
        result["site_packages"] = job_stage.site_packages_mode(stage)
        return result
    finally:
        job_stage.remove_stage(stage)
        os.close(lock)


def compile_chunks(spec: dict, spec_path: str) -> dict:
    """Compile every chunk in a fresh pinned process from its own stage (job_stage.py
    explains why), generating contexts prepare-only (GENERATION_OPTIONS): no simulator
    threads run beside the serialiser."""
    if spec["precision"] != "fp16":
        require_onnxruntime()  # here, not in a chunk process: its line ends the job's output
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
    by_variant = {}
    sim_out = run_calls(compiled, chains, calls, "HTP simulator calls run", by_variant)
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
        "simulator_seconds_by_variant": {v: round(t, 3) for v, t in sorted(by_variant.items())},
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
    if spec.get("compiled"):  # the chunks were compiled by jobs of their own
        result = json.loads(Path(spec["compiled"]).read_text())
    else:
        result = compile_chunks(spec, argv[0])
    if spec.get("verify"):
        result["verification"] = verify(spec, result)
    result_path = Path(spec["work_dir"]) / "result.json"
    result_path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    log(f"wrote {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
