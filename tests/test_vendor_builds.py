"""End to end through Snakemake: one SoC of each vendor that runs here.

    snakemake --cores all --config model=rwkv7-tiny target=RK3588,SM8650,BM1688 \
        precision=fp16,f16 toolchain_runtime=podman
    snakemake --cores all --config target=SM8650      # fp16 and a16w8, native

Each builds its toolchain through the workflow's prepare_toolchain rule, compiles
with the real vendor compiler, verifies on the vendor's simulator and packages a
release bundle (session fixtures in conftest.py: one build per run, several tests read
it). They skip, with the reason, where the toolchain cannot run. The container builds are
then repeated from a second checkout into another results directory, with every image
built again from nothing in a podman storage of the test's own, and every release byte
must match: bytes are promised per runtime, and the runtime is what the image is built
from.
"""

import json
import re
import subprocess

import pytest
from conftest import (
    PODMAN_MODEL,
    PODMAN_SELECTION,
    copy_workflow,
    podman_build_env,
    snakemake,
)
from test_workflow import dry_run, sha256_tree

from npuforge import toolchain


def bundle_of(workflow, target, precision, model="rwkv7-demo"):
    return workflow / "results" / "release" / model / target / precision


def check_bundle(bundle):
    sums = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=bundle, capture_output=True)
    assert sums.returncode == 0, sums.stdout.decode() + sums.stderr.decode()
    assert (bundle.parent / f"{bundle.name}.tar.gz").is_file()
    return json.loads((bundle / "manifest.json").read_text())


