"""The host's instruction set, as far as it changes fp32 results on the CPU.

onnxruntime's kernels take other paths per instruction set (its Softmax differs in the
last bit on a CPU without AVX-512; docs/reproducibility.md), so calibration samples and
the int8 ranges a toolkit measures from them follow the host. A calibrated build's
record names the instruction set its samples and ranges were computed on: two builds
whose records differ here may differ in bytes and figures; fp16 builds record nothing.
Only the features kernels dispatch on are kept, so hosts of one instruction set record
the same thing whatever their model or stepping.
"""

import platform
from pathlib import Path

# The features onnxruntime's MLAS and the toolkits' own kernels dispatch on.
KERNEL_FEATURES = {
    "x86_64": (
        "sse4_1",
        "sse4_2",
        "avx",
        "f16c",
        "fma",
        "avx2",
        "avx_vnni",
        "avx512f",
        "avx512dq",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
    ),  # fmt: skip
    "aarch64": ("asimd", "fphp", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2"),
}
CPUINFO = Path("/proc/cpuinfo")


def kernel_features(cpuinfo_text: str, machine: str) -> list[str] | None:
    """The kernel-relevant features of the first processor in a /proc/cpuinfo text, in
    KERNEL_FEATURES order; None for a machine or text this does not know."""
    wanted = KERNEL_FEATURES.get(machine)
    if wanted is None:
        return None
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        # x86 names them 'flags', arm64 'Features'.
        if key.strip() in ("flags", "Features"):
            present = set(value.split())
            return [name for name in wanted if name in present]
    return None


def instruction_set() -> dict:
    """{'machine': 'x86_64', 'features': [...]} of this host (features None where unknown)."""
    machine = platform.machine()
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return {"machine": machine, "features": kernel_features(text, machine)}
