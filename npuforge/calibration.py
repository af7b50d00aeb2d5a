"""Calibration samples from real multi-step runs, written in every vendor's format.

Quantizers pick activation ranges from the samples they are given. A recurrent
model's state inputs (shift vectors, the wkv matrix) are only realistic after
the model has actually read some text; zero or random states give the wrong
ranges and saturate the quantized model. So the samples here are the inputs of
every graph chunk captured at sampled steps of real runs of the fp32 export
(``npuforge.runtime.GraphChain``) over the project's calibration text.

Sample ``j``: a start offset drawn (seeded) from the tokenized text, a run of
``1 + capture_step_j`` calls from zero state (a decode export reads one token
per call, a prefill export ``T``; states and positions carry from call to
call), and the feeds of every chunk at the last call. ``capture_step_j`` is
drawn in ``[steps // 4, steps)``, so the states have seen at least a quarter of
the run. Graphs with a KV cache (``cache_len``) must hold every call of the
run: ``steps * T`` tokens at most. Graphs with host-fed
position inputs (roles beyond tokens/embedding/hidden/state, e.g. a KV cache's
mask and RoPE rows) draw it in ``[0, steps)``: their activations depend on the
absolute position, and the first positions (attention over one or two slots)
reach ranges later ones never do. ``zero_state=True``
captures at the first call instead (all states zero): the weak calibration
that shows why real runs matter.

Layout (docs/interfaces.md, "Calibration directory"); every path in a list
file is relative to that list file's directory, so the directory can move::

    calibration.json
    rknn/chunk{i}/dataset.txt         one line per sample: space-separated .npy files
    rknn/chunk{i}/sample{j}_{k}.npy   input k of chunk i (graph input order)
    qnn/chunk{i}/input_list.txt       one line per sample: name:=file.raw ...
    qnn/chunk{i}/sample{j}_{k}.raw    raw little-endian tensor data
    tpumlir/chunk{i}/sample{j}.npz    keys = input names

Everything is byte-identical for the same export, text, and options.
"""

import functools
import hashlib
import io
import zipfile
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, write_json

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"
DEFAULT_TEXT = DATA_DIR / "text"
HELDOUT_TEXT = DATA_DIR / "heldout.txt"
# Held-out tokens recorded in calibration.json for verification runs.
VERIFY_TOKENS = 128
# A zip entry's timestamp; fixed so .npz files are byte-deterministic.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


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


def tokenizer_for(meta: dict, checkpoint=None) -> tuple:
    """``(tokenizer, description)`` for the texts of an export's model.

    RWKV: the World tokenizer. Llama family: the checkpoint's ``tokenizer.json`` when
    it has one, else the byte fallback (labelled so in calibration.json).
    """
    if meta.get("family", "rwkv") == "rwkv":
        return world_tokenizer(), {"kind": "rwkv-world"}
    path = Path(checkpoint) / "tokenizer.json" if checkpoint else None
    if path is not None and path.is_file():
        from npuforge.fileio import sha256_file

        return HfTokenizer(path), {"kind": "hf", "file": path.name, "sha256": sha256_file(path)}
    why = "the checkpoint has no tokenizer.json" if checkpoint else "no --checkpoint given"
    return ByteTokenizer(), {
        "kind": "bytes",
        "note": f"{why}: token ids are UTF-8 bytes folded into the vocabulary, not a vocabulary",
    }


def heldout_tokens(count: int, vocab_size: int, text=None, tokenizer=None):
    """``count`` tokens of the held-out text (repeated if short): the verification input."""
    import numpy as np

    docs = read_documents(text or HELDOUT_TEXT)
    ids = np.concatenate(tokenize_documents(docs, vocab_size, tokenizer))
    if ids.size == 0:
        raise NpuforgeError("held-out verification text is empty")
    return np.resize(ids, int(count)).astype(np.int64)


def verification_tokens(count: int, vocab_size: int, calibration_dirs=()) -> list[int]:
    """``count`` held-out token ids, the recurrent checks' input: the ``tokens`` a
    calibration.json recorded (model tokenizer) when one of ``calibration_dirs`` (a
    directory or a list) has enough, else the held-out text tokenized here."""
    if count <= 0:
        return []
    if isinstance(calibration_dirs, (str, Path)):
        calibration_dirs = [calibration_dirs]
    for directory in calibration_dirs or ():
        meta = Path(directory) / "calibration.json"
        recorded = read_json(meta).get("tokens", []) if meta.is_file() else []
        if len(recorded) >= count:
            return [int(t) for t in recorded[:count]]
    return [int(t) for t in heldout_tokens(count, vocab_size)]


# Input roles every runner feeds the same way; any other role is position-dependent.
RUNNER_ROLES = ("tokens", "embedding", "hidden", "state")


