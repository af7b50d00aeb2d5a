"""Pinned inputs stay pinned: a release never claims a checkpoint it was not built from."""

import hashlib
import os

import pytest
import yaml
from conftest import snakemake

from npuforge import provenance
from npuforge.cache import CACHE_ENV
from npuforge.errors import NpuforgeError
from npuforge.fetch import tree_sha256


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def synthetic(tmp_path, name, fmt="pth", **spec):
    """A real checkpoint from the project's generator (file, or llama model directory)."""
    from npuforge import models

    out = tmp_path / "inputs" / name
    out.parent.mkdir(exist_ok=True)
    models.family("llama" if fmt == "hf" else "rwkv").write_synthetic(out, spec, fmt)
    return out


TINY_RWKV = {"version": 7, "layers": 2, "embed": 64, "vocab": 65536, "head_size": 32}


def pinned_model(workflow, path, digest, **fields):
    entry = {
        "family": "rwkv",
        "version": 7,
        "source": {"path": str(path)},
        "sha256": digest,
        "format": "pth",
        "context_length": 1024,
        "tokenizer": "rwkv-world",
        "arch": {"layers": 2, "embed": 64, "vocab": 65536, "head_size": 32},
        **fields,
    }
    extra = workflow / "pinned.yaml"
    extra.write_text(yaml.safe_dump({"models": {"pinned": entry}}))
    return ("--configfile", extra, "--config", "model=pinned", "target=onnx")


def one_npuforge_line(result) -> str:
    text = result.stdout + result.stderr
    lines = [line for line in text.splitlines() if "npuforge:" in line or "error:" in line]
    assert lines, text[-3000:]
    return lines[0]


def release_files(workflow):
    root = workflow / "results" / "release"
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_editing_a_pinned_source_after_a_build_stops_the_next_run(workflow, tmp_path):
    source = synthetic(tmp_path, "tiny.pth", seed=1, **TINY_RWKV)
    args = pinned_model(workflow, source, sha(source))
    snakemake(workflow, *args, check=True)
    before = release_files(workflow)
    assert before

    other = synthetic(tmp_path, "other.pth", seed=2, **TINY_RWKV)
    with open(source, "r+b") as handle:  # rewritten in place, as torch.save to the same path
        handle.write(other.read_bytes())
    result = snakemake(workflow, *args)
    assert result.returncode != 0
    line = one_npuforge_line(result)
    assert f"now hashes to {sha(source)}" in line and "the registry pins" in line, line
    assert release_files(workflow) == before


def test_a_file_changed_in_a_pinned_model_directory_stops_planning(workflow, tmp_path):
    model_dir = synthetic(
        tmp_path, "llama", arch="qwen2", layers=1, embed=32, heads=2, kv_heads=1, vocab=64,
        intermediate=64, seed=0, fmt="hf",
    )  # fmt: skip
    args = pinned_model(
        workflow,
        model_dir,
        tree_sha256(model_dir),
        family="llama",
        format="hf",
        tokenizer="none",
        context_length=64,
        arch={"layers": 1, "embed": 32, "vocab": 64},
    )
    snakemake(workflow, "--dry-run", *args, check=True)
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" '))
    result = snakemake(workflow, "--dry-run", *args)
    assert result.returncode != 0
    assert "changed after it was pinned" in one_npuforge_line(result)


def test_a_source_replaced_by_a_symlink_stops_planning(workflow, tmp_path):
    source = synthetic(tmp_path, "tiny.pth", seed=1, **TINY_RWKV)
    args = pinned_model(workflow, source, sha(source))
    snakemake(workflow, "--dry-run", *args, check=True)
    other = synthetic(tmp_path, "other.pth", seed=2, **TINY_RWKV)
    source.unlink()
    source.symlink_to(other)
    result = snakemake(workflow, "--dry-run", *args)
    assert result.returncode != 0
    assert f"now hashes to {sha(other)}" in one_npuforge_line(result)


def test_a_fetched_checkpoint_replaced_by_a_symlink_stops_planning(workflow, tmp_path):
    source = synthetic(tmp_path, "tiny.pth", seed=1, **TINY_RWKV)
    args = pinned_model(workflow, source, sha(source))
    fetched = workflow / "results" / "models" / "pinned" / "checkpoint.pth"
    snakemake(workflow, fetched.relative_to(workflow), *args, check=True)
    other = synthetic(tmp_path, "other.pth", seed=2, **TINY_RWKV)
    fetched.unlink()
    fetched.symlink_to(other)
    result = snakemake(workflow, "--dry-run", *args)
    assert result.returncode != 0
    line = one_npuforge_line(result)
    assert "was replaced by a link" in line and "delete" in line, line


def test_arch_that_disagrees_with_the_checkpoint_stops_before_export(workflow, tmp_path):
    source = synthetic(tmp_path, "tiny.pth", seed=1, **TINY_RWKV)
    args = pinned_model(
        workflow, source, sha(source), arch={"layers": 4, "embed": 64, "vocab": 65536}
    )
    result = snakemake(workflow, *args)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "the registry says arch.layers=4 but the checkpoint has 2" in text
    assert not (workflow / "results" / "models" / "pinned" / "inspect.json").exists()
    assert not (workflow / "results" / "export").exists()


def test_hashes_are_reused_until_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"x" * 1000)
    from npuforge import fileio

    calls = []
    original = fileio.sha256_file

    def counting(p, *args):
        calls.append(p)
        return original(p, *args)

    monkeypatch.setattr(fileio, "sha256_file", counting)
    expected = hashlib.sha256(b"x" * 1000).hexdigest()
    assert provenance.current_sha256(path) == expected
    assert provenance.current_sha256(path) == expected
    assert len(calls) == 1
    path.write_bytes(b"y" * 1000)
    os.utime(path, ns=(1, 1))
    with pytest.raises(NpuforgeError, match="now hashes to"):
        provenance.check_path_source("m", path, expected)
    assert len(calls) == 2


def test_the_engines_directory_marker_is_not_part_of_a_fetched_tree(tmp_path):
    """Snakemake writes .snakemake_timestamp into a directory output after its job; a
    fetched model directory must hash the same with it, or the second run refuses it."""
    from npuforge.provenance import current_sha256

    model_dir = tmp_path / "checkpoint.hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    before = tree_sha256(model_dir)
    assert current_sha256(model_dir) == before
    (model_dir / ".snakemake_timestamp").write_text("")
    assert tree_sha256(model_dir) == before
    assert current_sha256(model_dir) == before
    (model_dir / "config.json").write_text('{"a": 1}')
    assert current_sha256(model_dir) != before
