"""bench/bench_quant.py's records: a run of fewer models keeps the figures of more."""

import sys
from pathlib import Path

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
