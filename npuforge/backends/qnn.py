"""Qualcomm HTP backend: per-SoC QNN context binaries, verified on the x86 HTP simulator.

Two routes produce the binaries:

* ``ep`` (default, runs here): ONNX Runtime's QNN execution provider from the
  ``onnxruntime-qnn`` wheel (QAIRT host libraries) compiles each graph chunk
  into a QNN HTP context binary for the target's ``soc_model``/``htp_arch``
  (EP-context generation) and runs it on the simulator. The work happens in
  ``qnn_job.py`` inside the toolchain environment; this module writes its spec
  and turns its result into ``compile.json``.
* ``sdk``: the QNN SDK's own command-line tools, for users who hold the SDK
  (``npuforge.backends.qnn_sdk``).

The route is ``route`` in the target options, or ``NPUFORGE_QNN_ROUTE`` for
every QNN target at once.

No heavy imports at module level: the toolchain module imports this one while
Snakemake parses the workflow.
"""

import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, sha256_file, write_json
from npuforge.verify import logits_agreement

BACKEND = "qnn"
JOB_SCRIPT = Path(__file__).with_name("qnn_job.py")
ROUTES = ("ep", "sdk")
ROUTE_ENV = "NPUFORGE_QNN_ROUTE"
PRECISIONS = ("fp16", "a16w8", "a16w4")
QUANTIZED = ("a16w8", "a16w4")

# SoC model ids from the QNN SDK's Qnn_SocModel_t (QnnTypes.h) and HTP
# versions, for one-line messages and for checking targets.yaml entries.
SOC_MODELS = {
    "SM8350": (30, 68),
    "SM8450": (36, 69),
    "SM8475": (42, 69),
    "SM8550": (43, 73),
    "SM8650": (57, 75),
    "SC8380": (60, 73),
    "SM8750": (69, 79),
}

# What each HTP generation computes natively: no fp16 datapath before v69, and
# 4-bit weights only from v73 on.
MIN_HTP_ARCH = {"a16w8": 68, "fp16": 69, "a16w4": 73}

# A context must stay under the HTP's 2 GB graph allocation; weights take this
# much of it, the rest is activations, spill-fill and the context's own tables.
CONTEXT_WEIGHT_BUDGET = 1_500_000_000
BYTES_PER_PARAM = {"fp16": 2.0, "a16w8": 1.0, "a16w4": 0.5}

# Calibrated activation ranges are widened by this share of their span on each
# side that is not zero-bounded: a few samples miss a recurrent model's
# extremes, and 16-bit codes have bits to spare (one span each side costs ~1.6
# bits). On the demo RWKV-7, A16W8 min-step cosine over 32 steps: 0.9920 at
# 0.1, 0.99926 at 1.0, 0.99929 at 2.0 (onnxruntime CPU on the QDQ graphs).
RANGE_MARGIN = 1.0

# Lowest acceptable logits cosine on the simulator vs onnxruntime fp32 (issue 5).
MIN_COSINE = {"fp16": 0.9999, "a16w8": 0.999, "a16w4": 0.99}

# Context binaries are not forward compatible: the device must load them with
# the same QAIRT release's runtime libraries (or a newer one that still reads it).
DEVICE_RUNTIME_NOTE = (
    "load these context binaries with QAIRT {version} device libraries: libQnnHtp.so, "
    "libQnnSystem.so, libQnnHtpV{arch}Stub.so and hexagon-v{arch} libQnnHtpV{arch}Skel.so "
    "from the same QAIRT release (onnxruntime-qnn {ort_qnn} on Android/Windows ARM64 ships them)"
)


# --------------------------------------------------------------------------- capability


def route(target_options: dict) -> str:
    chosen = os.environ.get(ROUTE_ENV) or (target_options or {}).get("route") or "ep"
    if chosen not in ROUTES:
        raise NpuforgeError(
            f"unknown QNN route '{chosen}': set route (or {ROUTE_ENV}) "
            f"to one of {', '.join(ROUTES)}"
        )
    return chosen