def image_id(image, env=None):
    probe = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True,
        text=True,
        env=env,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def sha256s(bundle, suffix):
    found = {}
    for line in (bundle / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        if name.endswith(suffix):
            found[name] = digest
    return found


# ------------------------------------------------------------ in the toolchain images


@pytest.mark.slow
@pytest.mark.toolchain
def test_rk3588_in_podman_builds_a_verified_rknn(podman_release):
    bundle = bundle_of(podman_release, "RK3588", "fp16", PODMAN_MODEL)
    compiled = check_bundle(bundle)["compile"]
    assert compiled["toolchain"]["runtime"] == "podman"
    assert compiled["toolchain"]["image"] == toolchain.image_name("rknn")
    assert compiled["toolchain"]["definition"] == toolchain.env_hash("rknn")
    assert compiled["toolchain"]["versions"]["rknn-toolkit2"] == "2.5.0"
    # The image's Debian userland is named too: one line per package dpkg lists in it.
    listed = subprocess.run(
        ["podman", "run", "--rm", "--network=none", toolchain.image_name("rknn"), "dpkg", "-l"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = [line for line in listed.splitlines() if line.startswith("ii ")]
    userland = compiled["toolchain"]["debian_packages"]
    assert userland["count"] == len(installed) > 50
    assert re.fullmatch(r"[0-9a-f]{64}", userland["sha256"])
    assert compiled["verification"]["positions"] >= 32
    assert compiled["verification"]["cosine"] >= 0.9999
    assert compiled["verification"]["nan_inf"] == 0
    assert compiled["placement"]["cpu_fallback"] == 0
    assert compiled["options"]["aslr_disabled"] is True
    assert sha256s(bundle, ".rknn"), "no .rknn file in the bundle"


@pytest.mark.slow
@pytest.mark.toolchain
def test_sm8650_in_podman_builds_a_verified_htp_context(podman_release):
    bundle = bundle_of(podman_release, "SM8650", "fp16", PODMAN_MODEL)
    compiled = check_bundle(bundle)["compile"]
    assert compiled["toolchain"]["runtime"] == "podman"
    assert compiled["toolchain"]["image"] == toolchain.image_name("qnn")
    assert compiled["qairt"]["version"].startswith("2.51")
    assert compiled["verification"]["positions"] >= 32 and compiled["verification"]["passed"]
    assert compiled["verification"]["cosine"] >= 0.9999
    assert compiled["reproducible"] is True
    assert all(h["aslr_disabled"] and h["fixed_clock"] for h in compiled["options"]["heap"])
    assert sha256s(bundle, ".bin"), "no context binary in the bundle"


@pytest.mark.slow
@pytest.mark.toolchain
def test_bm1688_in_podman_builds_a_verified_combined_bmodel(podman_release):
    """BM1688 only: a build is minutes of cmodel checks, and BM1684X's compile takes 8.6
    min here (the 32-token prefill net's model_deploy, checked on the cmodel) against
    BM1688's 3.5. BM1684X's deploy and combine run natively in test_tpumlir.py."""
    from npuforge.backends.tpumlir import FLOORS

    bundle = bundle_of(podman_release, "BM1688", "f16", PODMAN_MODEL)
    compiled = check_bundle(bundle)["compile"]
    record = compiled["toolchain"]
    assert record["runtime"] == "podman" and record["image"] == toolchain.image_name("tpumlir")
    assert record["image_inputs"]["python310.version"].startswith("3.10.")
    assert record["versions"]["tpu_mlir"] == "1.30.2"
    assert compiled["options"]["processor"] == "bm1688"
    assert compiled["options"]["quantize"] == "F16"
    binary = [a for a in compiled["artifacts"] if a["role"] == "binary"]
    assert len(binary) == 1 and binary[0]["nets"] == ["decode", "prefill"]
    # One prefill call then decode calls on the cmodel, against onnxruntime fp32.
    figures = compiled["verification"]
    assert figures["passed"] is True and figures["nan_inf"] == 0
    assert figures["calls"]["prefill"] == 1 and figures["calls"]["decode"] >= 32
    assert figures["floors"] == FLOORS["f16"] and figures["positions"] >= 64
    assert figures["prefill"]["cosine"] >= FLOORS["f16"]["min_cosine"]
    assert figures["decode"]["cosine"] >= FLOORS["f16"]["min_cosine"]
    # Every TPU-MLIR check ran and printed figures: ONNX vs top, top vs tpu, tpu vs bmodel.
    assert figures["tpumlir"]["passed"] is True and figures["tpumlir"]["cosine"] >= 0.99
    for net in ("decode", "prefill"):
        assert len(figures["tpumlir"]["similarity"][f"{net}:model_transform"]) == 1
        assert len(figures["tpumlir"]["similarity"][f"{net}:model_deploy"]) == 2
    # The build time model_tool writes is pinned, so the bytes depend on the graphs only.
    assert binary[0]["build_time"] == "Thu Jan  1 00:00:00 1970"
    assert sha256s(bundle, ".bmodel"), "no .bmodel in the BM1688 bundle"


@pytest.mark.slow
@pytest.mark.toolchain
def test_a_second_run_of_the_container_builds_has_nothing_to_do(podman_release):
    again = snakemake(podman_release, *PODMAN_SELECTION, check=True, env=podman_build_env())
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
@pytest.mark.toolchain
def test_images_built_again_from_nothing_give_every_release_byte_again(
    podman_release, images_from_nothing, tmp_path
):
    """The same builds from another checkout path into another results directory, with the
    base and every toolchain image built again from nothing in a storage of their own
    (conftest.ImagesFromNothing): the release (manifests, which name the images,
    included) is the same to the byte."""
    other = copy_workflow(tmp_path / "a-second-checkout-at-a-much-longer-path" / "wf")
    results = tmp_path / "other-results"
    env = dict(podman_build_env(), **images_from_nothing)
    snakemake(other, *PODMAN_SELECTION, f"results={results}", check=True, env=env)
    backends = ("rknn", "qnn", "tpumlir")
    for image in (toolchain.BASE_IMAGE, *map(toolchain.image_name, backends)):
        rebuilt, machines = image_id(image, env), image_id(image)
        assert rebuilt is not None and rebuilt != machines, image
    assert sha256_tree(results / "release") == sha256_tree(podman_release / "results" / "release")


# ------------------------------------------------------------------- native toolchains


@pytest.mark.slow
@pytest.mark.toolchain
def test_sm8650_builds_a_verified_htp_context_binary(native_sm8650_release):
    workflow = native_sm8650_release
    bundle = bundle_of(workflow, "SM8650", "fp16")
    manifest = check_bundle(bundle)
    compiled = manifest["compile"]
    binaries = sha256s(bundle, ".bin")
    assert binaries and sha256s(bundle, "_ctx.onnx")
    assert compiled["qairt"]["version"].startswith("2.51")
    assert compiled["toolchain"]["runtime"] == "native" and "image" not in compiled["toolchain"]
    assert compiled["toolchain"]["definition"] == toolchain.env_hash("qnn")
    assert compiled["options"]["soc_model"] == 57 and compiled["options"]["htp_arch"] == 75
    assert compiled["verification"]["positions"] >= 32
    assert compiled["verification"]["cosine"] >= 0.9999
    assert compiled["verification"]["nan_inf"] == 0
    # The context binary is QNN's own format, naming the QAIRT build inside.
    data = (bundle / sorted(binaries)[0]).read_bytes()
    assert b"2.51" in data

    # a16w8 is a default precision of SM8650 too, held to the 8-bit gate.
    quantized = check_bundle(bundle_of(workflow, "SM8650", "a16w8"))["compile"]
    figures = quantized["verification"]
    assert figures["positions"] >= 32 and figures["nan_inf"] == 0
    assert figures["floors"]["min_cosine"] == 0.999 and figures["cosine"] >= 0.999
    notes = quantized["options"]["chunks"][0]["quantization"]["decode"]
    assert notes["weight_type"] == "int8" and notes["activation_type"] == "uint16"
    # every layer's wkv read-out r @ state and its state-side product (4 layers)
    assert len(notes["row_matmuls_as_mul_reducesum"]) == 8
    assert notes["matmuls_of_activations_unshaped"] == []
    assert {"state_0_wkv", "state_0_wkv_out"} <= set(notes["kept_16bit"])

    def binary_bytes(manifest):
        return sum(a["bytes"] for a in manifest["artifacts"] if a["role"] == "binary")

    assert binary_bytes(quantized) < 0.6 * binary_bytes(compiled)

    # Editing a calibration text reruns the calibration and the a16w8 build it feeds (the
    # texts' digest is a calibrate param); the export and the fp16 build stay. The edit
    # is undone: other tests read this build.
    text = sorted((workflow / "data" / "calibration" / "text").glob("*.txt"))[0]
    original = text.read_text()
    text.write_text(original + "\nOne more sentence for the calibration.\n")
    try:
        counts = dry_run(workflow, "--config", "target=SM8650")
    finally:
        text.write_text(original)
    assert counts["calibrate"] == 1 and counts["compile"] == counts["package"] == 1
    assert "export" not in counts and "verify_onnx" not in counts


# ------------------------------------------------------------- the trained model


@pytest.mark.slow
@pytest.mark.toolchain
def test_trained_smollm2_fp16_verifies_on_real_text_only_with_the_fp16_safe_norm(
    smollm2_workflow,
):
    """SmolLM2-135M's hidden states reach |x| ~ 2e4; squared in RMSNorm they overflow the
    HTP's fp16. The fp16-safe export computes the same model without that overflow, and
    with SiLU in its tanh form it meets the fp16 gate over the 64 held-out positions its
    registry entry asks for (with the Sigmoid form: logits cosine 0.99839 < 0.999,
    perplexity -0.85 %)."""
    from npuforge.backends.gate import TRAINED_FLOORS

    reason = toolchain.unavailable_reason("qnn", "native", {"htp_arch": 75, "soc_model": 57})
    if reason:
        pytest.skip(f"qnn native: {reason}")
    workflow = smollm2_workflow
    select = ("--config", "model=smollm2-135m", "target=SM8650", "precision=fp16")
    snakemake(workflow, *select, check=True)
    bundle = bundle_of(workflow, "SM8650", "fp16", model="smollm2-135m")
    manifest = check_bundle(bundle)
    assert manifest["inputs"]["exports"][0]["export"]["options"]["tanh_silu"] is True
    figures = manifest["compile"]["verification"]
    assert figures["floors"] == TRAINED_FLOORS["fp16"] and figures["passed"]
    assert figures["positions"] == 64 and figures["nan_inf"] == 0
    assert figures["top1_agreement"] >= 0.99 and figures["cosine"] >= 0.999
    assert abs(figures["perplexity"]["delta"]) <= 0.005
    assert figures["reference"].startswith("onnxruntime") and "HTP" in figures["runner"]

    # The same graphs with the plain norm, in the same results (the checkpoint is not
    # dequantized again): the check fails (a few positions suffice) with one line, and the
    # release of the build above stays as it was.
    release = sha256_tree(workflow / "results" / "release")
    plain = workflow / "plain.yaml"
    plain.write_text(
        "targets: {SM8650: {export: {fp16_fixes: false}}}\n"
        "models: {smollm2-135m: {verify_steps: 4}}\n"
    )
    failed = snakemake(workflow, "--configfile", plain, *select)
    assert failed.returncode != 0
    output = failed.stdout + failed.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: SM8650 fp16")]
    assert len(errors) == 1 and "top-1 agreement" in errors[0], output[-3000:]
    assert "rule dequantize:" not in output and "rule export:" in output
    assert sha256_tree(workflow / "results" / "release") == release


@pytest.mark.slow
@pytest.mark.toolchain
def test_rotated_twin_w16a16i_dfp_passes_the_8bit_gate_on_the_rknn_simulator(
    smollm2_workflow,
):
    """A quantized build of trained weights on no 4-bit grid, end to end: SmolLM2-135M's
    permuted twin (made from the download by the permute rule, the stand-in for the
    bf16/fp16 checkpoints users bring), its residual stream rotated at export, 16-bit
    integer matmuls (the rest float16) keep its next-token choices and perplexity on
    held-out text, and the bundle records the rotation."""
    from npuforge.backends.gate import TRAINED_FLOORS

    reason = toolchain.unavailable_reason("rknn", "podman", {"target_platform": "rk3588"})
    if reason:
        pytest.skip(f"rknn in podman: {reason}")
    workflow, model = smollm2_workflow, "smollm2-135m-permuted"
    select = ("--config", f"model={model}", "target=RK3588", "precision=w16a16i_dfp")
    snakemake(workflow, *select, "toolchain_runtime=podman", check=True)
    bundle = bundle_of(workflow, "RK3588", "w16a16i_dfp", model=model)
    manifest = check_bundle(bundle)
    export = manifest["inputs"]["exports"][0]["export"]
    assert export["options"]["rotate"] == 0
    assert export["rotation"]["hidden"] == {"kind": "hadamard", "size": 576}
    compiled = manifest["compile"]
    figures = compiled["verification"]
    assert figures["floors"] == TRAINED_FLOORS["w16a16i_dfp"] and figures["passed"]
    assert figures["positions"] >= 64 and figures["nan_inf"] == 0
    assert figures["top1_agreement"] >= 0.95
    assert abs(figures["perplexity"]["delta"]) <= 0.03
    assert figures["text"]["source"] == "data/calibration/heldout.txt"
    assert compiled["options"]["calibration"]["samples"] == 64
    assert compiled["options"]["float16"]["selection"] == {"except_op_types": ["Conv"]}
