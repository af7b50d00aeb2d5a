"""The compile steps' fp32 reference run (npuforge.backends.base.reference_logits): the
logits of transformers over prefill calls then decode calls, whatever the chunking, and a
peak memory of one chunk, not of the whole model."""

import json
from pathlib import Path

import numpy as np
from memory_probe import peak_bytes

from npuforge.backends import base
from npuforge.models.llama.onnx_export import export_llama
from npuforge.models.llama.weights import reference_logits, write_synthetic_checkpoint

PREFILL = 4


def exports_of(checkpoint: Path, out: Path, chunks: int, variants=("prefill", "decode")):
    exports = {}
    for variant in variants:
        directory = out / f"{variant}-c{chunks}"
        export_llama(
            checkpoint, directory, variant=variant, tokens=PREFILL if variant == "prefill" else 1,
            chunks=chunks, cache_len=32, ext_embedding=chunks > 1, kv_prefix=(1,),
        )  # fmt: skip
        exports[variant] = base.Export(
            directory, json.loads((directory / "export.json").read_text())
        )
    return exports


def test_prefill_then_decode_by_chunk_gives_the_models_logits_at_any_chunking(tmp_path):
    checkpoint = tmp_path / "ckpt"
    write_synthetic_checkpoint(
        checkpoint, layers=3, embed=64, heads=4, kv_heads=2, vocab=128, intermediate=96,
        arch="qwen2", seed=3,
    )  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 128, size=13)
    # Two prefill calls (the second from the first's cache), then decode calls.
    schedule = [
        base.Call("prefill", 0, PREFILL), base.Call("prefill", PREFILL, PREFILL),
        *[base.Call("decode", p, 1) for p in range(2 * PREFILL, 12)],
    ]  # fmt: skip
    # The exports hold token 1 in their kv_prefix rows, ahead of the calls' tokens.
    want = reference_logits(checkpoint, np.concatenate([[1], ids[:12]])[None])[0, 1:]
    for chunks in (1, 3):
        seen = []

        def capture(variant, chunk, feeds, seen=seen):
            seen.append((variant, chunk))

        got = base.reference_logits(
            exports_of(checkpoint, tmp_path, chunks), schedule, ids, capture
        )
        assert got.shape == (12, 128)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Every graph's feeds, each chunk's calls in order: chunk by chunk, the prefill calls'
    # chunks first, then the decode calls'.
    assert seen == [
        (variant, chunk)
        for variant in ("prefill", "decode")
        for chunk in range(3)
        for call in schedule
        if call.variant == variant
    ]


SETUP = """
import json
from pathlib import Path
from npuforge.backends import base
import npuforge.models.llama.onnx_export
"""
RUN = """
directory = Path({directory!r})
export = base.Export(directory, json.loads((directory / "export.json").read_text()))
schedule = [base.Call("decode", p, 1) for p in range(4)]
base.reference_logits({{"decode": export}}, schedule, [3, 5, 7, 9])
"""


def test_the_reference_run_holds_one_chunk_at_a_time(tmp_path):
    """Peak RSS of the run over the same 8-layer model exported in 1 and in 8 chunks:
    the 8-chunk run holds one layer at a time (onnxruntime keeps the heap a session
    leaves and loads the next chunk into it), so it peaks at well under half."""
    checkpoint = tmp_path / "ckpt"
    write_synthetic_checkpoint(
        checkpoint, layers=8, embed=512, heads=8, kv_heads=8, vocab=256, intermediate=2048,
    )  # fmt: skip
    layer_bytes = 4 * (4 * 512 * 512 + 3 * 512 * 2048)
    peaks = {}
    for chunks in (1, 8):
        directory = tmp_path / f"c{chunks}"
        export_llama(checkpoint, directory, variant="decode", tokens=1, chunks=chunks,
                     cache_len=8, ext_embedding=chunks > 1)  # fmt: skip
        peaks[chunks] = peak_bytes(SETUP, RUN.format(directory=str(directory)))
    assert peaks[8] < peaks[1] / 2 and peaks[1] - peaks[8] > 4 * layer_bytes, (peaks, layer_bytes)