def supported_precisions(htp_arch: int) -> list[str]:
    return [p for p in PRECISIONS if int(htp_arch) >= MIN_HTP_ARCH[p]]


def precision_problem(target_id: str, target_options: dict, precision: str) -> str | None:
    """One line when ``precision`` cannot run on this SoC's HTP, else None."""
    if precision not in PRECISIONS:
        return (
            f"target {target_id}: precision '{precision}' is not a QNN precision; "
            f"choose one of {', '.join(PRECISIONS)}"
        )
    arch = int(target_options.get("htp_arch", 0))
    if arch < MIN_HTP_ARCH[precision]:
        supported = ", ".join(supported_precisions(arch)) or "none"
        return (
            f"target {target_id} has HTP v{arch}, which cannot run {precision} "
            f"(needs v{MIN_HTP_ARCH[precision]} or newer); it supports: {supported}"
        )
    return None


def check_target(target_id: str, target_options: dict, precision: str) -> None:
    problem = precision_problem(target_id, target_options, precision)
    if problem:
        raise NpuforgeError(problem)
    for key in ("soc_model", "htp_arch"):
        if key not in target_options:
            raise NpuforgeError(
                f"target {target_id}: options need '{key}' for the QNN backend; "
                "add it in targets.yaml"
            )
    known = SOC_MODELS.get(target_id)
    given = (int(target_options["soc_model"]), int(target_options["htp_arch"]))
    if known and known != given:
        raise NpuforgeError(
            f"target {target_id}: soc_model/htp_arch {given[0]}/{given[1]} "
            "do not match the QNN SDK's "
            f"{known[0]}/{known[1]}; fix targets.yaml"
        )


def plan_chunks(n_params: int, precision: str, budget_bytes: int = CONTEXT_WEIGHT_BUDGET) -> int:
    """Graph chunks so that each HTP context's weights stay within the budget."""
    if precision not in BYTES_PER_PARAM:
        raise NpuforgeError(
            f"unknown QNN precision '{precision}'; choose one of {', '.join(PRECISIONS)}"
        )
    return max(1, math.ceil(int(n_params) * BYTES_PER_PARAM[precision] / budget_bytes))


def unavailable_reason(runtime: str, target_options: dict) -> str | None:
    """Cheap parse-time check of what this host lacks for a QNN target, as one line."""
    target_options = dict(target_options or {})
    try:
        chosen = route(target_options)
    except NpuforgeError as err:
        return str(err)
    if chosen == "sdk":
        from npuforge.backends import qnn_sdk

        return qnn_sdk.unavailable_reason(runtime, target_options)
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            "the QNN EP route compiles with onnxruntime-qnn's x86_64 Linux host libraries; "
            "build QNN targets on an x86_64 Linux machine"
        )
    if runtime == "native" and sys.version_info[:2] != (3, 11):
        return (
            "onnxruntime-qnn 2.7.0 ships only CPython 3.11 wheels: run the workflow with "
            "Python 3.11 or use a container runtime (toolchain runtime podman/docker)"
        )
    return None


# --------------------------------------------------------------------------- inputs


def _load_export(path) -> dict:
    path = Path(path)
    try:
        meta = read_json(path / "export.json")
    except FileNotFoundError:
        raise NpuforgeError(
            f"{path} has no export.json: pass an export directory (export_onnx.py --out-dir)"
        ) from None
    meta["dir"] = path.resolve()
    return meta


def split_exports(export_dirs) -> tuple[dict, dict | None]:
    """(decode export, prefill export or None) from the --export directories."""
    by_variant = {}
    for directory in export_dirs:
        meta = _load_export(directory)
        variant = meta.get("variant", "decode")
        if variant in by_variant:
            raise NpuforgeError(
                f"two {variant} exports given ({by_variant[variant]['dir']}, {meta['dir']}); "
                "pass one"
            )
        by_variant[variant] = meta
    if "decode" not in by_variant:
        raise NpuforgeError(
            "no decode export among --export directories; the QNN backend compiles decode graphs"
        )
    decode, prefill = by_variant["decode"], by_variant.get("prefill")
    if prefill and len(prefill["graphs"]) != len(decode["graphs"]):
        raise NpuforgeError(
            f"prefill export has {len(prefill['graphs'])} chunks but decode has "
            f"{len(decode['graphs'])}: "
            "export both with the same --chunks"
        )
    return decode, prefill


