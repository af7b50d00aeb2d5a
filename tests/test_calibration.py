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
    from npuforge.export import export_checkpoint
    from npuforge.synthetic import write_synthetic_checkpoint

    ckpt = out_dir / "tiny.pth"
    write_synthetic_checkpoint(
        ckpt, version=7, layers=2, embed=64, vocab=1024, head_size=32, seed=0
    )
    export = out_dir / "export"
    export_checkpoint(
        ckpt, export, variant="decode", chunks=chunks, dtype="fp32", ext_embedding=True
    )
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


def test_samples_every_format_deterministic(export_dir, tmp_path):
    from npuforge.calibration import make_calibration_samples

    first = tmp_path / "a"
    record = make_calibration_samples(export_dir, first, samples=4, steps=12, seed=3)
    again = tmp_path / "b"
    make_calibration_samples(export_dir, again, samples=4, steps=12, seed=3)
    assert tree_digest(first) == tree_digest(again)

    meta = json.loads((export_dir / "export.json").read_text())
    assert len(record["chunks"]) == len(meta["graphs"]) == 2
    for chunk, graph in zip(record["chunks"], meta["graphs"], strict=True):
        index = chunk["index"]
        lines = (first / chunk["rknn"]["dataset"]).read_text().splitlines()
        qnn_lines = (first / chunk["qnn"]["input_list"]).read_text().splitlines()
        assert len(lines) == len(qnn_lines) == len(chunk["tpumlir"]["npz"]) == 4
        for j, (line, qnn_line) in enumerate(zip(lines, qnn_lines, strict=True)):
            files = line.split()
            entries = [e.split(":=") for e in qnn_line.split()]
            assert len(files) == len(entries) == len(graph["inputs"])
            npz = np.load(first / chunk["tpumlir"]["npz"][j])
            for spec, npy, (name, raw) in zip(graph["inputs"], files, entries, strict=True):
                value = np.load(first / "rknn" / f"chunk{index}" / npy)
                assert list(value.shape) == spec["shape"] and value.dtype == spec["dtype"]
                raw_bytes = (first / "qnn" / f"chunk{index}" / raw).read_bytes()
                assert name == spec["name"] and raw_bytes == value.astype("<f4").tobytes()
                np.testing.assert_array_equal(npz[spec["name"]], value)
    # Fixed zip timestamps: an .npz written now equals one written in 1980.
    with zipfile.ZipFile(first / record["chunks"][0]["tpumlir"]["npz"][0]) as archive:
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
        for k, spec in enumerate(chunk["inputs"]):
            if spec["role"] == "state":
                got = np.load(out / "rknn" / "chunk1" / f"sample{j}_{k}.npy")
                np.testing.assert_array_equal(got, chain.state[spec["name"]])
                assert np.abs(got).max() > 0


def test_zero_state_and_seed(export_dir, tmp_path):
    from npuforge.calibration import make_calibration_samples

    zero = make_calibration_samples(
        export_dir, tmp_path / "zero", samples=2, steps=8, seed=0, zero_state=True
    )
    assert zero["zero_state"] and all(r["capture_step"] == 0 for r in zero["runs"])
    for k, spec in enumerate(zero["chunks"][0]["inputs"]):
        value = np.load(tmp_path / "zero" / "rknn" / "chunk0" / f"sample0_{k}.npy")
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

    from npuforge.calibration import make_calibration_samples, tokenizer_for
    from npuforge.models import llama

    dims = dict(layers=1, embed=32, heads=4, kv_heads=2, vocab=300, intermediate=48, seed=1)
    llama.write_synthetic_checkpoint(tmp_path / "ckpt", **dims)
    llama.export_llama(tmp_path / "ckpt", tmp_path / "export", variant="decode", cache_len=16)
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
    tokenizer, info = tokenizer_for({"family": "llama"}, tmp_path / "ckpt")
    assert info["kind"] == "hf" and info["file"] == "tokenizer.json"
    assert tokenizer.encode("the cat sat on the mat.") == [1, 2, 3, 4, 1, 5]
    record = make_calibration_samples(
        tmp_path / "export", tmp_path / "c2", samples=2, steps=8, seed=0, text=text,
        checkpoint=tmp_path / "ckpt",
    )  # fmt: skip
    assert record["text"]["tokenizer"]["kind"] == "hf" and record["text"]["tokens"] == 8
    assert set(record["tokens"]) <= set(words.values())
