"""Registries: the shipped YAML validates, overlays merge, bad entries are refused."""

import copy

import jsonschema
import pytest
import yaml
from conftest import REPO

from npuforge.errors import NpuforgeError
from npuforge.registry import check_registries, load_registries, merge_registry

SCHEMAS = REPO / "config" / "schemas"


def schema(name):
    return yaml.safe_load((SCHEMAS / f"{name}.schema.yaml").read_text())


def shipped(overlay=None):
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config.update(overlay or {})
    return load_registries(config, REPO)


def valid(kind, data):
    jsonschema.validate(data, schema(kind))


def test_shipped_files_validate():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    valid("config", config)
    models, targets = shipped()
    valid("models", models)
    valid("targets", targets)
    check_registries(models, targets)


@pytest.mark.parametrize(
    "target, htp_arch, soc_model",
    [
        ("SM8650", 75, 57),
        ("SM8550", 73, 43),
        ("SM8750", 79, 69),
        ("SC8380", 73, 60),
        ("SM8475", 69, 42),
        ("SM8350", 68, 30),
    ],
)
def test_qualcomm_socs(target, htp_arch, soc_model):
    _, targets = shipped()
    entry = targets[target]
    assert entry["backend"] == "qnn"
    assert (entry["options"]["htp_arch"], entry["options"]["soc_model"]) == (htp_arch, soc_model)
    # fp16 needs HTP v69 or newer.
    assert ("fp16" in entry["precisions"]) == (htp_arch >= 69)


def test_other_socs_and_reference():
    _, targets = shipped()
    assert targets["RK3588"]["options"]["target_platform"] == "rk3588"
    assert set(targets["RK3588"]["precisions"]) == {"fp16", "w8a8", "w16a16i_dfp"}
    assert targets["RK3576"]["options"]["target_platform"] == "rk3576"
    assert targets["BM1684X"]["options"]["processor"] == "bm1684x"
    assert targets["BM1688"]["options"]["processor"] == "bm1688"
    assert targets["BM1684X"]["export"]["variants"] == ["decode", "prefill"]
    assert targets["onnx"]["backend"] == "onnx" and list(targets["onnx"]["precisions"]) == ["fp32"]


def test_default_model_is_the_synthetic_demo():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    models, _ = shipped()
    demo = models[config["model"]]
    assert demo["source"]["synthetic"] == {
        "version": 7,
        "layers": 4,
        "embed": 256,
        "vocab": 65536,
        "head_size": 64,
        "seed": 0,
    }
    assert config["target"] == "onnx"


def test_overlay_adds_and_merges_without_leaking_through_anchors():
    overlay = {
        "models": {
            "local": {
                "family": "rwkv",
                "version": 7,
                "source": {"path": "/abs/ckpt.pth"},
                "sha256": "a" * 64,
                "format": "pth",
                "context_length": 4096,
                "tokenizer": "rwkv-world",
                "arch": {"layers": 12, "embed": 768, "vocab": 65536},
            }
        },
        "targets": {"SM8650": {"export": {"ext_embedding": False}}},
    }
    models, targets = shipped(overlay)
    valid("models", models)
    valid("targets", targets)
    assert models["local"]["source"] == {"path": "/abs/ckpt.pth"}
    assert targets["SM8650"]["export"]["ext_embedding"] is False
    assert targets["SM8650"]["export"]["variants"] == ["decode"]  # merged, not replaced
    # SM8550 shares the YAML anchor of SM8650's export block; it must not change.
    assert targets["SM8550"]["export"]["ext_embedding"] is True


def test_overlay_replaces_the_source_whole():
    registry = {"m": {"source": {"synthetic": {"seed": 0}}, "format": "pth"}}
    merged = merge_registry(registry, {"m": {"source": {"path": "/x.pth"}}})
    assert merged["m"]["source"] == {"path": "/x.pth"}
    assert registry["m"]["source"] == {"synthetic": {"seed": 0}}


