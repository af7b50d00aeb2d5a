"""Build matrix: selection, capability checks, shared exports, chunk planning."""

import copy
import math
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from npuforge.errors import NpuforgeError
from npuforge.matrix import (
    Build,
    check_toolchains,
    choose_runtimes,
    export_key,
    export_variants,
    make_plan,
    parse_selection,
    select_builds,
)
from npuforge.memory_plan import (
    compile_costs,
    estimate_params,
    fetch_mem_mb,
    memory_plan,
    policy_chunks,
)
from npuforge.registry import build_options, load_registries

CONFIG = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
MODELS, TARGETS = load_registries(CONFIG, REPO)


def selection(**kw):
    return dict(CONFIG, **kw)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("SM8650", ["SM8650"]),
        ("SM8650, RK3588,", ["SM8650", "RK3588"]),
        (["a", "b"], ["a", "b"]),
        ("", []),
        (None, []),
    ],
)
def test_parse_selection(value, expected):
    assert parse_selection(value) == expected


def test_default_selection_builds_the_demo_reference():
    assert select_builds(CONFIG, MODELS, TARGETS) == [Build("rwkv7-demo", "onnx", "fp32")]


def test_target_selection_uses_default_precisions():
    builds = select_builds(selection(target="SM8650,RK3588"), MODELS, TARGETS)
    assert [(b.target, b.precision) for b in builds] == [
        ("SM8650", "fp16"),
        ("SM8650", "a16w8"),
        ("RK3588", "fp16"),
    ]
    builds = select_builds(selection(target="SM8350"), MODELS, TARGETS)
    assert [(b.target, b.precision) for b in builds] == [("SM8350", "a16w8")]


def test_all_keyword():
    builds = select_builds(
        selection(model="all", target="RK3588", precision="all"), MODELS, TARGETS
    )
    # every model gets RK3588's three precisions unless its entry narrows them (llama-tiny
    # to fp16, smollm2-135m and its permuted twin to fp16 and w16a16i_dfp); models built
    # on request only are left out
    everyday = [m for m in MODELS.values() if not m.get("on_request")]
    expected = sum(
        len(model.get("precisions", {}).get("RK3588", TARGETS["RK3588"]["precisions"]))
        for model in everyday
    )
    assert len(builds) == expected
    built = [(b.model, b.target, b.precision) for b in builds]
    assert ("llama-tiny", "RK3588", "fp16") in built
    assert ("smollm2-135m", "RK3588", "w16a16i_dfp") in built
    assert ("smollm2-135m", "RK3588", "w8a8") not in built
    assert len(everyday) * 3 - expected == 4


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"model": "rwkv9"}, "unknown model 'rwkv9'; valid models: rwkv7-demo, rwkv7-tiny"),
        ({"target": "SM9999"}, "unknown target 'SM9999'; valid targets: onnx, SM8650"),
        ({"target": "SM8650", "precision": "int3"}, "unknown precision 'int3'; valid precisions:"),
        (
            {"target": "SM8350", "precision": "fp16"},
            "target SM8350 (Snapdragon 888 (HTP v68, no fp16)) does not support precision "
            "'fp16'; it supports: a16w8",
        ),
        (
            {"target": "RK3588,SM8650", "precision": "w8a8"},
            "target SM8650 (Snapdragon 8 Gen 3 (HTP v75)) does not support precision 'w8a8'",
        ),
        ({"target": ""}, "no target selected"),
    ],
)
def test_bad_selection_is_one_line_naming_choices(kw, message):
    with pytest.raises(NpuforgeError) as err:
        select_builds(selection(**kw), MODELS, TARGETS)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def built(**kw) -> list[tuple[str, str, str]]:
    return [
        (b.model, b.target, b.precision) for b in select_builds(selection(**kw), MODELS, TARGETS)
    ]


def test_listed_precisions_are_built_on_the_selected_targets_that_have_them():
    # onnx has no fp16 and RK3588 no fp32: each builds the one it has.
    assert built(target="onnx,RK3588", precision="fp32,fp16") == [
        ("rwkv7-demo", "onnx", "fp32"),
        ("rwkv7-demo", "RK3588", "fp16"),
    ]
    assert built(target="SM8650,RK3588", precision="w8a8,fp16,a16w8") == [
        ("rwkv7-demo", "SM8650", "fp16"),
        ("rwkv7-demo", "SM8650", "a16w8"),
        ("rwkv7-demo", "RK3588", "w8a8"),
        ("rwkv7-demo", "RK3588", "fp16"),
    ]
    # With every target: those that have it, the others left out.
    assert built(target="all", precision="a16w4") == [
        ("rwkv7-demo", t, "a16w4") for t, spec in TARGETS.items() if "a16w4" in spec["precisions"]
    ]


def test_a_precision_none_of_the_selected_targets_has_is_refused_in_one_line():
    with pytest.raises(NpuforgeError) as err:
        built(target="onnx,SM8350", precision="fp16")
    assert str(err.value) == (
        "no selected target supports precision 'fp16' (onnx: fp32; SM8350: a16w8)"
    )
    # One such precision in a list refuses the list: nothing is built for it.
    with pytest.raises(NpuforgeError, match="no selected target supports precision 'int8'"):
        built(target="onnx,RK3588", precision="fp32,int8")


def test_a_named_model_and_target_left_with_nothing_are_refused():
    # SM8650 gets none of the listed precisions: the selection names it for nothing.
    with pytest.raises(NpuforgeError) as err:
        built(target="RK3588,SM8650", precision="w8a8,w16a16i_dfp")
    assert str(err.value).startswith(
        "target SM8650 (Snapdragon 8 Gen 3 (HTP v75)) does not support any of the precisions "
        "'w8a8', 'w16a16i_dfp'; it supports: fp16, a16w8, a16w4"
    )
    # smollm2-135m's entry leaves w8a8 out on RK3588 (under its gate); rwkv7-tiny builds it.
    gate = r"model smollm2-135m is built for RK3588 in fp16, w16a16i_dfp only \(its registry"
    with pytest.raises(NpuforgeError, match=gate + r" entry's precisions\), not 'w8a8'"):
        built(model="smollm2-135m,rwkv7-tiny", target="RK3588", precision="w8a8")
    # With every model: the models whose entry leaves it out are left out.
    everyone = built(model="all", target="RK3588", precision="w8a8")
    assert ("rwkv7-tiny", "RK3588", "w8a8") in everyone
    assert "smollm2-135m" not in {model for model, _, _ in everyone}
    # ... but a named target left with nothing at all is still refused.
    with pytest.raises(NpuforgeError, match="target SM8650 .* does not support precision 'w8a8'"):
        built(model="all", target="RK3588,SM8650", precision="w8a8")


