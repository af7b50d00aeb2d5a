import functools
import json
import shlex
import sys
from pathlib import Path

from snakemake_interface_executor_plugins.settings import DeploymentMethod

# The Snakefile imports npuforge from this checkout.
sys.path.insert(0, workflow.basedir)

# Step CLIs run under the interpreter that runs Snakemake (the .venv of setup.sh)
# and import npuforge from this checkout, whatever the calling shell's PATH; with
# --sdm conda the rule's conda environment provides python instead.
# Each rule sends its step's output to its log; descriptor 3 stays on the terminal, so a
# failed step's one-line error is the first thing the user reads (npuforge.cli).
_checkout = shlex.quote(workflow.basedir)
_errors = "exec 3>&2; export NPUFORGE_ERROR_FD=3; "
# onnxruntime's Linux wheels keep telemetry under ~/.cache and try to send it (every
# toolchain job has it off too); the hub client's requests would name the machine's torch
# and any coding agent it detects. Steps send neither.
from npuforge.jobs.job_stage import NO_TELEMETRY

_no_telemetry = "".join(
    f"export {k}={v}; "
    for k, v in {**NO_TELEMETRY, "HF_HUB_DISABLE_TELEMETRY": "1"}.items()
)
if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
    shell.prefix(
        f'{_errors}{_no_telemetry}export PYTHONPATH={_checkout}:"$PYTHONPATH"; '
    )
else:
    _bin = shlex.quote(str(Path(sys.executable).parent))
    shell.prefix(
        f"{_errors}{_no_telemetry}"
        f'export PATH={_bin}:"$PATH" PYTHONPATH={_checkout}:"$PYTHONPATH"; '
    )

from npuforge import memory_plan
from npuforge.memory import available_mb
from npuforge.calibration_formats import LAYOUT as CALIBRATION_LAYOUT
from npuforge.errors import NpuforgeError
from npuforge.fileio import files_digest
from npuforge.matrix import (
    REFERENCE_BACKEND,
    check_toolchains,
    choose_runtimes,
    make_plan,
    parse_selection,
)
from npuforge.provenance import check_models
from npuforge.registry import (
    build_options,
    check_configfiles,
    check_registries,
    load_registries,
    model_weights,
)
from npuforge.schema import validate
from npuforge.settings import check_calibration_text, hold_results, results_dir

MAIN_ENV = "../envs/main/environment.yaml"
SCHEMAS = f"{workflow.basedir}/config/schemas"
# Registries and configs that passed their schema (npuforge.schema.validate).
VALIDATED = ".snakemake/npuforge/validated"
# The main environment's pins: an input of the stages kept in Snakemake's output cache
# (export, calibrate), so another software stack never reuses their outputs.
MAIN_LOCK = "envs/main/requirements.lock"
# Shipped in every bundle as run.py: a change to it repackages every bundle.
BUNDLE_RUNNER = f"{workflow.basedir}/npuforge/bundle_runner.py"


def _stop(err):
    # A config, registry or selection error stops the run before any job, as one line
    # (SystemExit: no Snakemake traceback around it).
    print(f"npuforge: {err}", file=sys.stderr)
    sys.exit(1)


try:
    check_configfiles(workflow.overwrite_configfiles or [])
    validate(config, f"{SCHEMAS}/config.schema.yaml", "config", VALIDATED)
    RESULTS = results_dir(config["results"])
    MODELS, TARGETS = load_registries(config, workflow.basedir)
    validate(MODELS, f"{SCHEMAS}/models.schema.yaml", "models", VALIDATED)
    validate(TARGETS, f"{SCHEMAS}/targets.schema.yaml", "targets", VALIDATED)
    check_registries(MODELS, TARGETS)
    PLAN = make_plan(config, MODELS, TARGETS)
    RUNTIMES = {}
    if PLAN.vendor_targets():
        # Imported only when a vendor target is selected; the check itself is light.
        from npuforge.toolchain import CONTAINER_RUNTIMES, unavailable_reason

        RUNTIMES, _notes = choose_runtimes(
            PLAN, config["toolchain_runtime"], unavailable_reason, CONTAINER_RUNTIMES
        )
        for _note in _notes:
            print(f"npuforge: {_note}", file=sys.stderr)
        skip = parse_selection(config.get("target")) == ["all"]
        for _target, _reason in check_toolchains(
            PLAN, RUNTIMES, unavailable_reason, skip=skip
        ):
            print(f"npuforge: skipping target {_target}: {_reason}", file=sys.stderr)
except NpuforgeError as err:
    _stop(err)