def test_schema_refuses_branch_revision_and_missing_sha256():
    models, _ = shipped()
    entry = copy.deepcopy(models["rwkv7-demo"])
    entry["source"] = {
        "hf": {"repo": "BlinkDL/rwkv-7-world", "filename": "x.pth", "revision": "main"}
    }
    entry["sha256"] = "b" * 64
    with pytest.raises(jsonschema.ValidationError):
        valid("models", {"x": entry})
    entry["source"]["hf"]["revision"] = "c" * 40
    valid("models", {"x": entry})
    del entry["sha256"]
    with pytest.raises(jsonschema.ValidationError):
        valid("models", {"x": entry})


def test_schema_refuses_chunks_and_policy_together():
    _, targets = shipped()
    entry = copy.deepcopy(targets["SM8650"])
    entry["export"]["chunks"] = 2
    with pytest.raises(jsonschema.ValidationError):
        valid("targets", {"X": entry})


def test_semantic_checks():
    models, targets = shipped()
    bad_targets = copy.deepcopy(targets)
    bad_targets["SM8350"]["default_precisions"] = ["fp16"]
    with pytest.raises(NpuforgeError, match="SM8350: default precision 'fp16'"):
        check_registries(models, bad_targets)
    bad_models = copy.deepcopy(models)
    bad_models["rwkv7-demo"]["arch"]["layers"] = 5
    with pytest.raises(NpuforgeError, match="layers=4 differs from arch.layers=5"):
        check_registries(bad_models, targets)
    bad_models = copy.deepcopy(models)
    bad_models["rwkv7-demo"]["source"] = {"path": "relative/ckpt.pth"}
    with pytest.raises(NpuforgeError, match="must be an absolute path"):
        check_registries(bad_models, targets)


def test_directory_format_goes_with_a_snapshot():
    models, targets = shipped()
    bad = copy.deepcopy(models)
    bad["rwkv7-demo"]["format"] = "hf"
    with pytest.raises(NpuforgeError, match="format hf needs hf.snapshot: true"):
        check_registries(bad, targets)
    entry = copy.deepcopy(models["rwkv7-demo"])
    entry.update(format="hf", sha256="d" * 64)
    entry["source"] = {"hf": {"repo": "org/llama", "snapshot": True, "revision": "e" * 40}}
    valid("models", {"llama": entry})
    check_registries({"llama": entry}, targets)


def test_synthetic_llama_is_a_model_directory():
    models, targets = shipped()
    check_registries({"llama-tiny": models["llama-tiny"]}, targets)
    bad = copy.deepcopy(models["llama-tiny"])
    bad["format"] = "safetensors"
    with pytest.raises(NpuforgeError, match="synthetic llama checkpoint is a model directory"):
        check_registries({"x": bad}, targets)
    bad = copy.deepcopy(models["llama-tiny"])
    bad["precisions"] = {"RK3588": ["fp32"]}
    with pytest.raises(NpuforgeError, match="precision 'fp32' for RK3588 is not among"):
        check_registries({"x": bad}, targets)


def test_each_backends_options_schema_names_exactly_its_options_dataclass():
    import dataclasses

    from npuforge import backends

    schema = yaml.safe_load((REPO / "config" / "schemas" / "targets.schema.yaml").read_text())
    for name in backends.BACKENDS:
        fields = {f.name for f in dataclasses.fields(backends.get(name).Options)}
        assert set(schema["$defs"][name]["properties"]) == fields, name


def test_a_typo_in_target_options_is_one_line_naming_the_valid_ones():
    from npuforge import backends

    with pytest.raises(NpuforgeError, match="unknown option 'verfy_steps'; valid options: "):
        backends.options_of("rknn", {"target_platform": "rk3588", "verfy_steps": 8}, "RK3588")
    with pytest.raises(NpuforgeError, match="target SM8650: options need 'htp_arch'"):
        backends.options_of("qnn", {"soc_model": 57}, "SM8650")