def test_a_listed_precision_no_selected_model_is_built_in_is_refused():
    # smollm2-135m builds fp16 on RK3588, never w8a8: the list asks for a build of it.
    with pytest.raises(NpuforgeError, match="model smollm2-135m is built for RK3588 .* not 'w8a8'"):
        built(model="smollm2-135m", target="RK3588", precision="fp16,w8a8")
    # Another selected model builds it: smollm2-135m builds what it has.
    pairs = built(model="smollm2-135m,rwkv7-tiny", target="RK3588,onnx", precision="fp16,w8a8,fp32")
    assert [b for b in pairs if b[0] == "smollm2-135m"] == [
        ("smollm2-135m", "RK3588", "fp16"),
        ("smollm2-135m", "onnx", "fp32"),
    ]


def test_targets_with_equal_needs_share_exports():
    plan = make_plan(selection(target="SM8650,SM8550,RK3588,onnx,BM1684X"), MODELS, TARGETS)
    demo = "rwkv7-demo"
    assert plan.export_keys(demo, "SM8650", "fp16") == plan.export_keys(demo, "SM8550", "fp16")
    assert plan.export_keys(demo, "SM8650", "fp16") != plan.export_keys(demo, "onnx", "fp32")
    assert len(plan.export_keys(demo, "BM1684X", "f16")) == 2
    prefill = plan.export_options(demo, plan.export_keys(demo, "BM1684X", "f16")[1])
    assert (prefill["variant"], prefill["tokens"]) == ("prefill", 32)
    # onnx, qnn (shared), rknn (ext embedding like qnn, same chunks here), tpumlir x2
    assert len(plan.exports) == len({k for key in plan.target_exports.values() for k in key})


def test_export_key_covers_every_option():
    base = export_variants(MODELS["rwkv7-demo"], TARGETS["onnx"])[0]
    keys = {export_key(base)}
    for option, value in [("dtype", "fp16"), ("ext_embedding", True), ("batch", 2), ("chunks", 2)]:
        keys.add(export_key(dict(base, **{option: value})))
    keys.add(export_key(dict(base, variant="prefill", tokens=16)))
    keys.add(export_key(dict(base, variant="prefill", tokens=32)))
    assert len(keys) == 7
    assert export_key(dict(base)) == export_key(base)


def test_chunk_policy_sets_the_fewest_chunks_from_the_model_size():
    policy = {"chunk_policy": {"max_chunk_bytes": 1.5e9, "bytes_per_param": 2}}
    assert policy_chunks(MODELS["rwkv7-demo"], policy) == 1
    big = {"arch": {"layers": 24, "embed": 2048, "vocab": 65536, "n_params": 1_600_000_000}}
    assert policy_chunks(big, policy) == 3
    assert policy_chunks(big, {}) == 1


def test_calibration_only_for_quantized_precisions():
    plan = make_plan(selection(target="SM8650", precision="fp16,a16w8"), MODELS, TARGETS)
    assert not plan.needs_calibration("SM8650", "fp16")
    assert plan.needs_calibration("SM8650", "a16w8")


def test_toolchain_check_asks_for_vendor_targets_only():
    asked = []

    def reason(backend, runtime, options):
        asked.append((backend, runtime, options["target_platform"]))
        return None

    plan = make_plan(selection(target="onnx,RK3588"), MODELS, TARGETS)
    check_toolchains(plan, {"RK3588": "podman"}, reason)
    assert asked == [("rknn", "podman", "rk3588")]

    def refuse(backend, runtime, options):
        return "no TPU-MLIR here: build the sophgo image (README)"

    plan = make_plan(selection(target="BM1684X"), MODELS, TARGETS)
    with pytest.raises(NpuforgeError, match="^target BM1684X: no TPU-MLIR here"):
        check_toolchains(plan, {"BM1684X": "native"}, refuse)


def test_target_all_skips_unavailable_toolchains_and_keeps_the_rest():
    def only_rknn_missing(backend, runtime, options):
        return "rknn-toolkit2 is missing" if backend == "rknn" else None

    plan = make_plan(selection(target="all", precision=""), MODELS, TARGETS)
    runtimes, _ = choose_runtimes(plan, "native", only_rknn_missing, ENGINES)
    skipped = check_toolchains(plan, runtimes, only_rknn_missing, skip=True)
    rknn_targets = sorted(t for t, spec in TARGETS.items() if spec["backend"] == "rknn")
    assert sorted(t for t, _ in skipped) == rknn_targets
    built = {b.target for b in plan.builds}
    assert not built & set(rknn_targets)
    assert {"onnx", "SM8650"} <= built


def test_registries_are_not_mutated_by_planning():
    before = copy.deepcopy(TARGETS)
    make_plan(selection(target="all", precision=""), MODELS, TARGETS)
    assert TARGETS == before


def test_prefill_export_is_verified_with_its_decode_partner():
    plan = make_plan(selection(target="BM1684X,onnx"), MODELS, TARGETS)
    decode, prefill = plan.export_keys("rwkv7-demo", "BM1684X", "f16")
    assert plan.verify_exports("rwkv7-demo", decode) == [decode]
    assert plan.verify_exports("rwkv7-demo", prefill) == [decode, prefill]
    onnx = plan.export_keys("rwkv7-demo", "onnx", "fp32")[0]
    assert plan.verify_exports("rwkv7-demo", onnx) == [onnx]


def test_model_export_overrides_apply_to_every_target():
    model = dict(MODELS["rwkv7-demo"], export={"chunks": 2, "prefill_tokens": 16})
    for target in ("SM8650", "onnx", "BM1684X"):
        variants = export_variants(model, TARGETS[target])
        assert {v["chunks"] for v in variants} == {2}
    prefill = export_variants(model, TARGETS["BM1684X"])[1]
    assert prefill["tokens"] == 16