# A local run starts no more jobs at once than the memory free now holds, by the mem_mb
# each job reserves (a compile's is its plan's): chunk jobs side by side on a many-core
# host would otherwise each take a budget. --resources mem_mb=N sets another total.
if workflow.local_exec and not any(
    name in workflow.global_resources for name in ("mem", "mem_mb", "mem_mib")
):
    _free_mb = available_mb()
    if _free_mb:
        workflow.global_resources["mem_mb"] = _free_mb


def lock_results():
    # Taken when jobs are about to start (onstart): dry runs and runs with nothing to do
    # never wait on another run.
    try:
        hold_results(RESULTS)
    except NpuforgeError as err:
        _stop(err)


wildcard_constraints:
    model=r"[^/]+",
    target=r"[^/]+",
    precision=r"[^/]+",
    key=r"[^/]+",
    tokenizer=r"[^/]+",
    backend=r"[a-z0-9]+",
    runtime=r"[a-z]+",
    chunk=r"\d+",


def as_json(data):
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def local_source_stamp(model):
    # A path source is keyed by its size and mtime too: the output cache keys exports by
    # the fetch job's params, and a file edited in place keeps its path.
    path = MODELS[model]["source"].get("path")
    if not path or not Path(path).exists():
        return ""
    stat = Path(path).stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def permuted_source(model):
    # The registry model a permuted twin is made from, else None.
    return MODELS[model]["source"].get("permuted", {}).get("model")


def fetched_path(model):
    # A permuted twin is made, not fetched: its directory stands where a fetch's would.
    if permuted_source(model):
        return f"{RESULTS}/models/{model}/permuted.hf"
    return f"{RESULTS}/models/{model}/checkpoint.{MODELS[model]['format']}"


def checkpoint_path(model):
    # What the stages read: a GGUF file is read through its dequantized directory.
    if MODELS[model]["format"] == "gguf":
        return f"{RESULTS}/models/{model}/dequantized.hf"
    return fetched_path(model)


def fetch_record(model):
    return fetched_path(model) + ".json"


def dequantize_record(model):
    # A twin of a GGUF model ships the record of the dequantization it was made from.
    base = permuted_source(model)
    if base:
        return dequantize_record(base)
    if MODELS[model]["format"] == "gguf":
        return f"{RESULTS}/models/{model}/dequantized.hf.json"
    return []


def pinned_models():
    # The models whose pins are checked before any job: those built and their twins' sources.
    built = PLAN.models_built()
    return sorted(
        set(built) | {permuted_source(m) for m in built if permuted_source(m)}
    )


def export_dir(model, key):
    return f"{RESULTS}/export/{model}/{key}"


def target_export_dirs(model, target, precision):
    return [
        export_dir(model, key) for key in PLAN.export_keys(model, target, precision)
    ]


def export_options_json(model, key):
    options = PLAN.export_options(model, key)
    for option in ("smoothquant", "gptq"):
        if option in options:
            # Its scales (roundings) come from the calibration text: name it, and an
            # edit re-exports.
            text = {
                "text": calibration_text(),
                "text_sha256": calibration_text_digest(),
            }
            options = dict(options, **{option: {**options[option], **text}})
    return as_json(options)


def export_mem_mb(model, key):
    return memory_plan.export_mem_mb(MODELS[model], PLAN.export_options(model, key))


def calibration_mem_mb(model, key):
    return memory_plan.calibration_mem_mb(
        MODELS[model], PLAN.export_options(model, key)
    )


def verify_mem_mb(model):
    return memory_plan.verify_mem_mb(MODELS[model])


def inspect_mem_mb(model):
    return memory_plan.inspect_mem_mb(MODELS[model])


def whole_model_mem_mb(model):
    return memory_plan.whole_model_mem_mb(MODELS[model])


def fetch_mem_mb(model):
    return memory_plan.fetch_mem_mb(MODELS[model])


def tokenizer_path(model):
    # None: the registry says the checkpoint has no tokenizer (the manifest records it).
    tokenizer = MODELS[model]["tokenizer"]
    if tokenizer == "none":
        return None
    if tokenizer == "hf":
        return f"{RESULTS}/tokenizer/hf/{model}/tokenizer.json"
    return f"{RESULTS}/tokenizer/{tokenizer}/tokenizer.bin"


def verify_report(model, key):
    return f"{RESULTS}/verify/{model}/{key}.json"


def calibration_text():
    # The project's own calibration texts unless the config names a file or directory.
    return config["calibration"].get("text") or "data/calibration/text"


def calibration_text_digest():
    # The texts' content as a params value: editing a text reruns the calibration (and
    # misses the output cache) without every text being an input file of every job.
    path = Path(calibration_text())
    if path.is_dir():
        root, files = path, sorted(path.rglob("*.txt"))
    else:
        root, files = path.parent, [path]
    return files_digest(root, [file for file in files if file.is_file()])


