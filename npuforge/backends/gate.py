"""The figures a binary is judged by and the gate on them, for every backend.

``fidelity`` compares a binary's logits with the fp32 reference's position by position
(worst and mean cosine, max |Δ| / max |reference|, top-1 agreement, NaN/Inf, the held-out
text's perplexity under both); ``verify`` scores a backend's simulator run over its
verification schedule (``npuforge.backends.base``) and ``check_gate`` stops a build whose
figures fall below the floors of its precision in one line.
"""

import math

from npuforge.backends.base import (
    calls_per_variant,
    load_exports,
    reference_logits,
    reference_name,
)
from npuforge.errors import NpuforgeError

# The floors a target may set per precision; a backend's FLOORS gives the defaults.
FLOOR_KEYS = ("min_cosine", "min_top1", "max_perplexity_delta")
# Floors for trained weights, where held-out text means something to the model: the
# task-level figures gate (top-1 agreement, perplexity change), and the whole-vocabulary
# cosine only catches a broken binary. Exact fp16 arithmetic (torch) on SmolLM2-135M
# reaches a worst-position cosine of 0.99984, so a 0.9999 floor fails every fp16 build
# of a trained model. A backend's FLOORS stay the floors of synthetic (random) weights,
# whose near-uniform logits make top-1 a toss-up between near-ties.
# Quantized weights are gated on the task-level figures alone (their cosine is reported).
# bf16 is offered as a 16-bit float beside f16 and held to the same figures (on
# SmolLM2-135M, bf16 arithmetic in torch: worst cosine 0.9978, perplexity +2.1 %).
_FLOAT16_TRAINED = {"min_cosine": 0.999, "min_top1": 0.99, "max_perplexity_delta": 0.005}
_8BIT_TRAINED = {"min_top1": 0.95, "max_perplexity_delta": 0.03}
_4BIT_TRAINED = {"min_top1": 0.90, "max_perplexity_delta": 0.10}
TRAINED_FLOORS = {
    **dict.fromkeys(("fp16", "f16", "bf16"), _FLOAT16_TRAINED),
    **dict.fromkeys(("a16w8", "w8a8", "int8", "w8f16", "w16a16i_dfp"), _8BIT_TRAINED),
    **dict.fromkeys(("a16w4", "w4f16"), _4BIT_TRAINED),
}

# --------------------------------------------------------------------------- figures


def _log_softmax_at(logits, targets):
    import numpy as np

    top = logits.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return logits[np.arange(len(targets)), targets] - log_z


def perplexity(logits, next_ids) -> float:
    """exp(mean negative log-likelihood of ``next_ids[i]`` under row ``i``'s logits)."""
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)
    return float(math.exp(-np.mean(_log_softmax_at(logits, np.asarray(next_ids)))))


def fidelity(reference, compiled, next_ids=None) -> dict:
    """The figures of ``compiled`` against ``reference`` logits, one row per position.

    ``next_ids``: the token that follows each position in the text (batch 1), which
    the perplexity scores; rows beyond it are left out of the perplexity only.
    """
    import numpy as np

    ref = np.asarray(reference, dtype=np.float64)
    rows = ref.shape[0]
    ref = ref.reshape(rows, -1)
    out = np.asarray(compiled, dtype=np.float64).reshape(rows, -1)
    figures = {"positions": int(rows), "nan_inf": int((~np.isfinite(out)).sum())}
    if figures["nan_inf"]:
        unknown = ("cosine", "cosine_mean", "worst_cosine_position", "max_abs_rel")
        unknown += ("top1_agreement", "top1_misses", "perplexity")
        figures.update(dict.fromkeys(unknown))
        return figures
    dot = (out * ref).sum(-1)
    norms = np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1)
    cosine = dot / np.maximum(norms, 1e-30)
    scale = max(float(np.abs(ref).max()), 1e-30)
    agree = out.argmax(-1) == ref.argmax(-1)
    figures.update(
        cosine=round(float(cosine.min()), 7),
        cosine_mean=round(float(cosine.mean()), 7),
        worst_cosine_position=int(cosine.argmin()),
        max_abs_rel=round(float(np.abs(out - ref).max() / scale), 7),
        top1_agreement=round(float(np.mean(agree)), 6),
        top1_misses=top1_misses(ref, agree),
        perplexity=None,
    )
    if next_ids is not None and ref.shape[1] and len(next_ids):
        scored = min(rows, len(next_ids))
        targets = np.asarray(next_ids[:scored], dtype=np.int64)
        vocab = ref.shape[1]
        if targets.max() < vocab:
            fp32 = perplexity(ref[:scored], targets)
            binary = perplexity(out[:scored], targets)
            figures["perplexity"] = {
                "reference": round(fp32, 5),
                "compiled": round(binary, 5),
                "delta": round(binary / fp32 - 1.0, 6),
                "positions": int(scored),
            }
    return figures