def test_parsing_imports_nothing_heavy():
    code = (
        "import importlib, sys, npuforge.registry, npuforge.matrix, npuforge.toolchain\n"
        "for backend in ('onnx', 'qnn', 'rknn', 'tpumlir'):\n"
        "    importlib.import_module('npuforge.backends.' + backend)\n"
        "heavy = {'torch', 'onnx', 'onnxruntime', 'numpy', 'huggingface_hub'} & set(sys.modules)\n"
        "print(sorted(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert result.stdout.strip() == "[]"


def test_model_precisions_narrow_a_target():
    models = {"m": dict(MODELS["rwkv7-tiny"], precisions={"RK3588": ["fp16", "w16a16i_dfp"]})}

    def pick(**kw):
        builds = select_builds(selection(model="m", **kw), models, TARGETS)
        return [b.precision for b in builds]

    assert pick(target="RK3588") == ["fp16"]  # the target's defaults among the model's list
    assert pick(target="RK3588", precision="all") == ["fp16", "w16a16i_dfp"]
    assert pick(target="RK3588", precision="w16a16i_dfp") == ["w16a16i_dfp"]
    assert pick(target="RK3576", precision="all") == ["fp16", "w8a8"]  # not narrowed there
    with pytest.raises(NpuforgeError, match="built for RK3588 in fp16, w16a16i_dfp only"):
        pick(target="RK3588", precision="w8a8")
    models["m"]["precisions"] = {"RK3588": ["w16a16i_dfp"]}
    assert pick(target="RK3588") == ["w16a16i_dfp"]  # no default in the list: the list


def test_smollm2_is_built_in_the_precisions_that_pass_its_gate():
    def pick(target, precision):
        builds = select_builds(
            selection(model="smollm2-135m", target=target, precision=precision), MODELS, TARGETS
        )
        return [b.precision for b in builds]

    assert pick("SM8650", "all") == ["fp16", "a16w8", "a16w4"]
    assert pick("RK3588", "all") == ["fp16", "w16a16i_dfp"]
    assert pick("BM1688", "all") == pick("BM1684X", "all") == ["f16", "w8f16", "w4f16"]
    refused = [
        ("RK3588", "w8a8"),
        ("BM1684X", "int8"),
        ("BM1688", "bf16"),
    ]
    for target, failing in refused:
        with pytest.raises(NpuforgeError, match=f"built for {target} in .* only"):
            pick(target, failing)


def test_llama_export_options_carry_cache_and_sha():
    from npuforge.models import llama

    model = MODELS["llama-tiny"]
    (qnn,) = export_variants(model, TARGETS["SM8650"])
    (rknn,) = export_variants(model, TARGETS["RK3588"])
    assert qnn["sha"] is True and rknn["sha"] is False
    assert qnn["cache_len"] == rknn["cache_len"] == model["context_length"]
    assert qnn["mask_value"] == llama.MASK_VALUE
    assert qnn["fp16_fixes"] is True and "last_token_logits" not in qnn  # fp16-safe norms
    assert export_key(qnn) != export_key(rknn)  # SHA changes the bytes: its own export
    # The HTP's fp16 and a16w8 builds share the tanh form of SiLU; a16w4 keeps the
    # Sigmoid.
    (fp16,) = export_variants(model, TARGETS["SM8650"], "fp16")
    (a16w8,) = export_variants(model, TARGETS["SM8650"], "a16w8")
    (a16w4,) = export_variants(model, TARGETS["SM8650"], "a16w4")
    assert fp16 == a16w8 == dict(qnn, tanh_silu=True) and a16w4 == qnn
    assert "tanh_silu" not in qnn
    assert export_variants(model, TARGETS["RK3588"], "fp16") == [rknn]
    # RWKV exports keep their option set: the sha choice of a target does not split them
    assert export_variants(MODELS["rwkv7-tiny"], TARGETS["SM8650"]) == export_variants(
        MODELS["rwkv7-tiny"],
        dict(TARGETS["SM8650"], export={**TARGETS["SM8650"]["export"], "sha": False}),
    )


def test_llama_verification_runs_must_fit_the_cache():
    short = {"llama-tiny": dict(MODELS["llama-tiny"], context_length=48)}
    with pytest.raises(NpuforgeError, match=r"verify.tokens \(64\) exceeds its context_length"):
        make_plan(selection(model="llama-tiny", target="onnx"), short, TARGETS)
    plan = make_plan(
        selection(model="llama-tiny", target="onnx", verify={"tokens": 48}), short, TARGETS
    )
    assert [b.precision for b in plan.builds] == ["fp32"]


def test_a_model_verify_steps_replaces_the_targets_and_must_fit_the_cache():
    smollm2, demo = MODELS["smollm2-135m"], MODELS["rwkv7-demo"]
    assert TARGETS["SM8650"]["options"]["verify_steps"] == 32
    assert build_options(smollm2, TARGETS["SM8650"])["verify_steps"] == 64
    assert build_options(demo, TARGETS["SM8650"]) == TARGETS["SM8650"]["options"]
    # The model's figure is the one checked against its cache (less the kv_prefix slot).
    long = {"smollm2-135m": dict(smollm2, verify_steps=smollm2["context_length"])}
    with pytest.raises(NpuforgeError, match=r"SM8650 verify_steps \(256\) exceeds"):
        make_plan(selection(model="smollm2-135m", target="SM8650"), long, TARGETS)


def test_a_check_with_prefill_graphs_keeps_eight_decode_calls():
    """BM targets verify one 32-token prefill call, then decode calls: at least 8."""
    smollm2 = MODELS["smollm2-135m"]
    assert make_plan(selection(model="smollm2-135m", target="BM1688"), MODELS, TARGETS).builds
    short = {"smollm2-135m": dict(smollm2, verify_steps=39)}
    with pytest.raises(NpuforgeError, match="leaves 7 decode calls") as refused:
        make_plan(selection(model="smollm2-135m", target="BM1688"), short, TARGETS)
    assert "set verify_steps to at least 40" in str(refused.value)
    assert "\n" not in str(refused.value)
    twice = dict(
        TARGETS["BM1688"], options={**TARGETS["BM1688"]["options"], "verify_prefill_calls": 2}
    )
    with pytest.raises(NpuforgeError, match="after 2 32-token prefill call"):
        make_plan(
            selection(model="smollm2-135m", target="BM1688"), MODELS, {**TARGETS, "BM1688": twice}
        )
    # A decode-only check is decode calls throughout: a short one is the user's choice.
    few = {"smollm2-135m": dict(smollm2, verify_steps=4)}
    assert make_plan(selection(model="smollm2-135m", target="SM8650"), few, TARGETS).builds


def test_a_model_may_ask_for_more_calibration_samples():
    plan = make_plan(
        selection(model="smollm2-135m,rwkv7-demo", target="SM8650", precision="a16w4"),
        MODELS,
        TARGETS,
    )
    default = CONFIG["calibration"]["samples"]
    assert MODELS["smollm2-135m"]["calibration"]["samples"] == 64 != default
    assert plan.calibration_samples("smollm2-135m", default) == 64
    assert plan.calibration_samples("rwkv7-demo", default) == default


def test_llama_calibration_runs_as_many_calls_as_the_cache_holds():
    # llama-tiny's cache holds 64 tokens: 32 calls of a 4-token prefill graph do not fit,
    # so its prefill calibration makes 16; the decode graph's 32 one-token calls fit.
    sm8650 = dict(TARGETS["SM8650"])
    sm8650["export"] = dict(sm8650["export"], variants=["decode", "prefill"], prefill_tokens=4)
    targets = dict(TARGETS, SM8650=sm8650)
    plan = make_plan(
        selection(model="llama-tiny", target="SM8650", precision="a16w8"), MODELS, targets
    )
    decode, prefill = plan.export_keys("llama-tiny", "SM8650", "a16w8")
    assert plan.calibration_steps("llama-tiny", decode, 32) == 32
    assert plan.calibration_steps("llama-tiny", prefill, 32) == 16
    assert plan.calibration_steps("llama-tiny", prefill, 8) == 8
    # SmolLM2's kv_prefix takes one of its 256 slots: seven 32-token prefill calls fit
    # (int8 on request: its registry entry leaves it out, under its gate).
    smollm2 = {k: v for k, v in MODELS["smollm2-135m"].items() if k != "precisions"}
    plan = make_plan(
        selection(model="smollm2-135m", target="BM1688", precision="int8"),
        dict(MODELS, **{"smollm2-135m": smollm2}),
        TARGETS,
    )
    decode, prefill = plan.export_keys("smollm2-135m", "BM1688", "int8")
    assert plan.calibration_steps("smollm2-135m", prefill, 32) == 7
    # A model without a KV cache runs the configured calls.
    plan = make_plan(
        selection(model="rwkv7-demo", target="BM1688", precision="int8"), MODELS, TARGETS
    )
    (key, *_) = plan.export_keys("rwkv7-demo", "BM1688", "int8")
    assert plan.calibration_steps("rwkv7-demo", key, 32) == 32


@pytest.mark.parametrize("target", ["BM1684X", "BM1688"])
def test_tpumlir_refuses_batch_above_one_when_the_matrix_is_planned(target):
    # The cmodel check compares one sequence's logits: a batch-2 bmodel would go out
    # unverified, so the plan stops before any export or compile.
    batched = {"rwkv7-demo": dict(MODELS["rwkv7-demo"], export={"batch": 2})}
    with pytest.raises(NpuforgeError) as refused:
        make_plan(selection(model="rwkv7-demo", target=target), batched, TARGETS)
    assert str(refused.value) == (
        f"model rwkv7-demo on {target}: export.batch is 2, but the tpumlir backend builds "
        "and verifies batch 1 only; set export.batch: 1"
    )
    # Batch 1, and backends without the limit, plan as before.
    assert make_plan(selection(model="rwkv7-demo", target=target), MODELS, TARGETS).builds
    assert make_plan(selection(model="rwkv7-demo", target="onnx"), batched, TARGETS).builds


ENGINES = ("podman", "docker")


def test_auto_runtime_takes_the_first_engine_that_can_run_each_toolchain():
    asked = []

    def podman_cannot_run_tpumlir(backend, runtime, options):
        asked.append((backend, runtime))
        if backend == "tpumlir" and runtime == "podman":
            return "the TPU-MLIR image needs a CPython 3.10 base image"
        return None

    plan = make_plan(selection(target="onnx,RK3588,BM1684X", precision=""), MODELS, TARGETS)
    runtimes, notes = choose_runtimes(plan, "auto", podman_cannot_run_tpumlir, ENGINES)
    assert runtimes == {"RK3588": "podman", "BM1684X": "docker"}
    assert notes == []
    assert ("rknn", "docker") not in asked  # the first engine that can run it is taken


def test_auto_runtime_falls_back_to_native_and_says_why():
    def no_engine(backend, runtime, options):
        if runtime == "native":
            raise AssertionError("native is not asked by choose_runtimes")
        return f"container engine '{runtime}' is not installed"

    plan = make_plan(selection(target="RK3588,SM8650", precision=""), MODELS, TARGETS)
    runtimes, notes = choose_runtimes(plan, "auto", no_engine, ENGINES)
    assert runtimes == {"RK3588": "native", "SM8650": "native"}
    assert notes == [
        f"target {t} builds in the native toolchain environment, not in a container image "
        "(the reference runtime): container engine 'podman' is not installed"
        for t in ("RK3588", "SM8650")
    ]


def test_a_named_runtime_is_taken_as_it_is():
    def never(backend, runtime, options):
        raise AssertionError("a named runtime is not probed while choosing")

    plan = make_plan(selection(target="onnx,RK3588,SM8650", precision=""), MODELS, TARGETS)
    runtimes, notes = choose_runtimes(plan, "docker", never, ENGINES)
    assert runtimes == {"RK3588": "docker", "SM8650": "docker"} and notes == []


def test_smoothquant_gives_only_its_precision_an_export_of_its_own():
    # Built on request in every RK3588 precision (its entry leaves w8a8 out: under its gate).
    smollm2 = {k: v for k, v in MODELS["smollm2-135m"].items() if k != "precisions"}
    models = dict(MODELS, **{"smollm2-135m": smollm2})
    plan = make_plan(
        selection(model="smollm2-135m", target="RK3588", precision="all"), models, TARGETS
    )
    keys = {p: plan.export_keys("smollm2-135m", "RK3588", p) for p in ("fp16", "w16a16i_dfp")}
    (smoothed,) = plan.export_keys("smollm2-135m", "RK3588", "w8a8")
    assert keys["fp16"] == keys["w16a16i_dfp"] and smoothed not in keys["fp16"]
    assert plan.export_options("smollm2-135m", smoothed)["smoothquant"] == {"alpha": 0.7}
    assert "smoothquant" not in plan.export_options("smollm2-135m", keys["fp16"][0])
    # Precisions without it keep the export they had: same options, same key.
    model = {k: v for k, v in MODELS["smollm2-135m"].items() if k != "export"}
    model["export"] = {"kv_prefix": [1]}
    (plain,) = export_variants(model, TARGETS["RK3588"], "w8a8")
    assert export_key(plain) == keys["fp16"][0]


@pytest.mark.parametrize(
    "option, value",
    [
        ("smoothquant", {"w8a8": 0.5}),
        ("group_offsets", {"w4f16": 32}),
        ("block_centres", {"a16w4": 32}),
    ],
)
def test_a_llama_export_option_on_an_rwkv_model_is_refused_in_one_line(option, value):
    model = dict(MODELS["rwkv7-demo"], export={option: value})
    with pytest.raises(NpuforgeError, match=f"{option} is a llama export option") as err:
        export_variants(model, TARGETS["RK3588"], "w8a8")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "option, value",
    [
        ("smoothquant", 0.5),
        ("group_offsets", 32),
        ("block_centres", 32),
        ("rotate", 7),
        ("gptq", {"bits": 8}),
    ],
)
def test_a_per_precision_export_option_for_a_precision_no_target_builds_is_refused(option, value):
    smollm2 = dict(MODELS["smollm2-135m"], export={option: {"w8a9": value}})
    models = dict(MODELS, **{"smollm2-135m": smollm2})
    with pytest.raises(
        NpuforgeError, match=f"export.{option} names precision 'w8a9', which no target builds"
    ):
        make_plan(selection(model="smollm2-135m", target="RK3588"), models, TARGETS)


