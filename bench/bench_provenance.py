"""Cost of keeping pins pinned, on the ~0.45B RWKV-7 bench checkpoint (bf16, ~0.9 GB).

    python bench/bench_provenance.py

Prints: the private copy a fetch makes of a ``path:`` source (reflink where the
filesystem offers one, else a copy: time and extra disk), the full sha256 a
changed file costs, and the stat-only check every later planning run makes.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/npuforge-bench"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.workdir / "rwkv7-24x1024-v65536.pth"
    if not ckpt.exists():
        subprocess.run(
            [sys.executable, str(ROOT / "workflow_scripts/make_synthetic_checkpoint.py"),
             "--layers", "24", "--embed", "1024", "--out", str(ckpt)],
            check=True,
        )  # fmt: skip
    os.environ["NPUFORGE_CACHE"] = tempfile.mkdtemp(prefix="npuforge-bench-cache-")
    from npuforge import provenance
    from npuforge.fetch import copy_private
    from npuforge.fileio import sha256_file

    size = ckpt.stat().st_size
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        copy = Path(tmp) / "checkpoint.pth"
        seconds, _ = timed(copy_private, ckpt, copy)
        shared = os.stat(copy).st_blocks * 512
        df = os.statvfs(tmp)
        print(f"checkpoint                       {size / 1e9:.3f} GB  ({ckpt})")
        print(f"private copy (fetch)             {seconds:.2f} s, {shared / 1e9:.3f} GB on disk "
              f"(filesystem block size {df.f_bsize})")  # fmt: skip
    seconds, digest = timed(sha256_file, ckpt)
    print(f"sha256 of a changed file         {seconds:.2f} s ({size / seconds / 1e9:.2f} GB/s)")
    timed(provenance.current_sha256, ckpt)  # the first planning run hashes and remembers
    runs = [timed(provenance.check_path_source, "bench", ckpt, digest)[0] for _ in range(20)]
    print(f"unchanged file, each planning run {min(runs) * 1e3:.2f} ms (stat + memo)")


if __name__ == "__main__":
    main()