def test_chip_tables_are_checked_when_the_registry_loads():
    from npuforge.registry import check_registries, load_registries

    cases = [
        ({"RK3588": {"precisions": {"fp16": {}, "w16a16i": {"calibrate": True}}}},
         "cannot build precision 'w16a16i'"),
        ({"SM8550": {"options": {"soc_model": 57}}}, "do not match the QNN SDK's 43/73"),
        ({"SM8475": {"precisions": {"a16w4": {"calibrate": True}}}}, "needs v73 or newer"),
        ({"BM1684X": {"options": {"processor": "bm1690"}}}, "processor 'bm1690'"),
    ]  # fmt: skip
    for overlay, message in cases:
        config = {
            "models_registry": "config/models.yaml",
            "targets_registry": "config/targets.yaml",
            "targets": overlay,
        }
        models, targets = load_registries(config, REPO)
        with pytest.raises(NpuforgeError, match=message):
            check_registries(models, targets)


def test_permuted_twin_names_a_llama_model_with_its_own_checkpoint():
    models, targets = shipped()
    twin = models["smollm2-135m-permuted"]
    assert twin["source"] == {"permuted": {"model": "smollm2-135m", "seed": 0}}
    assert "test fixture of quantization" in " ".join(twin["description"].split())
    check_registries({"t": twin, "smollm2-135m": models["smollm2-135m"]}, targets)
    cases = [
        ({"model": "nope", "seed": 0}, {}, "names unknown model 'nope'"),
        ({"model": "t", "seed": 0}, {}, "a model with a checkpoint of its own"),
        ({"model": "rwkv7-demo", "seed": 0}, {}, "llama family only"),
        ({"model": "smollm2-135m", "seed": 0}, {"format": "safetensors"}, "set format: hf"),
        ({"model": "smollm2-135m", "seed": 0}, {"arch": {"layers": 2, "embed": 576,
         "vocab": 49152}}, r"arch.layers=2 differs from its source smollm2-135m's \(30\)"),
    ]  # fmt: skip
    for source, change, message in cases:
        bad = {**copy.deepcopy(twin), "source": {"permuted": source}, **change}
        registry = {**models, "t": bad}
        with pytest.raises(NpuforgeError, match=message) as err:
            check_registries(registry, targets)
        assert "\n" not in str(err.value)
    bad = copy.deepcopy(twin)
    bad["source"]["permuted"]["seed"] = -1
    with pytest.raises(jsonschema.ValidationError):
        valid("models", {"t": bad})


def test_every_target_has_a_memory_budget_and_its_backend_a_compile_cost():
    from npuforge import backends

    _, targets = shipped()
    for target_id, target in targets.items():
        assert target["memory_budget_gb"] > 0, target_id
        costs = backends.get(target["backend"]).COMPILE_BYTES_PER_PARAM
        assert set(target["precisions"]) <= set(costs), target_id
    entry = copy.deepcopy(targets["RK3588"])
    del entry["memory_budget_gb"]
    with pytest.raises(jsonschema.ValidationError, match="'memory_budget_gb' is a required"):
        valid("targets", {"X": entry})


def test_a_llama_model_without_n_params_is_estimated_and_a_synthetic_one_counted():
    """Without arch.n_params a llama from a download is estimated from its dimensions
    (its FFN width is unknown to the registry); a synthetic one is counted tensor by
    tensor from its source, exactly."""
    from npuforge.memory_plan import estimate_params

    models, targets = shipped()
    bad = copy.deepcopy(models)
    del bad["smollm2-135m"]["arch"]["n_params"]
    check_registries(bad, targets)
    arch = bad["smollm2-135m"]["arch"]
    guess = 2 * arch["vocab"] * arch["embed"] + arch["layers"] * 12.5 * arch["embed"] ** 2
    assert estimate_params(bad["smollm2-135m"]) == int(guess)
    tiny = copy.deepcopy(models["llama-tiny"])
    counted = estimate_params(
        dict(tiny, arch={k: v for k, v in tiny["arch"].items() if k != "n_params"})
    )
    assert counted == tiny["arch"]["n_params"]


def test_on_request_is_a_flag_of_the_model_schema():
    models, _ = shipped()
    entry = copy.deepcopy(models["qwen2.5-0.5b-shape"])
    valid("models", {"x": entry})
    entry["on_request"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        valid("models", {"x": entry})
