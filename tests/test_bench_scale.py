"""bench/bench_scale.py's reading of a results directory: each finished step's resources
line and outputs, merged per stage, and the growth exponents between model sizes."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_scale  # noqa: E402


def finished_step(results: Path, log: str, seconds, rss_mb, child_mb, cpu=None, together=None):
    """A step's log; ``cpu`` and ``together``: its CPU seconds and sampled peak of the
    step and its processes together, else the line of logs from before them."""
    path = results / "logs" / log
    path.parent.mkdir(parents=True, exist_ok=True)
    used = f"{seconds} s wall, " + ("" if cpu is None else f"{cpu} s CPU, ")
    both = "" if together is None else f", {together} MB (together)"
    path.write_text(
        f"progress\nstep resources: {used}peak RSS {rss_mb} MB (step), {child_mb} MB "
        f"(processes it ran){both}\n"
    )


def fake_build(results: Path, model: str, scale: int):
    """Two export keys, a compile, chunk jobs, a step that failed before any process ran
    (no resources line) and a compile whose job was killed."""
    export = f"export/{model}"
    finished_step(results, f"{export}/decode-a.log", 10.0 * scale, 100 * scale, 0, 8.0 * scale)
    finished_step(results, f"{export}/prefill-b.log", 5.0 * scale, 300 * scale, 0, 4.0 * scale)
    # The larger compile shared the host: its wall time grew as the square, its CPU time
    # linearly. The step's and its processes' peaks came at different moments.
    finished_step(
        results, f"compile/{model}/RK3588/fp16.log", 60.0 * scale**2, 200 * scale, 900 * scale,
        50.0 * scale, together=1000 * scale,
    )  # fmt: skip
    # A TPU-MLIR build's chunk jobs: one stage per build, their times added.
    for chunk in (0, 1):
        finished_step(results, f"compile-chunk/{model}/BM1684X/f16/{chunk}.log", 30.0, 50, 400)
    (results / "logs" / "package" / model / "RK3588").mkdir(parents=True)
    (results / "logs" / "package" / model / "RK3588" / "fp16.log").write_text("error: no\n")
    # A compile whose toolchain job was killed: what it had used, a stage of its own.
    (results / "logs" / "compile" / model / "SM8650").mkdir(parents=True)
    (results / "logs" / "compile" / model / "SM8650" / "a16w8.log").write_text(
        "step resources (failed): 7.0 s wall, peak RSS 90 MB (step), 5000 MB (processes it "
        "ran)\nerror: the toolchain job was killed (signal 9)\n"
    )
    out = results / "compile" / model / "RK3588" / "fp16"
    out.mkdir(parents=True)
    (out / "model.rknn").write_bytes(b"x" * 1000 * scale)


def test_steps_are_read_merged_per_stage_and_their_growth_is_an_exponent(tmp_path):
    for model, scale in (("small", 1), ("large", 4)):
        fake_build(tmp_path / model, model, scale)
    small = bench_scale.step_rows(tmp_path / "small", "small")
    assert [(r["step"], r["job"]) for r in small] == [
        ("compile", "RK3588/fp16"),
        ("compile", "SM8650/a16w8 (failed)"),
        ("compile-chunk", "BM1684X/f16/0"),
        ("compile-chunk", "BM1684X/f16/1"),
        ("export", "decode-a"),
        ("export", "prefill-b"),
    ]
    assert small[0]["written"] == 1000 and small[0]["child_rss_mb"] == 900
    merged = bench_scale.stages(small)
    # Export keys add up in time and take the larger peak.
    assert merged["export"]["seconds"] == 15.0 and bench_scale.peak_mb(merged["export"]) == 300
    assert merged["export"]["cpu_seconds"] == 12.0
    # The sampled peak of the two together where the log has it, else their sum (a bound).
    assert bench_scale.peak_mb(merged["compile RK3588/fp16"]) == 1000
    assert bench_scale.peak_mb(merged["compile SM8650/a16w8 (failed)"]) == 5090
    chunks = merged["compile-chunk BM1684X/f16"]
    assert chunks["seconds"] == 60.0 and bench_scale.peak_mb(chunks) == 450
    assert chunks["cpu_seconds"] is None  # logs from before the CPU figure
    large = bench_scale.stages(bench_scale.step_rows(tmp_path / "large", "large"))
    table = bench_scale.growth_table([("small", 1_000, merged), ("large", 4_000, large)])
    # stage, then seconds and MB per model, then the three exponents
    rows = {" ".join(cells[:-7]): cells for cells in map(str.split, table.splitlines()[2:])}
    # 4x the parameters: the compile's wall time grew 16x (k = 2), its CPU time 4x
    # (k = 1), its memory (the step and the processes it ran, together) 4x (k = 1).
    assert rows["compile RK3588/fp16"][-3:] == ["2.00", "1.00", "1.00"]
    assert rows["export"][-3:] == ["1.00", "1.00", "1.00"]
    assert rows["compile-chunk BM1684X/f16"][-3:] == ["0.00", "–", "0.00"]


def test_a_file_linked_downstream_counts_once_at_the_step_that_made_it(tmp_path):
    """The onnx target's compile and every bundle hard-link the build's outputs: the
    written bytes say what each step put on disk, not what its directory lists."""
    import os

    finished_step(tmp_path, "export/m/decode-a.log", 1.0, 1, 0)
    finished_step(tmp_path, "compile/m/onnx/fp32.log", 1.0, 1, 0)
    finished_step(tmp_path, "package/m/onnx/fp32.log", 1.0, 1, 0)
    export, compiled = tmp_path / "export/m/decode-a", tmp_path / "compile/m/onnx/fp32"
    bundle = tmp_path / "release/m/onnx/fp32"
    for directory in (export, compiled, bundle):
        directory.mkdir(parents=True)
    (export / "chunk0.onnx").write_bytes(b"w" * 5000)
    os.link(export / "chunk0.onnx", compiled / "chunk0.onnx")
    (compiled / "compile.json").write_bytes(b"j" * 30)
    os.link(compiled / "chunk0.onnx", bundle / "chunk0.onnx")
    (bundle / "run.py").write_bytes(b"r" * 200)
    (tmp_path / "release/m/onnx/fp32.tar.gz").write_bytes(b"t" * 4000)
    written = {r["step"]: r["written"] for r in bench_scale.step_rows(tmp_path, "m")}
    assert written == {"export": 5000, "compile": 30, "package": 4200}


def test_each_compiles_simulator_check_is_read_whether_it_passed_or_not(tmp_path):
    import json

    import pytest

    from npuforge.backends import gate
    from npuforge.backends.base import Call
    from npuforge.errors import NpuforgeError

    figures = {
        "positions": 40, "cosine": 0.9999968, "cosine_mean": 0.9999991,
        "top1_agreement": 0.975, "top1_misses": [{"position": 3, "fp32_margin": 0.01}],
        "worst_cosine_position": 0,
        "perplexity": {"reference": 10.0, "compiled": 10.012, "delta": 0.0012, "positions": 40},
    }  # fmt: skip
    schedule = [Call("prefill", 0, 32)] + [Call("decode", 32 + i, 1) for i in range(8)]
    text = {"ids": list(range(41))}
    landed = gate.verification(figures, {"min_cosine": 0.9999}, schedule=schedule, text=text,
                               runner="cmodel", reference="fp32")  # fmt: skip
    out = tmp_path / "compile" / "m" / "BM1688" / "f16"
    out.mkdir(parents=True)
    (out / "compile.json").write_text(json.dumps({"verification": landed}))
    finished_step(tmp_path, "compile/m/BM1688/f16.log", 100.0, 10, 20)
    # A failed gate leaves no compile.json: its line in the log is all there is.
    failing = {**figures, "cosine": 0.99541, "cosine_mean": 0.99902, "top1_agreement": 1.0}
    failing["perplexity"] = {**figures["perplexity"], "delta": 0.0022}
    record = gate.verification(failing, {"min_cosine": 0.9999}, schedule=schedule, text=text,
                               runner="htp", reference="fp32")  # fmt: skip
    with pytest.raises(NpuforgeError) as failed:
        gate.check_gate("SM8650", "fp16", record, gate.FP16_HINT)
    log = tmp_path / "logs" / "compile" / "m" / "SM8650" / "fp16.log"
    log.parent.mkdir(parents=True)
    log.write_text(f"progress\nerror: {failed.value}\n")
    # A compile stopped before its check says nothing.
    (log.parent / "int8.log").write_text("progress\nerror: model_deploy failed\n")
    rows = bench_scale.verification_rows(tmp_path, "m")
    assert rows == [
        {"job": "BM1688/f16", "positions": 40, "calls": {"decode": 8, "prefill": 1},
         "cosine": 0.9999968, "cosine_mean": 0.9999991, "top1": 0.975, "perplexity": 0.12,
         "passed": True},
        {"job": "SM8650/fp16", "positions": 40, "calls": None, "cosine": 0.99541,
         "cosine_mean": 0.99902, "top1": 1.0, "perplexity": 0.22, "passed": False},
    ]  # fmt: skip
    table = bench_scale.verification_table(rows)
    lines = [line.split() for line in table.splitlines()[2:]]
    assert lines[0] == ["BM1688/f16", "40", "8", "decode", "+", "1", "prefill", "0.9999968",
                        "0.9999991", "0.975", "+0.12", "%", "passes"]  # fmt: skip
    assert lines[1] == ["SM8650/fp16", "40", "–", "0.99541", "0.99902", "1.0", "+0.22", "%",
                        "fails"]  # fmt: skip
    # Recorded as bench rows of their own, one per compile.
    from argparse import Namespace

    args = Namespace(models="m", targets="BM1688,SM8650", precisions="f16,fp16",
                     verify_steps=40, budget_gb=12.0)  # fmt: skip
    compiled = {"seconds": 9.0, "cpu_seconds": 9.0, "step_rss_mb": 1, "child_rss_mb": 2,
                "together_rss_mb": 3, "written": 0}  # fmt: skip
    measured = [("m", 1_500_000_000, {"compile BM1688/f16": compiled})]
    recorded = bench_scale.bench_rows(measured, args, {"m": rows})
    # A compile's time and its check are settings of their length: a longer check of
    # the same build is a row of its own, not a new figure of this one.
    assert [(r["id"], r["setting"]) for r in recorded] == [
        ("scale-m-compile-BM1688-f16-40-positions",
         "m (1500M parameters): compile BM1688/f16 (40 positions)"),
        ("scale-check-m-BM1688-f16-40-positions",
         "m (1500M parameters): BM1688/f16 (40 positions)"),
        ("scale-check-m-SM8650-fp16-40-positions",
         "m (1500M parameters): SM8650/fp16 (40 positions)"),
    ]  # fmt: skip
    assert recorded[0]["figures"]["together MB"] == 3
    recorded = recorded[1:]
    assert recorded[1]["figures"] == {
        "positions": 40, "calls": "–", "cosine": 0.99541, "cosine mean": 0.99902,
        "top-1": 1.0, "perplexity %": 0.22, "gate": "fails",
    }  # fmt: skip


def scale_row(model: str, params_m: int, stage: str, seconds: float, step_mb, child_mb, cpu=None):
    cpu_figure = {} if cpu is None else {"CPU s": cpu}  # rows from before the CPU figure
    return {
        "id": f"scale-{model}-{bench_scale.slug(stage)}",
        "family": "scale",
        "setting": f"{model} ({params_m}M parameters): {stage}",
        "figures": {
            "wall s": seconds, **cpu_figure, "step MB": step_mb, "processes MB": child_mb,
            "written MB": 1.0,
        },
        "date": "2026-12-05", "commit": "abc1234", "command": "python bench/bench_scale.py",
        "status": "current",
    }  # fmt: skip


def test_growth_from_recorded_rows_pairs_steps_by_name(tmp_path, monkeypatch, capsys):
    # Builds too long to run in one go are recorded one at a time; their growth is
    # computed from the rows, each step paired with its namesake.
    from npuforge.measurements import load_rows, write_rows

    small, large = "qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape"
    rows = [
        scale_row(small, 494, "compile RK3588/fp16", 100.0, 1000, 3000),
        scale_row(small, 494, "export (for RK3588)", 10.0, 500, 0, cpu=8.0),
        scale_row(large, 1544, "compile RK3588/fp16", 400.0, 2000, 6000, cpu=350.0),
        scale_row(large, 1544, "export (for RK3588)", 30.0, 500, 0, cpu=16.0),
        scale_row(large, 1544, "export (for SM8650)", 30.0, 500, 0),  # no namesake
    ]
    rows.append({**rows[0], "id": "old", "status": "superseded", "figures": {
        **rows[0]["figures"], "wall s": 1.0}})  # fmt: skip
    data = tmp_path / "benches.yaml"
    write_rows(data, rows)
    record = tmp_path / "record.yaml"
    argv = ["bench_scale.py", "--from-records", str(data), "--models", f"{large},{small}"]
    monkeypatch.setattr(sys, "argv", [*argv, "--record", str(record)])
    assert bench_scale.main() == 0
    growth = {r["setting"]: r["figures"] for r in load_rows(record)}
    ratio = bench_scale.parameters(large) / bench_scale.parameters(small)
    k_time = f"{math.log(4) / math.log(ratio):.2f}"
    k_memory = f"{math.log(8000 / 4000) / math.log(ratio):.2f}"
    assert growth == {
        # The smaller build's row predates the CPU figure: no CPU exponent.
        f"compile RK3588/fp16: {small} -> {large}": {
            "time k": k_time, "CPU k": "–", "memory k": k_memory},
        f"export (for RK3588): {small} -> {large}": {
            "time k": f"{math.log(3) / math.log(ratio):.2f}",
            "CPU k": f"{math.log(2) / math.log(ratio):.2f}", "memory k": "0.00"},
    }  # fmt: skip
    assert "from recorded rows" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv[:-1], f"{small},smollm2-135m"])
    assert bench_scale.main() == 1
    assert "has no current scale rows of smollm2-135m" in capsys.readouterr().err


def test_compiles_pair_only_when_their_checks_verified_the_same_positions(tmp_path):
    """A compile's time holds its simulator check: 8 calls at 0.5B against 64 at 1.5B is
    no growth of the compile. Steps without a check pair as before."""
    from npuforge.measurements import write_rows

    small, large = "qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape"
    rows = [
        scale_row(small, 494, "compile SM8650/a16w8", 100.0, 1000, 3000),
        scale_row(small, 494, "compile SM8650/fp16", 100.0, 1000, 3000),
        scale_row(small, 494, "export (for SM8650)", 10.0, 500, 0),
        scale_row(large, 1544, "compile SM8650/a16w8", 800.0, 2000, 6000),
        scale_row(large, 1544, "compile SM8650/fp16", 300.0, 2000, 6000),
        scale_row(large, 1544, "export (for SM8650)", 30.0, 500, 0),
    ]
    steps = {0: 8, 1: 16, 3: 64, 4: 16}  # the export rows' commands name 8 and 64 as well
    for index, row in enumerate(rows):
        row["command"] += f" --verify-steps {steps.get(index, 8 if index < 3 else 64)}"
    # Rows recorded since name their length in their setting: read once, not twice.
    rows.append(scale_row(small, 494, "compile SM8650/a16w8 (64 positions)", 200.0, 1000, 3000))
    rows[-1]["command"] += " --verify-steps 64"
    data = tmp_path / "benches.yaml"
    write_rows(data, rows)
    paired = set(bench_scale.recorded_stages(data, small)) & set(
        bench_scale.recorded_stages(data, large)
    )
    assert paired == {
        "compile SM8650/fp16 (16 positions)",
        "compile SM8650/a16w8 (64 positions)",
        "export (for SM8650)",
    }
