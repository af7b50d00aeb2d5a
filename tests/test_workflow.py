"""The Snakemake workflow, run for real on temporary copies of the repository."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, rknn_stamp, script_env, snakemake

EXTRA_TARGETS = {
    # Reference-backend targets with different needs: no vendor toolchain required.
    "onnx-c2": {"export": {"chunks": 2}},
    "onnx-emb": {"export": {"ext_embedding": True}},
    # Same export needs as `onnx`, its own compile option.
    "onnx-v16": {"options": {"verify_steps": 16}},
}


def reference_target(overrides: dict) -> dict:
    base = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())["onnx"]
    for key, value in overrides.items():
        base[key] = dict(base[key], **value) if isinstance(value, dict) else value
    return base


def write_extra(workflow, data, name="extra.yaml"):
    path = workflow / name
    path.write_text(yaml.safe_dump(data))
    return path


def job_counts(output: str) -> dict:
    """The 'Job stats' table of a snakemake run as {rule: count}."""
    match = re.search(r"Job stats:\njob\s+count\n[-\s]+\n(.*?)\ntotal\s+(\d+)", output, re.S)
    assert match, f"no job stats in output:\n{output[-3000:]}"
    counts = {}
    for line in match.group(1).splitlines():
        rule, count = line.split()
        counts[rule] = int(count)
    counts["total"] = int(match.group(2))
    return counts


def dry_run(workflow, *args):
    result = snakemake(workflow, "--dry-run", *args, check=True)
    return job_counts(result.stdout + result.stderr)


def test_default_dry_run(workflow):
    counts = dry_run(workflow)
    assert counts == {
        "fetch": 1,
        "inspect": 1,
        "tokenizer": 1,
        "heldout": 1,
        "export": 1,
        "verify_onnx": 1,
        "compile": 1,
        "package": 1,
        "release_index": 1,
        "release_report": 1,
        "all": 1,
        "total": 11,
    }


def test_inspecting_a_seed_size_checkpoint_reserves_no_model(workflow):
    """The inspect step reads headers or maps tensors (33 and 224 MB at 1.5B): its
    reservation, which a cluster asks of a node, stays at the steps' floor where a step
    holding the model reserves 16 bytes per parameter (24.6 GB here)."""
    from npuforge.memory_plan import STEP_FLOOR_MB

    result = snakemake(
        workflow, "--dry-run", "--resources", "mem_mb=100000", "--config",
        "model=qwen2.5-1.5b-shape", "target=onnx", check=True,
    )  # fmt: skip
    reserved = dict(
        re.findall(
            r"^(?:local)?rule (\w+):\n(?:\s+.*\n)*?\s+resources: .*?\bmem_mb=(\d+)",
            result.stdout,
            re.M,
        )
    )
    assert int(reserved["inspect"]) == STEP_FLOOR_MB, reserved
    assert int(reserved["export"]) > 10 * STEP_FLOOR_MB, reserved  # one 1.5B chunk


def test_two_models_by_four_targets_share_fetch_and_exports(workflow):
    extra = write_extra(
        workflow, {"targets": {tid: reference_target(o) for tid, o in EXTRA_TARGETS.items()}}
    )
    counts = dry_run(
        workflow,
        "--configfile",
        extra,
        "--config",
        "model=rwkv7-demo,rwkv7-tiny",
        "target=onnx,onnx-c2,onnx-emb,onnx-v16",
    )
    # Per model: one fetch; three distinct export option sets (onnx and onnx-v16 share one).
    assert counts["fetch"] == 2
    assert counts["inspect"] == 2
    assert counts["tokenizer"] == 1
    assert counts["export"] == 2 * 3
    assert counts["verify_onnx"] == 2 * 3
    assert counts["compile"] == 2 * 4
    assert counts["package"] == 2 * 4
    assert "calibrate" not in counts and "prepare_toolchain" not in counts


def test_vendor_targets_share_exports_and_calibration(workflow):
    from npuforge.toolchain import unavailable_reason

    options = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())
    for target in ("SM8650", "SM8550"):
        reason = unavailable_reason("qnn", "native", options[target]["options"])
        if reason:
            pytest.skip(f"qnn toolchain check refuses here: {reason}")
    # SM8550 builds a16w8 on request only (targets.yaml): ask for it on both
    counts = dry_run(workflow, "--config", "target=SM8650,SM8550", "precision=fp16,a16w8")
    assert counts["export"] == 1  # equal export needs: one export for both SoCs
    assert counts["calibrate"] == 1
    assert counts["prepare_toolchain"] == 1
    assert counts["compile"] == 4 and counts["package"] == 4
    # SM8650 builds fp16 and a16w8 by default, so its default run calibrates
    counts = dry_run(workflow, "--config", "target=SM8650")
    assert counts["calibrate"] == 1 and counts["compile"] == 2


def test_listed_precisions_build_on_the_selected_targets_that_have_them(workflow):
    from npuforge.toolchain import unavailable_reason

    options = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())["RK3588"]["options"]
    reason = unavailable_reason("rknn", "native", options)
    if reason:
        pytest.skip(f"rknn toolchain check refuses here: {reason}")
    # onnx has no fp16, RK3588 no fp32: each target builds the one it has.
    result = snakemake(
        workflow, "--dry-run", "--config", "target=onnx,RK3588", "precision=fp32,fp16"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert job_counts(output)["compile"] == 2
    assert "results/compile/rwkv7-demo/onnx/fp32" in output
    assert "results/compile/rwkv7-demo/RK3588/fp16" in output


def test_prefill_export_gets_its_own_calibration_feeding_the_compile(workflow):
    from npuforge.toolchain import unavailable_reason

    options = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())["SM8650"]["options"]
    reason = unavailable_reason("qnn", "native", options)
    if reason:
        pytest.skip(f"qnn toolchain check refuses here: {reason}")
    overlay = {"SM8650": {"export": {"variants": ["decode", "prefill"], "prefill_tokens": 4}}}
    extra = write_extra(workflow, {"targets": overlay})
    result = snakemake(
        workflow, "--dry-run", "--printshellcmds", "--configfile", extra,
        "--config", "target=SM8650", "precision=a16w8", check=True,
    )  # fmt: skip
    output = result.stdout + result.stderr
    counts = job_counts(output)
    assert counts["export"] == 2 and counts["calibrate"] == 2 and counts["compile"] == 1
    calibrated = re.findall(r"make_calibration_samples\.py --export (\S+)", output)
    compile_cmd = next(line for line in output.splitlines() if "compile.py --backend qnn" in line)
    exports = re.findall(r"--export (\S+)", compile_cmd)
    calibrations = re.findall(r"--calibration (\S+)", compile_cmd)
    # One calibration per export, in the exports' order (decode, then prefill).
    assert [Path(e).name.split("-")[0] for e in exports] == ["decode", "prefill"]
    assert sorted(calibrated) == sorted(exports)
    assert [c.replace("/calibration/", "/export/") for c in calibrations] == exports


# Two chunks of the demo model (36.8M parameters, 16.8M of them the head).
TWO_CHUNKS = {
    "BM1684X": {"chunks": 2},
    "SM8650": {"chunk_policy": {"max_chunk_bytes": 40_000_000, "bytes_per_param": 2}},
}


@pytest.mark.parametrize(
    "backend, target, precision, options",
    [("tpumlir", "BM1684X", "f16", {"processor": "bm1684x"}),
     ("qnn", "SM8650", "fp16", {"soc_model": 57, "htp_arch": 75})],
)  # fmt: skip
def test_a_chunked_build_runs_a_job_per_chunk_then_the_compile(
    workflow, backend, target, precision, options
):
    from npuforge.toolchain import unavailable_reason

    reason = unavailable_reason(backend, "native", options)
    if reason:
        pytest.skip(f"{backend} toolchain check refuses here: {reason}")
    extra = write_extra(workflow, {"targets": {target: {"export": TWO_CHUNKS[target]}}})
    select = ["--config", f"target={target}", f"precision={precision}"]
    select.append("toolchain_runtime=native")
    result = snakemake(
        workflow, "--dry-run", "--printshellcmds", "--configfile", extra, *select, check=True
    )
    output = result.stdout + result.stderr
    counts = job_counts(output)
    assert counts["compile_chunk"] == 2 and counts["compile"] == 1
    commands = [line for line in output.splitlines() if f"compile.py --backend {backend}" in line]
    chunk_jobs = sorted(re.findall(r"--only-chunk (\d+) --out-dir (\S+)", " ".join(commands)))
    assert [chunk for chunk, _ in chunk_jobs] == ["0", "1"]
    compile_cmd = next(line for line in commands if "--only-chunk" not in line)
    # The compile takes back every chunk's build, after the same options.
    assert re.findall(r"--chunk-build (\S+)", compile_cmd) == [out for _, out in chunk_jobs]
    strip = re.compile(r" --(?:only-chunk \d+|chunk-build \S+|out-dir \S+)")
    assert {strip.sub("", c).split(">")[0] for c in commands} == {
        strip.sub("", compile_cmd).split(">")[0]
    }
    # One chunk: no job of its own.
    result = snakemake(workflow, "--dry-run", *select, check=True)
    assert "compile_chunk" not in job_counts(result.stdout + result.stderr)


BAD_SELECTIONS = [
    (["model=rwkv9"], "unknown model 'rwkv9'; valid models: rwkv7-demo, rwkv7-tiny"),
    (["target=SM9999"], "unknown target 'SM9999'; valid targets: onnx, SM8650, SM8550"),
    (["target=SM8650", "precision=fp99"], "unknown precision 'fp99'; valid precisions:"),
    (
        ["target=SM8350", "precision=fp16"],
        "does not support precision 'fp16'; it supports: a16w8",
    ),
    (["target=RK3588,onnx", "precision=fp32"], "target RK3588 (Rockchip RK3588 NPU (6 TOPS))"),
    (["toolchain_runtime=lxc"], "lxc"),
]


@pytest.mark.parametrize("config, message", BAD_SELECTIONS)
def test_bad_selection_stops_before_any_job(workflow, config, message):
    result = snakemake(workflow, "--config", *config)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert message in output
    assert "Job stats" not in output and "rule " not in output
    assert not (workflow / "results").exists()


def test_bad_registry_entry_from_configfile_stops_before_any_job(workflow):
    model = yaml.safe_load((REPO / "config" / "models.yaml").read_text())["rwkv7-tiny"]
    model["source"] = {"hf": {"repo": "org/name", "filename": "m.pth", "revision": "main"}}
    model["sha256"] = "0" * 64
    extra = write_extra(workflow, {"models": {"bad": model}, "model": "bad"})
    result = snakemake(workflow, "--configfile", extra)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "npuforge: models.bad.source.hf.revision: 'main' does not match" in output
    assert "a pinned commit, never a branch" in output
    assert not (workflow / "results").exists()


def test_configfile_adds_a_local_checkpoint(workflow, tmp_path):
    model = yaml.safe_load((REPO / "config" / "models.yaml").read_text())["rwkv7-tiny"]
    model["source"] = {"path": str(tmp_path / "mine.pth")}
    model["sha256"] = "0" * 64
    extra = write_extra(workflow, {"models": {"mine": model}})
    result = snakemake(workflow, "--dry-run", "--configfile", extra, "--config", "model=mine")
    assert result.returncode == 0, result.stderr
    assert "results/models/mine/checkpoint.pth" in result.stdout
    assert job_counts(result.stdout)["fetch"] == 1


def test_lint_and_format_are_clean():
    lint = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "Congratulations, your workflow is in a good condition!" in lint.stdout + lint.stderr
    beside = Path(sys.executable).parent / "snakefmt"
    snakefmt = str(beside) if beside.exists() else shutil.which("snakefmt")
    if snakefmt is None:
        pytest.skip("snakefmt is not installed")
    fmt = subprocess.run(
        [snakefmt, "--check", "Snakefile", "rules"], cwd=REPO, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def sha256_tree(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def release_files(workflow):
    return sha256_tree(workflow / "results" / "release")


def test_default_build_verifies_reruns_nothing_and_rebuilds_identically(workflow):
    """The README's build on the embedded demo model, end to end, twice from scratch."""
    built = snakemake(workflow, check=True)
    # Unless told, a run starts no more jobs at once than the host's free memory holds.
    free = re.search(
        r'Provided resources: .*mem_mb=Resource\("mem_mb", (\d+)\)', built.stdout + built.stderr
    )
    assert (
        free
        and 0 < int(free.group(1)) <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e6
    )
    bundle = workflow / "results" / "release" / "rwkv7-demo" / "onnx" / "fp32"
    assert (bundle / "manifest.json").is_file()
    assert (bundle.parent / "fp32.tar.gz").is_file()
    sums = subprocess.run(
        ["sha256sum", "-c", "SHA256SUMS"], cwd=bundle, capture_output=True, text=True
    )
    assert sums.returncode == 0, sums.stdout + sums.stderr
    # The bundle's graphs are the export's own files through the compile (hard links):
    # an fp32 model's weights are on disk once, not three times.
    exported = next((workflow / "results" / "export" / "rwkv7-demo").glob("*/chunk0.onnx"))
    assert (bundle / "chunk0.onnx").stat().st_ino == exported.stat().st_ino
    first = release_files(workflow)

    again = snakemake(workflow, check=True)
    assert "Nothing to be done" in again.stdout + again.stderr

    # An edit to a backend the build does not run reruns nothing: each step digests the
    # code it reaches (test_a_code_edit_reruns_only_the_steps_that_reach_it).
    backend = workflow / "npuforge" / "backends" / "qnn.py"
    source = backend.read_text()
    backend.write_text(source + "# an edit to the package\n")
    assert "Nothing to be done" in snakemake(workflow, "--dry-run").stdout
    backend.write_text(source)

    # A second target with the same export needs but its own option: only its jobs run.
    one_target_jobs = {  # what a rebuild of one target plans
        "compile": 1,
        "package": 1,
        "release_index": 1,
        "release_report": 1,
        "all": 1,
        "total": 5,
    }
    second = {"onnx-v16": reference_target(EXTRA_TARGETS["onnx-v16"])}
    extra = write_extra(workflow, {"targets": second})
    select = ("--config", "target=onnx,onnx-v16")
    added = snakemake(
        workflow, "--configfile", extra, *select, "--resources", "mem_mb=123456", check=True
    )
    assert job_counts(added.stdout + added.stderr) == one_target_jobs
    assert 'mem_mb=Resource("mem_mb", 123456)' in added.stdout + added.stderr  # as told
    # The index lists every bundle in results/release, whichever selection built it.
    index = json.loads((workflow / "results" / "release" / "index.json").read_text())
    rows = [(b["model"], b["target"], b["precision"]) for b in index["bundles"]]
    assert rows == [("rwkv7-demo", "onnx", "fp32"), ("rwkv7-demo", "onnx-v16", "fp32")]
    # Changing that target's option reruns exactly its compile and package.
    changed = write_extra(
        workflow,
        {"targets": {"onnx-v16": reference_target({"options": {"verify_steps": 8}})}},
        name="changed.yaml",
    )
    dry = snakemake(workflow, "--dry-run", "--configfile", changed, *select)
    output = dry.stdout + dry.stderr
    assert job_counts(output) == one_target_jobs
    assert "results/compile/rwkv7-demo/onnx-v16/fp32" in output
    assert "results/compile/rwkv7-demo/onnx/fp32" not in output
    # A registry field that only the manifest records reruns that bundle's packaging alone.
    renamed = write_extra(
        workflow, {"targets": {"onnx-v16": {"description": "renamed"}}}, name="renamed.yaml"
    )
    dry = snakemake(workflow, "--dry-run", "--configfile", extra, renamed, *select)
    output = dry.stdout + dry.stderr
    packaging = {"package": 1, "release_index": 1, "release_report": 1, "all": 1, "total": 4}
    assert job_counts(output) == packaging
    assert "results/release/rwkv7-demo/onnx-v16/fp32/manifest.json" in output

    shutil.rmtree(workflow / "results")
    snakemake(workflow, check=True)
    assert release_files(workflow) == first


