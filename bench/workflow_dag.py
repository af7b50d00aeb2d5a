"""Planning speed: npuforge's dry run against bare Snakemake workflows of the same jobs.

    python bench/workflow_dag.py [--models 1 10 50] [--targets 12] [--repeat 3]
                                  [--no-rerun] [--calls]

Synthetic models and rknn targets are added to copies of the registries, so no toolchain
is needed (a dry run only asks rknn's cheap availability check); each target gets its
own export options so exports are not shared (the worst case for the DAG size), and
three precisions, two calibrated. The bench writes two bare Snakemake workflows with the
same jobs (fetch, inspect, tokenizer, heldout, export, verify, calibrate, toolchain,
compile, package, index, report) and times the three dry runs side by side (one of
each in turn, --repeat times; the best of each is kept):

  minimal bare      each job a trivial shell rule with its inputs and outputs and nothing
                    else: no log, benchmark, conda, threads, resources or params. The
                    issue's figure: npuforge / minimal bare <= 1.25 at 50 models.
  directives bare   the same jobs written the way npuforge's rules are: every rule of
                    rules/*.smk with its directives (log, benchmark, conda, cache,
                    threads, resources, params, named and report() outputs), the same
                    number of callables per rule (trivial lambdas) and of static values,
                    the same inputs per job, the same targets of rule all (every bundle
                    file and the report), paths of the same shape under an absolute
                    results directory; still trivial shell jobs (a touch: npuforge's
                    longer command lines, formatted by Snakemake, count against it).
                    npuforge / directives bare is what npuforge's own code (Snakefile,
                    rules' functions, the library) costs over what Snakemake charges for
                    the directives.

Both ratios are printed, plainly labelled; neither replaces the other.
Last, it builds the default matrix in a scratch copy and times the no-op rerun.
--calls adds the Python function calls of one profiled dry run of each: unlike seconds,
they do not move with the machine's load, so a busy machine can still compare them.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# An RK3588-like target (rknn's toolchain check is cheap and passes on any Linux x86_64
# with Python 3.11, so the dry run plans the vendor path: toolchain stamp, calibration).
PRECISIONS = {"fp16": {}, "w8a8": {"calibrate": True}, "w16a16i_dfp": {"calibrate": True}}
CALIBRATED = [p for p, spec in PRECISIONS.items() if spec.get("calibrate")]
WORKFLOW_PARTS = ("Snakefile", "config", "rules", "profiles", "envs", "workflow_scripts",
                  "npuforge", "data", "report")  # fmt: skip


def extra_config(n_models: int, n_targets: int) -> dict:
    models, targets = {}, {}
    for i in range(n_models):
        models[f"bench-m{i}"] = {
            "family": "rwkv",
            "version": 7,
            "source": {
                "synthetic": {
                    "version": 7,
                    "layers": 2,
                    "embed": 64,
                    "vocab": 256,
                    "head_size": 32,
                    "seed": i,
                }
            },  # fmt: skip
            "format": "pth",
            "context_length": 1024,
            "tokenizer": "rwkv-world",
            "arch": {"layers": 2, "embed": 64, "vocab": 256},
        }
    for j in range(n_targets):
        targets[f"bench-t{j}"] = {
            "backend": "rknn",
            "options": {"target_platform": "rk3588", "verify_steps": 8},
            "precisions": PRECISIONS,
            "default_precisions": list(PRECISIONS),
            "export": {"variants": ["decode"], "dtype": "fp32", "batch": j + 1, "chunks": 1},
        }
    return {"models": models, "targets": targets}


def write_registries(root: Path, n_models: int, n_targets: int) -> list[str]:
    """The project's registries with the synthetic entries added, as a release registers
    its models and SoCs (a YAML edit); returns the --config items that select them."""
    root.mkdir(parents=True, exist_ok=True)
    extra = extra_config(n_models, n_targets)
    items = []
    for kind in ("models", "targets"):
        registry = yaml.safe_load((REPO / "config" / f"{kind}.yaml").read_text())
        registry.update(extra[kind])
        path = root / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(registry, sort_keys=False))
        items.append(f"{kind}_registry={path}")
    return items


BARE_SNAKEFILE = """\
MODELS = config["models"]
TARGETS = config["targets"]
PRECISIONS = config["precisions"]
CALIBRATED = config["calibrated"]