def calibration_samples(calibration_dir, chunk: int) -> list[dict]:
    """One chunk's samples, [{input name: absolute raw path}], from qnn/chunk{i}/input_list.txt."""
    listing = Path(calibration_dir) / "qnn" / f"chunk{chunk}" / "input_list.txt"
    if not listing.is_file():
        raise NpuforgeError(
            f"calibration directory has no {listing.relative_to(Path(calibration_dir))}: "
            "rerun make_calibration_samples.py for this export"
        )
    samples = []
    for line in listing.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sample = {}
        for entry in line.split():
            name, sep, raw = entry.partition(":=")
            if not sep:
                raise NpuforgeError(
                    f"{listing}: entry '{entry}' is not name:=path; regenerate the samples"
                )
            raw_path = Path(raw)
            if not raw_path.is_absolute():
                raw_path = listing.parent / raw_path
            sample[name] = str(raw_path.resolve())
        samples.append(sample)
    if not samples:
        raise NpuforgeError(f"{listing} lists no samples: rerun make_calibration_samples.py")
    return samples


def verification_schedule(decode: dict, prefill: dict | None, steps: int) -> list[tuple]:
    """The calls of the recurrent check as (variant, first position, token count).

    With a prefill export one prefill call starts the run and decode calls take it
    to ``steps`` tokens; either way the run covers positions 0..steps-1, so a
    check that fits the KV cache by its step count fits it here too.
    """
    if not prefill:
        return [("decode", position, 1) for position in range(steps)]
    tokens = int(prefill["tokens_per_call"])
    if steps <= tokens:
        raise NpuforgeError(
            f"verify_steps {steps} leaves no decode step after a {tokens}-token prefill; "
            f"raise verify_steps above {tokens}"
        )
    return [("prefill", 0, tokens)] + [("decode", p, 1) for p in range(tokens, steps)]


def write_verification_feeds(decode, prefill, tokens: list[int], work_dir) -> list[dict]:
    """One ``.npz`` per call with every host-fed input of every chunk (``chunk{i}/{name}``).

    The values come from ``npuforge.runtime.host_feeds``, the runner every other
    stage uses, so the simulator sees the same tokens, embedding rows and family
    inputs (a KV cache's mask, RoPE rows, write slots) as onnxruntime would; the job
    only feeds them by name and carries recurrent outputs back itself.
    """
    import numpy as np

    from npuforge.export import read_embedding_bin
    from npuforge.runtime import host_feeds

    exports = {"decode": decode, "prefill": prefill}
    tables = {}
    calls = []
    ids = np.asarray(tokens, dtype=np.int64)
    for number, (variant, position, count) in enumerate(
        verification_schedule(decode, prefill, len(tokens))
    ):
        export = exports[variant]
        if variant not in tables:
            wanted = any(i["role"] == "embedding" for g in export["graphs"] for i in g["inputs"])
            tables[variant] = read_embedding_bin(_embedding_path(export)) if wanted else None
        call_ids = ids[position : position + count].reshape(1, count)
        batch = int(export.get("batch", 1))
        call_ids = np.repeat(call_ids, batch, axis=0)
        arrays = {}
        for index, graph in enumerate(export["graphs"]):
            feeds = host_feeds(export, graph, call_ids, position, tables[variant])
            arrays.update({f"chunk{index}/{name}": value for name, value in feeds.items()})
        path = Path(work_dir) / f"verify_call{number:04d}.npz"
        np.savez(path, **arrays)
        calls.append({"variant": variant, "position": position, "feeds": str(path.resolve())})
    return calls