def plan_samples(
    doc_tokens,
    samples: int,
    steps: int,
    seed: int,
    zero_state: bool,
    first_step=None,
    tokens_per_call: int = 1,
) -> list:
    """Seeded ``[(document, start, capture_step)]`` for each sample.

    ``capture_step`` is drawn in ``[first_step, steps)``; ``first_step`` defaults
    to ``steps // 4``. ``start`` leaves room for the run's ``(capture_step + 1) *
    tokens_per_call`` tokens where the document is long enough.
    """
    import numpy as np

    first_step = steps // 4 if first_step is None else int(first_step)

    rng = np.random.default_rng(seed)
    usable = [i for i, t in enumerate(doc_tokens) if len(t) >= 1]
    if not usable:
        raise NpuforgeError("calibration text tokenized to nothing")
    plan = []
    for _ in range(samples):
        doc = int(usable[rng.integers(len(usable))])
        capture = 0 if zero_state else int(rng.integers(first_step, steps))
        length = len(doc_tokens[doc])
        start = int(rng.integers(max(1, length - (capture + 1) * tokens_per_call + 1)))
        plan.append((doc, start, capture))
    return plan


def check_calls_fit(meta: dict, calls: int, export_dir) -> None:
    """A KV-cache export (``cache_len``) must hold every token of a ``calls``-call run."""
    cache_len = meta.get("cache_len")
    per_call = int(meta["tokens_per_call"])
    if cache_len is not None and calls * per_call > int(cache_len):
        raise NpuforgeError(
            f"{calls} calibration calls of {per_call} tokens ({calls * per_call}) overrun the "
            f"KV cache of {export_dir} (cache_len {cache_len}): lower --steps (calibration "
            f"steps) to {int(cache_len) // per_call} or less"
        )


def _feeds_of_run(chain, tokens, capture_step):
    """Run ``capture_step + 1`` calls over ``tokens`` from zero state; the chunk feeds at
    the last call. A short document repeats, as it would wrap in a decode run."""
    import numpy as np

    per_call = chain.tokens_per_call
    ids = np.resize(np.asarray(tokens, dtype=np.int64), (capture_step + 1) * per_call)
    captured = {}

    def capture(index, feeds):
        # The chain's position is the first token of the running call.
        if chain.position == capture_step * per_call:
            captured[index] = {k: np.array(v, copy=True) for k, v in feeds.items()}

    chain.capture = capture
    chain.reset()
    for call in range(capture_step + 1):
        chain.step(ids[call * per_call : (call + 1) * per_call].reshape(1, per_call))
    chain.capture = None
    return captured


def _npy_bytes(array) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _write_npz(path: Path, arrays: dict) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(f"{name}.npy", date_time=ZIP_EPOCH)
            info.external_attr = 0o644 << 16
            archive.writestr(info, _npy_bytes(arrays[name]))