# Scans of the package's files by content, kept between runs (npuforge.import_graph).
CODE_GRAPH_CACHE = ".snakemake/npuforge/code_graph.json"


def step_code(script, **picks):
    # The code a job can run, as a params value: its step CLI, this rule file and the
    # package files the CLI reaches (npuforge/step_code.py). A code change reruns the
    # job and misses the output cache (--rerun-triggers mtime input opts out while
    # developing). A job reaches only its own backend (its target's) and model family
    # (its model's) by name; ``picks`` (values, or functions of the wildcards) say
    # what the wildcards do not: family=None, a job that runs no family's code.
    rule_file = workflow.included_stack[-1].get_path_or_uri(secret_free=True)

    def code(wildcards):
        found = {}
        if "target" in wildcards.keys():
            found["backend"] = TARGETS[wildcards.target]["backend"]
        if "backend" in wildcards.keys():
            found["backend"] = wildcards.backend
        if "model" in wildcards.keys():
            found["family"] = MODELS[wildcards.model]["family"]
        for kind, pick in picks.items():
            found[kind] = pick(wildcards) if callable(pick) else pick
        return step_code_digest(script, rule_file, tuple(sorted(found.items())))

    return code


def fetched_family(wildcards):
    # A download or a copy runs no family's code; a synthetic checkpoint is its family's.
    from npuforge.fetch import runs_family_code

    model = MODELS[wildcards.model]
    return model["family"] if runs_family_code(model["source"]) else None


@functools.cache
def code_graph():
    # Parsed once per run.
    from npuforge.import_graph import code_graph as read

    return read(workflow.basedir, CODE_GRAPH_CACHE)


@functools.cache
def step_code_digest(script, rule_file, picks):
    from npuforge.step_code import dispatch_choices, step_code_digest as digest

    return digest(
        Path(workflow.basedir) / "workflow_scripts" / f"{script}.py",
        code_graph(),
        rule_file=rule_file,
        choices=dispatch_choices(dict(picks)),
    )


def calibration_dir(model, key):
    return f"{RESULTS}/calibration/{model}/{key}"


def target_calibration_dirs(model, target, precision):
    # One per export (decode first, then prefill): each graph variant gets samples of its own runs.
    return [
        calibration_dir(model, key)
        for key in PLAN.export_keys(model, target, precision)
    ]


def toolchain_options(backend):
    # One environment per backend: the first selected target of it supplies the options
    # its toolchain reads (a native interpreter path), and only those.
    from npuforge.toolchain import toolchain_options as read_by_toolchain

    for target in PLAN.vendor_targets():
        if TARGETS[target]["backend"] == backend:
            return read_by_toolchain(backend, TARGETS[target]["options"])
    return {}


def toolchain_definition(backend):
    # The content hash of envs/<backend>/: an edited lock or Containerfile prepares the
    # toolchain again, and the compiles that read its stamp rerun on the new one.
    from npuforge.toolchain import env_hash

    return env_hash(backend, workflow.basedir)


def toolchain_stamp(target):
    backend = TARGETS[target]["backend"]
    return f"{RESULTS}/toolchains/{backend}-{RUNTIMES[target]}.json"


def compile_dir(model, target, precision):
    return f"{RESULTS}/compile/{model}/{target}/{precision}"


def chunk_build_dir(model, target, precision, chunk):
    return f"{RESULTS}/compile-chunks/{model}/{target}/{precision}/{chunk}"


def release_dir(model, target, precision):
    return f"{RESULTS}/release/{model}/{target}/{precision}"


def release_outputs():
    outputs = []
    for build in PLAN.builds:
        path = release_dir(build.model, build.target, build.precision)
        outputs += [f"{path}/manifest.json", f"{path}/SHA256SUMS", f"{path}.tar.gz"]
    return outputs


def release_manifests():
    return [
        f"{release_dir(b.model, b.target, b.precision)}/manifest.json"
        for b in PLAN.builds
    ]


def bench_outputs(wildcards):
    # Evaluated while the DAG is built, so a missing adb or device stops the run
    # before any job (build or benchmark) starts.
    from npuforge.bench import device_problem

    problem = device_problem(config.get("device"))
    if problem:
        _stop(problem)
    return [
        f"{RESULTS}/bench/{b.model}/{b.target}/{b.precision}.json" for b in PLAN.builds
    ]


def heldout_path(model):
    return f"{RESULTS}/heldout/{model}.json"


