"""run.py, the generation runner every release bundle ships (npuforge/bundle_runner.py).

The end-to-end tests build bundles with the workflow, unpack the release tarball into
an empty directory and run ``python run.py`` there as a subprocess (PYTHONPATH cleared,
isolated mode, cwd the unpacked directory), so nothing from the checkout helps it. Its
greedy tokens are compared with npuforge's own fp32 runner (``npuforge.runtime.GraphChain``
on the export the bundle was compiled from), an independent implementation of the host
side. ``NPUFORGE_TEST_RESULTS=DIR`` reuses a results directory between runs (the
workflow then only repackages what changed); by default each module builds afresh.
"""

import ast
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, copy_workflow, snakemake

from npuforge import bundle_runner, toolchain

RUNNER = REPO / "npuforge" / "bundle_runner.py"
PROMPT = "The quick brown fox"
# Lazy imports run.py may make (a runtime, the HF tokenizer, stdlib helpers).
LAZY_ALLOWED = {
    "onnxruntime", "onnxruntime_qnn", "tokenizers", "rknnlite", "importlib", "mmap", "resource"
}  # fmt: skip


# --------------------------------------------------------------------------- unit


def test_runner_imports_only_the_standard_library_and_numpy():
    tree = ast.parse(RUNNER.read_text())
    top, lazy = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            (top if node in tree.body else lazy).update(n.split(".")[0] for n in names)
    stdlib = set(sys.stdlib_module_names)
    assert top - stdlib == {"numpy"}, top
    assert lazy <= LAZY_ALLOWED, lazy - LAZY_ALLOWED
    assert "npuforge" not in top | lazy


@pytest.mark.parametrize("scaling", [None, "llama3"])
@pytest.mark.parametrize("tokens,position", [(1, 0), (1, 37), (4, 8)])
def test_llama_host_inputs_equal_the_family_modules(scaling, tokens, position):
    from npuforge.models import llama

    config = {
        "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 128, "qkv_bias": True, "o_bias": False,
        "mlp_bias": False, "tie_word_embeddings": True, "qk_norm": False,
    }  # fmt: skip
    if scaling:
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16.0,
        }  # fmt: skip
    meta = {"family": "llama", "batch": 2, "tokens_per_call": tokens, "cache_len": 48,
            "config": config, "options": {"mask_value": -32.0}}  # fmt: skip
    ours = bundle_runner.llama_inputs(meta, position)
    for role in ("mask", "rope_cos", "rope_sin", "cache_write", "cache_keep"):
        spec = {"role": role, "name": role, "dtype": "float32"}
        expected = llama.extra_inputs(meta, spec, position)
        np.testing.assert_array_equal(np.asarray(ours[role], dtype=np.float32), expected)
    with pytest.raises(bundle_runner.RunnerError, match="48-slot cache"):
        bundle_runner.llama_inputs(meta, 48 - tokens + 1)


def test_world_tokenizer_matches_npuforge_and_the_rwkv_package(tmp_path):
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    from npuforge.tokenizer import convert_tokenizer, default_vocab_path

    convert_tokenizer(tmp_path / "tokenizer.bin")
    ours = bundle_runner.WorldTokenizer(tmp_path / "tokenizer.bin")
    trie = TRIE_TOKENIZER(str(default_vocab_path()))
    for text in (PROMPT, "Ünïcode — 中文 🙂\n\tcode: x = 1", "   spaces  "):
        ids = ours.encode(text)
        assert ids == trie.encode(text)
        assert ours.decode_bytes(ids).decode("utf-8") == text


def test_sampling_greedy_seeded_and_nucleus():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    top = int(np.argmax(logits))
    assert bundle_runner.sample(logits, 0.0, 1.0, None) == top
    # A nucleus smaller than the top token's mass keeps only it.
    assert bundle_runner.sample(logits, 1.0, 1e-9, np.random.default_rng(1)) == top

    def draws(seed, temperature, top_p):
        gen = np.random.default_rng(seed)
        return [bundle_runner.sample(logits, temperature, top_p, gen) for _ in range(50)]

    assert draws(3, 1.0, 0.9) == draws(3, 1.0, 0.9)
    assert draws(3, 1.0, 0.9) != draws(4, 1.0, 0.9)
    # top-p 0.5 at temperature 0.5 draws only from the few tokens holding half the mass.
    probs = np.exp((logits - logits.max()) / 0.5)
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5) + 1)].tolist())
    assert set(draws(5, 0.5, 0.5)) <= nucleus


