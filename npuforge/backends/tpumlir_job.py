"""Run a TPU-MLIR compile job inside the toolchain environment.

    python tpumlir_job.py <spec.json>

The spec (written by npuforge.backends.tpumlir.build_spec) lists the TPU-MLIR
command lines in order, each with its working directory and the files it must
produce. This script runs them, keeps each tool's output in <work_dir>/logs/,
parses the similarity figures TPU-MLIR prints when it compares tensors, and
writes the result JSON. Standard library only (plus the vendor tools it runs):
it never imports npuforge.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

# npz_tool's per-tensor line: "[name   ]      SIMILAR [PASSED]".
_TENSOR_LINE = re.compile(
    r"^\[(?P<name>.+?)\s*\]\s+(?P<result>[A-Z_]+)\s+\[\s*(?P<ok>PASSED|FAILED)\]"
)
_FIGURE_LINE = re.compile(
    r"^\s+(?P<key>cosine|euclidean|sqnr)_similarity\s+=\s+(?P<value>[-+0-9.eE]+|nan|inf)"
)
_VERDICT_LINE = re.compile(r"npz compare (?P<ok>PASSED|FAILED)")


def parse_comparisons(text: str) -> list[dict]:
    """Every npz comparison TPU-MLIR printed: files, verdict and per-tensor figures."""
    comparisons, tensors, current, files = [], {}, None, {}
    for line in text.splitlines():
        match = _TENSOR_LINE.match(line)
        if match:
            current = {"result": match["result"], "passed": match["ok"] == "PASSED"}
            tensors[match["name"].strip()] = current
            continue
        match = _FIGURE_LINE.match(line)
        if match and current is not None:
            current[match["key"]] = float(match["value"])
            continue
        if line.startswith("Target "):
            files["target"] = line.split(None, 1)[1].strip()
        elif line.startswith("Reference "):
            files["reference"] = line.split(None, 1)[1].strip()
        match = _VERDICT_LINE.search(line)
        if match and tensors:
            comparisons.append(
                {
                    "target": os.path.basename(files.get("target", "")),
                    "reference": os.path.basename(files.get("reference", "")),
                    "passed": match["ok"] == "PASSED",
                    "tensors": tensors,
                }
            )
            tensors, current, files = {}, None, {}
    return comparisons


def _loaded_system_library(stem: str) -> str | None:
    """Path of the libc/libm this interpreter itself runs on (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith(f"{stem}.so") or os.path.basename(path).startswith(
            f"{stem}-"
        ):
            return path
    return None


def tool_environment(threads: int) -> dict:
    """Environment for the TPU-MLIR tools.

    The wheel ships Ubuntu 22.04's libc.so.6/libm.so.6 in lib/third_party and puts
    that directory on LD_LIBRARY_PATH; on a newer glibc (Debian bookworm: 2.36)
    the system loader then fails ("GLIBC_2.36 not found"). Preloading the libc and
    libm this interpreter already runs on keeps the system's pair, which is
    backward compatible with what the tools were built against.
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    preload = [p for p in (_loaded_system_library("libc"), _loaded_system_library("libm")) if p]
    if preload:
        env["LD_PRELOAD"] = " ".join(preload + env.get("LD_PRELOAD", "").split())
    env["OMP_NUM_THREADS"] = str(max(1, threads))
    env.setdefault("HOME", "/tmp")
    return env


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line for word in ("Error", "error", "FAILED", "Exception", "assert")):
            return line
    return lines[-1] if lines else "no output"


def versions() -> dict:
    found = {}
    for name in ("tpu_mlir", "torch", "numpy", "onnx", "onnxruntime"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def missing_frontend() -> str | None:
    """TPU-MLIR's ONNX front end and calibrator import torch at module level."""
    if importlib.util.find_spec("tpu_mlir") is None:
        return "tpu_mlir is not installed in this environment"
    if importlib.util.find_spec("torch") is None:
        return (
            "torch is not installed in the TPU-MLIR environment (its ONNX front end imports "
            "it): install the CPU build the lock pins (envs/tpumlir/requirements.lock)"
        )
    return None


def run(spec: dict) -> dict:
    if spec.get("check_frontend", True):
        problem = missing_frontend()
        if problem:
            raise SystemExit(f"error: {problem}")
    work_dir = Path(spec["work_dir"])
    logs = work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = tool_environment(int(spec.get("threads", 1)))
    result = {"versions": versions(), "steps": []}
    for index, step in enumerate(spec["steps"]):
        Path(step["cwd"]).mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{index:02d}_{step['name'].replace(':', '_')}.log"
        with open(log_path, "w+", encoding="utf-8", errors="replace") as log:
            log.write("$ " + " ".join(step["argv"]) + "\n")
            log.flush()
            started = time.monotonic()
            proc = subprocess.run(
                step["argv"], cwd=step["cwd"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
            seconds = round(time.monotonic() - started, 1)
            log.seek(0)
            text = log.read()
        comparisons = parse_comparisons(text)
        missing = [p for p in step["expects"] if not os.path.exists(p)]
        passed = proc.returncode == 0 and not missing and all(c["passed"] for c in comparisons)
        result["steps"].append(
            {
                "name": step["name"],
                "graph": step["graph"],
                "stage": step["stage"],
                "returncode": proc.returncode,
                "passed": passed,
                "seconds": seconds,
                "comparisons": comparisons,
                "log": str(log_path),
            }
        )
        if not passed:
            why = _last_error(text) if proc.returncode else f"did not write {missing}"
            if proc.returncode == 0 and not missing:
                why = "similarity below tolerance " + str(spec.get("tolerance"))
            write_result(spec, result)
            raise SystemExit(f"error: TPU-MLIR step {step['name']} failed: {why} (log {log_path})")
    write_result(spec, result)
    return result


def write_result(spec: dict, result: dict) -> None:
    path = Path(spec["result"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: tpumlir_job.py <spec.json>", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