def runner_logits(decode: dict, prefill: dict | None, tokens: list[int]):
    """The gate's reference: ``npuforge.runtime.GraphChain`` (onnxruntime CPU) on the fp32
    source graphs over the same calls, as ``[tokens, ...]`` rows like the job's outputs.

    Computed here, not from the job's feeds, so inputs the job fed wrongly (a mask,
    RoPE rows, a cache slot) fail the check instead of agreeing with themselves.
    """
    import numpy as np

    from npuforge.runtime import GraphChain

    chains = {"decode": GraphChain(decode["dir"])}
    if prefill:
        chains["prefill"] = GraphChain(prefill["dir"])
    ids = np.asarray(tokens, dtype=np.int64)
    rows, state, previous = [], None, None
    for variant, position, count in verification_schedule(decode, prefill, len(tokens)):
        chain = chains[variant]
        if chain is not previous and previous is not None:
            # Recurrent state and position continue from the other variant's last call.
            chain.state = {k: state[k].astype(v.dtype) for k, v in chain.state.items()}
            chain.position = previous.position
        call_ids = np.repeat(ids[position : position + count].reshape(1, count), chain.batch, 0)
        logits = chain.step(call_ids)
        rows.append(np.moveaxis(logits, 1, 0).reshape(logits.shape[1], -1))
        state, previous = chain.state, chain
    return np.concatenate(rows)


# --------------------------------------------------------------------------- spec + result


def _embedding_path(export: dict) -> Path:
    embedding = export.get("embedding") or "embedding.bin"
    if isinstance(embedding, dict):
        embedding = embedding.get("file", "embedding.bin")
    return Path(export["dir"]) / embedding


def _input_ranges(export: dict, graph: dict) -> dict:
    """Exact value ranges of inputs fed from a table: embedding rows span the table's range."""
    import numpy as np

    from npuforge.export import read_embedding_bin

    ranges = {}
    for item in graph["inputs"]:
        if item["role"] == "embedding":
            table = read_embedding_bin(_embedding_path(export))
            ranges[item["name"]] = [float(np.min(table)), float(np.max(table))]
    return ranges


def ctx_file(chunk: int, variant: str) -> str:
    return f"chunk{chunk}_ctx.onnx" if variant == "decode" else f"chunk{chunk}_{variant}_ctx.onnx"


def keep_16bit_tensors(graph: dict) -> list[str]:
    """The recurrent state path of a chunk: every state input and output."""
    names = [item["name"] for item in graph["inputs"] if item["role"] == "state"]
    names += [item["name"] for item in graph["outputs"] if item["role"] == "state"]
    return names