def test_version_rules():
    check = bundle_runner.check_version
    assert check("QAIRT", "2.51.0.260929181845", "2.51.0.260929181845", "at_least") is None
    assert check("QAIRT", "2.51.0", "2.52.1", "at_least") is None
    line = check("QAIRT", "2.51.0.260929181845", "2.45.0.250101000000", "at_least")
    assert "2.51.0.260929181845" in line and "2.45.0.250101000000" in line
    assert "\n" not in line
    assert check("QAIRT", "2.51.0", "3.0.0", "at_least")  # another major
    assert check("tpu_mlir", "1.30.2", "1.30.9", "same_minor") is None
    assert check("tpu_mlir", "1.30.2", "1.29.0", "same_minor")


# --------------------------------------------------------------------------- helpers


def build(results, tmp_path_factory, *config):
    """Build with a copy of the workflow into ``results``; return it."""
    workflow = copy_workflow(tmp_path_factory.mktemp("wf"))
    snakemake(workflow, "--config", f"results={results}", *config, check=True)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One results directory for the module's builds (they share fetch and export)."""
    shared = os.environ.get("NPUFORGE_TEST_RESULTS")
    if shared:
        return Path(shared).resolve()
    return tmp_path_factory.mktemp("runner") / "results"


def unpack(results, model, target, precision, into):
    """The release tarball unpacked into an empty directory: the bundle directory."""
    into.mkdir(parents=True)
    with tarfile.open(results / "release" / model / target / f"{precision}.tar.gz") as tar:
        tar.extractall(into, filter="data")
    (bundle,) = list(into.iterdir())
    return bundle


def run_bundle(bundle, *args, python=None):
    """python run.py inside the bundle, with nothing from the checkout reachable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [python or sys.executable, "-I", "run.py", *map(str, args)],
        cwd=bundle,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def report_of(result):
    assert result.returncode == 0, result.stderr[-3000:]
    # The last JSON line: vendor libraries may print their own lines at exit.
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"')]
    assert lines, result.stdout[-3000:]
    return json.loads(lines[-1])


def one_line_error(result):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.py: error: "), result.stderr
    return lines[0]


def reference_greedy(results, bundle, prompt_ids, count):
    """npuforge's fp32 runner on the decode export the bundle was compiled from."""
    from npuforge.runtime import GraphChain

    manifest = json.loads((bundle / "manifest.json").read_text())
    model = manifest["model"]["id"]
    (key,) = [e["key"] for e in manifest["inputs"]["exports"] if e["key"].startswith("decode")]
    chain = GraphChain(results / "export" / model / key)
    logits = chain.run(np.asarray([prompt_ids]))[0, -1]
    tokens = []
    for _ in range(count):
        tokens.append(int(np.argmax(logits)))
        if chain.position >= chain.meta.get("cache_len", 1 << 30):
            break
        logits = chain.step(np.asarray([[tokens[-1]]]))[0, -1]
    return tokens