def test_group_offsets_give_only_their_precision_an_export_of_its_own():
    smollm2 = {k: v for k, v in MODELS["smollm2-135m"].items() if k != "precisions"}
    models = dict(MODELS, **{"smollm2-135m": smollm2})
    plan = make_plan(
        selection(model="smollm2-135m", target="BM1688", precision="f16,w4f16"), models, TARGETS
    )
    plain = plan.export_keys("smollm2-135m", "BM1688", "f16")
    split = plan.export_keys("smollm2-135m", "BM1688", "w4f16")
    assert len(split) == len(plain) == 2 and not set(split) & set(plain)
    for key in split:
        assert plan.export_options("smollm2-135m", key)["group_offsets"] == {"group": 32}
    assert not any("group_offsets" in plan.export_options("smollm2-135m", k) for k in plain)


def test_group_offsets_for_a_precision_built_with_the_sha_pass_is_refused():
    smollm2 = {k: v for k, v in MODELS["smollm2-135m"].items() if k != "precisions"}
    smollm2["export"] = dict(smollm2["export"], group_offsets={"a16w4": 32}, block_centres={})
    models = dict(MODELS, **{"smollm2-135m": smollm2})
    with pytest.raises(NpuforgeError, match="names a16w4, which a target builds with") as err:
        make_plan(
            selection(model="smollm2-135m", target="SM8650", precision="a16w4"), models, TARGETS
        )
    assert "\n" not in str(err.value)
    # Its other precisions plan as before.
    make_plan(selection(model="smollm2-135m", target="SM8650", precision="fp16"), models, TARGETS)