wildcard_constraints:
    model=r"[^/]+",
    target=r"[^/]+",
    precision=r"[^/]+",
    key=r"[^/]+",


def export_key(target):
    return "k-" + target


def compile_inputs(wildcards):
    key = export_key(wildcards.target)
    inputs = {
        "export": f"export/{wildcards.model}/{key}",
        "heldout": f"heldout/{wildcards.model}.json",
        "toolchain": "toolchains/rknn-native.json",
    }
    if wildcards.precision in CALIBRATED:
        inputs["calibration"] = f"calibration/{wildcards.model}/{key}"
    return inputs


def package_inputs(wildcards):
    key = export_key(wildcards.target)
    return {
        "compiled": f"compile/{wildcards.model}/{wildcards.target}/{wildcards.precision}",
        "export": f"export/{wildcards.model}/{key}",
        "verify": f"verify/{wildcards.model}/{key}.json",
        "tokenizer": "tokenizer/rwkv-world/tokenizer.bin",
        "record": f"models/{wildcards.model}/checkpoint.pth.json",
    }


MANIFESTS = [
    f"release/{m}/{t}/{p}/manifest.json" for m in MODELS for t in TARGETS for p in PRECISIONS
]


rule all:
    input:
        "report/bundles.html",


rule fetch:
    output:
        checkpoint="models/{model}/checkpoint.pth",
        record="models/{model}/checkpoint.pth.json",
    shell:
        "touch {output}"


rule inspect:
    input:
        "models/{model}/checkpoint.pth",
    output:
        "models/{model}/inspect.json",
    shell:
        "touch {output}"


rule toolchain:
    output:
        "toolchains/rknn-native.json",
    shell:
        "touch {output}"


rule tokenizer:
    output:
        "tokenizer/rwkv-world/tokenizer.bin",
    shell:
        "touch {output}"


rule heldout:
    input:
        "models/{model}/checkpoint.pth",
    output:
        "heldout/{model}.json",
    shell:
        "touch {output}"


rule export:
    input:
        "models/{model}/checkpoint.pth",
        "models/{model}/inspect.json",
    output:
        directory("export/{model}/{key}"),
    shell:
        "mkdir -p {output}"


rule verify:
    input:
        "models/{model}/checkpoint.pth",
        "export/{model}/{key}",
    output:
        "verify/{model}/{key}.json",
    shell:
        "touch {output}"


rule calibrate:
    input:
        "export/{model}/{key}",
        "models/{model}/checkpoint.pth",
    output:
        directory("calibration/{model}/{key}"),
    shell:
        "mkdir -p {output}"


rule compile:
    input:
        unpack(compile_inputs),
    output:
        directory("compile/{model}/{target}/{precision}"),
    shell:
        "mkdir -p {output}"


rule package:
    input:
        unpack(package_inputs),
    output:
        manifest="release/{model}/{target}/{precision}/manifest.json",
        sums="release/{model}/{target}/{precision}/SHA256SUMS",
        tarball="release/{model}/{target}/{precision}.tar.gz",
    shell:
        "touch {output}"


rule index:
    input:
        MANIFESTS,
    output:
        "release/index.json",
    shell:
        "touch {output}"


rule report:
    input:
        "release/index.json",
    output:
        "report/bundles.html",
    shell:
        "touch {output}"
"""


# The same jobs as BARE_SNAKEFILE, written the way npuforge's rules are: every rule of
# rules/*.smk (those no job of this matrix uses too), each with its directives (log,
# benchmark, conda, cache, threads, resources, params, named and report() outputs,
# wildcard_constraints, localrules) and its count of callables, the same inputs per job
# and the same path shape under an absolute results directory (a params callable for
# each step's code digest, as npuforge's rules have). Values are static or
# trivial lambdas and every shell command is a touch: what Snakemake itself charges for
# the directives, with no npuforge code in it.
BARE_DIRECTIVES_SNAKEFILE = """\
R = config["results"]
MODELS = config["models"]
TARGETS = config["targets"]
PRECISIONS = config["precisions"]
CALIBRATED = config["calibrated"]
ENV = "envs/main/environment.yaml"
LOCK = "envs/main/requirements.lock"
RUNNER = "runner.py"


localrules:
    fetch,
    fetch_tree,
    bench,
    bench_device,