def agreement(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- onnx bundles


@pytest.fixture(scope="module")
def demo_onnx(results, tmp_path_factory):
    return build(results, tmp_path_factory)


@pytest.mark.slow
def test_onnx_bundle_generates_the_fp32_greedy_tokens_from_its_tarball(demo_onnx, tmp_path):
    bundle = unpack(demo_onnx, "rwkv7-demo", "onnx", "fp32", tmp_path / "unpacked")
    assert (bundle / "run.py").read_bytes() == RUNNER.read_bytes()
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["runner"]["file"] == "run.py" and "run.py" in manifest["files"]

    report = report_of(
        run_bundle(bundle, "--prompt", PROMPT, "--max-new-tokens", 32, "--no-default-stop")
    )
    assert report["runtime"].startswith("onnxruntime") and report["simulator"] is False
    assert report["tokenizer"] == "rwkv-world"
    expected = reference_greedy(demo_onnx, bundle, report["prompt_ids"], 32)
    assert report["tokens"] == expected
    assert report["tokens_per_s"] > 0 and report["time_to_first_token_s"] > 0
    assert report["stopped"] == "max_new_tokens" and report["peak_rss_mb"] > 0

    # Seeded sampling repeats itself; another seed (almost surely) does not.
    sampled = ["--prompt", PROMPT, "--max-new-tokens", 16, "--temperature", "1.0", "--top-p", 0.9]
    first = report_of(run_bundle(bundle, *sampled, "--seed", 7))["tokens"]
    assert report_of(run_bundle(bundle, *sampled, "--seed", 7))["tokens"] == first
    assert report_of(run_bundle(bundle, *sampled, "--seed", 8))["tokens"] != first

    # A stop token ends generation at its first occurrence.
    stop = expected[3]
    stopped = report_of(run_bundle(bundle, "--prompt", PROMPT, "--stop-token", stop))
    assert stopped["tokens"] == expected[: expected.index(stop) + 1]
    assert stopped["stopped"] == "stop_token"


@pytest.mark.slow
def test_onnx_bundle_refuses_an_older_onnxruntime_naming_both_versions(demo_onnx, tmp_path):
    bundle = unpack(demo_onnx, "rwkv7-demo", "onnx", "fp32", tmp_path / "unpacked")
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["compile"]["toolchain"]["versions"]["onnxruntime"] = "1.99.0"
    manifest_path.write_text(json.dumps(manifest))
    import onnxruntime

    line = one_line_error(run_bundle(bundle, "--prompt", PROMPT))
    assert "1.99.0" in line and onnxruntime.__version__ in line and "drift" in line


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["rknn", "tpumlir"])
def test_vendor_doors_stop_in_one_line_on_this_host(demo_onnx, tmp_path, backend):
    """rknnlite needs a board; bmodels are not driven by run.py: a door, not a traceback.
    (An onnx bundle relabelled: the door opens before any file of the backend is read.)"""
    import platform

    if backend == "rknn" and platform.machine() in ("aarch64", "arm64"):
        pytest.skip("an aarch64 host may be the board itself")
    bundle = unpack(demo_onnx, "rwkv7-demo", "onnx", "fp32", tmp_path / "unpacked")
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["target"]["backend"] = backend
    manifest["compile"]["toolchain"]["versions"] = {"tpu_mlir": "1.30.2"}
    manifest_path.write_text(json.dumps(manifest))
    line = one_line_error(run_bundle(bundle, "--prompt", PROMPT))
    if backend == "rknn":
        assert "rknn-toolkit-lite2" in line and "aarch64" in line and platform.machine() in line
    else:
        assert "TPU-MLIR" in line and "1.30.2" in line


@pytest.mark.slow
def test_bad_input_and_damaged_bundles_stop_in_one_line(demo_onnx, tmp_path):
    bundle = unpack(demo_onnx, "rwkv7-demo", "onnx", "fp32", tmp_path / "unpacked")
    line = one_line_error(run_bundle(bundle, "--prompt-ids", "1,70000"))
    assert "70000" in line and "65536" in line
    line = one_line_error(run_bundle(bundle, "--prompt", ""))
    assert "no tokens" in line
    with open(bundle / "embedding.bin" if (bundle / "embedding.bin").exists()
              else bundle / "chunk0.onnx", "r+b") as handle:  # fmt: skip
        handle.seek(200)
        handle.write(b"\xff\xfe")
    assert "sha256" in one_line_error(run_bundle(bundle, "--prompt", PROMPT))


@pytest.fixture(scope="module")
def llama_onnx(results, tmp_path_factory):
    return build(results, tmp_path_factory, "model=llama-tiny", "target=onnx")


