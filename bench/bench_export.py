"""Export benchmark: wall time and peak RSS of export_onnx.py on a ~0.4B RWKV-7 checkpoint.

    python bench/bench_export.py                     # 24 layers x 1024, fp32 decode
    python bench/bench_export.py --dtype fp16 --chunks 2

The synthetic checkpoint (bf16, ~0.9 GB) is generated once into --workdir and
reused. The export runs as a child process; its peak RSS comes from wait4().
For comparison, the public export scripts take 50-60 s and 5.8-7.5 GB peak RSS
for this model on this machine; the aims are >= 3x faster and peak RSS <= 1.5x
the checkpoint file size.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--variant", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/npuforge-bench"))
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.workdir / f"rwkv7-{args.layers}x{args.embed}-v{args.vocab}.pth"
    if not ckpt.exists():
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, str(ROOT / "workflow_scripts/make_synthetic_checkpoint.py"),
             "--version", "7", "--layers", str(args.layers), "--embed", str(args.embed),
             "--vocab", str(args.vocab), "--seed", "0", "--out", str(ckpt)],
            check=True,
        )  # fmt: skip
        print(f"generated {ckpt.name} in {time.perf_counter() - t0:.1f} s")
    out_dir = args.workdir / f"export-{args.dtype}-{args.variant}-c{args.chunks}"
    cmd = [
        sys.executable, str(ROOT / "workflow_scripts/export_onnx.py"), "--checkpoint", str(ckpt),
        "--out-dir", str(out_dir), "--dtype", args.dtype, "--chunks", str(args.chunks),
        "--variant", args.variant,
    ]  # fmt: skip
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"export failed with status {os.waitstatus_to_exitcode(status)}")
    ckpt_bytes = ckpt.stat().st_size
    peak = usage.ru_maxrss * 1024
    out_bytes = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"model            {args.layers} layers x {args.embed} embed, vocab {args.vocab}")
    print(f"checkpoint       {ckpt_bytes / 1e9:.3f} GB (bf16)")
    print(
        f"export           {args.dtype} {args.variant}, {args.chunks} chunk(s), "
        f"{out_bytes / 1e9:.3f} GB written"
    )
    print(f"wall time        {wall:.1f} s")
    print(f"cpu time         {usage.ru_utime + usage.ru_stime:.1f} s")
    print(f"peak RSS         {peak / 1e9:.3f} GB = {peak / ckpt_bytes:.2f} x checkpoint")


if __name__ == "__main__":
    main()
