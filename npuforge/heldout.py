"""The held-out text as each model's own tokenizer sees it: the verification input.

``data/calibration/heldout.txt`` is never used for calibration. Every backend
verifies its binaries over these ids (``npuforge.backends.base``), so fidelity is
measured on real text in the model's own vocabulary: the World tokenizer for
``tokenizer: rwkv-world``, the checkpoint's tokenizer.json for ``tokenizer: hf``,
and for ``tokenizer: none`` (random test weights) UTF-8 bytes folded into the
vocabulary, labelled so. The file (``results/heldout/{model}.json``)::

    {"ids": [...], "count": N, "text": {"source", "sha256", "tokenizer": {...}}}
"""

from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import read_json, sha256_file, write_json

TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration" / "heldout.txt"
SOURCE = "data/calibration/heldout.txt"


def tokenizer_for(kind: str, checkpoint=None):
    """``(tokenizer, description)`` for the registry's ``tokenizer`` kind."""
    from npuforge import calibration

    if kind == "rwkv-world":
        return calibration.world_tokenizer(), {"kind": "rwkv-world"}
    if kind == "hf":
        path = Path(checkpoint or "") / "tokenizer.json"
        if not path.is_file():
            raise NpuforgeError(
                f"{checkpoint} has no tokenizer.json for tokenizer: hf; set the model's "
                "tokenizer to none or use a checkpoint that ships one"
            )
        description = {"kind": "hf", "file": path.name, "sha256": sha256_file(path)}
        return calibration.HfTokenizer(path), description
    if kind == "none":
        return calibration.ByteTokenizer(), {
            "kind": "bytes",
            "note": "the model has no tokenizer: UTF-8 bytes folded into the vocabulary",
        }
    raise NpuforgeError(f"unknown tokenizer kind {kind!r}: use rwkv-world, hf or none")


def tokenize(tokenizer, vocab_size: int) -> list[int]:
    ids = [int(t) % int(vocab_size) for t in tokenizer.encode(TEXT.read_text(encoding="utf-8"))]
    if not ids:
        raise NpuforgeError(f"{SOURCE} is empty: the verification needs held-out text")
    return ids


def write(kind: str, vocab_size: int, out, checkpoint=None) -> dict:
    tokenizer, description = tokenizer_for(kind, checkpoint)
    ids = tokenize(tokenizer, vocab_size)
    record = {
        "ids": ids,
        "count": len(ids),
        "text": {"source": SOURCE, "sha256": sha256_file(TEXT), "tokenizer": description},
    }
    write_json(out, record)
    return record


def read(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise NpuforgeError(f"held-out token file {path} is missing; run the heldout step")
    return read_json(path)


def describe(record: dict) -> dict:
    return {**record["text"], "tokens": len(record["ids"])}


def fallback_tokens(count: int, export_meta: dict, calibrations=()) -> dict:
    """Held-out ids without a held-out file: those a calibration.json recorded (made with
    the model's tokenizer), else the text tokenized for the export's family here."""
    for directory in calibrations or ():
        meta = Path(directory) / "calibration.json"
        recorded = read_json(meta) if meta.is_file() else {}
        if len(recorded.get("tokens", [])) >= count:
            text = recorded.get("text", {})
            return {
                "ids": [int(t) for t in recorded["tokens"][:count]],
                "text": {"source": SOURCE, "tokenizer": text.get("tokenizer"), "tokens": count},
            }
    family = export_meta.get("family", "rwkv")
    kind = "rwkv-world" if family == "rwkv" else "none"
    tokenizer, description = tokenizer_for(kind)
    ids = tokenize(tokenizer, export_meta["vocab_size"])
    repeated = [ids[i % len(ids)] for i in range(count)]
    return {
        "ids": repeated,
        "text": {
            "source": SOURCE,
            "tokenizer": description,
            "tokens": count,
            "repeated": count > len(ids),
        },  # fmt: skip
    }
