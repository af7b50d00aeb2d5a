"""npuforge doctor: every backend's toolchain (found, version, runtime), building none."""

import json
import subprocess
import sys

from conftest import REPO, script_env

from npuforge import doctor


def _fake_repo(tmp_path):
    for backend in ("qnn", "rknn"):
        (tmp_path / "envs" / backend).mkdir(parents=True)
        (tmp_path / "envs" / backend / "requirements.lock").write_text("numpy==2.4.6\n")
    (tmp_path / "envs" / "main").mkdir()
    (tmp_path / "envs" / "main" / "requirements.lock").write_text("pyyaml\n")
    (tmp_path / "envs" / "notes").mkdir()
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("toolchain: {runtime: native}\n")
    (tmp_path / "config" / "targets.yaml").write_text(
        "SM8650: {backend: qnn, options: {htp_arch: 75, soc_model: 57}}\n"
    )
    return tmp_path


def test_backends_are_the_env_dirs_with_a_toolchain_definition(tmp_path):
    repo = _fake_repo(tmp_path)
    assert doctor.backends(repo) == ["qnn", "rknn"]
    assert doctor.configured_runtime(repo) == "native"


def test_found_needs_a_stamp_whose_environment_still_exists(tmp_path):
    repo = _fake_repo(tmp_path)
    stamps = tmp_path / "results" / "toolchains"
    stamps.mkdir(parents=True)
    versions = {"onnxruntime-qnn": "2.7.0", "qairt": "2.51.0"}
    stamp = {"backend": "qnn", "runtime": "native", "python": sys.executable, "versions": versions}
    (stamps / "qnn-native.json").write_text(json.dumps(stamp))
    gone = {"backend": "rknn", "runtime": "native", "python": str(tmp_path / "nope" / "python")}
    (stamps / "rknn-native.json").write_text(json.dumps(gone))
    rows = {
        r["backend"]: r for r in doctor.report(results_dir=tmp_path / "results", repo_root=repo)
    }
    assert rows["qnn"]["found"] and rows["qnn"]["versions"]["qairt"] == "2.51.0"
    assert rows["qnn"]["runtime"] == "native"
    assert not rows["rknn"]["found"] and "gone" in rows["rknn"]["note"]
    text = doctor.format_rows(list(rows.values()))
    assert "qnn        native   yes" in text and "onnxruntime-qnn 2.7.0" in text
    podman = doctor.report(runtime="podman", results_dir=tmp_path / "results", repo_root=repo)
    assert not any(r["found"] for r in podman if r["backend"] != "qnn-sdk")


def test_cli_prints_every_backend_of_this_repository():
    run = subprocess.run(
        [sys.executable, "-m", "npuforge", "doctor", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=script_env(QNN_SDK_ROOT=None),
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    names = [r["backend"] for r in rows]
    assert {"qnn", "qnn-sdk"} <= set(names)
    sdk = rows[names.index("qnn-sdk")]
    assert not sdk["found"] and "QNN_SDK_ROOT" in sdk["note"]
    assert all(set(r) == {"backend", "runtime", "found", "versions", "note"} for r in rows)
