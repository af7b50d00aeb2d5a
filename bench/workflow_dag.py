"""Planning speed: npuforge's dry run against a bare Snakemake workflow of the same jobs.

    python bench/workflow_dag.py [--models 1 10 50] [--targets 12] [--repeat 3]
                                  [--no-rerun] [--calls]

Synthetic models and rknn targets are added to copies of the registries, so no toolchain
is needed (a dry run only asks rknn's cheap availability check); each target gets its
own export options so exports are not shared (the worst case for the DAG size), and
three precisions, two calibrated. The
bench writes a bare Snakemake workflow with the same job shape (fetch, inspect,
tokenizer, heldout, export, verify, calibrate, toolchain, compile, package, index, report; each a
trivial shell job) and times both dry runs in the same process, best of --repeat.
Last, it builds the default matrix in a scratch copy and times the no-op rerun.
--calls adds the Python function calls of one profiled dry run of each: unlike seconds,
they do not move with the machine's load, so a busy machine can still compare the two.
"""

import argparse
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


def write_bare_workflow(root: Path, n_models: int, n_targets: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Snakefile").write_text(BARE_SNAKEFILE)
    config = {
        "models": [f"bench-m{i}" for i in range(n_models)],
        "targets": [f"bench-t{j}" for j in range(n_targets)],
        "precisions": list(PRECISIONS),
        "calibrated": CALIBRATED,
    }
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


def best_of(repeat, cmd, cwd) -> tuple[float, int]:
    runs = [timed(cmd, cwd) for _ in range(repeat)]
    return min(t for t, _ in runs), total_jobs(runs[0][1])


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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--targets", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best is kept)")
    parser.add_argument("--no-rerun", action="store_true", help="skip the no-op rerun figure")
    parser.add_argument(
        "--calls", action="store_true", help="also count function calls (load-independent)"
    )
    args = parser.parse_args()
    targets = ",".join(f"bench-t{j}" for j in range(args.targets))
    print(f"dry runs, best of {args.repeat}, {args.targets} targets x {len(PRECISIONS)} precisions")
    print(
        f"{'models':>6} {'jobs':>6} {'npuforge s':>10} {'bare jobs':>9} {'bare s':>7} {'ratio':>6}"
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
                # The bare workflow's jobs use native stamps; auto would add one container
                # engine probe (`podman info`, 0.1-0.7 s) per run.
                "toolchain_runtime=native",
            ]  # fmt: skip
            bare_dir = write_bare_workflow(tmp / f"bare-{n_models}", n_models, args.targets)
            bare = [sys.executable, "-m", "snakemake", "--dry-run", "--cores", "1",
                    "--configfile", "config.yaml"]  # fmt: skip
            seconds, jobs = best_of(args.repeat, ours, REPO)
            bare_seconds, bare_jobs = best_of(args.repeat, bare, bare_dir)
            print(
                f"{n_models:>6} {jobs:>6} {seconds:>10.2f} {bare_jobs:>9} {bare_seconds:>7.2f} "
                f"{seconds / bare_seconds:>6.2f}",
                flush=True,
            )
            if args.calls:
                calls = python_calls(ours, REPO, tmp)
                bare_calls = python_calls(bare, bare_dir, tmp)
                print(
                    f"{'':>6} function calls: npuforge {calls / 1e6:.1f} M, bare "
                    f"{bare_calls / 1e6:.1f} M, ratio {calls / bare_calls:.2f}",
                    flush=True,
                )
        if not args.no_rerun:
            print(
                f"no-op rerun of the default matrix: {noop_rerun_seconds(tmp, args.repeat):.2f} s"
            )


if __name__ == "__main__":
    main()