def test_block_centres_give_sm8650_a16w4_its_own_export_through_the_sha_pass():
    """Block centres split only the MLP, which the MHA->SHA pass leaves alone: SM8650's
    a16w4 (sha: true) gets an export of its own; a16w8 keeps the plain one. Naming one
    precision in both group splits is refused in one line."""
    smollm2 = {k: v for k, v in MODELS["smollm2-135m"].items() if k != "precisions"}
    models = dict(MODELS, **{"smollm2-135m": smollm2})
    plan = make_plan(
        selection(model="smollm2-135m", target="SM8650", precision="a16w8,a16w4"), models, TARGETS
    )
    plain = plan.export_keys("smollm2-135m", "SM8650", "a16w8")
    centred = plan.export_keys("smollm2-135m", "SM8650", "a16w4")
    assert not set(centred) & set(plain)
    for key in centred:
        options = plan.export_options("smollm2-135m", key)
        assert options["block_centres"] == {"group": 32} and options["sha"]
    assert not any("block_centres" in plan.export_options("smollm2-135m", k) for k in plain)

    smollm2["export"] = dict(smollm2["export"], group_offsets={"w4f16": 32, "a16w4": 32})
    models = dict(MODELS, **{"smollm2-135m": smollm2})
    with pytest.raises(NpuforgeError, match="both name a16w4") as err:
        make_plan(
            selection(model="smollm2-135m", target="SM8650", precision="a16w4"), models, TARGETS
        )
    assert "\n" not in str(err.value)


def test_a_build_rounded_at_export_is_measured_against_the_export_before_rounding():
    """GPTQ rounds the export's weights, so its fp32 graphs are no longer the model: the
    plan gives such a build reference exports of the same options without gptq (planned
    as exports too); other builds get none, and the compile job takes them."""
    smollm2 = dict(MODELS["smollm2-135m-permuted"])
    smollm2["precisions"] = {"RK3588": ["fp16", "w8a8"]}
    smollm2["export"] = dict(
        smollm2["export"],
        rotate={"w8a8": 0},
        gptq={"w8a8": {"bits": 8, "symmetric": False, "integer_zero": True}},
    )
    models = dict(MODELS, **{"smollm2-135m-permuted": smollm2})
    plan = make_plan(
        selection(model="smollm2-135m-permuted", target="RK3588", precision="fp16,w8a8"),
        models,
        TARGETS,
    )
    rounded = plan.export_keys("smollm2-135m-permuted", "RK3588", "w8a8")
    references = plan.reference_keys("smollm2-135m-permuted", "RK3588", "w8a8")
    assert len(references) == len(rounded) and not set(references) & set(rounded)
    for key, reference in zip(rounded, references, strict=True):
        options = plan.export_options("smollm2-135m-permuted", key)
        assert "gptq" in options
        unrounded = {k: v for k, v in options.items() if k != "gptq"}
        assert plan.export_options("smollm2-135m-permuted", reference) == unrounded
    assert plan.reference_keys("smollm2-135m-permuted", "RK3588", "fp16") == []


# ------------------------------------------------------------------ memory budget

# An RWKV-7 of 24 layers x 1024: 13.1M parameters per layer (12.5 * 1024^2), a 67.1M
# token table and as large a head.
MID = {
    "family": "rwkv",
    "version": 7,
    "source": {"synthetic": {"version": 7, "layers": 24, "embed": 1024, "vocab": 65536,
                             "head_size": 64, "seed": 0}},
    "format": "pth",
    "context_length": 1024,
    "tokenizer": "rwkv-world",
    "arch": {"layers": 24, "embed": 1024, "vocab": 65536, "head_size": 64},
}  # fmt: skip
MID_LAYER, MID_TABLE = 13_107_200, 67_108_864


