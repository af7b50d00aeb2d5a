"""Check exported graphs against an independent reference and report the figures.

The graphs run through ``npuforge.runtime.GraphChain`` over a seeded token
sequence (fp16 exports through ``Fp16EmulationSession``, so overflow shows as it
would on an fp16 NPU). The reference (``auto``, alias ``rwkv``) is the family's
own implementation on the same checkpoint — BlinkDL's ``rwkv`` package (strategy
``cpu fp32``) for RWKV, ``npuforge.models.<family>.reference_logits`` otherwise —
or another export directory (``onnx-fp32:DIR``). Figures, over every step and
batch row:

* ``max_abs_rel``: max |Δlogit| / max |reference logit|
* ``cosine`` (minimum per step) and ``cosine_mean``
* ``top1_agreement``: fraction of steps with the same arg-max
* ``nan_inf``: non-finite logits of the export
* ``prefill_vs_decode``: with a prefill export, prefill the first tokens, carry
  its state into the decode graphs, and compare with decode alone.
"""

from pathlib import Path

from npuforge import progress
from npuforge.errors import NpuforgeError
from npuforge.memory import release_memory

TOKEN_SEED = 0


def seeded_tokens(vocab_size: int, batch: int, steps: int, seed: int = TOKEN_SEED):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, steps), dtype=np.int64)


def session_factory_for(meta):
    from npuforge.runtime import Fp16EmulationSession, onnxruntime_session

    return Fp16EmulationSession if meta["dtype"] == "fp16" else onnxruntime_session


def open_chain(export_dir):
    from npuforge.fileio import read_json
    from npuforge.runtime import GraphChain

    meta_path = Path(export_dir) / "export.json"
    if not meta_path.is_file():
        raise NpuforgeError(f"{export_dir}: no export.json; run export_onnx.py first")
    return GraphChain(export_dir, session_factory=session_factory_for(read_json(meta_path)))


def family_reference(family: str, checkpoint, tokens, prefix=()) -> tuple:
    """(logits [B, S, V], exact name) of the family's own implementation on ``checkpoint``
    (BlinkDL's rwkv package for RWKV, transformers for the llama family). ``prefix``: an
    export's kv_prefix tokens, run first; their logits are left out."""
    import numpy as np

    from npuforge import models

    module = models.family(family)
    if not prefix:
        return module.reference_logits(checkpoint, tokens)
    tokens = np.asarray(tokens, dtype=np.int64)
    lead = np.tile(np.asarray(prefix, dtype=np.int64), (tokens.shape[0], 1))
    logits, name = module.reference_logits(checkpoint, np.concatenate([lead, tokens], axis=1))
    return logits[:, len(prefix) :], f"{name}, after the kv_prefix tokens {list(prefix)}"


def compare(logits, reference) -> dict:
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    finite = np.isfinite(logits)
    nan_inf = int((~finite).sum())
    if nan_inf:
        return {
            "max_abs_rel": None,
            "cosine": None,
            "cosine_mean": None,
            "top1_agreement": float(
                np.mean(np.nan_to_num(logits, nan=-np.inf).argmax(-1) == reference.argmax(-1))
            ),
            "nan_inf": nan_inf,
        }
    scale = float(np.abs(reference).max())
    dot = (logits * reference).sum(-1)
    norms = np.linalg.norm(logits, axis=-1) * np.linalg.norm(reference, axis=-1)
    cosine = dot / np.maximum(norms, 1e-30)
    return {
        "max_abs_rel": float(np.abs(logits - reference).max() / max(scale, 1e-30)),
        "cosine": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "top1_agreement": float(np.mean(logits.argmax(-1) == reference.argmax(-1))),
        "nan_inf": 0,
    }


def logits_agreement(reference, compiled) -> dict:
    """``compare`` with one row per entry of the first axis (a step or a token),
    rounded for manifests; with any NaN/Inf only their count is a figure."""
    import numpy as np

    ref = np.asarray(reference, dtype=np.float64)
    rows = ref.shape[0]
    out = np.asarray(compiled, dtype=np.float64).reshape(rows, -1)
    figures = compare(out, ref.reshape(rows, -1))
    if figures["nan_inf"]:
        return {**figures, "top1_agreement": None}
    digits = {"cosine": 7, "cosine_mean": 7, "max_abs_rel": 7, "top1_agreement": 6}
    return {**figures, **{key: round(figures[key], n) for key, n in digits.items()}}


