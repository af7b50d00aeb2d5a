"""Run a TPU-MLIR compile job inside the toolchain environment.

    python tpumlir_job.py <spec.json>

The spec (written by npuforge.backends.tpumlir_spec.build_spec) lists the TPU-MLIR
command lines in order, each with its working directory and the files it must
produce. This script runs them, keeps each tool's output in <work_dir>/logs/,
parses the similarity figures TPU-MLIR prints when it compares tensors, and
writes the result JSON. Then, if the spec has ``verify``, it re-executes itself
(``--verify``, in the tools' environment) to run the combined bmodel on
TPU-MLIR's cmodel simulator over the spec's recurrent calls, all in one process.
Standard library only at module level (the verify run imports the toolchain's
numpy and tpu_mlir): it never imports npuforge.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

# Sibling modules: this script is also loaded by path, without its directory on the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cmodel_calls import VERIFY_PROGRESS, run_calls  # noqa: E402
from job_estimates import time_left  # noqa: E402
from job_turns import OneAtATime  # noqa: E402

# npz_tool's per-tensor line: "[name   ]      SIMILAR [PASSED]".
_TENSOR_LINE = re.compile(
    r"^\[(?P<name>.+?)\s*\]\s+(?P<result>[A-Z_]+)\s+\[\s*(?P<ok>PASSED|FAILED)\]"
)
_FIGURE_LINE = re.compile(
    r"^\s+(?P<key>cosine|euclidean|sqnr)_similarity\s+=\s+(?P<value>[-+0-9.eE]+|nan|inf)"
)
_VERDICT_LINE = re.compile(r"npz compare (?P<ok>PASSED|FAILED)")
# In the image, the package's chip-selecting links (libcmodel.so, libbmlib.so.0) point
# here, into the container's private /tmp: the image is read-only to the job, and
# TPU-MLIR selects a chip by re-linking them in its package directory.
CHIP_LIBRARIES = Path("/tmp/tpumlir-chip")


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
            "it): prepare the toolchain again from envs/tpumlir/requirements.lock"
        )
    return None


def _die_with_parent():
    """job_stage.die_with_parent, imported when a tool runs."""
    from job_stage import die_with_parent

    return die_with_parent()


def step_chains(steps: list) -> tuple[list, list]:
    """Step indices as one chain per net (its steps in order) and the graph-less steps
    (model_tool's combine), which run after every chain."""
    chains: dict = {}
    tail = []
    for index, step in enumerate(steps):
        if step.get("graph") is None:
            tail.append(index)
        else:
            chains.setdefault(step["graph"], []).append(index)
    return list(chains.values()), tail


class _Steps:
    """Runs the spec's steps, the nets' chains side by side up to ``parallel`` at once.

    Each net's steps read and write only its own directory, and each tool process is
    deterministic on its own, so running them side by side keeps every byte. After a
    failing step no other step starts (one already running finishes, so no tool is left
    half-killed); the first failure is the job's error.
    """

    def __init__(self, spec: dict, env: dict, logs: Path, total: int):
        self.spec, self.env, self.logs, self.total = spec, env, logs, total
        self.records: dict = {}
        self.failure: str | None = None
        self.running: set = set()
        self.started: dict = {}  # index -> monotonic start of a running step
        self.parallel = 1
        self.planned = None  # the step indices this run runs, where not all
        self.one_at_a_time = OneAtATime(spec.get("one_at_a_time", ()))
        self.rank: dict = {}  # step index -> its chain's place in the run order
        self.lock = threading.Lock()
        # {"dir": the compile's store, "root": the staging directory, "keys": {net: key},
        #  "also": the stores of the compile's chunk jobs, where the workflow ran them}
        self.finished = spec.get("finished")
        self.store, self.chunk_stores = None, []
        if self.finished:
            from finished_chunks import FinishedChunks

            self.store = FinishedChunks(self.finished["dir"])
            self.chunk_stores = [FinishedChunks(d) for d in self.finished.get("also", [])]

    def run_chain(self, indices: list) -> None:
        try:
            self._run_chain(indices)
        finally:
            if indices and indices[0] in self.rank:  # a net's chain, not the combine
                self.one_at_a_time.done(self.rank[indices[0]])

    def _run_chain(self, indices: list) -> None:
        if not indices or self.reuse_chain(indices):
            return
        from finished_chunks import files_in

        inputs = {os.path.abspath(path) for path in files_in(self.spec["steps"][indices[0]]["cwd"])}
        for index in indices:
            if self.failure is not None:
                return
            self.run_step(index, self.spec["steps"][index])
        if self.chain_passed(indices):
            self.prune_chain(indices, inputs)
            self.keep_chain(indices)

    def chain_passed(self, indices: list) -> bool:
        return all(self.records.get(index, {}).get("passed") for index in indices)

    def prune_chain(self, indices: list, inputs: set) -> None:
        """A net's passed chain keeps its inputs and its last step's outputs (the bmodel
        the combine reads), nothing it made on the way: the top MLIR's fp32 weights and
        the TPU MLIR's and compiler's copies are four times the bmodel (2.9 GB beside 0.57
        for a 280M-parameter net), and every net's stayed until the combine: a 1.5B
        model's build ran out of 37 GB of disk."""
        first, last = self.spec["steps"][indices[0]], self.spec["steps"][indices[-1]]
        if first.get("graph") is None:
            return
        # Only a directory of the net's own: no other step, nor the logs, live under it.
        cwd = os.path.abspath(last["cwd"])
        others = [
            os.path.abspath(step["cwd"])
            for index, step in enumerate(self.spec["steps"])
            if index not in indices
        ] + [os.path.abspath(self.logs)]
        if any(other == cwd or other.startswith(cwd + os.sep) for other in others):
            return
        keep = inputs | {os.path.abspath(path) for path in last["expects"]}
        for root, dirs, files in os.walk(cwd, topdown=False):
            for name in files:
                path = os.path.abspath(os.path.join(root, name))
                if path not in keep:
                    os.unlink(path)
            for name in dirs:
                path = os.path.join(root, name)
                if os.path.islink(path):
                    os.unlink(path)
                elif not os.listdir(path):
                    os.rmdir(path)

    def reuse_chain(self, indices: list) -> bool:
        """A net's chain an earlier run of this compile finished (the host keyed it)."""
        net = self.spec["steps"][indices[0]]["graph"] if indices else None
        key = (self.finished or {}).get("keys", {}).get(net)
        if key is None:  # not keyed, or the graph-less steps (the combine)
            return False
        root = self.finished["root"]
        by = "an earlier run of this compile"
        record = self.store.restore(key, {"staging": root})
        for store in self.chunk_stores if record is None else []:
            by, record = "its chunk's job", store.restore(key, {"staging": root})
            if record is not None:
                break
        if record is None:
            return False
        steps = json.loads(json.dumps(record["steps"]).replace("<staging>", root))
        with self.lock:
            self.records.update(zip(indices, steps, strict=True))
            print(f"TPU-MLIR net {net}: built by {by}, reused", flush=True)
        return True

    def keep_chain(self, indices: list) -> None:
        steps = [self.records[index] for index in indices]
        if not self.finished:
            return
        net = steps[0]["graph"]
        key, root = self.finished["keys"].get(net), self.finished["root"]
        if key is None:
            return
        outputs = [self.spec["steps"][indices[0]]["cwd"]] + [step["log"] for step in steps]
        record = {"steps": json.loads(json.dumps(steps).replace(root, "<staging>"))}
        self.store.keep(key, outputs, {"staging": root}, record)

    def run_step(self, index: int, step: dict) -> None:
        with self.one_at_a_time.turn(step.get("stage"), self.rank.get(index, 0)):
            if self.failure is None:  # a step failed while this one waited: none starts
                self._run_step(index, step)

    def _run_step(self, index: int, step: dict) -> None:
        # The tools write to their own logs: say which ones run, for the step's log.
        # Under the lock: print writes the line and its newline apart, so two chains'
        # lines printed at once would run together.
        with self.lock:
            beside = f" (beside {', '.join(sorted(self.running))})" if self.running else ""
            now = time.monotonic()
            left = time_left(
                self.spec["steps"], self.records,
                {i: now - t for i, t in self.started.items()}, self.parallel, self.planned,
            )  # fmt: skip
            self.running.add(step["name"])
            self.started[index] = now
            # Early in the line: the runner's quiet-job report keeps its first 120 chars.
            estimate = ""
            if left is not None:
                seconds, left_out = left
                after = [f"the {stage}" for stage in left_out]
                after += ["the cmodel check"] if self.spec.get("verify") else []
                until = f" before {' and '.join(after)}" if after else ""
                estimate = f" [about {seconds:.0f} s left{until}]"
            print(
                f"TPU-MLIR step {index + 1}/{self.total}{estimate}: {step['name']}{beside}",
                flush=True,
            )
        Path(step["cwd"]).mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{index:02d}_{step['name'].replace(':', '_')}.log"
        with open(log_path, "w+", encoding="utf-8", errors="replace") as log:
            log.write("$ " + " ".join(step["argv"]) + "\n")
            log.flush()
            started = time.monotonic()
            proc = subprocess.run(
                step["argv"], cwd=step["cwd"], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent(),
            )  # fmt: skip
            seconds = round(time.monotonic() - started, 1)
            log.seek(0)
            text = log.read()
        comparisons = parse_comparisons(text)
        missing = [p for p in step["expects"] if not os.path.exists(p)]
        passed = proc.returncode == 0 and not missing and all(c["passed"] for c in comparisons)
        record = {
            "name": step["name"],
            "graph": step["graph"],
            "stage": step["stage"],
            "returncode": proc.returncode,
            "passed": passed,
            "seconds": seconds,
            "comparisons": comparisons,
            "log": str(log_path),
        }
        why = None
        if not passed:
            why = _last_error(text) if proc.returncode else f"did not write {missing}"
            if proc.returncode == 0 and not missing:
                why = "similarity below tolerance " + str(self.spec.get("tolerance"))
            why = f"error: TPU-MLIR step {step['name']} failed: {why} (log {log_path})"
        with self.lock:
            self.running.discard(step["name"])
            self.started.pop(index, None)
            self.records[index] = record
            if why and self.failure is None:
                self.failure = why

    def run(self, parallel: int) -> list:
        self.parallel = max(1, parallel)
        chains, tail = step_chains(self.spec["steps"])
        only = self.spec.get("only_nets")
        if only is not None:
            # A chunk's job: its nets' chains, kept for the compile that combines them.
            steps = self.spec["steps"]
            chains, tail = [c for c in chains if steps[c[0]]["graph"] in only], []
            self.planned = {index for chain in chains for index in chain}
        # The chains the spec names first start first (the longest: their last step can
        # then overlap the others' first).
        order = {net: place for place, net in enumerate(self.spec.get("chain_order", []))}
        chains.sort(key=lambda c: order.get(self.spec["steps"][c[0]]["graph"], len(order)))
        self.rank = {index: place for place, chain in enumerate(chains) for index in chain}
        for place, chain in enumerate(chains):
            stages = [self.spec["steps"][index].get("stage") for index in chain]
            self.one_at_a_time.expect(place, sum(s in self.one_at_a_time.stages for s in stages))
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for done in [pool.submit(self.run_chain, chain) for chain in chains]:
                done.result()
        self.run_chain(tail)
        return [self.records[i] for i in sorted(self.records)]


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
    total = len(spec["steps"]) + bool(spec.get("verify"))
    steps = _Steps(spec, env, logs, total)
    result["steps"] = steps.run(int(spec.get("parallel_nets", 1)))
    if steps.failure is not None:
        write_result(spec, result)
        raise SystemExit(steps.failure)
    verify = None if spec.get("only_nets") is not None else spec.get("verify")
    if verify:
        index = len(spec["steps"])
        print(f"TPU-MLIR step {index + 1}/{total}: the bmodel on the cmodel", flush=True)
        log_path = logs / f"{index:02d}_verify_cmodel.log"
        with open(log_path, "w+", encoding="utf-8", errors="replace") as log:
            argv = [sys.executable, os.path.abspath(__file__), "--verify", spec["spec_path"]]
            started = time.monotonic()
            # The calls can take many minutes on the cmodel: their progress lines reach
            # this job's output (and so its heartbeat) as well as the log.
            with subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, errors="replace", preexec_fn=_die_with_parent(),
            ) as proc:  # fmt: skip
                for line in proc.stdout:
                    log.write(line)
                    if line.startswith(VERIFY_PROGRESS):
                        print(line, end="", flush=True)
            seconds = round(time.monotonic() - started, 1)
            log.seek(0)
            text = log.read()
        passed = proc.returncode == 0 and os.path.exists(verify["outputs"])
        result["steps"].append(
            {
                "name": "verify:cmodel",
                "graph": None,
                "stage": "verify",
                "returncode": proc.returncode,
                "passed": passed,
                "seconds": seconds,
                "comparisons": [],
                "log": str(log_path),
            }
        )
        if not passed:
            write_result(spec, result)
            raise SystemExit(
                f"error: running the bmodel on the cmodel simulator failed: "
                f"{_last_error(text)} (log {log_path})"
            )
    write_result(spec, result)
    return result


