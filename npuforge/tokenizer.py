"""The RWKV World tokenizer as a compact binary file, and encode/decode over it.

Source: ``rwkv_vocab_v20230424.txt`` shipped in BlinkDL's ``rwkv`` package, one
token per line: ``<id> <python str or bytes literal> <byte length>`` (parsed with
``ast.literal_eval``, never ``eval``).

Binary layout (all integers little-endian uint32):

    magic      8 bytes  b"NPFTOK\\0\\0"
    version    1
    n_ids      number of token ids (largest id + 1)
    blob_size  total bytes of all tokens
    reserved   0
    offsets    n_ids + 1 values; token i is blob[offsets[i]:offsets[i+1]] (empty: unused id)
    blob       the token byte strings, concatenated in id order

Encoding is greedy longest match over bytes (what the reference TRIE tokenizer
does); every single byte is a token, so any byte string encodes, and decoding
returns the exact bytes (UTF-8 text split mid-character round-trips too).
"""

import ast
import struct
from pathlib import Path

from npuforge.errors import NpuforgeError

MAGIC = b"NPFTOK\0\0"
HEADER = struct.Struct("<8sIIII")
DEFAULT_VOCAB = "rwkv_vocab_v20230424.txt"


def default_vocab_path() -> Path:
    """The World vocabulary inside the installed ``rwkv`` package."""
    import importlib.util

    spec = importlib.util.find_spec("rwkv")
    if spec is None or not spec.submodule_search_locations:
        raise NpuforgeError("the rwkv package is not installed; pip install rwkv or pass --vocab")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_VOCAB


def parse_vocab(path) -> dict:
    """id -> token bytes from a ``rwkv_vocab_*.txt`` file."""
    path = Path(path)
    if not path.is_file():
        raise NpuforgeError(f"{path}: vocabulary file not found; check --vocab")
    tokens = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            first, last = line.index(" "), line.rindex(" ")
            token_id = int(line[:first])
            value = ast.literal_eval(line[first:last].strip())
            length = int(line[last:])
        except (ValueError, SyntaxError):
            raise NpuforgeError(
                f"{path}:{lineno}: not '<id> <literal> <length>'; use an rwkv_vocab_*.txt file"
            ) from None
        data = value.encode("utf-8") if isinstance(value, str) else value
        if not isinstance(data, bytes) or len(data) != length or token_id in tokens:
            raise NpuforgeError(f"{path}:{lineno}: bad token entry; the vocabulary is damaged")
        tokens[token_id] = data
    if not tokens:
        raise NpuforgeError(f"{path}: empty vocabulary")
    return tokens


def pack(tokens: dict) -> bytes:
    """The binary file's bytes for id -> token bytes."""
    n_ids = max(tokens) + 1
    offsets, blob, position = [], bytearray(), 0
    for token_id in range(n_ids):
        offsets.append(position)
        data = tokens.get(token_id, b"")
        blob += data
        position += len(data)
    offsets.append(position)
    return (
        HEADER.pack(MAGIC, 1, n_ids, len(blob), 0)
        + struct.pack(f"<{n_ids + 1}I", *offsets)
        + bytes(blob)
    )


def convert_tokenizer(out, vocab=None) -> dict:
    """Write the binary tokenizer for ``vocab`` (default: the rwkv package's) to ``out``."""
    from npuforge.fileio import atomic_path, sha256_file

    vocab = Path(vocab) if vocab else default_vocab_path()
    data = pack(parse_vocab(vocab))
    with atomic_path(out) as tmp:
        Path(tmp).write_bytes(data)
    return {"file": Path(out).name, "bytes": len(data), "sha256": sha256_file(out)}


class Tokenizer:
    """Greedy longest-match byte tokenizer over a binary tokenizer file."""

    def __init__(self, tokens: dict):
        self.id_to_bytes = dict(tokens)
        self.bytes_to_id = {v: k for k, v in tokens.items() if v}
        self.lengths = sorted({len(v) for v in self.bytes_to_id}, reverse=True)
        missing = [b for b in range(256) if bytes([b]) not in self.bytes_to_id]
        if missing:
            raise NpuforgeError(
                f"tokenizer lacks single-byte token {missing[0]}; not every input can encode"
            )

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        path = Path(path)
        data = path.read_bytes() if path.is_file() else b""
        if len(data) < HEADER.size:
            raise NpuforgeError(f"{path}: not a tokenizer file; run convert_tokenizer.py")
        magic, version, n_ids, blob_size, _ = HEADER.unpack_from(data)
        table_end = HEADER.size + 4 * (n_ids + 1)
        if magic != MAGIC or version != 1 or len(data) != table_end + blob_size:
            raise NpuforgeError(f"{path}: not a v1 tokenizer file or truncated; re-convert it")
        offsets = struct.unpack_from(f"<{n_ids + 1}I", data, HEADER.size)
        blob = data[table_end:]
        tokens = {
            i: blob[offsets[i] : offsets[i + 1]]
            for i in range(n_ids)
            if offsets[i + 1] > offsets[i]
        }
        return cls(tokens)

    @classmethod
    def world(cls) -> "Tokenizer":
        """The World tokenizer straight from the rwkv package's text vocabulary."""
        return cls(parse_vocab(default_vocab_path()))

    def encode(self, text) -> list:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids, position, lookup = [], 0, self.bytes_to_id
        while position < len(data):
            for length in self.lengths:
                piece = data[position : position + length]
                token = lookup.get(piece)
                if token is not None:
                    ids.append(token)
                    position += len(piece)
                    break
        return ids

    def decode(self, ids) -> bytes:
        try:
            return b"".join(self.id_to_bytes[int(i)] for i in ids)
        except KeyError as err:
            raise NpuforgeError(f"token id {err.args[0]} is not in the vocabulary") from None

    def decode_text(self, ids, errors: str = "replace") -> str:
        return self.decode(ids).decode("utf-8", errors=errors)


def copy_hf_tokenizer(checkpoint_dir, out) -> str:
    """Ship a Hugging Face checkpoint's own ``tokenizer.json`` unchanged; return its sha256.

    The registry says ``tokenizer: hf`` for such models; a checkpoint without the file
    (random-weight test models) must say ``tokenizer: none`` instead of getting an
    invented vocabulary.
    """
    import shutil

    from npuforge.fileio import atomic_path, sha256_file

    src = Path(checkpoint_dir) / "tokenizer.json"
    if not src.is_file():
        raise NpuforgeError(
            f"{checkpoint_dir} has no tokenizer.json; set the model's tokenizer to none "
            "in the registry, or fetch a snapshot that includes it"
        )
    with atomic_path(out) as tmp:
        shutil.copyfile(src, tmp)
    return sha256_file(out)
