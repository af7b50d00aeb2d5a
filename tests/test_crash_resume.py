"""Crash and resume: a build killed at a random moment resumes to the same bytes.

CI runs a few seeded trials (three of the onnx build, one kill inside an RKNN compile);
bench/reliability.py runs many (N >= 20).
"""

import random

import pytest
from crash_trials import clean_build, kill_trial, run_fetch_trials, run_trials

from npuforge import toolchain

RKNN_REASON = toolchain.unavailable_reason("rknn", "native", {"target_platform": "rk3588"})


@pytest.mark.slow
def test_killed_onnx_builds_resume_to_identical_bytes(tmp_path):
    trials = run_trials(tmp_path, ["model=rwkv7-tiny", "target=onnx"], count=3, seed=1)
    for trial in trials:
        assert trial.resumed, trial
        assert trial.identical, trial
        assert trial.leftovers == [], trial


@pytest.mark.slow
def test_fetches_killed_inside_the_hf_download_resume_to_identical_bytes(tmp_path):
    # Seed 3 puts both kills inside the 2 s download (0.59 and 1.36 s in). The runs stop
    # after the fetch; bench/reliability.py runs whole builds.
    trials = run_fetch_trials(tmp_path, count=2, seed=3, whole_build=False)
    for trial in trials:
        assert trial.resumed and trial.identical and trial.leftovers == [], trial
        assert "fetch" in trial.stage.split(","), trial
    # The kills left partial downloads in the HF cache, and no rerun trusted them.
    assert any(trial.partial_downloads for trial in trials), trials


@pytest.mark.slow
@pytest.mark.toolchain
@pytest.mark.skipif(RKNN_REASON is not None, reason=f"no rknn toolchain: {RKNN_REASON}")
def test_a_killed_rknn_build_resumes_to_identical_bytes(tmp_path):
    # One kill, inside the vendor compile (a seeded moment in its first seconds, when
    # rknn-toolkit2 is loading or building): the part of a build only this test kills.
    # The onnx trials above cover kills spread over a whole build.
    config = ["model=rwkv7-tiny", "target=RK3588"]
    reference, _ = clean_build(tmp_path, config)
    kill_at = random.Random(2).uniform(0.5, 5.0)

    def compiling(wf):
        return any((wf / "results" / "logs" / "compile").rglob("*.log"))

    trial = kill_trial(tmp_path, config, kill_at, reference, "trial", started=compiling)
    assert "compile" in trial.stage.split(","), trial
    assert trial.resumed and trial.identical and trial.leftovers == [], trial
