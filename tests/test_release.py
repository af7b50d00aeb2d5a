"""Release bundles: contents, SHA256SUMS, manifest and tarball determinism, failures."""

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile

import pytest

from npuforge import release
from npuforge.errors import NpuforgeError
from npuforge.release import build_bundle, write_deterministic_tarball

MODEL = {
    "family": "rwkv",
    "version": 7,
    "source": {"synthetic": {"version": 7, "layers": 2, "embed": 64, "vocab": 256, "seed": 1}},
    "format": "pth",
    "context_length": 1024,
    "tokenizer": "rwkv-world",
    "arch": {"layers": 2, "embed": 64, "vocab": 256},
}
TARGET = {"backend": "onnx", "options": {"verify_steps": 4}, "export": {"variants": ["decode"]}}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_inputs(root, *, ext_embedding=True, mtime=None):
    """Stage outputs as the earlier steps leave them (compile dir, export dir, records)."""
    compiled, export = root / "compiled", root / "export" / "decode-fp32-c1-abc"
    compiled.mkdir(parents=True)
    export.mkdir(parents=True)
    graphs = {"chunk0.onnx": b"graph-zero" * 50, "chunk1.onnx": b"graph-one" * 70}
    for name, data in graphs.items():
        (compiled / name).write_bytes(data)
        (export / name).write_bytes(data)
    compile_json = {
        "backend": "onnx",
        "target": "onnx",
        "precision": "fp32",
        "artifacts": [
            {"file": name, "sha256": sha(data), "role": "binary", "chunk": i}
            for i, (name, data) in enumerate(graphs.items())
        ],
        "verification": {"steps": 4, "cosine": 1.0, "nan_inf": 0},
    }
    (compiled / "compile.json").write_text(json.dumps(compile_json))
    meta = {"variant": "decode", "chunks": 2, "embedding": None, "graphs": []}
    if ext_embedding:
        (export / "embedding.bin").write_bytes(b"EMB0" + bytes(100))
        meta["embedding"] = {"file": "embedding.bin"}
    meta["graphs"] = [{"file": n, "sha256": sha(d)} for n, d in graphs.items()]
    (export / "export.json").write_text(json.dumps(meta))
    tokenizer = root / "tokenizer.bin"
    tokenizer.write_bytes(b"TOKENS" * 10)
    record = root / "checkpoint.pth.json"
    record.write_text(json.dumps({"sha256": "ab" * 32, "size": 123}))
    verify = root / "verify.json"
    verify.write_text(json.dumps({"cosine": 1.0, "top1_agreement": 1.0}))
    if mtime is not None:
        for path in root.rglob("*"):
            os.utime(path, (mtime, mtime))
    return dict(
        compiled_dir=compiled,
        export_dirs=[export],
        tokenizer=tokenizer,
        fetch_record=record,
        export_verification=[verify],
    )


def bundle(root, **kwargs):
    inputs = make_inputs(root, **kwargs)
    out, tarball = root / "release" / "fp32", root / "release" / "fp32.tar.gz"
    manifest = build_bundle(
        model_id="rwkv7-tiny",
        model_entry=MODEL,
        target_id="onnx",
        target_entry=TARGET,
        precision="fp32",
        out_dir=out,
        tarball=tarball,
        **inputs,
    )
    return out, tarball, manifest


def test_bundle_contents_and_checksums(tmp_path):
    out, tarball, manifest = bundle(tmp_path)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "SHA256SUMS",
        "chunk0.onnx",
        "chunk1.onnx",
        "embedding.bin",
        "manifest.json",
        "run.py",
        "tokenizer.bin",
    ]
    # The generation runner ships as it is in the library; the manifest says how to run it.
    assert (out / "run.py").read_bytes() == release.RUNNER_SOURCE.read_bytes()
    assert manifest["runner"]["file"] == "run.py" and manifest["runner"]["runtime"]
    assert manifest["genie"] is None  # recorded for QNN bundles only
    sums = (out / "SHA256SUMS").read_text().splitlines()
    assert [line.split("  ")[1] for line in sums] == sorted(n for n in names if n != "SHA256SUMS")
    for line in sums:
        digest, name = line.split("  ")
        assert sha((out / name).read_bytes()) == digest
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True)
        assert check.returncode == 0, check.stdout
    assert manifest["model"]["sha256"] == "ab" * 32
    assert manifest["verification"]["cosine"] == 1.0
    assert manifest["export_verification"] == [{"cosine": 1.0, "top1_agreement": 1.0}]
    assert set(manifest["files"]) == {n for n in names if n not in ("SHA256SUMS", "manifest.json")}
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert str(tmp_path) not in (out / "manifest.json").read_text()