def planned_jobs(output: str) -> list[tuple[str, str, str]]:
    """(rule, output, reason) of each job a dry run plans, in its order."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:\n)", output)[1:]:
        rule = re.match(r"(?:local)?rule (\w+):", block).group(1)
        outputs = re.search(r"^\s+output: (.*)$", block, re.M)
        reason = re.search(r"^\s+reason: (.*)$", block, re.M)
        jobs.append((rule, outputs.group(1) if outputs else "", reason.group(1) if reason else ""))
    return jobs


def with_edit(workflow, relative, *dry_run_args) -> str:
    """The dry run's output with a comment appended to ``relative``, which is then undone."""
    path = workflow / relative
    source = path.read_text()
    path.write_text(source + "# an edit\n")
    try:
        dry = snakemake(workflow, "--dry-run", *dry_run_args, check=True)
    finally:
        path.write_text(source)
    return dry.stdout + dry.stderr


def test_a_code_edit_reruns_only_the_steps_that_reach_it(workflow):
    """Built for real: each step digests its CLI, its rule and the code it reaches."""
    select = ("--config", "model=rwkv7-tiny,llama-tiny", "target=onnx")
    snakemake(workflow, *select, check=True)
    index = {"release_index": 1, "release_report": 1, "all": 1}
    one_model = {"inspect": 1, "heldout": 1, "export": 1, "verify_onnx": 1, "compile": 1}
    expected = {
        "npuforge/backends/onnx.py": {"compile": 2, "package": 2, **index},
        "npuforge/backends/qnn.py": {},
        "npuforge/jobs/qnn_job.py": {},
        # llama-tiny's synthetic checkpoint is written by its family's code.
        "npuforge/models/llama/model.py": {"fetch_tree": 1, **one_model, "package": 1, **index},
        "npuforge/fetch.py": {"fetch": 1, "fetch_tree": 1}
        | {rule: 2 for rule in one_model}
        | {"package": 2, **index},
    }
    for relative, jobs in expected.items():
        output = with_edit(workflow, relative, *select)
        if not jobs:
            assert "Nothing to be done" in output, (relative, output[-3000:])
            continue
        assert job_counts(output) == {**jobs, "total": sum(jobs.values())}, relative
        if "llama" in relative:
            built = [out for rule, out, _ in planned_jobs(output) if rule not in index]
            assert built and all("llama-tiny" in out for out in built), built
    assert "Nothing to be done" in snakemake(workflow, "--dry-run", *select).stdout