@pytest.mark.slow
def test_llama_onnx_bundle_feeds_mask_rope_and_cache_slots(llama_onnx, tmp_path):
    bundle = unpack(llama_onnx, "llama-tiny", "onnx", "fp32", tmp_path / "unpacked")
    # No tokenizer in this bundle (tokenizer: none): UTF-8 bytes, as npuforge's runs use.
    report = report_of(run_bundle(bundle, "--prompt", PROMPT, "--max-new-tokens", 24))
    assert report["tokenizer"] == "bytes"
    assert report["prompt_ids"] == list(PROMPT.encode())
    assert report["tokens"] == reference_greedy(llama_onnx, bundle, report["prompt_ids"], 24)
    assert report["tokens_per_s"] > 0
    # The KV cache holds context_length (64) positions: generation stops when it is full.
    full = report_of(run_bundle(bundle, "--prompt", PROMPT, "--max-new-tokens", 200))
    assert full["stopped"] == "context_full"
    assert len(full["prompt_ids"]) + len(full["tokens"]) == 64 + 1
    assert full["tokens"][:24] == report["tokens"]


@pytest.mark.slow
def test_llama_bundle_with_a_kv_prefix_starts_from_its_shipped_rows(tmp_path_factory, tmp_path):
    """A kv_prefix export ships kv_prefix.bin; run.py starts every sequence from it."""
    results = tmp_path_factory.mktemp("prefixed") / "results"
    overlay = tmp_path / "prefix.yaml"
    # verify.tokens: the export check's 64 positions would not fit beside the prefix.
    overlay.write_text(
        "models: {llama-tiny: {export: {kv_prefix: [1, 2]}}}\nverify: {tokens: 48}\n"
    )
    build(results, tmp_path_factory, "model=llama-tiny", "target=onnx", "--configfile", overlay)
    bundle = unpack(results, "llama-tiny", "onnx", "fp32", tmp_path / "unpacked")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert "kv_prefix.bin" in manifest["files"]
    report = report_of(run_bundle(bundle, "--prompt", PROMPT, "--max-new-tokens", 16))
    assert report["tokens"] == reference_greedy(results, bundle, report["prompt_ids"], 16)
    # Two of the 64 cache slots hold the prefix.
    full = report_of(run_bundle(bundle, "--prompt", PROMPT, "--max-new-tokens", 200))
    assert len(full["prompt_ids"]) + len(full["tokens"]) == 62 + 1
    (bundle / "kv_prefix.bin").write_bytes(b"\0" * 8)
    assert "sha256" in one_line_error(run_bundle(bundle, "--prompt", PROMPT))


# --------------------------------------------------------------------------- QNN bundle

QNN_NATIVE = toolchain.unavailable_reason("qnn", "native", {"htp_arch": 75, "soc_model": 57})


@pytest.fixture(scope="module")
def sm8650_fp16(native_sm8650_release):
    """The run's native SM8650 build of the demo (conftest.py), fp16 among its precisions."""
    results = native_sm8650_release / "results"
    stamp = toolchain.read_stamp(results / "toolchains" / "qnn-native.json")
    return results, stamp


def toolchain_python(stamp) -> str:
    """The QNN toolchain's interpreter: onnxruntime + onnxruntime-qnn, no npuforge."""
    return stamp["python"]


@pytest.mark.slow
@pytest.mark.toolchain
@pytest.mark.skipif(QNN_NATIVE is not None, reason=f"qnn native: {QNN_NATIVE}")
def test_qnn_fp16_bundle_on_the_htp_simulator_matches_fp32_greedy(sm8650_fp16, tmp_path):
    results, stamp = sm8650_fp16
    bundle = unpack(results, "rwkv7-demo", "SM8650", "fp16", tmp_path / "unpacked")
    count = 24
    result = run_bundle(
        bundle, "--prompt", PROMPT, "--max-new-tokens", count, "--no-default-stop",
        python=toolchain_python(stamp),
    )  # fmt: skip
    report = report_of(result)
    assert report["simulator"] is True and "simulator" in report["runtime"]
    assert report["versions"]["found"]["qairt"] == report["versions"]["built"]["qairt"]
    expected = reference_greedy(results, bundle, report["prompt_ids"], count)
    agreed = agreement(report["tokens"], expected)
    print(f"SM8650 fp16 greedy agreement with fp32: {agreed}/{count}; {report['tokens_per_s']} "
          "tok/s on the x86 HTP simulator")  # fmt: skip
    assert agreed >= 16, (report["tokens"], expected)
    assert report["tokens_per_s"] > 0 and report["time_to_first_token_s"] > 0
    genie = json.loads((bundle / "manifest.json").read_text())["genie"]
    assert (
        genie["config"] is None
        and genie["differences"]
        and not (bundle / "genie_config.json").exists()
    )


