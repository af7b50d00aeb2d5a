"""Running the TPU-MLIR job on a spec and keeping its finished nets: each net's key over
what its chain reads, the stores of a compile and of its chunk jobs, and the tools'
logs echoed when the job fails."""

import dataclasses
import json
import sys
from pathlib import Path

from npuforge.backends import base
from npuforge.errors import NpuforgeError
from npuforge.jobs.finished_chunks import FinishedChunks, files_in, job_identity, store_beside

JOB_SCRIPT = Path(__file__).resolve().parents[1] / "jobs" / "tpumlir_job.py"
# A calibrated net's list of sample files (run_calibration's --data_list), in its directory.
DATA_LIST = "calibration_list.txt"


def net_store(out_dir: Path, stamp: dict) -> FinishedChunks:
    """Where a compile (or a chunk's job) into ``out_dir`` keeps the nets it finished."""
    return FinishedChunks(store_beside(Path(out_dir).resolve()), job_identity(JOB_SCRIPT, stamp))


# Where a chunk's job keeps its nets in its output directory (a FinishedChunks store).
CHUNK_STORE = "nets"


def chunk_store(chunk_build) -> Path:
    return (Path(chunk_build) / CHUNK_STORE).resolve()


def run_spec(request, spec: dict, tmp: Path, work: Path, store) -> None:
    """Write ``spec`` and run the job on it in the toolchain; on failure echo the tools'
    logs (the temporary directory goes away with the failure)."""
    from npuforge.fileio import write_json

    store.dir.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    write_json(spec_path, spec)
    read_only = [g["export"] for g in spec["graphs"]] + list(spec["state_files"])
    read_only += [str(d.resolve()) for d in request.calibrations]
    read_only += spec["finished"].get("also", [])
    log = tmp / "logs" / "toolchain.log"
    job = dataclasses.replace(request, log_path=log)
    writable = [str(tmp), str(store.dir)]
    try:
        base.run_job(job, JOB_SCRIPT, spec_path, read_only=read_only, writable=writable)
    except NpuforgeError as failed:
        echo_logs(log, work / "logs", str(failed))
        raise


def finished_nets(spec: dict, store, root: Path) -> dict:
    """For the job: the store, and each net's key over what its chain reads (its
    command lines, its directory's inputs, its graph and weights, its samples), so a
    rerun reuses the nets a stopped compile finished (npuforge.jobs.finished_chunks)."""
    keys = {}
    for graph in spec["graphs"]:
        indices = [i for i, step in enumerate(spec["steps"]) if step["graph"] == graph["net"]]
        steps = [spec["steps"][i] for i in indices]
        net_dir, onnx = Path(steps[0]["cwd"]), Path(graph["onnx"])
        reads = files_in(net_dir) + [onnx]
        weights = onnx.with_name(onnx.name + ".data")
        reads += [weights] if weights.is_file() else []
        if (net_dir / DATA_LIST).is_file():
            reads += [Path(line) for line in (net_dir / DATA_LIST).read_text().split()]
        description = json.dumps(
            {"indices": indices, "steps": steps, "threads": spec["threads"]}, sort_keys=True
        )
        keys[graph["net"]] = store.key(description, {"staging": root}, inputs=reads)
    return {"dir": str(store.dir), "root": str(root), "keys": keys}


def echo_logs(toolchain_log: Path, tool_logs: Path, error: str, tail: int = 60) -> None:
    """Each log's tail to stderr; the failed step's (the error names it) last, where a
    reader of the step's log looks first."""
    logs = [toolchain_log, *sorted(tool_logs.glob("*.log"))]
    logs.sort(key=lambda log: log.name in error)  # stable: the rest keep their order
    for log in logs:
        if log.is_file():
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
            print(f"--- {log.name} (last {tail} lines)", file=sys.stderr)
            print("\n".join(lines[-tail:]), file=sys.stderr)