def build_spec(
    decode,
    prefill,
    calibrations,
    target_options,
    precision,
    out_dir,
    work_dir,
    verify_steps: int,
    calls,
) -> dict:
    """The job spec; ``calibrations``: ``{variant: calibration directory}`` (quantized only)."""
    exports = {"decode": decode, "prefill": prefill}
    if precision in QUANTIZED:
        from npuforge.calibration import check_calibration_matches

        for variant, export in exports.items():
            if not export:
                continue
            if variant not in (calibrations or {}):
                raise NpuforgeError(
                    f"{precision} with a {variant} export needs {variant} calibration samples: "
                    f"pass --calibration DIR made by make_calibration_samples.py --export "
                    f"{export['dir']}"
                )
            check_calibration_matches(calibrations[variant], export, export["dir"])
    chunks = []
    for index, graph in enumerate(decode["graphs"]):
        variants = [("decode", decode, graph)]
        if prefill:
            variants.append(("prefill", prefill, prefill["graphs"][index]))
        graphs = []
        for variant, export, meta in variants:
            entry = {
                "variant": variant,
                "model": str(export["dir"] / meta["file"]),
                "ctx_file": ctx_file(index, variant),
                "inputs": meta["inputs"],
            }
            ranges = _input_ranges(export, meta)
            if ranges:
                entry["input_ranges"] = ranges
            if precision in QUANTIZED:
                # Each graph is quantized with the samples of its own variant's runs.
                entry["calibration"] = calibration_samples(calibrations[variant], index)
            graphs.append(entry)
        chunks.append(
            {"index": index, "graphs": graphs, "keep_16bit_tensors": keep_16bit_tensors(graph)}
        )
    spec = {
        "precision": precision,
        "soc_model": int(target_options["soc_model"]),
        "htp_arch": int(target_options["htp_arch"]),
        "vtcm_mb": int(target_options.get("vtcm_mb", 0)) or None,
        "optimization_mode": int(target_options.get("optimization_level", 3)),
        # Headroom on calibrated 16-bit activation ranges, as a fraction of each span.
        "range_margin": float(target_options.get("range_margin", RANGE_MARGIN)),
        "quantize_op_types": target_options.get("quantize_op_types"),
        "out_dir": str(Path(out_dir).resolve()),
        "work_dir": str(Path(work_dir).resolve()),
        "chunks": chunks,
    }
    if verify_steps > 0:
        spec["verify"] = {
            "steps": verify_steps,
            # Per call: which graph variant runs and the file holding its host-fed inputs.
            "calls": list(calls),
            "outputs": str((Path(work_dir) / "verify_outputs.npz").resolve()),
            "chains": {
                variant: [
                    {
                        "source": str(exports[variant]["dir"] / graph["file"]),
                        "ctx_file": ctx_file(index, variant),
                        "inputs": graph["inputs"],
                        "outputs": graph["outputs"],
                    }
                    for index, graph in enumerate(exports[variant]["graphs"])
                ]
                for variant in sorted({call["variant"] for call in calls})
            },
        }
    return spec


def verification_figures(reference, compiled) -> dict:
    """Logits agreement over steps (see npuforge.verify.logits_agreement)."""
    return {"steps": int(reference.shape[0]), **logits_agreement(reference, compiled)}


def _weights_shared(chunk_result: dict, variants: list[str]) -> dict:
    binaries = chunk_result["binaries"]
    shared = len(variants) > 1 and len(binaries) == 1
    note = {"graphs": variants, "one_context": shared, "binary": binaries[0] if shared else None}
    if shared:
        note["how"] = "ONNX Runtime ep.share_ep_contexts: one QNN context, weights stored once"
        note["simulated"] = (
            "decode graph compiled alone from the same source and options: QAIRT 2.51's x86 "
            "simulator cannot load a multi-graph context"
        )
    return note


def _default_job_runner(stamp_path, spec_path, read_only, writable, log_path):
    from npuforge import toolchain

    return toolchain.run_job(
        stamp_path, JOB_SCRIPT, spec_path, read_only=read_only, writable=writable, log_path=log_path
    )