def top1_misses(ref, agree) -> list[dict]:
    """The positions whose top-1 token differs from fp32's, each with fp32's own margin
    between its top two logits: a miss at a near-tie says less than one at a wide margin."""
    import numpy as np

    if ref.shape[1] < 2:
        return []
    top2 = np.partition(ref, -2, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    return [
        {"position": int(i), "fp32_margin": round(float(margin[i]), 4)}
        for i in np.flatnonzero(~agree)
    ]


# --------------------------------------------------------------------------- gate


def floors_for(defaults: dict, options, precision: str, weights: str) -> dict:
    """The floors of ``precision``: the backend's defaults (TRAINED_FLOORS first, for
    trained weights), overridden by the target's options (``min_cosine``, ``min_top1``,
    ``max_perplexity_delta``: one number for every precision, or precision -> number)."""
    trained = TRAINED_FLOORS.get(precision) if weights == "trained" else None
    floors = dict(trained or defaults.get(precision, {}))
    for key in FLOOR_KEYS:
        given = getattr(options, key, None)
        if isinstance(given, dict):
            given = given.get(precision)
        if given is not None:
            floors[key] = float(given)
    return floors


def gate(figures: dict, floors: dict) -> list[str]:
    """What fails the floors, as short phrases (empty: passed). NaN/Inf always fails."""
    if figures.get("nan_inf"):
        return [f"{figures['nan_inf']} NaN/Inf logits"]
    failures = []
    if "min_cosine" in floors and not (figures.get("cosine") or -1) >= floors["min_cosine"]:
        failures.append(f"logits cosine {figures.get('cosine')} < {floors['min_cosine']}")
    if "min_top1" in floors and not (figures.get("top1_agreement") or 0) >= floors["min_top1"]:
        failures.append(f"top-1 agreement {figures.get('top1_agreement')} < {floors['min_top1']}")
    if "max_perplexity_delta" in floors:
        ppl = figures.get("perplexity")
        if ppl is None:
            failures.append("no perplexity (the text's tokens do not fit the vocabulary)")
        elif not ppl["delta"] <= floors["max_perplexity_delta"]:
            failures.append(
                f"perplexity {ppl['compiled']} vs fp32 {ppl['reference']} "
                f"(+{ppl['delta']:.2%}) > +{floors['max_perplexity_delta']:.2%}"
            )
    return failures


def verification(
    figures: dict, floors: dict, *, schedule, text: dict, runner: str, reference=None
) -> dict:
    """The ``verification`` record every backend writes into compile.json."""
    failures = gate(figures, floors)
    return {
        **figures,
        "calls": calls_per_variant(schedule),
        "text": text,
        "reference": reference or reference_name(),
        "runner": runner,
        "floors": floors,
        "passed": not failures,
        "failures": failures,
    }


def verify(request, floors: dict, schedule, text: dict, reference, compiled, *, runner: str,
           reference_label=None) -> dict:  # fmt: skip
    """The figures of ``compiled`` against ``reference`` over the held-out ``text``, with the
    floors of the request's precision (``floors``: the backend's FLOORS) applied.

    With ``request.references`` (exports rounded at export) the gate's reference is those
    unrounded graphs over the same calls, ``against_export`` keeps the figures against the
    build's own fp32 exports (the toolkit's share of the loss) and ``rounding_at_export``
    those of the own exports against the unrounded ones (the rounding's share)."""
    against_export = rounded = None
    if request.references:
        against_export = fidelity(reference, compiled, text["ids"][1:])
        rounded = reference
        unrounded = load_exports(request.references, "reference", prefill=True)
        missing = {call.variant for call in schedule} - set(unrounded)
        if missing:
            raise NpuforgeError(
                f"no {' or '.join(sorted(missing))} export among the --reference-export "
                "directories: give one per --export"
            )
        reference = reference_logits(unrounded, schedule, text["ids"])
        reference_label = f"{reference_label or reference_name()}, before rounding at export"
    record = verification(
        fidelity(reference, compiled, text["ids"][1:]),
        floors_for(floors, request.options, request.precision, request.weights),
        schedule=schedule,
        text=text["text"],
        runner=runner,
        reference=reference_label,
    )
    record.update(variant_figures(schedule, reference, compiled))
    if against_export is not None:
        keys = ("cosine", "top1_agreement", "perplexity")
        record["against_export"] = {key: against_export[key] for key in keys}
        rounding = fidelity(reference, rounded, text["ids"][1:])
        record["rounding_at_export"] = {key: rounding[key] for key in keys}
    return record


def variant_figures(schedule, reference, compiled) -> dict:
    """With prefill calls: the figures of the prefill rows and of the decode rows apart,
    and of the prefill calls that started from a carried (not zero) state."""
    prefill_rows = [call.tokens for call in schedule if call.variant == "prefill"]
    split = sum(prefill_rows)
    if not split:
        return {}
    figures = {
        "prefill": fidelity(reference[:split], compiled[:split]),
        "decode": fidelity(reference[split:], compiled[split:]),
    }
    if len(prefill_rows) > 1:
        first = prefill_rows[0]
        figures["prefill_from_state"] = fidelity(reference[first:split], compiled[first:split])
    return figures


def _figures_text(figures: dict, cosine: bool) -> str:
    """'top-1 T[, cosine C][, perplexity +P%]' of a figures record."""
    text = f"top-1 {figures.get('top1_agreement')}"
    if cosine:
        text += f", cosine {figures.get('cosine')}"
    delta = (figures.get("perplexity") or {}).get("delta")
    return text + (f", perplexity {delta:+.2%}" if delta is not None else "")


# What to try when an fp16 binary fails its gate, on every backend.
FP16_HINT = (
    "fp16 has nothing to calibrate: keep the export's fp16_fixes on (a trained Llama also "
    "needs a kv_prefix, docs/models.md)"
)

# Top-1 misses a failed gate's message names (the manifest lists them all).
MISSES_NAMED = 6


def check_gate(target: str, precision: str, record: dict, fix: str) -> None:
    """One line naming what failed and what to try, when the verification failed."""
    if record["passed"]:
        return
    failures = record["failures"]
    # The figures that passed too: which ones failed alone says where to look.
    ppl = (record.get("perplexity") or {}).get("delta")
    figures = {
        "cosine": f"logits cosine {record.get('cosine')}",
        "top-1": f"top-1 agreement {record.get('top1_agreement')}",
        "perplexity": f"perplexity {ppl:+.2%}" if ppl is not None else None,
    }
    passed = [text for key, text in figures.items() if text and key not in " ".join(failures)]
    misses = record.get("top1_misses") or []
    where = ", ".join(f"{m['position']} ({m['fp32_margin']})" for m in misses[:MISSES_NAMED])
    if len(misses) > MISSES_NAMED:
        where += f" and {len(misses) - MISSES_NAMED} more"
    if misses:
        where = f"; top-1 differs at positions {where}, fp32's top-2 margin in brackets"
    if any(failure.startswith("logits cosine") for failure in failures):
        # One bad position or all of them: an fp16 build's first positions from the zero
        # state are its hardest (docs/scale.md), a drifting one's last.
        where += (
            f"; the worst cosine at position {record.get('worst_cosine_position')}, "
            f"the mean {record.get('cosine_mean')}"
        )
    # Rounded at export: the binary against its own graphs is the toolkit's share of the
    # loss, those graphs against the unrounded ones the rounding's.
    for key, label, cosine in (
        ("against_export", "against the build's own rounded export", True),
        ("rounding_at_export", "the rounding at export alone (its fp32 graphs)", False),
    ):
        if record.get(key):
            where += f"; {label}: {_figures_text(record[key], cosine)}"
    raise NpuforgeError(
        f"{target} {precision}: the simulator check over {record['positions']} positions of "
        f"held-out text failed ({'; '.join(failures + passed)}{where}) against "
        f"{record['reference']}; {fix}"
    )