wildcard_constraints:
    model=r"[^/]+",
    target=r"[^/]+",
    precision=r"[^/]+",
    key=r"[^/]+",
    tokenizer=r"[^/]+",
    backend=r"[a-z0-9]+",
    runtime=r"[a-z]+",


def checkpoint(model):
    return f"{R}/models/{model}/checkpoint.pth"


def export_key(target):
    return "k-" + target


def heldout_inputs(wildcards):
    return {"text": "heldout.txt", "checkpoint": checkpoint(wildcards.model)}


def compile_inputs(wildcards):
    key = export_key(wildcards.target)
    inputs = {
        "exports": [f"{R}/export/{wildcards.model}/{key}"],
        "heldout": f"{R}/heldout/{wildcards.model}.json",
    }
    if wildcards.precision in CALIBRATED:
        inputs["calibration"] = [f"{R}/calibration/{wildcards.model}/{key}"]
    inputs["toolchain"] = f"{R}/toolchains/rknn-native.json"
    return inputs


def compile_options(wildcards):
    return "--target " + wildcards.target


def compile_paths(wildcards, input):
    return "--heldout " + input.heldout


def package_inputs(wildcards):
    key = export_key(wildcards.target)
    return {
        "compiled": f"{R}/compile/{wildcards.model}/{wildcards.target}/{wildcards.precision}",
        "exports": [f"{R}/export/{wildcards.model}/{key}"],
        "verify": [f"{R}/verify/{wildcards.model}/{key}.json"],
        "tokenizer": f"{R}/tokenizer/rwkv-world/tokenizer.bin",
        "fetch_record": checkpoint(wildcards.model) + ".json",
        "dequantize_record": [],
        "runner": RUNNER,
    }


def package_options(wildcards):
    return "--model " + wildcards.model


def package_paths(wildcards, input, output):
    return "--tarball " + output.tarball


def bench_outputs(wildcards):
    return []


BUILDS = [(m, t, p) for m in MODELS for t in TARGETS for p in PRECISIONS]


rule all:
    default_target: True
    input:
        [f"{R}/release/{m}/{t}/{p}/manifest.json" for m, t, p in BUILDS],
        [f"{R}/release/{m}/{t}/{p}/SHA256SUMS" for m, t, p in BUILDS],
        [f"{R}/release/{m}/{t}/{p}.tar.gz" for m, t, p in BUILDS],
        f"{R}/report/bundles.html",
        f"{R}/report/fidelity.png",
        f"{R}/report/size.png",


rule fetch:
    output:
        checkpoint=f"{R}/models/{{model}}/checkpoint.{{fmt}}",
        record=f"{R}/models/{{model}}/checkpoint.{{fmt}}.json",
    log:
        f"{R}/logs/fetch/{{model}}.{{fmt}}.log",
    benchmark:
        f"{R}/benchmarks/fetch/{{model}}.{{fmt}}.tsv"
    wildcard_constraints:
        fmt="pth|safetensors|gguf",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
    params:
        code=lambda w: "c",
        source=lambda w: "s-" + w.model,
        source_stamp=lambda w: "",
        sha256=lambda w: "",
        family=lambda w: "rwkv",
    shell:
        "touch {output} > {log} 2>&1"


rule fetch_tree:
    output:
        checkpoint=directory(f"{R}/models/{{model}}/checkpoint.hf"),
        record=f"{R}/models/{{model}}/checkpoint.hf.json",
    log:
        f"{R}/logs/fetch/{{model}}.hf.log",
    benchmark:
        f"{R}/benchmarks/fetch/{{model}}.hf.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=2000,
    params:
        code=lambda w: "c",
        source=lambda w: "s-" + w.model,
        source_stamp=lambda w: "",
        sha256=lambda w: "",
        family=lambda w: "rwkv",
    shell:
        "mkdir -p {output.checkpoint} && touch {output.record} > {log} 2>&1"


rule dequantize:
    input:
        f"{R}/models/{{model}}/checkpoint.gguf",
    output:
        checkpoint=directory(f"{R}/models/{{model}}/dequantized.hf"),
        record=f"{R}/models/{{model}}/dequantized.hf.json",
    log:
        f"{R}/logs/dequantize/{{model}}.log",
    benchmark:
        f"{R}/benchmarks/dequantize/{{model}}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=lambda w: 1000,
    params:
        code=lambda w: "c",
    shell:
        "mkdir -p {output.checkpoint} && touch {output.record} > {log} 2>&1"


