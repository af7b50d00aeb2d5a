"""Calibration text the model writes itself, for GPTQ's Hessians.

The project's calibration text is short (5.8k tokens of SmolLM2 over eleven documents),
and a projection's Hessian from so few positions fits that text more than the model's
inputs at large. Sampling the model's own distribution adds positions that follow what
the model itself expects (LLM-QAT's data-free calibration); each sequence opens with the
first tokens of a calibration document (cycled), so the languages and code of the text
carry over into what is sampled.

The sampling runs in float64 and draws from a seeded numpy generator: in float32 the
logits' last bits follow the host's kernels, and a draw that lands on a boundary between
two tokens would change the whole sequence after it, and with it GPTQ's weights.
"""

import hashlib
import time

import numpy as np

PROMPT_TOKENS = 8  # of each calibration document, before the model continues it
BATCH = 16  # sequences decoded side by side


def _step(model, ids, position, caches, cache_len):
    """Logits [B, vocab] (float64 numpy) of the last of ``ids`` [B, T] at ``position``,
    and the caches with their rows written."""
    import torch

    from npuforge.models.llama.config import host_inputs

    roles = ("mask", "rope_cos", "rope_sin", "cache_write", "cache_keep")
    host = host_inputs(
        model.cfg,
        batch=ids.shape[0],
        tokens=ids.shape[1],
        cache_len=cache_len,
        position=position,
        dtype=np.float64,
    )
    with torch.no_grad():
        logits, caches = model(
            torch.from_numpy(ids), *(torch.from_numpy(host[r]) for r in roles), caches
        )
    return logits[:, -1].numpy(), caches


def _draw(logits, rng):
    """One token per row of ``logits``, sampled at temperature 1 (inverse CDF)."""
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1)
    cdf /= cdf[:, -1:]
    picks = (cdf <= rng.random(len(cdf))[:, None]).sum(axis=1)
    return np.minimum(picks, cdf.shape[1] - 1).astype(np.int64)


def generate(model, documents, count: int, length: int, prefix, seed: int = 0) -> list:
    """``count`` token sequences of ``length`` tokens each, sampled from ``model`` (a
    float32 ``Llama``, returned as it came) after ``prefix`` (ids every sequence starts
    with; not part of the sequences): sequence i opens with the first PROMPT_TOKENS of
    ``documents[i % len(documents)]`` (token arrays) and the model writes the rest."""
    import torch

    prefix = [int(t) for t in prefix]
    openings = [[int(t) for t in doc[:PROMPT_TOKENS]] for doc in documents if len(doc)]
    if not openings:
        raise ValueError("no calibration document to open the sampled sequences with")
    cache_len = len(prefix) + length
    rng = np.random.Generator(np.random.PCG64(seed))
    cfg, sequences, started = model.cfg, [], time.monotonic()
    model.double()
    try:
        for first in range(0, count, BATCH):
            rows = [openings[i % len(openings)] for i in range(first, min(first + BATCH, count))]
            # Openings of unequal length: each row is fed its own up to the shortest, then
            # forced through the rest of it while the others sample.
            shortest = min(map(len, rows))
            ids = np.array([prefix + row[:shortest] for row in rows], dtype=np.int64)
            shape = [len(rows), cfg.num_kv_heads, cache_len, cfg.head_dim]
            caches = [torch.zeros(shape, dtype=torch.float64) for _ in range(2 * cfg.num_layers)]
            logits, caches = _step(model, ids, 0, caches, cache_len)
            written = [list(row[:shortest]) for row in rows]
            for position in range(len(prefix) + shortest, cache_len):
                drawn = _draw(logits, rng)
                for row, opening, token in zip(written, rows, drawn, strict=True):
                    row.append(opening[len(row)] if len(row) < len(opening) else int(token))
                if len(written[0]) == length:
                    break
                step = np.array([[row[-1]] for row in written], dtype=np.int64)
                logits, caches = _step(model, step, position, caches, cache_len)
            sequences += written
            print(
                f"GPTQ calibration: sampled {len(sequences)} of {count} sequences of "
                f"{length} tokens ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    finally:
        model.float()
    return sequences


def digest(sequences) -> str:
    """sha256 of the sampled token ids (int64 little-endian, sequence after sequence)."""
    hasher = hashlib.sha256()
    for row in sequences:
        hasher.update(np.asarray(row, dtype="<i8").tobytes())
    return hasher.hexdigest()