def compile_qnn(
    export_dirs,
    calibration_dirs,
    target_id,
    target_options,
    precision,
    toolchain_stamp,
    out_dir,
    *,
    job_runner=None,
    log_path=None,
) -> dict:
    """Compile every chunk for one SoC and precision; write binaries + compile.json into out_dir.

    ``calibration_dirs``: None, one directory or a list, one per export (paired by the
    variant each calibration.json records).
    """
    from npuforge.calibration import calibrations_by_variant

    target_options = dict(target_options or {})
    check_target(target_id, target_options, precision)
    calibrations = calibrations_by_variant(calibration_dirs)
    calibration_dir = calibrations.get("decode")
    chosen = route(target_options)
    if chosen == "sdk":
        from npuforge.backends import qnn_sdk

        return qnn_sdk.compile_sdk(
            export_dirs,
            calibration_dir,
            target_id,
            target_options,
            precision,
            out_dir,
            log_path=log_path,
        )
    if precision in QUANTIZED and not calibrations:
        raise NpuforgeError(f"{precision} needs calibration samples: pass --calibration DIR")
    if not toolchain_stamp:
        raise NpuforgeError(
            "the QNN EP route needs a toolchain: "
            "pass --toolchain results/toolchains/qnn-<runtime>.json"
        )
    decode, prefill = split_exports(export_dirs)
    stamp = read_json(toolchain_stamp)
    verify_steps = int(target_options.get("verify_steps", 32))
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.work-", dir=out_dir.parent))
    try:
        with atomic_path(out_dir) as staging:
            staging.mkdir()
            from npuforge.calibration import verification_tokens

            tokens = verification_tokens(verify_steps, int(decode["vocab_size"]), calibration_dir)
            calls = write_verification_feeds(decode, prefill, tokens, work_dir)
            reference = runner_logits(decode, prefill, tokens) if tokens else None
            spec = build_spec(
                decode,
                prefill,
                calibrations,
                target_options,
                precision,
                staging,
                work_dir,
                verify_steps,
                calls,
            )
            spec_path = work_dir / "spec.json"
            write_json(spec_path, spec)
            read_only = [decode["dir"]] + ([prefill["dir"]] if prefill else [])
            read_only += [Path(d).resolve() for d in calibrations.values()]
            runner = job_runner or _default_job_runner
            runner(toolchain_stamp, spec_path, read_only, [staging.resolve(), work_dir], log_path)
            result = read_json(work_dir / "result.json")
            manifest = _manifest(
                target_id,
                target_options,
                precision,
                decode,
                prefill,
                stamp,
                spec,
                result,
                staging,
                reference,
                calibrations if precision in QUANTIZED else {},
            )
            write_json(staging / "compile.json", manifest)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return manifest


def heap_pinned(result: dict) -> bool:
    """Whether every chunk compiled with the heap settings that make its bytes repeat.

    QAIRT 2.51 writes uninitialised heap bytes into the padding of fp16 constants;
    two builds are byte-identical only when each chunk process ran with
    MALLOC_PERTURB_, the glibc tcache off, a fixed PYTHONHASHSEED and address
    randomisation off (``qnn_job.compile_chunks``; a container that refuses
    personality() cannot).
    """
    settings = [chunk.get("heap") or {} for chunk in result["chunks"]]
    return bool(settings) and all(
        h.get("aslr_disabled")
        and h.get("malloc_perturb")
        and h.get("tcache_disabled")
        and h.get("python_hash_seed")
        for h in settings
    )


