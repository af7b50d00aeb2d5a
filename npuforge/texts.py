"""Texts and tokenizers: the calibration documents, the held-out text, and the
tokenizers that turn them into a model's ids (the RWKV World vocabulary, a Hugging
Face tokenizer.json, or UTF-8 bytes for a model without one)."""

import functools
import hashlib
from pathlib import Path

from npuforge.errors import NpuforgeError

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"
DEFAULT_TEXT = DATA_DIR / "text"
HELDOUT_TEXT = DATA_DIR / "heldout.txt"


def _text_files(path: Path) -> list:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise NpuforgeError(f"calibration text directory {path} has no .txt files")
        return files
    if path.is_file():
        return [path]
    raise NpuforgeError(f"calibration text {path} does not exist: pass a .txt file or directory")


def read_documents(path=None) -> list:
    """``[(relative name, text)]`` of a calibration text file or directory, sorted by name."""
    path = Path(path or DEFAULT_TEXT)
    base = path if path.is_dir() else path.parent
    docs = []
    for file in _text_files(path):
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise NpuforgeError(f"{file} is not UTF-8 text; convert it or leave it out") from None
        docs.append((file.relative_to(base).as_posix(), text))
    return docs


def text_digest(documents) -> str:
    digest = hashlib.sha256()
    for name, text in documents:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


@functools.cache
def world_tokenizer():
    """The RWKV World tokenizer: ``encode(str) -> list[int]``.

    Prefers the project's ``npuforge.tokenizer`` when it offers ``encode``;
    otherwise the vocabulary shipped in BlinkDL's ``rwkv`` package (the same one).
    """
    try:
        from npuforge import tokenizer as project_tokenizer

        loader = getattr(project_tokenizer, "world_tokenizer", None)
        if loader is not None:
            return loader()
    except ImportError:
        pass
    import os

    try:
        import rwkv
        from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    except ImportError:
        raise NpuforgeError(
            "no World tokenizer: install the 'rwkv' package (pip install rwkv) in the main env"
        ) from None
    return TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__), "rwkv_vocab_v20230424.txt"))


def tokenize_documents(documents, vocab_size: int, tokenizer=None) -> list:
    """One int64 token array per document; ids folded into ``vocab_size`` for toy vocabularies."""
    import numpy as np

    tokenizer = tokenizer or world_tokenizer()
    arrays = []
    for _, text in documents:
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        arrays.append(ids % int(vocab_size))
    return arrays


class ByteTokenizer:
    """UTF-8 bytes as token ids: the fallback for a checkpoint without a tokenizer.

    Not the model's vocabulary (there is none): only deterministic, in-range ids
    (bytes folded into the vocabulary size) for calibration and verification runs.
    """

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))


class HfTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise NpuforgeError(
                "calibrating a model with a tokenizer.json needs the 'tokenizers' package"
            ) from None
        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def heldout_tokens(count: int, vocab_size: int, text=None, tokenizer=None):
    """``count`` tokens of the held-out text (repeated if short): the verification input."""
    import numpy as np

    docs = read_documents(text or HELDOUT_TEXT)
    ids = np.concatenate(tokenize_documents(docs, vocab_size, tokenizer))
    if ids.size == 0:
        raise NpuforgeError("held-out verification text is empty")
    return np.resize(ids, int(count)).astype(np.int64)
