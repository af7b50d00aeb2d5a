"""Context-generation wall time and peak RSS: npuforge's QNN compile vs a direct ONNX Runtime call.

Builds a synthetic RWKV-7 (default 24 layers x 1024, vocab 65536: ~0.45B
parameters), exports one fp32 decode graph with an external embedding, then
compiles it for SM8650 fp16 twice on the same ONNX:

  npuforge  workflow_scripts/compile_qnn.py (spec, job script, one process per
            chunk, compile.json), verification limited to --verify-steps
  direct    one InferenceSession with the QNN EP in EP-context mode, in the
            same toolchain python

and prints wall seconds and peak RSS (of the process tree doing the work).

    python bench/bench_qnn.py [--layers 24 --embed 1024] [--work /tmp/npuforge-bench-qnn]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DIRECT = r"""
import resource, sys, time
import onnxruntime as ort, onnxruntime_qnn as qnn
source, ctx = sys.argv[1], sys.argv[2]
ort.register_execution_provider_library("QNNExecutionProvider", qnn.get_library_path())
devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
so = ort.SessionOptions()
so.add_session_config_entry("ep.context_enable", "1")
so.add_session_config_entry("ep.context_file_path", ctx)
so.add_session_config_entry("ep.context_embed_mode", "0")
so.add_provider_for_devices(devices, {"backend_path": qnn.get_qnn_htp_path(), "soc_model": "57",
                                      "htp_arch": "75", "enable_htp_fp16_precision": "1"})
started = time.monotonic()
ort.InferenceSession(source, so)
print(time.monotonic() - started)
"""


def run(cmd, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.monotonic()
    subprocess.run([str(c) for c in cmd], check=True, env=env, **kwargs)
    return time.monotonic() - started


def measured(label, cmd, **kwargs):
    """Run in a fresh helper process so RUSAGE_CHILDREN covers only this command's tree."""
    probe = (
        "import resource, subprocess, sys, time, json;"
        "t = time.monotonic(); subprocess.run(sys.argv[1:], check=True);"
        "print(json.dumps({'seconds': time.monotonic() - t, 'peak_mb': "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", probe, *map(str, cmd)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        **kwargs,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    figures["stderr"] = out.stderr
    print(f"{label:<10} {figures['seconds']:8.1f} s   peak RSS {figures['peak_mb']:8.0f} MB")
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--verify-steps", type=int, default=2)
    parser.add_argument("--work", default="/tmp/npuforge-bench-qnn")
    parser.add_argument("--stamp", default=str(REPO / "results" / "toolchains" / "qnn-native.json"))
    args = parser.parse_args(argv)

    from npuforge import toolchain

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stamp = toolchain.prepare("qnn", "native", args.stamp)
    checkpoint = work / f"rwkv7-{args.layers}x{args.embed}.pth"
    export = work / f"export-{args.layers}x{args.embed}"
    if not checkpoint.exists():
        run([sys.executable, REPO / "workflow_scripts" / "make_synthetic_checkpoint.py",
             "--version", 7, "--layers", args.layers, "--embed", args.embed, "--vocab", args.vocab,
             "--head-size", 64, "--seed", 0, "--out", checkpoint])  # fmt: skip
    if not (export / "export.json").exists():
        run([sys.executable, REPO / "workflow_scripts" / "export_onnx.py", "--checkpoint",
             checkpoint, "--out-dir", export, "--variant", "decode", "--chunks", 1,
             "--dtype", "fp32", "--ext-embedding"])  # fmt: skip
    meta = json.loads((export / "export.json").read_text())
    params = (
        sum(f.stat().st_size for f in export.iterdir() if f.name.startswith("chunk")) // 4
        + (export / "embedding.bin").stat().st_size // 4
    )
    print(
        f"model: RWKV-7 {args.layers} x {args.embed}, vocab {args.vocab}, ~{params / 1e9:.2f}B "
        f"parameters, {len(meta['graphs'])} chunk(s); SM8650 fp16; cores: {os.cpu_count()}"
    )

    out = work / "npuforge-SM8650-fp16"
    # The bench reports the simulator figures; it does not gate on them.
    options = {
        "htp_arch": 75,
        "soc_model": 57,
        "vtcm_mb": 8,
        "verify_steps": args.verify_steps,
        "min_cosine": -1,
    }
    npuforge = measured(
        "npuforge",
        [sys.executable, REPO / "workflow_scripts" / "compile_qnn.py", "--export", export,
         "--target", "SM8650", "--target-options", json.dumps(options), "--precision", "fp16",
         "--toolchain", args.stamp, "--out-dir", out, "--log", work / "npuforge.log"],
    )  # fmt: skip
    manifest = json.loads((out / "compile.json").read_text())
    # Wall times stay out of compile.json (it must not vary run to run): the CLI logs them.
    context = sum(map(float, re.findall(r"context generation ([\d.]+) s", npuforge["stderr"])))
    simulator = re.search(r"simulator verification: ([\d.]+) s", npuforge["stderr"])
    check = manifest["verification"]
    print(
        f"           of which context generation {context:.1f} s; simulator "
        f"{float(simulator.group(1)) if simulator else float('nan'):.1f} s for "
        f"{check['steps']} steps, cosine {check['cosine']}"
    )
    direct_dir = work / "direct"
    direct_dir.mkdir(exist_ok=True)
    direct = measured(
        "direct",
        [stamp["python"], "-c", DIRECT, export / meta["graphs"][0]["file"],
         direct_dir / "chunk0_ctx.onnx"],
    )  # fmt: skip
    sizes = {
        "npuforge": sum(a.get("bytes", 0) for a in manifest["artifacts"]),
        "direct": sum(p.stat().st_size for p in direct_dir.glob("*.bin")),
    }
    print(f"binary bytes: npuforge {sizes['npuforge']}, direct {sizes['direct']}")
    return {
        "npuforge": {k: v for k, v in npuforge.items() if k != "stderr"},
        "direct": {k: v for k, v in direct.items() if k != "stderr"},
        "bytes": sizes,
    }


if __name__ == "__main__":
    main()