def heldout_inputs(wildcards):
    # The family's tokenizer reads the checkpoint where the model ships its own.
    return {
        "text": "data/calibration/heldout.txt",
        "checkpoint": checkpoint_path(wildcards.model),
    }


def compile_inputs(wildcards):
    # The chunks built by jobs of their own, where the backend compiles chunk by chunk.
    model, target, precision = wildcards.model, wildcards.target, wildcards.precision
    chunks = PLAN.chunk_jobs(model, target, precision)
    built = [chunk_build_dir(model, target, precision, chunk) for chunk in chunks]
    return {**chunk_inputs(wildcards), "chunks": built}


def chunk_inputs(wildcards):
    backend = TARGETS[wildcards.target]["backend"]
    inputs = {
        "exports": target_export_dirs(
            wildcards.model, wildcards.target, wildcards.precision
        ),
        "heldout": heldout_path(wildcards.model),
        # The same graphs before rounding at export: what the simulator's figures gate on.
        "references": [
            export_dir(wildcards.model, key)
            for key in PLAN.reference_keys(
                wildcards.model, wildcards.target, wildcards.precision
            )
        ],
    }
    if PLAN.needs_calibration(wildcards.target, wildcards.precision):
        inputs["calibration"] = target_calibration_dirs(
            wildcards.model, wildcards.target, wildcards.precision
        )
    if backend == REFERENCE_BACKEND:
        # The reference target checks its graphs against the checkpoint itself.
        inputs["checkpoint"] = checkpoint_path(wildcards.model)
    else:
        inputs["toolchain"] = toolchain_stamp(wildcards.target)
    return inputs


def compile_options(wildcards):
    # Only wildcards here: Snakemake's params rerun trigger ignores params derived from
    # input or output, so every option that changes the binary must be in this one.
    options = build_options(MODELS[wildcards.model], TARGETS[wildcards.target])
    args = ["--target", wildcards.target]
    args += ["--target-options", as_json(options)]
    args += ["--precision", wildcards.precision]
    args += ["--weights", model_weights(MODELS[wildcards.model])]
    return shlex.join(args)


def compile_paths(wildcards, input):
    # One params callable per kind: Snakemake inspects the signature of every callable
    # of every job, which is most of the planning time of a big release matrix.
    args = ["--backend", TARGETS[wildcards.target]["backend"]]
    for export in input.exports:
        args += ["--export", export]
    for calibration in input.get("calibration", []):
        args += ["--calibration", calibration]
    for reference in input.references:
        args += ["--reference-export", reference]
    if "toolchain" in input.keys():
        args += ["--toolchain", input.toolchain]
    if "checkpoint" in input.keys():
        args += ["--checkpoint", input.checkpoint]
    for built in input.get("chunks", []):
        args += ["--chunk-build", built]
    args += ["--heldout", input.heldout]
    return shlex.join(args)


def package_inputs(wildcards):
    model, target, precision = wildcards.model, wildcards.target, wildcards.precision
    exports = target_export_dirs(model, target, precision)
    return {
        "compiled": compile_dir(model, target, wildcards.precision),
        "exports": exports,
        "verify": [
            verify_report(model, key)
            for key in PLAN.export_keys(model, target, precision)
        ],
        "tokenizer": tokenizer_path(model) or [],
        "fetch_record": fetch_record(model),
        "dequantize_record": dequantize_record(model),
        "runner": BUNDLE_RUNNER,
    }


def package_options(wildcards):
    # Wildcards only, so that a changed registry entry reruns packaging (see compile_options).
    model, target = wildcards.model, wildcards.target
    args = ["--model", model, "--model-entry", as_json(MODELS[model])]
    args += ["--target", target, "--target-entry", as_json(TARGETS[target])]
    args += ["--precision", wildcards.precision]
    return shlex.join(args)


def package_paths(wildcards, input, output):
    args = ["--compiled", input.compiled]
    for export in input.exports:
        args += ["--export", export]
    for report in input.verify:
        args += ["--export-verification", report]
    args += ["--tokenizer", input.tokenizer] if input.tokenizer else ["--no-tokenizer"]
    args += ["--fetch-record", input.fetch_record]
    if input.dequantize_record:
        args += ["--dequantize-record", input.dequantize_record]
    args += ["--out-dir", str(Path(output.manifest).parent)]
    args += ["--tarball", output.tarball]
    return shlex.join(args)


# Before any job: pinned inputs still match their pins (sources and fetched copies),
# and the calibration text exists.
try:
    check_models(
        MODELS, {m: (fetched_path(m), fetch_record(m)) for m in pinned_models()}
    )
    if PLAN.needs_any_calibration():
        check_calibration_text(calibration_text())
except NpuforgeError as err:
    _stop(err)
