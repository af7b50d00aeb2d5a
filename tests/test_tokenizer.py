"""World tokenizer: binary layout, round trips, agreement with the reference tokenizer."""

import hashlib
import importlib.util
import struct
from pathlib import Path

import pytest

from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError
from npuforge.tokenizer import Tokenizer, convert_tokenizer, default_vocab_path

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。RWKV 是一种 RNN。",
    "Привет, мир! Ελληνικά · العربية · हिन्दी · 日本語のテキスト 🙂🚀",
    "def f(x):\n\treturn x ** 2  # ≠ ∑\r\n\x00\x7f",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("rwkv", reason="the World vocabulary ships in the rwkv package")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.bin"
    info = convert_tokenizer(path)
    return path, info


def test_binary_layout(converted):
    path, info = converted
    data = path.read_bytes()
    magic, version, n_ids, blob_size, reserved = struct.unpack_from("<8sIIII", data)
    assert (magic, version, reserved) == (b"NPFTOK\0\0", 1, 0)
    assert n_ids == 65530  # ids 0..65529 (id 0 is the unused end-of-text slot)
    offsets = struct.unpack_from(f"<{n_ids + 1}I", data, 24)
    blob = data[24 + 4 * (n_ids + 1) :]
    assert len(blob) == blob_size == offsets[-1]
    assert blob[offsets[1] : offsets[2]] == b"\x00"  # id 1 is byte 0x00
    assert offsets[0] == offsets[1]  # id 0 has no bytes
    assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert len(data) < 1_000_000  # compact: smaller than the 1.1 MB text vocabulary


def test_round_trips_and_matches_reference(converted):
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    tokenizer = Tokenizer.from_file(converted[0])
    reference = TRIE_TOKENIZER(str(default_vocab_path()))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode_text(ids) == text
    # Bytes that are not valid UTF-8 on their own: a split character, stray bytes.
    raw = "世界".encode()[:4] + b"\xff\xfe abc \x80"
    ids = tokenizer.encode(raw)
    assert tokenizer.decode(ids) == raw
    assert ids == reference.encodeBytes(raw)
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("世界")]
    assert b"".join(pieces) == "世界".encode()
    assert len(tokenizer.encode(TEXTS[0])) < len(TEXTS[0]) / 2  # real merges happen


def test_conversion_is_deterministic_and_cli(tmp_path, converted):
    spec = importlib.util.spec_from_file_location(
        "convert_tokenizer", ROOT / "workflow_scripts" / "convert_tokenizer.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "again.bin"
    assert run_cli(cli.main, ["--out", str(out)]) == 0
    assert out.read_bytes() == converted[0].read_bytes()
    bad_vocab = tmp_path / "bad.txt"
    bad_vocab.write_text("1 __import__('os').system('true') 1\n")
    assert run_cli(cli.main, ["--out", str(tmp_path / "x.bin"), "--vocab", str(bad_vocab)]) == 2
    assert not (tmp_path / "x.bin").exists()


def test_bad_files(tmp_path, converted):
    data = converted[0].read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-10])
    with pytest.raises(NpuforgeError, match="truncated"):
        Tokenizer.from_file(tmp_path / "cut.bin")
    with pytest.raises(NpuforgeError, match="not a tokenizer"):
        Tokenizer.from_file(tmp_path / "missing.bin")
    tokenizer = Tokenizer.from_file(converted[0])
    with pytest.raises(NpuforgeError, match="not in the vocabulary"):
        tokenizer.decode([70000])


def test_hf_tokenizer_is_copied_or_refused(tmp_path):
    from npuforge.errors import NpuforgeError
    from npuforge.tokenizer import copy_hf_tokenizer

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(NpuforgeError, match="no tokenizer.json; set the model's tokenizer to none"):
        copy_hf_tokenizer(tmp_path / "ckpt", tmp_path / "out" / "tokenizer.json")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    (tmp_path / "ckpt" / "tokenizer.json").write_text('{"version": "1.0"}')
    copy_hf_tokenizer(tmp_path / "ckpt", tmp_path / "out" / "tokenizer.json")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