def env_without_container_engines(tmp_path) -> dict:
    # A PATH with this interpreter and a coreutils directory only: no container engine.
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "bash", "env", "cat", "mkdir", "dirname"):
        if shutil.which(tool):
            (bare / tool).symlink_to(shutil.which(tool))
    return script_env(PATH=os.pathsep.join((str(Path(sys.executable).parent), str(bare))))


def rknn_refusal(workflow, runtime):
    from npuforge.toolchain import unavailable_reason

    targets = yaml.safe_load((workflow / "config" / "targets.yaml").read_text())
    return unavailable_reason("rknn", runtime, targets["RK3588"]["options"])


def test_edited_toolchain_definition_prepares_the_toolchain_again(workflow):
    reason = rknn_refusal(workflow, "native")
    if reason:
        pytest.skip(f"rknn toolchain check refuses here: {reason}")
    stamp = "results/toolchains/rknn-native.json"
    select = ("--config", "target=RK3588")
    snakemake(workflow, stamp, *select, check=True)
    assert "Nothing to be done" in snakemake(workflow, "--dry-run", stamp, *select).stdout
    # Another SoC of the backend (other options, other float16 layers) shares the
    # environment: selecting it must not prepare it again, nor rebuild RK3588's binaries.
    other = snakemake(workflow, "--dry-run", stamp, "--config", "target=RK3576")
    assert "Nothing to be done" in other.stdout, other.stdout + other.stderr
    versions = workflow / "envs" / "rknn" / "versions.py"
    versions.write_text(versions.read_text() + "# an edit to the toolchain's definition\n")
    dry = snakemake(workflow, "--dry-run", stamp, *select)
    assert job_counts(dry.stdout + dry.stderr) == {"prepare_toolchain": 1, "total": 1}
    assert "Params have changed" in dry.stdout + dry.stderr