def _manifest(
    target_id,
    target_options,
    precision,
    decode,
    prefill,
    stamp,
    spec,
    result,
    staging,
    reference,
    calibrations,
) -> dict:
    import numpy as np

    from npuforge.calibration import read_calibration

    variants = ["decode"] + (["prefill"] if prefill else [])
    artifacts, chunk_notes, qairt = [], [], set()
    for chunk in result["chunks"]:
        index = chunk["index"]
        for binary in chunk["binaries"]:
            artifacts.append(
                {
                    "file": binary,
                    "sha256": sha256_file(staging / binary),
                    "role": "binary",
                    "chunk": index,
                    "bytes": (staging / binary).stat().st_size,
                }
            )
        for variant in variants:
            name = ctx_file(index, variant)
            artifacts.append(
                {
                    "file": name,
                    "sha256": sha256_file(staging / name),
                    "role": "ep_context",
                    "chunk": index,
                    "variant": variant,
                }
            )
        qairt.update(v for v in chunk["qairt"].values() if v)
        # Wall times go to the log, not the record: manifests must not vary run to run.
        print(f"chunk {index}: context generation {chunk['context_seconds']} s", file=sys.stderr)
        chunk_notes.append(
            {
                "chunk": index,
                "weight_sharing": _weights_shared(chunk, variants),
                "quantization": {
                    variant: {k: v for k, v in info.items() if k not in ("qdq_model", "source")}
                    for variant, info in chunk["quantization"].items()
                },
            }
        )
    if len(qairt) != 1:
        raise NpuforgeError(
            f"expected one QAIRT version in the produced binaries, found {sorted(qairt) or 'none'}"
        )
    qairt_version = qairt.pop()
    verification = None
    if "verification" in result:
        outputs = dict(np.load(result["verification"]["outputs"]))
        logits = [name[len("reference/") :] for name in outputs if name.startswith("reference/")]
        if not logits:
            raise NpuforgeError(
                "the simulator run produced no logits to compare; check the export's output roles"
            )
        compiled = outputs[f"compiled/{logits[0]}"]
        if compiled.shape != reference.shape:
            raise NpuforgeError(
                f"the simulator returned logits of shape {list(compiled.shape)}, npuforge's "
                f"runner {list(reference.shape)}: the spec and the job disagree; rerun with one "
                "npuforge checkout"
            )
        figures = verification_figures(reference, compiled)
        # The job's own onnxruntime CPU run on the same feeds: tells a compiler error
        # (this is ~0) from a feeding error (this is large too).
        job_cpu = verification_figures(reference, outputs[f"reference/{logits[0]}"])
        floor = float(target_options.get("min_cosine", MIN_COSINE[precision]))
        seconds = result["verification"]["simulator_seconds"]
        print(f"simulator verification: {seconds} s", file=sys.stderr)
        verification = {
            **figures,
            "reference": "onnxruntime CPU on the fp32 source graphs (npuforge.runtime)",
            "runner": "QNN HTP x86 simulator (onnxruntime-qnn)",
            "toolchain_cpu_max_abs_rel": job_cpu["max_abs_rel"],
            # Graph calls per variant: a prefill call covers several of the steps.
            "calls": result["verification"].get("calls"),
            "min_cosine": floor,
            "passed": figures["nan_inf"] == 0 and figures["cosine"] >= floor,
        }
        if not verification["passed"]:
            raise NpuforgeError(
                f"{target_id} {precision}: simulator check failed over {figures['steps']} steps "
                f"(cosine {figures['cosine']}, NaN/Inf {figures['nan_inf']}, floor {floor}); "
                "keep more tensors at 16 bit or use fp16"
            )
    versions = dict(stamp.get("versions", {}))
    arch = int(target_options["htp_arch"])
    return {
        "backend": BACKEND,
        "target": target_id,
        "precision": precision,
        "route": "ep",
        "artifacts": artifacts,
        "split": {
            "chunks": len(result["chunks"]),
            "reason": (
                "export chunks; plan_chunks keeps each HTP context under "
                f"{CONTEXT_WEIGHT_BUDGET} bytes of weights"
            ),
        },
        "toolchain": {"runtime": stamp.get("runtime"), "versions": versions},
        "reproducible": heap_pinned(result),
        "qairt": {
            "version": qairt_version,
            "source": "read from the produced context binaries",
            "device_runtime": DEVICE_RUNTIME_NOTE.format(
                version=qairt_version, arch=arch, ort_qnn=versions.get("onnxruntime-qnn", "?")
            ),
        },
        "verification": verification,
        "options": {
            "soc_model": spec["soc_model"],
            "htp_arch": spec["htp_arch"],
            "vtcm_mb": spec["vtcm_mb"],
            "range_margin": spec["range_margin"] if precision in QUANTIZED else None,
            "provider_options": result["provider_options"],
            "generation_options": result.get("generation_options", {}),
            "heap": [chunk.get("heap") for chunk in result["chunks"]],
            # hard-linked: the bytes do not depend on where the toolchain venv lives.
            "site_packages": sorted({c.get("site_packages", "none") for c in result["chunks"]}),
            "graphs": variants,
            "export": {
                "variant": decode.get("variant"),
                "dtype": decode.get("dtype"),
                "options": decode.get("options", {}),
            },
            "chunks": chunk_notes,
            # Which samples quantized each variant's graphs (calibration.json's sha256).
            "calibration": {
                variant: {
                    "samples": read_calibration(directory).get("samples"),
                    "tokens_per_call": read_calibration(directory).get("tokens_per_call", 1),
                    "sha256": sha256_file(Path(directory) / "calibration.json"),
                }
                for variant, directory in sorted(calibrations.items())
                if variant in variants
            }
            or None,
        },
    }