def prefill_then_decode(prefill_dir, decode_dir, tokens, decode_logits) -> dict:
    """Prefill the first whole calls, continue with decode; compare with decode alone.

    One export's graphs are loaded at a time: the prefill graphs are released before the
    decode graphs load and continue from their state."""
    import numpy as np

    progress.stage("prefill graphs: loading, then prefill calls")
    prefill = open_chain(prefill_dir)
    t = prefill.tokens_per_call
    steps = tokens.shape[1]
    n_prefill = (steps // t) * t
    if n_prefill == 0 or n_prefill == steps:
        n_prefill = max(0, n_prefill - t)
    if n_prefill == 0:
        raise NpuforgeError(
            f"--tokens {steps} is too short to prefill {t} tokens and then decode; raise --tokens"
        )
    last_only = bool(prefill.meta["options"].get("last_token_logits"))
    pieces, positions = [], []
    for start in range(0, n_prefill, t):
        out = prefill.step(tokens[:, start : start + t])
        pieces.append(out)
        positions += [start + t - 1] if last_only else list(range(start, start + t))
    state, position, batch = prefill.state, prefill.position, prefill.batch
    del prefill
    release_memory()
    progress.stage("decode graphs: loading, then decode calls after the prefill")
    decode_chain = open_chain(decode_dir)
    if batch != decode_chain.batch:
        raise NpuforgeError("prefill and decode exports have different --batch; export them alike")
    missing = set(decode_chain.state) - set(state)
    if missing:
        raise NpuforgeError(
            f"prefill export lacks state {sorted(missing)[0]!r}; export both from one checkpoint"
        )
    decode_chain.state = {k: state[k].astype(v.dtype) for k, v in decode_chain.state.items()}
    # Position-indexed inputs (a KV cache's mask, RoPE rows, write slots) continue where
    # the prefill stopped; recurrent families ignore the counter.
    decode_chain.position = position
    for start in range(n_prefill, steps):
        pieces.append(decode_chain.step(tokens[:, start : start + 1]))
        positions.append(start)
    combined = np.concatenate(pieces, axis=1)
    figures = compare(combined, decode_logits[:, positions])
    figures.update(
        {"prefill_tokens": n_prefill, "tokens_per_call": t, "compared_steps": len(positions)}
    )
    return figures


def verify_export(export_dirs, checkpoint=None, steps=64, reference="auto") -> dict:
    """Run the checks; return the report dict (``verify_onnx.py`` writes it as JSON)."""
    from npuforge.fileio import read_json

    if not export_dirs:
        raise NpuforgeError("give at least one --export directory")
    meta_path = Path(export_dirs[0]) / "export.json"
    if not meta_path.is_file():
        raise NpuforgeError(f"{export_dirs[0]}: no export.json; run export_onnx.py first")
    meta = read_json(meta_path)
    if meta["variant"] != "decode":
        raise NpuforgeError(f"{export_dirs[0]}: the first --export must be a decode export")
    if steps < 1:
        raise NpuforgeError("--tokens must be at least 1")
    tokens = seeded_tokens(meta["vocab_size"], int(meta["batch"]), steps)

    # One model in memory at a time: the reference's is released before the graphs load,
    # and the prefill graphs before decode continues from their state.
    if reference in ("auto", "rwkv"):
        progress.stage(f"reference: {meta['family']} over {steps} tokens")
        if checkpoint is None:
            raise NpuforgeError(f"--reference {reference} needs --checkpoint")
        prefix = meta.get("kv_prefix", {}).get("tokens", ())
        ref_logits, ref_name = family_reference(meta["family"], checkpoint, tokens, prefix)
    elif reference.startswith("onnx-fp32:"):
        ref_chain = open_chain(reference[len("onnx-fp32:") :])
        if ref_chain.meta["dtype"] != "fp32" or ref_chain.meta["variant"] != "decode":
            raise NpuforgeError(f"{reference}: the reference must be an fp32 decode export")
        ref_logits = ref_chain.run(tokens)
        del ref_chain
        ref_name = "onnxruntime fp32"
    else:
        raise NpuforgeError(f"--reference {reference!r} is unknown; use auto or onnx-fp32:DIR")
    release_memory()
    progress.stage(f"decode graphs: loading, then {steps} calls")
    decode = open_chain(export_dirs[0])
    logits = decode.run(tokens)
    del decode
    release_memory()

    report = compare(logits, ref_logits)
    report.update(
        {
            "steps": steps,
            "batch": int(meta["batch"]),
            "reference": ref_name,
            "runtime": "onnxruntime fp16-storage emulation"
            if meta["dtype"] == "fp16"
            else "onnxruntime cpu",
            "tokens": f"seeded uniform ids, numpy PCG64 seed {TOKEN_SEED}",
            "export": {
                "dtype": meta["dtype"],
                "chunks": meta["chunks"],
                "options": meta["options"],
            },
            "prefill_vs_decode": None,
        }
    )
    if len(export_dirs) > 1:
        report["prefill_vs_decode"] = prefill_then_decode(
            export_dirs[1], export_dirs[0], tokens, logits
        )
    progress.clear()
    return report