def budgeted(target_id, gb, **fields):
    return dict(copy.deepcopy(TARGETS[target_id]), memory_budget_gb=gb, **fields)


def heaviest_chunk(layers_in_last, table_in_graph=False):
    # The exporters' split gives earlier chunks the extra layers: the last chunk, with
    # the head, is the heaviest when the table is external.
    return layers_in_last * MID_LAYER + MID_TABLE + (MID_TABLE if table_in_graph else 0)


def test_the_plan_takes_the_fewest_chunks_whose_compile_fits_the_budget():
    from npuforge.backends import base, qnn, rknn, tpumlir

    # RKNN, 46 bytes/parameter to compile beside the reference run's 8, external table:
    # 2 chunks of 12 layers need 12.1 GB, one needs 20.6 GB.
    plan = memory_plan(MID, budgeted("RK3588", 13), "fp16")
    per_param = rknn.COMPILE_BYTES_PER_PARAM["fp16"] + base.REFERENCE_BYTES_PER_PARAM
    assert plan.chunks == 2 and plan.problem is None
    assert plan.need_bytes == int(per_param * heaviest_chunk(12))
    assert per_param * heaviest_chunk(24) > 13e9 >= plan.need_bytes
    # A smaller budget asks for more chunks (3 of 8 layers: 9.3 GB).
    assert memory_plan(MID, budgeted("RK3588", 10), "fp16").chunks == 3
    # QNN: its own figure, the same split.
    plan = memory_plan(MID, budgeted("SM8650", 8), "fp16")
    assert plan.chunks == 2
    per_param = qnn.COMPILE_BYTES_PER_PARAM["fp16"] + base.REFERENCE_BYTES_PER_PARAM
    assert plan.need_bytes == int(per_param * heaviest_chunk(12))
    # TPU-MLIR: the table is in the graph, one chunk; RWKV's own figure.
    plan = memory_plan(MID, budgeted("BM1684X", 40), "f16")
    assert plan.chunks == 1 and plan.problem is None
    whole = heaviest_chunk(24, table_in_graph=True)
    per_param = compile_costs(tpumlir, "rwkv")["f16"] + base.REFERENCE_BYTES_PER_PARAM
    assert plan.need_bytes == int(per_param * whole)


def test_a_family_the_backend_measured_apart_plans_with_its_own_figure():
    """TPU-MLIR's tools take 48 bytes per parameter of an RWKV chunk against 40 of a
    Llama's: an RWKV model's chunks are planned and reserved by its family's figure, and
    a budget its heaviest one-layer chunk does not fit stops the plan with it."""
    from npuforge.backends import base, tpumlir
    from npuforge.memory_plan import chunk_params, parameter_counts

    rwkv = MODELS["rwkv7-1.5b-shape"]
    costs = tpumlir.COMPILE_BYTES_PER_PARAM_BY_FAMILY["rwkv"]
    assert costs["f16"] > tpumlir.COMPILE_BYTES_PER_PARAM["f16"]
    plan = memory_plan(rwkv, budgeted("BM1688", 12), "f16")
    sizes = chunk_params(parameter_counts(rwkv), 24, plan.chunks, False, plan.layers_per_chunk)
    per_param = costs["f16"] + base.REFERENCE_BYTES_PER_PARAM
    assert plan.problem is None and plan.need_bytes == int(per_param * max(sizes)) <= 12e9
    refused = memory_plan(rwkv, budgeted("BM1688", 8), "f16").problem
    assert "needs about 10.5 GB to compile (48 bytes/parameter" in refused
    assert "memory_budget_gb of 8" in refused


def test_a_device_limit_still_asks_for_at_least_its_chunks():
    # SM8650's chunk_policy (1.5 GB of fp16 weights per HTP context) on 1.6B parameters:
    # 3 chunks, though a big host budget would fit one.
    big = dict(MID, arch=dict(MID["arch"], n_params=1_600_000_000))
    assert memory_plan(big, budgeted("SM8650", 1000), "fp16").chunks == 3


def test_the_compile_job_reserves_what_its_plan_needs_above_the_targets_floor():
    models = dict(MODELS, mid=MID)
    targets = dict(TARGETS, RK3588=budgeted("RK3588", 13))
    plan = make_plan(selection(model="mid,rwkv7-demo", target="RK3588"), models, targets)
    need = plan.memory[("mid", "RK3588", "fp16")].need_bytes
    assert need > TARGETS["RK3588"]["compile_mem_mb"] * 1e6
    assert plan.compile_mem_mb("mid", "RK3588", "fp16") == math.ceil(need / 1e6)
    # The demo needs less than the floor: the floor is reserved.
    floor = TARGETS["RK3588"]["compile_mem_mb"]
    assert plan.memory[("rwkv7-demo", "RK3588", "fp16")].need_bytes < floor * 1e6
    assert plan.compile_mem_mb("rwkv7-demo", "RK3588", "fp16") == floor == 8000
    assert [k.split("-")[2] for k in plan.export_keys("mid", "RK3588", "fp16")] == ["c2"]


def test_each_chunk_job_reserves_its_own_chunks_need():
    # SM8650 a16w8 within 13 GB: 12 layers, then 12 beside the head. Its chunks are jobs
    # of their own that run no fp32 graph: each reserves its chunk's compile alone; the
    # compile, which runs the reference, the heaviest chunk's compile with it.
    from npuforge.backends import base, qnn

    models = dict(MODELS, mid=MID)
    targets = dict(TARGETS, SM8650=budgeted("SM8650", 13, compile_mem_mb=2000))
    plan = make_plan(selection(model="mid", target="SM8650", precision="a16w8"), models, targets)
    assert plan.chunk_jobs("mid", "SM8650", "a16w8") == [0, 1]
    compile_only = qnn.COMPILE_BYTES_PER_PARAM["a16w8"]
    with_reference = compile_only + base.REFERENCE_BYTES_PER_PARAM
    first = math.ceil(int(compile_only * 12 * MID_LAYER) / 1e6)
    assert plan.chunk_mem_mb("mid", "SM8650", "a16w8", 0) == first == 4719
    last = plan.chunk_mem_mb("mid", "SM8650", "a16w8", 1)
    assert last == math.ceil(int(compile_only * heaviest_chunk(12)) / 1e6)
    compile_mb = plan.compile_mem_mb("mid", "SM8650", "a16w8")
    assert compile_mb == math.ceil(int(with_reference * heaviest_chunk(12)) / 1e6) > last

    # With the per-layer analysis (layer_error), a chunk's job runs the fp32 graphs too.
    analysed = budgeted("SM8650", 13, compile_mem_mb=2000)
    analysed["options"]["layer_error"] = 4
    plan = make_plan(
        selection(model="mid", target="SM8650", precision="a16w8"),
        models,
        dict(TARGETS, SM8650=analysed),
    )
    assert plan.chunk_mem_mb("mid", "SM8650", "a16w8", 1) == compile_mb
    assert plan.chunk_mem_mb("mid", "SM8650", "a16w8", 0) == math.ceil(
        int(with_reference * 12 * MID_LAYER) / 1e6
    )


