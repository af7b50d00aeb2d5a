"""bench/bench_quant.py's records: a run of fewer models keeps the figures of more."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from npuforge import measurements

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_quant  # noqa: E402


def _line(model, row, top1):
    return {"model": model, "row": row, "top1_agreement": top1, "perplexity": {"delta": 0.01}}


def test_a_twin_only_run_adds_its_rows_and_keeps_the_two_model_rows(tmp_path):
    path = tmp_path / "benches.yaml"
    both = ["smollm2-135m", "smollm2-135m-permuted"]
    first = [_line(m, r, 1.0) for m in both for r in ("rotation, fp32", "4bit-g32 gptq")]
    bench_quant.record(path, first, both, ["--jobs", "2"])
    again = [_line(both[1], r, 0.5) for r in ("rotation, fp32", "4bit-g32 gptq+generated")]
    written = bench_quant.record(path, again, both[1:], ["--models", both[1]])
    assert written == ["quant-levers-4bit-g32-gptq-generated"]
    rows = {row["id"]: row for row in measurements.load_rows(path)}
    assert rows["quant-levers-rotation-fp32"]["figures"]["smollm2-135m top-1"] == 1.0
    assert rows["quant-levers-4bit-g32-gptq-generated"]["figures"] == {
        "twin top-1": 0.5,
        "twin perplexity": "+1.00 %",
    }
    # A run of as many models replaces its rows.
    bench_quant.record(path, [_line(m, "rotation, fp32", 0.9) for m in both], both, [])
    rows = {row["id"]: row for row in measurements.load_rows(path)}
    assert rows["quant-levers-rotation-fp32"]["figures"]["twin top-1"] == 0.9


def test_documents_score_every_token_once_in_windows_the_cache_holds():
    from npuforge import heldout, texts

    tokenizer = texts.ByteTokenizer()
    windows = bench_quant.held_out(tokenizer, 256, "documents", 64)
    documents = texts.read_documents(bench_quant.HELDOUT_DOCUMENTS)
    assert len(documents) >= 8 and len(windows) > len(documents)
    assert max(map(len, windows)) == 65 and min(map(len, windows)) >= 2
    # Each document's windows, their targets laid end to end, are the document less its
    # first token: every token a target exactly once.
    targets = [t for w in windows for t in w[1:]]
    expected = [int(t) for d in texts.tokenize_documents(documents, 256, tokenizer) for t in d[1:]]
    assert targets == expected
    (text,) = bench_quant.held_out(tokenizer, 256, "text", 64)
    assert text == heldout.tokenize(tokenizer, 256)[:64]


def test_windows_pool_as_one_pass_over_their_scored_rows(monkeypatch):
    import numpy as np
    import torch

    from npuforge.backends.gate import fidelity

    def logits_of(tokens, noise):
        rng = np.random.default_rng(sum(tokens) + noise)
        return torch.from_numpy(rng.normal(size=(len(tokens), 16)).astype(np.float32))

    def run(model, _caches, tokens):
        return logits_of(tokens, model.noise)

    monkeypatch.setattr(bench_quant, "run_after_prefix", run)
    fp32, quantized = SimpleNamespace(layers=[], noise=0), SimpleNamespace(layers=[], noise=1)
    windows = [[1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10]]
    reference = bench_quant.evaluate(fp32, None, windows, None)
    pooled = bench_quant.evaluate(quantized, None, windows, reference)
    compiled = bench_quant.evaluate(quantized, None, windows, None)
    whole = fidelity(
        np.concatenate([r[:-1] for r in reference]),
        np.concatenate([c[:-1] for c in compiled]),
        [t for w in windows for t in w[1:]],
    )
    assert pooled["positions"] == whole["positions"] == 9
    assert pooled["top1_agreement"] == whole["top1_agreement"]
    for key in ("reference", "compiled", "delta"):
        # Summed in another order, rounded alike: equal to the last digit.
        assert pooled["perplexity"][key] == pytest.approx(whole["perplexity"][key], abs=1.1e-5)
    assert pooled["cosine"] == whole["cosine"]


def test_document_rows_go_to_a_table_of_their_own(tmp_path):
    path = tmp_path / "benches.yaml"
    both = ["smollm2-135m", "smollm2-135m-permuted"]
    lines = [_line(m, "4bit-g32 gptq", 0.8) for m in both]
    bench_quant.record(path, lines, both, [], "text")
    bench_quant.record(path, lines, both, ["--heldout", "documents"], "documents")
    rows = {row["id"]: row["family"] for row in measurements.load_rows(path)}
    assert rows == {
        "quant-levers-4bit-g32-gptq": "quantization_levers",
        "quant-levers-documents-4bit-g32-gptq": "quantization_levers_documents",
    }