rule inspect:
    input:
        checkpoint=lambda w: checkpoint(w.model),
    output:
        f"{R}/models/{{model}}/inspect.json",
    log:
        f"{R}/logs/inspect/{{model}}.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=lambda w: 1000,
    params:
        code=lambda w: "c",
        arch=lambda w: "{}",
        family=lambda w: "rwkv",
    shell:
        "touch {output} > {log} 2>&1"


rule prepare_toolchain:
    output:
        f"{R}/toolchains/{{backend}}-{{runtime}}.json",
    log:
        step=f"{R}/logs/toolchains/{{backend}}-{{runtime}}.log",
        build=f"{R}/logs/toolchains/{{backend}}-{{runtime}}.build.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=lambda w: "c",
        options=lambda w: "{}",
        definition=lambda w: "d-" + w.backend,
    shell:
        "touch {output} > {log.step} 2>&1"


rule tokenizer:
    output:
        f"{R}/tokenizer/{{tokenizer}}/tokenizer.bin",
    log:
        f"{R}/logs/tokenizer/{{tokenizer}}.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=lambda w: "c",
    shell:
        "touch {output} > {log} 2>&1"


rule tokenizer_hf:
    input:
        checkpoint=lambda w: checkpoint(w.model),
    output:
        f"{R}/tokenizer/hf/{{model}}/tokenizer.json",
    log:
        f"{R}/logs/tokenizer/hf/{{model}}.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=lambda w: "c",
    shell:
        "touch {output} > {log} 2>&1"


rule heldout:
    input:
        unpack(heldout_inputs),
    output:
        f"{R}/heldout/{{model}}.json",
    log:
        f"{R}/logs/heldout/{{model}}.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=lambda w: "c",
        family=lambda w: "rwkv",
        vocab=lambda w: 256,
    shell:
        "touch {output} > {log} 2>&1"


rule export:
    input:
        checkpoint=lambda w: checkpoint(w.model),
        inspect=f"{R}/models/{{model}}/inspect.json",
        software=LOCK,
    output:
        directory(f"{R}/export/{{model}}/{{key}}"),
    log:
        f"{R}/logs/export/{{model}}/{{key}}.log",
    cache: True
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=lambda w: 1000,
    params:
        code=lambda w: "c",
        options=lambda w: "o-" + w.key,
    shell:
        "mkdir -p {output} > {log} 2>&1"


rule verify_onnx:
    input:
        checkpoint=lambda w: checkpoint(w.model),
        exports=lambda w: [f"{R}/export/{w.model}/{w.key}"],
    output:
        f"{R}/verify/{{model}}/{{key}}.json",
    log:
        f"{R}/logs/verify/{{model}}/{{key}}.log",
    benchmark:
        f"{R}/benchmarks/verify/{{model}}/{{key}}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=lambda w: 1000,
    params:
        code=lambda w: "c",
        tokens=16,
        exports=lambda w, input: "--export " + input.exports[0],
    shell:
        "touch {output} > {log} 2>&1"


rule calibrate:
    input:
        export=f"{R}/export/{{model}}/{{key}}",
        checkpoint=lambda w: checkpoint(w.model),
        software=LOCK,
    output:
        directory(f"{R}/calibration/{{model}}/{{key}}"),
    log:
        f"{R}/logs/calibrate/{{model}}/{{key}}.log",
    cache: True
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=lambda w: 1000,
    params:
        code=lambda w: "c",
        samples=lambda w: 8,
        steps=4,
        seed=0,
        text="text",
        texts="digest",
    shell:
        "mkdir -p {output} > {log} 2>&1"


rule compile:
    input:
        unpack(compile_inputs),
    output:
        directory(f"{R}/compile/{{model}}/{{target}}/{{precision}}"),
    log:
        f"{R}/logs/compile/{{model}}/{{target}}/{{precision}}.log",
    benchmark:
        f"{R}/benchmarks/compile/{{model}}/{{target}}/{{precision}}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=lambda w: 4000,
    params:
        code=lambda w: "c",
        options=compile_options,
        paths=compile_paths,
    shell:
        "mkdir -p {output} > {log} 2>&1"


