"""The instruction set a calibrated build records (npuforge.host_cpu)."""

from npuforge.host_cpu import CPUINFO, KERNEL_FEATURES, instruction_set, kernel_features

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Some CPU @ 2.1GHz
flags\t\t: fpu sse4_1 sse4_2 avx2 fma avx avx512f avx512bw amx_tile hypervisor
processor\t: 1
flags\t\t: fpu sse4_1
"""
ARM = """processor\t: 0
Features\t: fp asimd evtstrm aes asimdhp asimddp sve
CPU part\t: 0xd0c
"""


def test_only_the_kernel_features_of_the_first_processor_in_a_fixed_order():
    assert kernel_features(X86, "x86_64") == [
        "sse4_1", "sse4_2", "avx", "fma", "avx2", "avx512f", "avx512bw", "amx_tile",
    ]  # fmt: skip
    assert kernel_features(ARM, "aarch64") == ["asimd", "asimdhp", "asimddp", "sve"]
    # Another model of one instruction set records the same thing.
    other_model = X86.replace("Some CPU @ 2.1GHz", "Another CPU @ 3.0GHz")
    assert kernel_features(other_model, "x86_64") == kernel_features(X86, "x86_64")
    # An emulated CPU without AVX-512 records another set (its Softmax differs).
    haswell = X86.replace(" avx512f avx512bw amx_tile", "")
    assert "avx512f" not in kernel_features(haswell, "x86_64")
    assert kernel_features(X86, "riscv64") is None
    assert kernel_features("processor : 0\n", "x86_64") is None


def test_this_host_is_recorded_with_its_machine():
    host = instruction_set()
    assert set(host) == {"machine", "features"} and host["machine"]
    if host["machine"] in KERNEL_FEATURES and CPUINFO.is_file():
        assert host["features"] == kernel_features(CPUINFO.read_text(), host["machine"])
        assert host["features"]  # every x86_64 and aarch64 CPU has one of them
