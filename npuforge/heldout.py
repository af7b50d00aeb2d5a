"""The held-out text as each model's own tokenizer sees it: the verification input.

``data/calibration/heldout.txt`` is never used for calibration. Every backend
verifies its binaries over these ids (``npuforge.backends.base``), so fidelity is
measured on real text in the model's own vocabulary: the family's tokenizer
(``npuforge.models.<family>.tokenizer``: the World vocabulary for RWKV, the
checkpoint's tokenizer.json for the llama family, and for a checkpoint without
one, random test weights, UTF-8 bytes folded into the vocabulary, labelled so).
The file (``results/heldout/{model}.json``)::

    {"ids": [...], "count": N, "text": {"source", "sha256", "tokenizer": {...}}}
"""

from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import read_json, sha256_file, write_json

TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration" / "heldout.txt"
SOURCE = "data/calibration/heldout.txt"


def tokenize(tokenizer, vocab_size: int) -> list[int]:
    ids = [int(t) % int(vocab_size) for t in tokenizer.encode(TEXT.read_text(encoding="utf-8"))]
    if not ids:
        raise NpuforgeError(f"{SOURCE} is empty: the verification needs held-out text")
    return ids


def write(family: str, vocab_size: int, out, checkpoint=None) -> dict:
    from npuforge import models

    tokenizer, description = models.family(family).tokenizer(checkpoint)
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
    from npuforge import models

    # No checkpoint here: a family that ships its own tokenizer falls back to bytes.
    tokenizer, description = models.family(export_meta.get("family", "rwkv")).tokenizer(None)
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