def test_build_outputs_are_linked_and_the_runner_and_tokenizer_copied(tmp_path):
    out, _, _ = bundle(tmp_path)
    inode = lambda path: os.stat(path).st_ino  # noqa: E731
    for name in ("chunk0.onnx", "chunk1.onnx"):
        assert inode(out / name) == inode(tmp_path / "compiled" / name)
    assert inode(out / "embedding.bin") == inode(
        tmp_path / "export/decode-fp32-c1-abc/embedding.bin"
    )
    # Editing a bundle's runner or tokenizer must not edit npuforge's source or the build's.
    assert inode(out / "run.py") != inode(release.RUNNER_SOURCE)
    assert inode(out / "tokenizer.bin") != inode(tmp_path / "tokenizer.bin")
    assert {oct(os.stat(p).st_mode & 0o777) for p in out.iterdir()} == {"0o644"}


def test_a_filesystem_without_hard_links_gets_copies_of_the_same_bytes(tmp_path, monkeypatch):
    linked, _, linked_manifest = bundle(tmp_path / "linked")

    def refuse(source, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)
    copied, _, copied_manifest = bundle(tmp_path / "copied")
    assert (
        os.stat(copied / "chunk0.onnx").st_ino
        != os.stat(tmp_path / "copied/compiled/chunk0.onnx").st_ino
    )
    assert copied_manifest["files"] == linked_manifest["files"]
    assert (copied / "SHA256SUMS").read_bytes() == (linked / "SHA256SUMS").read_bytes()


def test_without_external_embedding_no_embedding_file(tmp_path):
    out, _, _ = bundle(tmp_path, ext_embedding=False)
    assert not (out / "embedding.bin").exists()


def test_rebuild_elsewhere_is_byte_identical(tmp_path):
    out_a, tar_a, _ = bundle(tmp_path / "a", mtime=1_000_000)
    out_b, tar_b, _ = bundle(tmp_path / "b", mtime=2_000_000)
    files_a = {p.name: p.read_bytes() for p in out_a.iterdir()}
    files_b = {p.name: p.read_bytes() for p in out_b.iterdir()}
    assert files_a == files_b
    assert tar_a.read_bytes() == tar_b.read_bytes()


def test_tarball_is_normalised(tmp_path):
    _, tarball, _ = bundle(tmp_path)
    raw = tarball.read_bytes()
    assert raw[4:8] == b"\0\0\0\0", "gzip header mtime must be 0"
    assert not raw[3] & 0x08, "gzip header must not carry a file name"
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names[0] == "rwkv7-tiny-onnx-fp32"
    assert names[1:] == sorted(names[1:])
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" for m in members)
    assert {m.mode for m in members if m.isfile()} == {0o644}
    with gzip.open(tarball) as gz:
        assert len(gz.read()) % 512 == 0


def test_source_date_epoch_sets_mtime(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    write_deterministic_tarball(tmp_path / "d", tmp_path / "t.tar.gz", "root")
    with tarfile.open(tmp_path / "t.tar.gz") as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}


def test_missing_artifact_leaves_nothing(tmp_path):
    inputs = make_inputs(tmp_path)
    (inputs["compiled_dir"] / "chunk1.onnx").unlink()
    out, tarball = tmp_path / "release" / "fp32", tmp_path / "release" / "fp32.tar.gz"
    with pytest.raises(NpuforgeError, match="listed in compile.json but missing"):
        build_bundle(
            model_id="m",
            model_entry=MODEL,
            target_id="onnx",
            target_entry=TARGET,
            precision="fp32",
            out_dir=out,
            tarball=tarball,
            **inputs,
        )
    assert not out.exists() and not tarball.exists()
    assert list((tmp_path / "release").iterdir()) == []


def test_corrupted_artifact_is_refused(tmp_path):
    inputs = make_inputs(tmp_path)
    (inputs["compiled_dir"] / "chunk0.onnx").write_bytes(b"tampered")
    with pytest.raises(NpuforgeError, match="does not match its sha256"):
        build_bundle(
            model_id="m",
            model_entry=MODEL,
            target_id="onnx",
            target_entry=TARGET,
            precision="fp32",
            out_dir=tmp_path / "r" / "fp32",
            tarball=tmp_path / "r" / "fp32.tar.gz",
            **inputs,
        )
    assert not (tmp_path / "r" / "fp32").exists()


def test_model_without_tokenizer_ships_none_and_says_so(tmp_path):
    inputs = make_inputs(tmp_path)
    inputs["tokenizer"] = None
    out = tmp_path / "release" / "fp32"
    manifest = build_bundle(
        model_id="llama-tiny",
        model_entry=dict(MODEL, family="llama", tokenizer="none"),
        target_id="onnx",
        target_entry=TARGET,
        precision="fp32",
        out_dir=out,
        tarball=tmp_path / "release" / "fp32.tar.gz",
        **inputs,
    )
    assert not (out / "tokenizer.bin").exists()
    assert manifest["model"]["tokenizer"] == "none"
    assert manifest["inputs"]["tokenizer"]["file"] is None
    assert "no tokenizer" in manifest["inputs"]["tokenizer"]["reason"]
    assert "tokenizer.bin" not in (out / "SHA256SUMS").read_text()