def test_tpumlir_chunk_jobs_reserve_the_reference_run_they_make():
    # A TPU-MLIR chunk job runs the fp32 graphs for its nets' test feeds.
    models = dict(MODELS, mid=MID)
    targets = dict(TARGETS, BM1684X=budgeted("BM1684X", 8, compile_mem_mb=1000))
    plan = make_plan(selection(model="mid", target="BM1684X", precision="f16"), models, targets)
    chunks = plan.chunk_jobs("mid", "BM1684X", "f16")
    assert len(chunks) > 1
    memory = plan.memory[("mid", "BM1684X", "f16")]
    assert max(memory.chunk_need_bytes) == memory.need_bytes
    last = plan.chunk_mem_mb("mid", "BM1684X", "f16", chunks[-1])
    assert last == plan.compile_mem_mb("mid", "BM1684X", "f16") > 1000


def refusal(model, target_id, target, precision):
    models, targets = dict(MODELS, mid=model), dict(TARGETS, **{target_id: target})
    config = selection(model="mid", target=target_id, precision=precision)
    with pytest.raises(NpuforgeError) as err:
        make_plan(config, models, targets)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model mid on {target_id} ({precision}): ")
    return message


def test_a_layer_alone_over_the_budget_stops_the_plan_in_one_line():
    # One layer and the head: 80.2M parameters, 4.3 GB at 46 bytes each to compile and
    # 8 for the reference run over the same chunk.
    message = refusal(MID, "RK3588", budgeted("RK3588", 4), "fp16")
    assert "one layer with the head" in message
    assert "about 4.3 GB" in message and "memory_budget_gb of 4" in message
    assert "(46 bytes/parameter, npuforge.backends.rknn, and 8 for the fp32 reference" in message
    assert message.endswith(
        "raise the target's memory_budget_gb or build on a host with more memory"
    )


def test_a_layer_over_the_devices_chunk_limit_names_the_limit_not_the_budget():
    # One layer and the head (80.2M parameters, 160 MB in fp16) over a device's limit of
    # 100 MB per chunk, within a host budget of 16 GB.
    target = budgeted("SM8650", 16)
    target["export"] = {**target["export"], "chunk_policy": {"max_chunk_bytes": 100e6,
                                                             "bytes_per_param": 2}}  # fmt: skip
    message = refusal(MID, "SM8650", target, "fp16")
    assert "holds about 0.2 GB of weights at 2 bytes/parameter, over the target's " in message
    assert "chunk_policy max_chunk_bytes of 0.1 GB" in message
    assert "memory_budget_gb" not in message


def test_explicit_chunks_win_and_are_refused_when_they_break_the_budget():
    fixed = dict(MID, export={"chunks": 4})
    assert memory_plan(fixed, budgeted("RK3588", 13), "fp16").chunks == 4
    message = refusal(dict(MID, export={"chunks": 1}), "RK3588", budgeted("RK3588", 13), "fp16")
    assert "export.chunks: 1 makes its compile job need about 20.6 GB" in message
    assert "memory_budget_gb of 13" in message and "the plan takes 2" in message


def test_tpumlir_plans_chunks_like_the_other_backends():
    # One net per chunk (npuforge.backends.tpumlir): a budget too small for one chunk
    # gives two, and an explicit chunks is taken.
    plan = memory_plan(MID, budgeted("BM1684X", 20), "f16")
    assert plan.problem is None and plan.chunks == 2 and plan.need_bytes <= 20e9
    assert memory_plan(dict(MID, export={"chunks": 2}), budgeted("BM1684X", 24), "f16").chunks == 2


def test_a_chunked_tpumlir_build_compiles_each_chunk_in_a_job_of_its_own():
    models = dict(MODELS, mid=MID)
    targets = dict(TARGETS, BM1684X=budgeted("BM1684X", 20), RK3588=budgeted("RK3588", 13))
    plan = make_plan(selection(model="mid,rwkv7-demo", target="BM1684X,RK3588"), models, targets)
    assert plan.chunk_jobs("mid", "BM1684X", "f16") == [0, 1]
    # One chunk needs no job of its own; RKNN builds its chunks in one job.
    assert plan.chunk_jobs("rwkv7-demo", "BM1684X", "f16") == []
    assert plan.memory[("mid", "RK3588", "fp16")].chunks == 2
    assert plan.chunk_jobs("mid", "RK3588", "fp16") == []


def test_registry_builds_keep_their_chunks():
    # SmolLM2 (6.2 GB in one chunk at RKNN's 46 bytes/parameter) keeps the two chunks its
    # measured RKNN builds have; everything else in the registry is one chunk.
    for precision in ("", "all"):
        plan = make_plan(selection(model="all", target="all", precision=precision), MODELS, TARGETS)
        for (model, target, _), keys in plan.target_exports.items():
            two = model.startswith("smollm2-135m") and TARGETS[target]["backend"] == "rknn"
            assert {key.split("-")[2] for key in keys} == {"c2" if two else "c1"}


# ------------------------------------------------------------------ seed-size shapes

SEEDS = ("qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape", "rwkv7-1.5b-shape")


def test_models_built_on_request_are_left_out_of_all_and_planned_when_named():
    assert all(MODELS[seed].get("on_request") for seed in SEEDS)
    everything = {
        b.model for b in select_builds(selection(model="all", target="all"), MODELS, TARGETS)
    }
    assert everything and not everything & set(SEEDS)
    plan = make_plan(selection(model="qwen2.5-0.5b-shape", target="SM8650"), MODELS, TARGETS)
    assert [(b.model, b.precision) for b in plan.builds] == [
        ("qwen2.5-0.5b-shape", "fp16"),
        ("qwen2.5-0.5b-shape", "a16w8"),
    ]