rule package:
    input:
        unpack(package_inputs),
    output:
        manifest=f"{R}/release/{{model}}/{{target}}/{{precision}}/manifest.json",
        sums=f"{R}/release/{{model}}/{{target}}/{{precision}}/SHA256SUMS",
        tarball=f"{R}/release/{{model}}/{{target}}/{{precision}}.tar.gz",
    log:
        f"{R}/logs/package/{{model}}/{{target}}/{{precision}}.log",
    benchmark:
        f"{R}/benchmarks/package/{{model}}/{{target}}/{{precision}}.tsv"
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=lambda w: "c",
        options=package_options,
        paths=package_paths,
    shell:
        "touch {output} > {log} 2>&1"


rule release_index:
    input:
        manifests=[f"{R}/release/{m}/{t}/{p}/manifest.json" for m, t, p in BUILDS],
    output:
        f"{R}/release/index.json",
    log:
        f"{R}/logs/release/index.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=500,
    params:
        code=lambda w: "c",
        release=lambda w, output: output[0],
    shell:
        "touch {output} > {log} 2>&1"


rule release_report:
    input:
        f"{R}/release/index.json",
    output:
        table=report(
            f"{R}/report/bundles.html",
            category="Release",
            caption="caption.rst",
            labels={"figure": "bundles"},
        ),
        fidelity=report(
            f"{R}/report/fidelity.png",
            category="Release",
            caption="caption.rst",
            labels={"figure": "fidelity"},
        ),
        size=report(
            f"{R}/report/size.png",
            category="Release",
            caption="caption.rst",
            labels={"figure": "binary size"},
        ),
    log:
        f"{R}/logs/release/report.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=lambda w: "c",
        benchmarks=f"{R}/benchmarks",
    shell:
        "touch {output} > {log} 2>&1"


rule bench:
    input:
        manifest=f"{R}/release/{{model}}/{{target}}/{{precision}}/manifest.json",
        sums=f"{R}/release/{{model}}/{{target}}/{{precision}}/SHA256SUMS",
    output:
        f"{R}/bench/{{model}}/{{target}}/{{precision}}.json",
    log:
        f"{R}/logs/bench/{{model}}/{{target}}/{{precision}}.log",
    conda:
        ENV
    threads: 1
    resources:
        mem_mb=500,
        adb_device=1,
    params:
        code=lambda w: "c",
        device="",
        prompt="p",
        max_new_tokens=8,
        python="python3",
        root="/tmp",
    shell:
        "touch {output} > {log} 2>&1"


rule bench_device:
    input:
        bench_outputs,
"""


def write_bare_workflow(root: Path, n_models: int, n_targets: int, directives: bool) -> Path:
    """The minimal bare workflow, or with ``directives`` the one with npuforge's
    directives (and the small source files its jobs read, results under ``root``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "Snakefile").write_text(BARE_DIRECTIVES_SNAKEFILE if directives else BARE_SNAKEFILE)
    config = {
        "models": [f"bench-m{i}" for i in range(n_models)],
        "targets": [f"bench-t{j}" for j in range(n_targets)],
        "precisions": list(PRECISIONS),
        "calibrated": CALIBRATED,
    }
    if directives:
        config["results"] = str(root / "results")
        (root / "envs" / "main").mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / "envs" / "main" / "environment.yaml", root / "envs" / "main")
        for source in ("envs/main/requirements.lock", "runner.py", "heldout.txt", "caption.rst"):
            (root / source).write_text("bench\n")
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def timed(cmd, cwd) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{result.stderr[-3000:]}")
    return elapsed, result.stdout + result.stderr


def total_jobs(output: str) -> int:
    return int(re.search(r"^total\s+(\d+)", output, re.M).group(1))


def python_calls(cmd, cwd, scratch: Path) -> int:
    """Function calls of one dry run under cProfile (cmd starts with the interpreter)."""
    import pstats

    profile = scratch / "dry-run.prof"
    timed([cmd[0], "-m", "cProfile", "-o", str(profile), *cmd[1:]], cwd)
    return pstats.Stats(str(profile)).total_calls


def side_by_side(repeat, runs: dict) -> dict:
    """Best seconds and job count of each ``name: (cmd, cwd)``, the runs taken in turn
    (one of each, ``repeat`` times): a change of the machine's load falls on all of them."""
    best, jobs = {}, {}
    for _ in range(repeat):
        for name, (cmd, cwd) in runs.items():
            elapsed, output = timed(cmd, cwd)
            best[name] = min(elapsed, best.get(name, elapsed))
            jobs.setdefault(name, total_jobs(output))
    return {name: (best[name], jobs[name]) for name in runs}