def test_shipped_default_runtime_is_auto():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert config["toolchain_runtime"] == "auto"


def test_auto_runtime_builds_natively_where_no_engine_runs_and_says_so(workflow, tmp_path):
    if rknn_refusal(workflow, "native"):
        pytest.skip(f"rknn toolchain check refuses here: {rknn_refusal(workflow, 'native')}")
    env = env_without_container_engines(tmp_path)
    select = ("--config", "target=RK3588", "toolchain_runtime=auto")
    result = snakemake(workflow, "--dry-run", *select, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert (
        "npuforge: target RK3588 builds in the native toolchain environment, not in a "
        "container image (the reference runtime): container engine 'podman' is not installed"
    ) in result.stderr
    assert "results/toolchains/rknn-native.json" in output
    assert "rknn-podman" not in output


def test_auto_runtime_builds_in_podman_where_it_runs(workflow):
    reason = rknn_refusal(workflow, "podman")
    if reason:
        pytest.skip(f"podman cannot run the rknn toolchain here: {reason}")
    result = snakemake(workflow, "--dry-run", "--config", "target=RK3588", "toolchain_runtime=auto")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "results/toolchains/rknn-podman.json" in output
    assert "native toolchain environment" not in output and "rknn-native" not in output


def test_missing_toolchain_stops_before_any_job(workflow, tmp_path):
    env = env_without_container_engines(tmp_path)
    result = snakemake(workflow, "--config", "target=RK3588", "toolchain_runtime=docker", env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "npuforge: target RK3588: container engine 'docker' is not installed" in output
    assert "Job stats" not in output and not (workflow / "results").exists()


# --------------------------------------------------------------------------- llama family

LLAMA = "llama-tiny"


def shell_commands(output: str, script: str) -> list[str]:
    return [line for line in output.splitlines() if f"workflow_scripts/{script}" in line]


def export_dir_of(command: str) -> str:
    return re.search(r"--out-dir (\S+)", command).group(1).rsplit("/", 1)[-1]


def test_llama_plans_through_onnx_rknn_and_qnn_with_sha_for_qnn_only(workflow):
    from npuforge.toolchain import unavailable_reason

    targets = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())
    for target in ("RK3588", "SM8650"):
        backend = targets[target]["backend"]
        reason = unavailable_reason(backend, "native", targets[target]["options"])
        if reason:
            pytest.skip(f"{backend} toolchain check refuses here: {reason}")
    result = snakemake(
        workflow, "--dry-run", "--config", f"model={LLAMA}", "target=onnx,RK3588,SM8650", check=True
    )
    output = result.stdout + result.stderr
    counts = job_counts(output)
    assert counts["fetch_tree"] == 1 and "fetch" not in counts
    # onnx (Gather), RK3588 (embedding.bin), SM8650 (embedding.bin + MHA->SHA, SiLU in
    # its tanh form; fp16 and a16w8 share it)
    assert counts["export"] == 3 and counts["verify_onnx"] == 3
    # llama-tiny builds fp16 only on RK3588 (its registry entry); SM8650 fp16 + a16w8
    assert counts["compile"] == 4 and counts["package"] == 4
    assert counts["calibrate"] == 1 and "tokenizer" not in counts  # tokenizer: none

    exports = shell_commands(output, "export_onnx.py")
    assert all('"cache_len":64' in c and '"mask_value":-64.0' in c for c in exports)
    sha_exports = {export_dir_of(c) for c in exports if '"sha":true' in c}
    tanh_exports = {export_dir_of(c) for c in exports if '"tanh_silu":true' in c}
    assert len(sha_exports) == 1 and tanh_exports == sha_exports
    compiles = shell_commands(output, "compile.py")
    for command in compiles:
        target = re.search(r"--target (\S+)", command).group(1)
        uses_sha = any(f"/{key} " in command for key in sha_exports)
        assert uses_sha == (target == "SM8650"), command
    assert len(compiles) == 4
    packages = shell_commands(output, "package_release.py")
    assert all("--no-tokenizer" in c for c in packages) and len(packages) == 4


def test_llama_model_precisions_narrow_the_target(workflow):
    counts = dry_run(workflow, "--config", f"model={LLAMA}", "target=RK3588", "precision=all")
    assert counts["compile"] == 1  # fp16 only, though RK3588 has three precisions
    result = snakemake(
        workflow, "--dry-run", "--config", f"model={LLAMA}", "target=RK3588", "precision=w8a8"
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"model {LLAMA} is built for RK3588 in fp16 only" in output


def check_llama_bundle(bundle: Path, tokenizer_file=None) -> dict:
    import json

    sums = subprocess.run(
        ["sha256sum", "-c", "SHA256SUMS"], cwd=bundle, capture_output=True, text=True
    )
    assert sums.returncode == 0, sums.stdout + sums.stderr
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["family"] == "llama"
    # no tokenizer is invented for a checkpoint without one; the manifest says so
    assert manifest["inputs"]["tokenizer"]["file"] is None
    assert "no tokenizer" in manifest["inputs"]["tokenizer"]["reason"]
    assert not any(name.startswith("tokenizer") for name in manifest["files"])
    (report,) = manifest["export_verification"]
    assert report["reference"].startswith("transformers 5.23.0 fp32")
    assert report["steps"] == 64 and report["nan_inf"] == 0
    assert report["max_abs_rel"] <= 1e-4 and report["top1_agreement"] == 1.0
    return manifest


def test_llama_onnx_build_verifies_and_bundles(workflow):
    snakemake(workflow, "--config", f"model={LLAMA}", "target=onnx", check=True)
    bundle = workflow / "results" / "release" / LLAMA / "onnx" / "fp32"
    manifest = check_llama_bundle(bundle)
    figures = manifest["verification"]
    assert figures["positions"] == 32 and figures["nan_inf"] == 0 and figures["passed"]
    assert figures["max_abs_rel"] <= 1e-4 and figures["top1_agreement"] == 1.0
    assert figures["reference"].startswith("transformers 5.23.0 fp32")
    # llama-tiny has no tokenizer: its held-out text is UTF-8 bytes, labelled so.
    assert figures["text"]["tokenizer"]["kind"] == "bytes"
    assert abs(figures["perplexity"]["delta"]) < 1e-4
    (export,) = manifest["inputs"]["exports"]
    assert export["export"]["cache_len"] == 64 and export["export"]["options"]["sha"] is False
    assert (bundle.parent / "fp32.tar.gz").is_file()


@pytest.mark.slow
@pytest.mark.toolchain
def test_llama_rk3588_fp16_build_verifies_and_bundles(workflow, tmp_path):
    stamp, reason = rknn_stamp(tmp_path)
    if stamp is None:
        pytest.skip(reason)
    toolchains = workflow / "results" / "toolchains"
    toolchains.mkdir(parents=True)
    shutil.copyfile(stamp, toolchains / "rknn-native.json")
    snakemake(workflow, "--config", f"model={LLAMA}", "target=RK3588", check=True)
    bundle = workflow / "results" / "release" / LLAMA / "RK3588" / "fp16"
    manifest = check_llama_bundle(bundle)
    assert {"chunk0.rknn", "embedding.bin"} <= set(manifest["files"])
    figures = manifest["verification"]
    floor = figures["floors"]["min_cosine"]
    assert figures["nan_inf"] == 0 and figures["cosine"] >= floor == 0.9999 and figures["passed"]
