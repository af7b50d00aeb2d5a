"""Calibration samples: captured from real runs of a small synthetic RWKV-7 export."""

import hashlib
import importlib.util
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "workflow_scripts" / "make_calibration_samples.py"


def small_export(out_dir: Path, chunks: int = 2) -> Path:
    """A 2-layer RWKV-7 (embed 64, head 32, vocab 1024) decode export with ext embedding."""
    from npuforge import models
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    ckpt = out_dir / "tiny.pth"
    write_synthetic_checkpoint(
        ckpt, version=7, layers=2, embed=64, vocab=1024, head_size=32, seed=0
    )
    export = out_dir / "export"
    options = {"variant": "decode", "chunks": chunks, "dtype": "fp32", "ext_embedding": True}
    models.export("rwkv", ckpt, export, options)
    return export


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return small_export(tmp_path_factory.mktemp("calib"))


def run_cli(capsys, *args):
    """The step CLI in this process (its tokenizer stays cached): (exit code, stderr)."""
    from npuforge.cli import run_cli as run

    spec = importlib.util.spec_from_file_location("make_calibration_samples", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = run(module.main, [str(a) for a in args])
    return code, capsys.readouterr().err


def tree_digest(root: Path) -> dict:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def sample_value(calibration_dir: Path, record: dict, index: int, j: int, name: str):
    """Input ``name`` of chunk ``index`` in sample ``j``, as stored."""
    with np.load(calibration_dir / record["chunks"][index]["npz"][j]) as data:
        return data[name]


def test_samples_stored_once_and_converted_per_vendor(export_dir, tmp_path):
    from npuforge.calibration import make_calibration_samples
    from npuforge.calibration_formats import (
        LAYOUT,
        chunk_samples,
        write_qnn_input_list,
        write_rknn_dataset,
    )
    from npuforge.host_cpu import instruction_set

    first = tmp_path / "a"
    record = make_calibration_samples(export_dir, first, samples=4, steps=12, seed=3)
    again = tmp_path / "b"
    make_calibration_samples(export_dir, again, samples=4, steps=12, seed=3)
    assert tree_digest(first) == tree_digest(again)
    # One .npz per chunk and sample, nothing else: no per-vendor copies.
    stored = sorted(tree_digest(first))
    expected = [f"chunk{i}/sample{j}.npz" for i in range(2) for j in range(4)]
    assert stored == sorted(["calibration.json", "host.json", *expected])
    assert record["layout"] == LAYOUT and "host" not in record
    assert json.loads((first / "host.json").read_text()) == instruction_set()

    meta = json.loads((export_dir / "export.json").read_text())
    assert len(record["chunks"]) == len(meta["graphs"]) == 2
    for chunk, graph in zip(record["chunks"], meta["graphs"], strict=True):
        index = chunk["index"]
        samples, inputs = chunk_samples(first, index)
        assert inputs == chunk["inputs"] and len(samples) == 4
        # What the rknn and QNN SDK jobs write into their work directories.
        dataset = write_rknn_dataset(samples, inputs, tmp_path / "rknn" / f"chunk{index}")
        listing = write_qnn_input_list(samples, inputs, tmp_path / "qnn" / f"chunk{index}")
        lines = dataset.read_text().splitlines()
        qnn_lines = listing.read_text().splitlines()
        assert len(lines) == len(qnn_lines) == 4
        for j, (line, qnn_line) in enumerate(zip(lines, qnn_lines, strict=True)):
            files = line.split()
            entries = [e.split(":=") for e in qnn_line.split()]
            assert len(files) == len(entries) == len(graph["inputs"])
            for spec, npy, (name, raw) in zip(graph["inputs"], files, entries, strict=True):
                value = np.load(dataset.parent / npy)
                assert list(value.shape) == spec["shape"] and value.dtype == spec["dtype"]
                raw_bytes = (listing.parent / raw).read_bytes()
                assert name == spec["name"] and raw_bytes == value.astype("<f4").tobytes()
                stored_value = sample_value(first, record, index, j, spec["name"])
                np.testing.assert_array_equal(stored_value, value)
    # Fixed zip timestamps: an .npz written now equals one written in 1980.
    with zipfile.ZipFile(first / record["chunks"][0]["npz"][0]) as archive:
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_samples_are_the_states_of_real_runs(export_dir, tmp_path):
    from npuforge.calibration import (
        make_calibration_samples,
        read_documents,
        tokenize_documents,
    )
    from npuforge.runtime import GraphChain

    out = tmp_path / "real"
    record = make_calibration_samples(export_dir, out, samples=3, steps=16, seed=1)
    docs = read_documents()
    tokens = tokenize_documents(docs, 1024)
    names = [name for name, _ in docs]
    chain = GraphChain(export_dir)
    for j, run in enumerate(record["runs"]):
        assert 4 <= run["capture_step"] < 16
        ids = tokens[names.index(run["document"])][run["start"] :]
        chain.reset()
        for step in range(run["capture_step"]):
            chain.step(np.asarray([[ids[step]]]))
        # The sample holds exactly the state a real run carries into that step.
        chunk = record["chunks"][1]
        for spec in chunk["inputs"]:
            if spec["role"] == "state":
                got = sample_value(out, record, 1, j, spec["name"])
                np.testing.assert_array_equal(got, chain.state[spec["name"]])
                assert np.abs(got).max() > 0


def test_zero_state_and_seed(export_dir, tmp_path):
    from npuforge.calibration import make_calibration_samples

    zero = make_calibration_samples(
        export_dir, tmp_path / "zero", samples=2, steps=8, seed=0, zero_state=True
    )
    assert zero["zero_state"] and all(r["capture_step"] == 0 for r in zero["runs"])
    for spec in zero["chunks"][0]["inputs"]:
        value = sample_value(tmp_path / "zero", zero, 0, 0, spec["name"])
        assert (np.abs(value).max() == 0) == (spec["role"] == "state")
    seeded = make_calibration_samples(export_dir, tmp_path / "s1", samples=2, steps=8, seed=1)
    other = make_calibration_samples(export_dir, tmp_path / "s2", samples=2, steps=8, seed=2)
    assert seeded["runs"] != other["runs"]


def test_cli_errors_are_one_line_and_leave_nothing(export_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(
        capsys, "--export", export_dir, "--out-dir", out, "--text", tmp_path / "missing.txt"
    )
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "missing.txt" in err and not out.exists()

    code, err = run_cli(capsys, "--export", tmp_path, "--out-dir", out)
    assert code == 2 and "export.json" in err and not out.exists()


def test_cli_writes_with_custom_text(export_dir, tmp_path, capsys):
    text = tmp_path / "mine.txt"
    text.write_text("Ein kurzer Text. A short text. 短い文章です。\n" * 20, encoding="utf-8")
    out = tmp_path / "out"
    code, err = run_cli(
        capsys, "--export", export_dir, "--out-dir", out, "--samples", 2, "--steps", 6,
        "--text", text,
    )  # fmt: skip
    assert code == 0, err
    record = json.loads((out / "calibration.json").read_text())
    assert record["text"]["documents"] == ["mine.txt"] and record["samples"] == 2


def test_llama_texts_use_the_checkpoint_tokenizer_or_labelled_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from npuforge import models as families
    from npuforge.calibration import make_calibration_samples
    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import weights as llama_weights

    dims = dict(layers=1, embed=32, heads=4, kv_heads=2, vocab=300, intermediate=48, seed=1)
    llama_weights.write_synthetic_checkpoint(tmp_path / "ckpt", **dims)
    llama_export.export_llama(
        tmp_path / "ckpt", tmp_path / "export", variant="decode", cache_len=16
    )
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. the end.\n")

    record = make_calibration_samples(
        tmp_path / "export", tmp_path / "c1", samples=2, steps=8, seed=0, text=text,
        checkpoint=tmp_path / "ckpt",
    )  # fmt: skip
    assert record["text"]["tokenizer"]["kind"] == "bytes"
    assert "no tokenizer.json" in record["text"]["tokenizer"]["note"]
    assert record["text"]["tokens"] == len(text.read_bytes())
    assert 0 <= min(record["tokens"]) and max(record["tokens"]) < 300

    words = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat.": 5, "end.": 6}
    hf = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    tokenizer, info = families.family("llama").tokenizer(tmp_path / "ckpt")
    assert info["kind"] == "hf" and info["file"] == "tokenizer.json"
    assert tokenizer.encode("the cat sat on the mat.") == [1, 2, 3, 4, 1, 5]
    record = make_calibration_samples(
        tmp_path / "export", tmp_path / "c2", samples=2, steps=8, seed=0, text=text,
        checkpoint=tmp_path / "ckpt",
    )  # fmt: skip
    assert record["text"]["tokenizer"]["kind"] == "hf" and record["text"]["tokens"] == 8
    assert set(record["tokens"]) <= set(words.values())


# --------------------------------------------------------------------------- prefill exports


@pytest.fixture(scope="module")
def rwkv_prefill(tmp_path_factory):
    """The same tiny RWKV-7 as ``small_export``, exported as a 4-token prefill graph."""
    from npuforge import models
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("prefill")
    ckpt = root / "tiny.pth"
    write_synthetic_checkpoint(
        ckpt, version=7, layers=2, embed=64, vocab=1024, head_size=32, seed=0
    )
    options = {"variant": "prefill", "tokens": 4, "chunks": 2, "dtype": "fp32",
               "ext_embedding": True}  # fmt: skip
    models.export("rwkv", ckpt, root / "export", options)
    return root / "export"


def replay(export_dir, record, run):
    """A real run of the sample's text up to its captured call: (chain, the call's token ids)."""
    from npuforge import models
    from npuforge.runtime import GraphChain
    from npuforge.texts import read_documents, tokenize_documents

    chain = GraphChain(export_dir)
    docs = read_documents()
    tokenizer, _ = models.family(chain.meta["family"]).tokenizer(None)
    tokens = tokenize_documents(docs, chain.meta["vocab_size"], tokenizer)
    ids = tokens[[name for name, _ in docs].index(run["document"])][run["start"] :]
    per_call = record["tokens_per_call"]
    ids = np.resize(ids, (run["capture_step"] + 1) * per_call).reshape(-1, per_call)
    chain.reset()
    for call in ids[:-1]:
        chain.step(call[None])
    assert chain.position == run["position"]
    return chain, ids[-1]


def test_rwkv_prefill_samples_carry_the_states_of_multi_call_runs(rwkv_prefill, tmp_path):
    from npuforge.calibration import make_calibration_samples
    from npuforge.onnx_io import read_embedding_bin

    record = make_calibration_samples(rwkv_prefill, tmp_path / "a", samples=3, steps=8, seed=5)
    make_calibration_samples(rwkv_prefill, tmp_path / "b", samples=3, steps=8, seed=5)
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    assert record["variant"] == "prefill" and record["tokens_per_call"] == 4
    meta = json.loads((rwkv_prefill / "export.json").read_text())
    embedding = read_embedding_bin(rwkv_prefill / "embedding.bin")
    for j, run in enumerate(record["runs"]):
        # A quarter of the run at least: 2..7 calls of 4 tokens already read.
        assert 2 <= run["capture_step"] < 8 and run["position"] == 4 * run["capture_step"]
        chain, call_ids = replay(rwkv_prefill, record, run)
        for index, graph in enumerate(meta["graphs"]):
            chunk = record["chunks"][index]
            assert chunk["inputs"] == [
                {k: s[k] for k in ("name", "shape", "dtype", "role")} for s in graph["inputs"]
            ]
            with np.load(tmp_path / "a" / chunk["npz"][j]) as npz:
                for spec in graph["inputs"]:
                    value = npz[spec["name"]]
                    assert list(value.shape) == spec["shape"] and value.dtype == spec["dtype"]
                    if spec["role"] == "state":
                        np.testing.assert_array_equal(value, chain.state[spec["name"]])
                        assert np.abs(value).max() > 0
                    elif spec["role"] == "embedding":
                        np.testing.assert_array_equal(value, embedding[call_ids][None])
                    else:
                        assert spec["role"] == "hidden" and value.shape[1] == 4


@pytest.fixture(scope="module")
def llama_prefill(tmp_path_factory):
    from npuforge.models.llama import onnx_export as llama_export
    from npuforge.models.llama import weights as llama_weights

    root = tmp_path_factory.mktemp("llama")
    dims = dict(layers=2, embed=32, heads=4, kv_heads=2, vocab=300, intermediate=48, seed=1)
    llama_weights.write_synthetic_checkpoint(root / "ckpt", **dims)
    llama_export.export_llama(
        root / "ckpt", root / "export", variant="prefill", tokens=4, cache_len=16, chunks=2
    )
    return root / "export"


def test_llama_prefill_samples_stay_in_the_cache_at_real_positions(llama_prefill, tmp_path):
    from npuforge.calibration import make_calibration_samples
    from npuforge.models.llama import onnx_export as llama_export

    record = make_calibration_samples(llama_prefill, tmp_path / "a", samples=6, steps=4, seed=0)
    make_calibration_samples(llama_prefill, tmp_path / "b", samples=6, steps=4, seed=0)
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    meta = json.loads((llama_prefill / "export.json").read_text())
    assert record["variant"] == "prefill" and record["tokens_per_call"] == 4
    positions = [run["position"] for run in record["runs"]]
    # Position-dependent graphs are captured from the first call on, and never past the cache.
    assert min(positions) == 0 and max(positions) > 0
    assert all(p + 4 <= meta["cache_len"] for p in positions)
    for j, run in enumerate(record["runs"]):
        chain, call_ids = replay(llama_prefill, record, run)
        for index, graph in enumerate(meta["graphs"]):
            for spec in graph["inputs"]:
                value = sample_value(tmp_path / "a", record, index, j, spec["name"])
                assert list(value.shape) == spec["shape"] and value.dtype == spec["dtype"]
                if spec["role"] == "state":
                    np.testing.assert_array_equal(value, chain.state[spec["name"]])
                    # The cache holds the earlier calls' keys/values, nothing beyond them.
                    filled = np.abs(value).max(axis=(0, 1, 3)) > 0
                    assert filled.tolist() == [s < run["position"] for s in range(16)]
                elif spec["role"] == "tokens":
                    np.testing.assert_array_equal(value, call_ids[None])
                elif spec["role"] != "hidden":
                    expected = llama_export.extra_inputs(meta, spec, run["position"])
                    np.testing.assert_array_equal(value, expected)


def test_steps_that_overrun_the_cache_stop_in_one_line(llama_prefill, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_cli(
        capsys, "--export", llama_prefill, "--out-dir", out, "--samples", 1, "--steps", 5
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cache_len 16" in err and "--steps" in err and "4 or less" in err
    assert not out.exists()


def test_calibrations_pair_with_exports_by_variant(export_dir, rwkv_prefill, tmp_path):
    from npuforge.calibration import (
        calibrations_by_variant,
        check_calibration_matches,
        make_calibration_samples,
    )
    from npuforge.errors import NpuforgeError

    make_calibration_samples(export_dir, tmp_path / "d", samples=1, steps=4, seed=0)
    make_calibration_samples(rwkv_prefill, tmp_path / "p", samples=1, steps=4, seed=0)
    paired = calibrations_by_variant([tmp_path / "p", tmp_path / "d"])
    assert paired == {"decode": tmp_path / "d", "prefill": tmp_path / "p"}
    assert calibrations_by_variant(str(tmp_path / "d")) == {"decode": tmp_path / "d"}
    assert calibrations_by_variant(None) == {}
    with pytest.raises(NpuforgeError, match="two prefill calibration directories"):
        calibrations_by_variant([tmp_path / "p", tmp_path / "p"])
    meta = json.loads((export_dir / "export.json").read_text())
    check_calibration_matches(tmp_path / "d", meta, export_dir)
    prefill_meta = json.loads((rwkv_prefill / "export.json").read_text())
    with pytest.raises(NpuforgeError, match="other graphs"):
        check_calibration_matches(tmp_path / "d", prefill_meta, rwkv_prefill)