def noop_rerun_seconds(tmp: Path, repeat: int) -> float:
    """Build the default matrix in a scratch copy, then time the rerun that has nothing to do."""
    copy = tmp / "default"
    copy.mkdir()
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, copy / part)
    snakemake = [sys.executable, "-m", "snakemake", "--cores", "2"]
    print("building the default matrix for the no-op rerun (about a minute)", flush=True)
    timed(snakemake, copy)
    times = []
    for _ in range(repeat):
        elapsed, output = timed(snakemake, copy)
        if "Nothing to be done" not in output:
            sys.exit(f"the rerun of the default matrix was not a no-op:\n{output[-3000:]}")
        times.append(elapsed)
    return min(times)


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--targets", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best is kept)")
    parser.add_argument("--no-rerun", action="store_true", help="skip the no-op rerun figure")
    parser.add_argument(
        "--calls", action="store_true", help="also count function calls (load-independent)"
    )
    args = parser.parse_args()
    targets = ",".join(f"bench-t{j}" for j in range(args.targets))
    print(
        f"dry runs, best of {args.repeat}, {args.targets} targets x {len(PRECISIONS)} "
        f"precisions ({load()})\n"
        "  minimal bare: the same jobs as trivial shell rules, no log/benchmark/conda/"
        "threads/resources/params (the issue's target: ratio <= 1.25 at 50 models)\n"
        "  directives bare: the same jobs and rules with npuforge's directives, static or "
        "trivial-lambda values (what Snakemake charges for the directives themselves)"
    )
    print(
        f"{'models':>6} {'jobs':>6} {'npuforge s':>10} {'minimal bare s':>14} {'ratio':>6} "
        f"{'directives bare s':>17} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory(prefix="npuforge-dag-") as tmp:
        tmp = Path(tmp)
        for n_models in args.models:
            models = ",".join(f"bench-m{i}" for i in range(n_models))
            registries = write_registries(tmp / f"registry-{n_models}", n_models, args.targets)
            ours = [
                sys.executable, "-m", "snakemake", "--dry-run", "--cores", "1",
                "--config", f"model={models}", f"target={targets}", *registries,
                "results=" + str(tmp / "results"),
                # The bare workflows' jobs use native stamps; auto would add one container
                # engine probe (`podman info`, 0.1-0.7 s) per run.
                "toolchain_runtime=native",
            ]  # fmt: skip
            bare = [sys.executable, "-m", "snakemake", "--dry-run", "--cores", "1",
                    "--configfile", "config.yaml"]  # fmt: skip
            bares = {
                "minimal": write_bare_workflow(
                    tmp / f"bare-{n_models}", n_models, args.targets, directives=False
                ),
                "directives": write_bare_workflow(
                    tmp / f"directives-{n_models}", n_models, args.targets, directives=True
                ),
            }
            runs = {"npuforge": (ours, REPO), **{name: (bare, d) for name, d in bares.items()}}
            figures = side_by_side(args.repeat, runs)
            seconds, jobs = figures["npuforge"]
            for name in bares:
                if figures[name][1] != jobs:
                    sys.exit(
                        f"the {name} bare workflow planned {figures[name][1]} jobs, npuforge {jobs}"
                    )
            minimal, directives = figures["minimal"][0], figures["directives"][0]
            print(
                f"{n_models:>6} {jobs:>6} {seconds:>10.2f} {minimal:>14.2f} "
                f"{seconds / minimal:>6.2f} {directives:>17.2f} {seconds / directives:>6.2f}",
                flush=True,
            )
            if args.calls:
                calls = python_calls(ours, REPO, tmp)
                bare_calls = {name: python_calls(bare, d, tmp) for name, d in bares.items()}
                minimal, directives = bare_calls["minimal"], bare_calls["directives"]
                print(
                    f"{'':>6} function calls (M): npuforge {calls / 1e6:.2f}, minimal bare "
                    f"{minimal / 1e6:.2f} (ratio {calls / minimal:.2f}), directives bare "
                    f"{directives / 1e6:.2f} (ratio {calls / directives:.2f})",
                    flush=True,
                )
        print(f"({load()})")
        if not args.no_rerun:
            print(
                f"no-op rerun of the default matrix: {noop_rerun_seconds(tmp, args.repeat):.2f} s"
            )


if __name__ == "__main__":
    main()