@pytest.mark.parametrize(
    "seed, public",
    [
        ("qwen2.5-0.5b-shape", 494_000_000),  # Qwen2.5-0.5B: 0.49B
        ("qwen2.5-1.5b-shape", 1_540_000_000),  # Qwen2.5-1.5B: 1.54B
        ("rwkv7-1.5b-shape", 1_500_000_000),  # RWKV-7 World 1.5B
    ],
)
def test_seed_shapes_count_the_public_models_parameters(seed, public):
    assert "n_params" not in MODELS[seed]["arch"]  # counted from the dimensions
    assert abs(estimate_params(MODELS[seed]) - public) <= 0.02 * public


def test_the_rwkv_estimate_is_close_to_the_checkpoint_layout():
    from npuforge.models.rwkv import layout
    from npuforge.models.rwkv.synthetic import make_config

    spec = MODELS["rwkv7-1.5b-shape"]["source"]["synthetic"]
    config = make_config(7, spec["layers"], spec["embed"], spec["vocab"], spec["head_size"])
    exact = sum(math.prod(shape) for shape in layout.expected_shapes(config).values())
    assert abs(estimate_params(MODELS["rwkv7-1.5b-shape"]) - exact) <= 0.01 * exact


def test_a_synthetic_llama_is_counted_as_its_checkpoint_is_written(tmp_path):
    from npuforge.models.llama.weights import write_synthetic_checkpoint

    # The seed's structure (qwen2: QKV bias, tied) at toy width; and untied llama.
    for spec in (
        dict(arch="qwen2", layers=3, embed=48, heads=6, kv_heads=2, vocab=300,
             intermediate=80, tied=True, seed=0),
        dict(arch="llama", layers=2, embed=32, heads=4, kv_heads=4, vocab=100,
             intermediate=64, seed=0),
    ):  # fmt: skip
        model = {
            "family": "llama",
            "source": {"synthetic": spec},
            "arch": {k: spec[k] for k in ("layers", "embed", "vocab")},
        }
        written = write_synthetic_checkpoint(tmp_path / spec["arch"], **spec)
        assert estimate_params(model) == written["n_params"]
    # llama-tiny's recorded count, from its dimensions alone
    tiny = copy.deepcopy(MODELS["llama-tiny"])
    recorded = tiny["arch"].pop("n_params")
    assert estimate_params(tiny) == recorded


def test_a_synthetic_checkpoints_fetch_reserves_its_tensors():
    seed = MODELS["qwen2.5-1.5b-shape"]
    # float32 tensors, held whole while the file is written
    assert fetch_mem_mb(seed) > estimate_params(seed) * 4 / 1e6
    assert fetch_mem_mb(MODELS["smollm2-135m"]) == fetch_mem_mb(MODELS["rwkv7-tiny"]) == 2000


def test_an_export_reserves_its_heaviest_chunk_unless_a_lever_needs_the_whole_model():
    from npuforge.memory_plan import export_mem_mb, verify_mem_mb, whole_model_mem_mb

    model = MODELS["qwen2.5-1.5b-shape"]
    whole = whole_model_mem_mb(model)
    assert whole == math.ceil(estimate_params(model) * 16 / 1e6)
    one = export_mem_mb(model, {"chunks": 1, "ext_embedding": True})
    six = export_mem_mb(model, {"chunks": 6, "ext_embedding": True})
    # Six chunks: the last, the heaviest, holds the 233M-parameter head and 4 of the 28
    # layers; the reservation follows it.
    from npuforge.memory_plan import EXPORT_CHUNK_BYTES_PER_PARAM, chunk_params, parameter_counts

    heaviest = max(chunk_params(parameter_counts(model), 28, 6, True))
    assert heaviest < estimate_params(model) / 3
    assert six == math.ceil(heaviest * EXPORT_CHUNK_BYTES_PER_PARAM / 1e6) and six < one / 2
    assert export_mem_mb(model, {"chunks": 6, "rotate": {"seed": 0}}) == whole
    # RWKV's exporter reads the checkpoint chunk by chunk too.
    rwkv = MODELS["rwkv7-1.5b-shape"]
    assert export_mem_mb(rwkv, {"chunks": 6}) < whole_model_mem_mb(rwkv) / 2
    assert whole_model_mem_mb(model) > verify_mem_mb(model)
    # Calibration capture holds one chunk's graph and samples, as the export does.
    from npuforge.memory_plan import CALIBRATION_CHUNK_BYTES_PER_PARAM, calibration_mem_mb

    options = {"chunks": 6, "ext_embedding": True}
    expected = math.ceil(heaviest * CALIBRATION_CHUNK_BYTES_PER_PARAM / 1e6)
    assert calibration_mem_mb(model, options) == expected < whole / 4


@pytest.mark.parametrize("layers", [1, 5, 24, 28])
def test_balanced_sizes_are_the_even_split_until_a_limit_binds(layers):
    from npuforge.memory_plan import balanced_sizes
    from npuforge.onnx_io import split_layers

    for chunks in range(1, layers + 1):
        even = [end - start for start, end in split_layers(layers, chunks)]
        assert balanced_sizes(layers, [layers] * chunks) == even
    if layers == 28:
        # The last chunk holds the head: one layer beside it, the rest spread evenly.
        assert balanced_sizes(28, [6, 6, 6, 6, 6, 1]) == [6, 6, 5, 5, 5, 1]
        assert balanced_sizes(28, [6, 6, 6, 6, 6, 0]) is None
        assert balanced_sizes(28, [5, 5, 5, 5, 5, 1]) is None


def test_the_plan_gives_the_heads_chunk_fewer_layers_where_even_chunks_do_not_fit():
    model = MODELS["qwen2.5-1.5b-shape"]
    target = dict(TARGETS["RK3588"], memory_budget_gb=16)
    plan = memory_plan(model, target, "fp16")
    assert plan.problem is None and plan.need_bytes <= 16e9
    assert plan.chunks == 6 and plan.layers_per_chunk == (6, 6, 5, 5, 5, 1)
    # Six even chunks put the head beside five layers: over the budget.
    even = dict(target, export=dict(target["export"], chunks=6))
    assert "over the target's memory_budget_gb of 16" in memory_plan(model, even, "fp16").problem
    # The export follows the plan; a plan whose even split fits keeps it (and its key).
    (options, *_) = export_variants(model, target, "fp16")
    assert options["layers_per_chunk"] == [6, 6, 5, 5, 5, 1]
    assert "layers_per_chunk" not in export_variants(MODELS["smollm2-135m"], TARGETS["RK3588"])[0]
