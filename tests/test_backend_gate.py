"""The shared gate of every backend: floors by precision and by the kind of weights, and
the one line a failed check prints."""

import numpy as np
import pytest

from npuforge import backends
from npuforge.backends import base, gate, qnn, rknn
from npuforge.errors import NpuforgeError
from npuforge.registry import model_weights


def test_trained_weights_are_gated_on_top1_and_perplexity():
    options = backends.options_of("qnn", {"htp_arch": 75, "soc_model": 57}, "SM8650")
    trained = gate.floors_for(qnn.FLOORS, options, "fp16", "trained")
    assert trained == {"min_cosine": 0.999, "min_top1": 0.99, "max_perplexity_delta": 0.005}
    # Random weights keep the cosine floor their figures were measured against.
    assert gate.floors_for(qnn.FLOORS, options, "fp16", "synthetic") == {"min_cosine": 0.9999}
    # Quantized precisions: task-level floors by weight bit width (the gates).
    eight = {"min_top1": 0.95, "max_perplexity_delta": 0.03}
    four = {"min_top1": 0.90, "max_perplexity_delta": 0.10}
    for precision in ("a16w8", "w8a8", "int8", "w8f16", "w16a16i_dfp"):
        assert gate.floors_for(rknn.FLOORS, None, precision, "trained") == eight
    for precision in ("a16w4", "w4f16"):
        assert gate.floors_for(rknn.FLOORS, None, precision, "trained") == four
    assert gate.floors_for(rknn.FLOORS, None, "w8a8", "synthetic") == rknn.FLOORS["w8a8"]


def test_a_target_option_overrides_the_trained_floors():
    options = backends.options_of(
        "qnn", {"htp_arch": 75, "soc_model": 57, "min_top1": {"fp16": 0.9}}, "SM8650"
    )
    assert gate.floors_for(qnn.FLOORS, options, "fp16", "trained")["min_top1"] == 0.9


def test_the_registry_says_which_weights_a_model_has():
    assert model_weights({"source": {"synthetic": {"seed": 0}}}) == "synthetic"
    assert model_weights({"source": {"pypi": {"package": "p"}}}) == "trained"
    assert model_weights({"source": {"path": "/x.pth"}}) == "trained"


def test_a_request_names_its_weights():
    with pytest.raises(NpuforgeError, match="weights must be one of trained, synthetic"):
        base.CompileRequest(
            exports=(), target="t", options=None, precision="fp16", out_dir="o", weights="random"
        )


def _record(reference, compiled, floors):
    ids = np.arange(reference.shape[0] + 1) % reference.shape[1]
    figures = gate.fidelity(reference, compiled, ids[1:])
    return gate.verification(
        figures, floors, schedule=[], text={"source": "t"}, runner="sim", reference="fp32"
    )


def test_a_failed_check_is_one_line_with_every_figure():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((16, 50)).astype(np.float32) * 4
    flipped = reference.copy()
    # Swap the top two logits at one position: top-1 fails, cosine barely moves.
    top2 = np.argsort(flipped[3])[-2:]
    flipped[3, top2] = flipped[3, top2[::-1]]
    floors = {"min_cosine": 0.9, "min_top1": 0.99, "max_perplexity_delta": 0.5}
    record = _record(reference, flipped, floors)
    assert not record["passed"] and len(record["failures"]) == 1
    with pytest.raises(NpuforgeError) as failed:
        gate.check_gate("SM8650", "fp16", record, "try fp16")
    message = str(failed.value)
    assert "\n" not in message
    assert "top-1 agreement 0.9375 < 0.99" in message
    # The figures that passed are named too, once each.
    assert message.count("logits cosine") == 1 and "perplexity" in message
    assert message.endswith("against fp32; try fp16")
    # The miss is named with fp32's own margin there (its top-1 minus top-2 logit).
    ranked = np.sort(reference[3])
    margin = round(float(ranked[-1] - ranked[-2]), 4)
    assert record["top1_misses"] == [{"position": 3, "fp32_margin": margin}]
    assert f"top-1 differs at positions 3 ({margin})," in message


def test_a_failed_check_names_the_first_misses_and_counts_the_rest():
    rng = np.random.default_rng(1)
    reference = rng.standard_normal((16, 50)).astype(np.float32)
    record = _record(reference, -reference, {"min_top1": 0.99})
    assert len(record["top1_misses"]) == 16
    with pytest.raises(NpuforgeError) as failed:
        gate.check_gate("RK3588", "w8a8", record, "try fp16")
    message = str(failed.value)
    named = message.split("top-1 differs at positions ")[1].split(", fp32's")[0]
    assert named.startswith("0 (") and named.endswith(f"and {16 - gate.MISSES_NAMED} more")
    assert named.count("(") == gate.MISSES_NAMED and "\n" not in message


def test_a_failed_cosine_names_its_worst_position_and_the_mean():
    rng = np.random.default_rng(2)
    reference = rng.standard_normal((8, 50)).astype(np.float32)
    compiled = reference.copy()
    compiled[5] += rng.standard_normal(50).astype(np.float32) * 0.2
    record = _record(reference, compiled, {"min_cosine": 0.9999})
    assert record["worst_cosine_position"] == 5
    with pytest.raises(NpuforgeError) as failed:
        gate.check_gate("SM8650", "fp16", record, gate.FP16_HINT)
    message = str(failed.value)
    assert f"the worst cosine at position 5, the mean {record['cosine_mean']}" in message
    assert "\n" not in message and message.endswith(gate.FP16_HINT)
    # A check that fails on top-1 alone does not point at a cosine position.
    flipped = reference.copy()
    flipped[2] = -flipped[2]
    record = _record(reference, flipped, {"min_top1": 0.99})
    with pytest.raises(NpuforgeError) as failed:
        gate.check_gate("RK3588", "w8a8", record, "try fp16")
    assert "the worst cosine" not in str(failed.value)


def test_a_passing_check_raises_nothing():
    reference = np.random.default_rng(1).standard_normal((8, 20)).astype(np.float32)
    record = _record(reference, reference.copy(), gate.TRAINED_FLOORS["fp16"])
    assert record["passed"] and record["top1_agreement"] == 1.0
    gate.check_gate("SM8650", "fp16", record, "unused")


def test_prefill_and_decode_rows_get_figures_of_their_own():
    """Two 4-token prefill calls and three decode calls: the prefill rows and the decode
    rows are scored apart, and the second prefill call (from a carried state) alone."""
    schedule = [base.Call("prefill", 0, 4), base.Call("prefill", 4, 4)]
    schedule += [base.Call("decode", p, 1) for p in (8, 9, 10)]
    reference = np.random.default_rng(0).normal(size=(11, 16))
    compiled = reference.copy()
    compiled[9] = -compiled[9]  # one decode row wrong
    compiled[5] *= 1.5  # a carried-state prefill row scaled: same direction
    figures = gate.variant_figures(schedule, reference, compiled)
    assert figures["prefill"]["positions"] == 8 and figures["prefill"]["top1_agreement"] == 1.0
    assert figures["decode"]["positions"] == 3 and figures["decode"]["cosine"] < 0
    assert figures["prefill_from_state"]["positions"] == 4
    assert figures["prefill_from_state"]["max_abs_rel"] > 0.0
    assert gate.variant_figures(schedule[2:], reference[8:], compiled[8:]) == {}
