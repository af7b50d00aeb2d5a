"""bench/bench_scale.py's reading of a results directory: each finished step's resources
line and outputs, merged per stage, and the growth exponents between model sizes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_scale  # noqa: E402


def finished_step(results: Path, log: str, seconds: float, rss_mb: int, child_mb: int):
    path = results / "logs" / log
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "progress\nstep resources: "
        f"{seconds} s wall, peak RSS {rss_mb} MB (step), {child_mb} MB (processes it ran)\n"
    )


def fake_build(results: Path, model: str, scale: int):
    """Two export keys, a compile, and a step that did not finish (no resources line)."""
    finished_step(results, f"export/{model}/decode-a.log", 10.0 * scale, 100 * scale, 0)
    finished_step(results, f"export/{model}/prefill-b.log", 5.0 * scale, 300 * scale, 0)
    finished_step(
        results, f"compile/{model}/RK3588/fp16.log", 60.0 * scale**2, 200 * scale, 900 * scale
    )
    (results / "logs" / "package" / model / "RK3588").mkdir(parents=True)
    (results / "logs" / "package" / model / "RK3588" / "fp16.log").write_text("error: no\n")
    out = results / "compile" / model / "RK3588" / "fp16"
    out.mkdir(parents=True)
    (out / "model.rknn").write_bytes(b"x" * 1000 * scale)


def test_steps_are_read_merged_per_stage_and_their_growth_is_an_exponent(tmp_path):
    for model, scale in (("small", 1), ("large", 4)):
        fake_build(tmp_path / model, model, scale)
    small = bench_scale.step_rows(tmp_path / "small", "small")
    assert [(r["step"], r["job"]) for r in small] == [
        ("compile", "RK3588/fp16"),
        ("export", "decode-a"),
        ("export", "prefill-b"),
    ]
    assert small[0]["written"] == 1000 and small[0]["child_rss_mb"] == 900
    merged = bench_scale.stages(small)
    # Export keys add up in time and take the larger peak.
    assert merged["export"]["seconds"] == 15.0 and bench_scale.peak_mb(merged["export"]) == 300
    large = bench_scale.stages(bench_scale.step_rows(tmp_path / "large", "large"))
    table = bench_scale.growth_table([("small", 1_000, merged), ("large", 4_000, large)])
    # stage, then seconds and MB per model, then the two exponents
    rows = {" ".join(cells[:-6]): cells for cells in map(str.split, table.splitlines()[2:])}
    # 4x the parameters: the compile's time grew 16x (k = 2), its memory (the step and
    # the processes it ran, together) 4x (k = 1).
    assert rows["compile RK3588/fp16"][-2:] == ["2.00", "1.00"]
    assert rows["export"][-2:] == ["1.00", "1.00"]