def verify(spec: dict) -> None:
    """Run the combined bmodel's nets on the cmodel over the recurrent calls of the spec
    (``cmodel_calls.run_calls``), in a fresh process of this script."""
    import tpu_mlir  # noqa: F401 - sets the tools' LD_LIBRARY_PATH

    # Importing tpu_mlir sets LD_LIBRARY_PATH (libcmodel.so...) for the processes it
    # starts, as its tools run; the loader reads it at start-up, so start afresh once.
    if os.environ.get("NPUFORGE_TPUMLIR_VERIFY") != "1":
        os.environ["NPUFORGE_TPUMLIR_VERIFY"] = "1"
        argv = [sys.executable, os.path.abspath(__file__), "--verify", spec["spec_path"]]
        os.execv(sys.executable, argv)
    run_calls(spec)


def write_result(spec: dict, result: dict) -> None:
    path = Path(spec["result"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def select_chip_libraries(processor: str, lib=None, chip_dir=CHIP_LIBRARIES) -> bool:
    """Point the image's chip-selecting links at ``processor``'s cmodel (and the bmlib
    the runtime links against); False, doing nothing, where the package's own links
    are writable (a native venv: TPU-MLIR's tools switch them themselves)."""
    if lib is None:
        found = importlib.util.find_spec("tpu_mlir")
        if found is None:
            return False  # the steps say that tpu_mlir is missing
        lib = Path(found.submodule_search_locations[0]) / "lib"
    lib, chip_dir = Path(lib), Path(chip_dir)
    link = lib / "libcmodel.so"
    if not (link.is_symlink() and Path(os.readlink(link)).parent == chip_dir):
        return False
    chip_dir.mkdir(exist_ok=True)
    chosen = {
        "libcmodel.so": lib / f"libcmodel_{processor.lower()}.so",
        "libbmlib.so.0": lib / "libbmlib_bm1684x.so.0",
    }
    for name, target in chosen.items():
        if not target.is_file():
            raise SystemExit(f"error: {target} is missing: TPU-MLIR has no cmodel for {processor}")
        path = chip_dir / name
        if path.is_symlink():
            path.unlink()
        path.symlink_to(target)
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verify_only = argv[:1] == ["--verify"]
    argv = argv[1:] if verify_only else argv
    if len(argv) != 1:
        print("usage: tpumlir_job.py [--verify] <spec.json>", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    spec["spec_path"] = os.path.abspath(argv[0])
    if spec.get("processor"):
        select_chip_libraries(spec["processor"])
    if verify_only:
        verify(spec)
    else:
        run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