@pytest.mark.slow
@pytest.mark.toolchain
@pytest.mark.skipif(QNN_NATIVE is not None, reason=f"qnn native: {QNN_NATIVE}")
def test_qnn_bundle_refuses_a_qairt_older_than_its_binaries(sm8650_fp16, tmp_path):
    results, stamp = sm8650_fp16
    bundle = unpack(results, "rwkv7-demo", "SM8650", "fp16", tmp_path / "unpacked")
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    found = manifest["compile"]["qairt"]["version"]
    manifest["compile"]["qairt"]["version"] = "2.99.0.300101000000"
    manifest_path.write_text(json.dumps(manifest))
    line = one_line_error(run_bundle(bundle, "--prompt", PROMPT, python=toolchain_python(stamp)))
    assert "QAIRT 2.99.0.300101000000" in line and f"QAIRT {found}" in line


class SumSession:
    """A stand-in graph: state_out = state + the call's token ids summed; the logits put
    their maximum at (state_out mod V), one row per token of the call."""

    def __init__(self, vocab, tokens):
        self.vocab, self.tokens = vocab, tokens

    def run(self, names, feeds):
        state = feeds["state"] + feeds["tokens"].sum()
        logits = np.zeros((1, self.tokens, self.vocab), dtype=np.float32)
        logits[0, :, int(state[0]) % self.vocab] = 1.0
        return [{"logits": logits, "state_out": state}[n] for n in names]


def sum_meta(variant, tokens, vocab=50):
    return {
        "family": "rwkv", "variant": variant, "tokens_per_call": tokens, "batch": 1,
        "vocab_size": vocab,
        "graphs": [{
            "file": f"{variant}.onnx",
            "inputs": [
                {"name": "tokens", "role": "tokens", "shape": [1, tokens], "dtype": "int64"},
                {"name": "state", "role": "state", "shape": [1], "dtype": "float32",
                 "output": "state_out"},
            ],
            "outputs": [
                {"name": "logits", "role": "logits", "shape": [1, tokens, vocab],
                 "dtype": "float32"},
                {"name": "state_out", "role": "state", "shape": [1], "dtype": "float32"},
            ],
        }],
    }  # fmt: skip


@pytest.mark.parametrize("prompt_length", [3, 4, 10])
def test_prompt_runs_whole_prefill_calls_then_decode_with_the_state_handed_over(prompt_length):
    generator = bundle_runner.Generator.__new__(bundle_runner.Generator)
    generator.chains = {
        "decode": bundle_runner.Chain(sum_meta("decode", 1), [SumSession(50, 1)], None),
        "prefill": bundle_runner.Chain(sum_meta("prefill", 4), [SumSession(50, 4)], None),
    }
    generator.limit = None
    ids = list(range(1, prompt_length + 1))
    logits, position, calls = generator.prompt(ids)
    assert calls == {"prefill": prompt_length // 4, "decode": prompt_length % 4}
    assert position == prompt_length
    assert int(np.argmax(logits)) == sum(ids) % 50  # every prompt token reached the state
    result = generator.generate(ids, 3, 0.0, 1.0, 0, set())
    # Each generated token is the running sum mod 50, fed back through decode calls.
    total, expected = sum(ids), []
    for _ in range(3):
        expected.append(total % 50)
        total += expected[-1]
    assert result["tokens"] == expected
