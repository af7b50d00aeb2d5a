"""Time the workflow's parse + DAG build for growing matrices (dry runs, nothing built).

    python bench/workflow_dag.py [--models 1 4 16] [--targets 4]

Synthetic models and reference-backend targets are added through --configfile,
so no vendor toolchain is needed; each target gets its own export options so
exports are not shared (the worst case for the DAG size).
"""

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


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
            "backend": "onnx",
            "options": {"verify_steps": 8},
            "precisions": {"fp32": {}},
            "default_precisions": ["fp32"],
            "export": {"variants": ["decode"], "dtype": "fp32", "batch": j + 1, "chunks": 1},
        }
    return {"models": models, "targets": targets}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--targets", type=int, default=4)
    args = parser.parse_args()
    print(f"{'models':>6} {'targets':>7} {'jobs':>6} {'seconds':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n_models in args.models:
            extra = Path(tmp) / f"extra-{n_models}.yaml"
            extra.write_text(yaml.safe_dump(extra_config(n_models, args.targets)))
            cmd = [
                sys.executable, "-m", "snakemake", "--dry-run", "--cores", "1",
                "--configfile", str(extra), "--config", "model=all",
                "target=" + ",".join(f"bench-t{j}" for j in range(args.targets)),
                "results=" + str(Path(tmp) / "results"),
            ]  # fmt: skip
            start = time.perf_counter()
            result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            elapsed = time.perf_counter() - start
            if result.returncode != 0:
                sys.exit(result.stderr[-2000:])
            jobs = re.search(r"^total\s+(\d+)", result.stdout, re.M).group(1)
            print(f"{n_models:>6} {args.targets:>7} {jobs:>6} {elapsed:>8.2f}")


if __name__ == "__main__":
    main()
