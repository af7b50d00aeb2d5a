"""Compile wall time and peak RSS: npuforge's rknn backend vs a direct rknn-toolkit2 call.

    python bench/bench_rknn.py --python /path/to/rknn-venv/bin/python [--layers 4 --embed 256]

Builds a synthetic RWKV-7 checkpoint, exports it (fp32 decode, ext embedding,
one chunk), then compiles the same ONNX to fp16 .rknn for rk3588 two ways:

* direct: the toolkit's own python runs config/load_onnx/build/export_rknn,
* npuforge: workflow_scripts/compile_rknn.py (graph rewrite, onnxruntime
  reference run, build + export, simulator over the verification steps),

each as a fresh child process, and prints wall time and the child's peak RSS
(getrusage). Peak compile memory per parameter is what plan_chunks assumes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DIRECT = """
import sys
from rknn.api import RKNN
rknn = RKNN(verbose=False)
rknn.config(target_platform="rk3588", optimization_level=3)
assert rknn.load_onnx(model=sys.argv[1]) == 0
assert rknn.build(do_quantization=False) == 0
assert rknn.export_rknn(sys.argv[2]) == 0
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--python", required=True, help="python of an rknn toolchain venv")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=65536)
    args = parser.parse_args()

    from npuforge import models
    from npuforge.fileio import write_json
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "model.pth"
        write_synthetic_checkpoint(
            ckpt, version=7, layers=args.layers, embed=args.embed, vocab=args.vocab, seed=0
        )
        export = tmp / "export"
        options = {"variant": "decode", "chunks": 1, "dtype": "fp32", "ext_embedding": True}
        models.export("rwkv", ckpt, export, options)
        onnx_path = export / "chunk0.onnx"
        import math

        import onnx

        initializers = onnx.load(str(onnx_path)).graph.initializer
        params = sum(math.prod(init.dims) for init in initializers)
        stamp = tmp / "stamp.json"
        write_json(stamp, {"backend": "rknn", "runtime": "native", "python": args.python})
        env = {**os.environ, "MALLOC_PERTURB_": "85", "OMP_NUM_THREADS": "1"}

        # Each measurement in its own interpreter so ru_maxrss belongs to it alone.
        direct_cmd = [args.python, "-c", DIRECT, str(onnx_path), str(tmp / "direct.rknn")]
        bench_cmd = [
            sys.executable,
            "-c",
            "import resource,subprocess,sys,time,json;"
            "t=time.monotonic();r=subprocess.run(sys.argv[1:]);w=time.monotonic()-t;"
            "print(json.dumps([r.returncode,w,"
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1e6]))",
        ]

        def run(cmd):
            out = subprocess.run(bench_cmd + cmd, capture_output=True, text=True, env=env)
            code, wall, peak = json.loads(out.stdout.strip().splitlines()[-1])
            if code:
                sys.exit(f"failed: {' '.join(map(str, cmd))}\n{out.stderr[-2000:]}")
            return wall, peak

        direct = run(direct_cmd)
        ours = run(
            [
                sys.executable,
                str(REPO / "workflow_scripts" / "compile_rknn.py"),
                "--export", str(export), "--target", "RK3588",
                "--target-options", json.dumps({"target_platform": "rk3588"}),
                "--precision", "fp16", "--toolchain", str(stamp), "--out-dir", str(tmp / "ours"),
            ]
        )  # fmt: skip
    size = f"{args.layers} layers, embed {args.embed}, {params / 1e6:.1f}M params"
    print(f"model: synthetic RWKV-7, {size}, fp16 for rk3588")
    print(f"direct rknn-toolkit2 build+export   : {direct[0]:7.1f} s  peak RSS {direct[1]:.2f} GB")
    print(f"npuforge compile_rknn (incl. verify): {ours[0]:7.1f} s  peak RSS {ours[1]:.2f} GB")
    print(f"ratio npuforge/direct: time {ours[0] / direct[0]:.2f}x, RSS {ours[1] / direct[1]:.2f}x")
    print(f"compile memory per parameter (direct): {direct[1] * 1e9 / params:.1f} bytes")


if __name__ == "__main__":
    main()
