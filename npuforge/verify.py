"""Check exported graphs against an independent reference and report the figures.

The graphs run chunk by chunk (``npuforge.runtime.run_chunk_by_chunk``: one graph's
session open at a time) over a seeded token sequence (fp16 exports through
``Fp16EmulationSession``, so overflow shows as it would on an fp16 NPU). The reference
(``auto``, alias ``rwkv``) is the family's own implementation on the same checkpoint —
BlinkDL's ``rwkv`` package (strategy ``cpu fp32``) for RWKV,
``npuforge.models.<family>.reference_logits`` otherwise — or another export directory
(``onnx-fp32:DIR``). Figures, over every step and batch row:

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


def open_session(meta, onnx_path):
    """A session for one graph of an export: fp16 exports through the emulation session."""
    from npuforge.runtime import Fp16EmulationSession, onnxruntime_session

    factory = Fp16EmulationSession if meta["dtype"] == "fp16" else onnxruntime_session
    return factory(onnx_path)


def read_export(export_dir) -> tuple:
    """(directory, export.json) of an export directory."""
    from npuforge.fileio import read_json

    meta_path = Path(export_dir) / "export.json"
    if not meta_path.is_file():
        raise NpuforgeError(f"{export_dir}: no export.json; run export_onnx.py first")
    return Path(export_dir), read_json(meta_path)


def run_decode(export, tokens, label: str):
    """``[B, S, V]`` logits of a decode export over ``tokens`` ``[B, S]``, call by call,
    one chunk's session at a time (``run_chunk_by_chunk``)."""
    import numpy as np

    from npuforge.runtime import run_chunk_by_chunk

    t = int(export[1]["tokens_per_call"])
    if tokens.shape[1] % t:
        raise NpuforgeError(f"sequence length {tokens.shape[1]} is not a multiple of {t}")
    calls = [("decode", tokens[:, i : i + t]) for i in range(0, tokens.shape[1], t)]
    rows = run_chunk_by_chunk({"decode": export}, calls, open_session, label=label)
    return np.concatenate(rows, axis=1)


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

    Chunk by chunk: the prefill graphs run the prefill calls one chunk at a time, then
    the decode graphs continue from their state the same way (either chunking)."""
    import numpy as np

    prefill, decode = read_export(prefill_dir), read_export(decode_dir)
    t = int(prefill[1]["tokens_per_call"])
    steps = tokens.shape[1]
    n_prefill = (steps // t) * t
    if n_prefill == 0 or n_prefill == steps:
        n_prefill = max(0, n_prefill - t)
    if n_prefill == 0:
        raise NpuforgeError(
            f"--tokens {steps} is too short to prefill {t} tokens and then decode; raise --tokens"
        )
    if int(prefill[1]["batch"]) != int(decode[1]["batch"]):
        raise NpuforgeError("prefill and decode exports have different --batch; export them alike")
    last_only = bool(prefill[1]["options"].get("last_token_logits"))
    calls, positions = [], []
    for start in range(0, n_prefill, t):
        calls.append(("prefill", tokens[:, start : start + t]))
        positions += [start + t - 1] if last_only else list(range(start, start + t))
    # Position-indexed inputs (a KV cache's mask, RoPE rows, write slots) continue where
    # the prefill stopped; recurrent families ignore the counter.
    for start in range(n_prefill, steps):
        calls.append(("decode", tokens[:, start : start + 1]))
        positions.append(start)
    from npuforge.runtime import run_chunk_by_chunk

    exports = {"prefill": prefill, "decode": decode}
    pieces = run_chunk_by_chunk(exports, calls, open_session, label="prefill, then decode")
    combined = np.concatenate(pieces, axis=1)
    figures = compare(combined, decode_logits[:, positions])
    figures.update(
        {"prefill_tokens": n_prefill, "tokens_per_call": t, "compared_steps": len(positions)}
    )
    return figures


def verify_export(export_dirs, checkpoint=None, steps=64, reference="auto") -> dict:
    """Run the checks; return the report dict (``verify_onnx.py`` writes it as JSON)."""
    if not export_dirs:
        raise NpuforgeError("give at least one --export directory")
    decode = read_export(export_dirs[0])
    meta = decode[1]
    if meta["variant"] != "decode":
        raise NpuforgeError(f"{export_dirs[0]}: the first --export must be a decode export")
    if steps < 1:
        raise NpuforgeError("--tokens must be at least 1")
    tokens = seeded_tokens(meta["vocab_size"], int(meta["batch"]), steps)

    # One model in memory at a time: the reference's is released before the graphs load,
    # and the graphs load one chunk at a time.
    if reference in ("auto", "rwkv"):
        progress.stage(f"reference: {meta['family']} over {steps} tokens")
        if checkpoint is None:
            raise NpuforgeError(f"--reference {reference} needs --checkpoint")
        prefix = meta.get("kv_prefix", {}).get("tokens", ())
        ref_logits, ref_name = family_reference(meta["family"], checkpoint, tokens, prefix)
    elif reference.startswith("onnx-fp32:"):
        ref_export = read_export(reference[len("onnx-fp32:") :])
        if ref_export[1]["dtype"] != "fp32" or ref_export[1]["variant"] != "decode":
            raise NpuforgeError(f"{reference}: the reference must be an fp32 decode export")
        ref_logits = run_decode(ref_export, tokens, f"reference graphs over {steps} calls")
        ref_name = "onnxruntime fp32"
    else:
        raise NpuforgeError(f"--reference {reference!r} is unknown; use auto or onnx-fp32:DIR")
    release_memory()
    logits = run_decode(decode, tokens, f"decode graphs over {steps} calls")

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