def make_calibration_samples(
    export_dir,
    out_dir,
    *,
    samples: int,
    steps: int,
    seed: int,
    text=None,
    zero_state=False,
    checkpoint=None,
) -> dict:
    """Capture ``samples`` input sets of every chunk and write them in each vendor format.

    ``checkpoint``: the exported checkpoint, whose tokenizer (``tokenizer_for``) turns
    the texts into ids for Llama-family exports; RWKV uses the World tokenizer.
    """
    import numpy as np

    from npuforge.runtime import GraphChain

    if samples < 1 or steps < 1:
        raise NpuforgeError("--samples and --steps must be at least 1")
    chain = GraphChain(export_dir)
    meta = chain.meta
    if chain.batch != 1:
        raise NpuforgeError(
            f"calibration runs batch-1 exports; {export_dir} has batch {chain.batch}: "
            "calibrate a --batch 1 export of the same model"
        )
    per_call = chain.tokens_per_call
    check_calls_fit(meta, 1 if zero_state else steps, export_dir)
    documents = read_documents(text)
    tokenizer, tokenizer_info = tokenizer_for(meta, checkpoint)
    doc_tokens = tokenize_documents(documents, meta["vocab_size"], tokenizer)
    positional = any(
        spec["role"] not in RUNNER_ROLES for graph in meta["graphs"] for spec in graph["inputs"]
    )
    first_step = 0 if positional else None
    plan = plan_samples(doc_tokens, samples, steps, seed, zero_state, first_step, per_call)

    graphs = meta["graphs"]
    captured = []
    for doc, start, capture_step in plan:
        tokens = doc_tokens[doc][start:]
        captured.append(_feeds_of_run(chain, tokens, capture_step))

    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        chunks = []
        for index, graph in enumerate(graphs):
            names = [spec["name"] for spec in graph["inputs"]]
            rknn_dir = tmp / "rknn" / f"chunk{index}"
            qnn_dir = tmp / "qnn" / f"chunk{index}"
            tpu_dir = tmp / "tpumlir" / f"chunk{index}"
            for folder in (rknn_dir, qnn_dir, tpu_dir):
                folder.mkdir(parents=True)
            dataset_lines, input_lines, npz_files = [], [], []
            for j, run in enumerate(captured):
                feeds = run[index]
                npy_files, raw_entries = [], []
                for k, spec in enumerate(graph["inputs"]):
                    value = np.ascontiguousarray(feeds[spec["name"]], dtype=spec["dtype"])
                    npy = f"sample{j}_{k}.npy"
                    (rknn_dir / npy).write_bytes(_npy_bytes(value))
                    npy_files.append(npy)
                    raw = f"sample{j}_{k}.raw"
                    little_endian = value.astype(value.dtype.newbyteorder("<"))
                    (qnn_dir / raw).write_bytes(little_endian.tobytes())
                    raw_entries.append(f"{spec['name']}:={raw}")
                dataset_lines.append(" ".join(npy_files))
                input_lines.append(" ".join(raw_entries))
                npz = f"sample{j}.npz"
                _write_npz(tpu_dir / npz, {n: feeds[n] for n in names})
                npz_files.append(f"tpumlir/chunk{index}/{npz}")
            (rknn_dir / "dataset.txt").write_text("\n".join(dataset_lines) + "\n")
            (qnn_dir / "input_list.txt").write_text("\n".join(input_lines) + "\n")
            chunks.append(
                {
                    "index": index,
                    "file": graph["file"],
                    "inputs": [
                        {k: spec[k] for k in ("name", "shape", "dtype", "role")}
                        for spec in graph["inputs"]
                    ],
                    "rknn": {"dataset": f"rknn/chunk{index}/dataset.txt"},
                    "qnn": {"input_list": f"qnn/chunk{index}/input_list.txt"},
                    "tpumlir": {"npz": npz_files},
                }
            )
        record = {
            "samples": samples,
            "steps": steps,
            "seed": seed,
            "zero_state": bool(zero_state),
            "text": {
                "source": "project" if text is None else str(text),
                "documents": [name for name, _ in documents],
                "sha256": text_digest(documents),
                "tokens": int(sum(len(t) for t in doc_tokens)),
                "tokenizer": tokenizer_info,
            },
            "variant": meta.get("variant", "decode"),
            "tokens_per_call": per_call,
            # position: the first token of the captured call (capture_step * tokens_per_call).
            "runs": [
                {
                    "document": documents[d][0],
                    "start": s,
                    "capture_step": c,
                    "position": c * per_call,
                }
                for d, s, c in plan
            ],
            "export": {"graphs": [{"file": g["file"], "sha256": g.get("sha256")} for g in graphs]},
            # Held-out text for backends' recurrent verification runs (never calibrated on).
            "tokens": [
                int(t) for t in heldout_tokens(VERIFY_TOKENS, meta["vocab_size"], None, tokenizer)
            ],
            "chunks": chunks,
        }
        write_json(tmp / "calibration.json", record)
    return record


def read_calibration(calibration_dir) -> dict:
    path = Path(calibration_dir) / "calibration.json"
    if not path.is_file():
        raise NpuforgeError(
            f"{calibration_dir}: no calibration.json; run make_calibration_samples.py first"
        )
    return read_json(path)


def calibrations_by_variant(calibration_dirs) -> dict:
    """``{variant: directory}`` of a compile step's ``--calibration`` directories.

    ``calibration_dirs``: None, one directory or a list (one per calibrated export).
    Each calibration.json names the variant of the export it was captured from; one
    without ``variant`` predates prefill samples and holds decode samples.
    """
    if not calibration_dirs:
        return {}
    if isinstance(calibration_dirs, str | Path):
        calibration_dirs = [calibration_dirs]
    by_variant = {}
    for directory in calibration_dirs:
        variant = read_calibration(directory).get("variant", "decode")
        if variant in by_variant:
            raise NpuforgeError(
                f"two {variant} calibration directories given ({by_variant[variant]}, "
                f"{directory}): pass one --calibration per export"
            )
        by_variant[variant] = Path(directory)
    return by_variant


def check_calibration_matches(calibration_dir, export_meta: dict, export_dir) -> None:
    """Refuse samples captured from other graphs than the export being compiled."""
    recorded = read_calibration(calibration_dir).get("export", {}).get("graphs")
    if recorded is None:
        return
    mine = [g.get("sha256") for g in export_meta["graphs"]]
    theirs = [g.get("sha256") for g in recorded]
    if None in mine or None in theirs:
        return
    if mine != theirs:
        raise NpuforgeError(
            f"calibration {calibration_dir} was captured from other graphs than {export_dir}: "
            f"rerun make_calibration_samples.py --export {export_dir}"
        )
