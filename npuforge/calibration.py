"""Calibration samples from real multi-step runs, one .npz per chunk and sample.

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

The directory holds ``calibration.json`` and the samples; each vendor's compile job
converts them to its own format (``npuforge.calibration_formats``). Everything is
byte-identical for the same export, text, and options.
"""

from pathlib import Path

from npuforge import progress
from npuforge.calibration_formats import LAYOUT, write_chunk_samples
from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, write_json
from npuforge.host_cpu import instruction_set
from npuforge.texts import heldout_tokens, read_documents, text_digest, tokenize_documents

# Held-out tokens recorded in calibration.json for verification runs.
VERIFY_TOKENS = 128
# The instruction set the samples were computed on (npuforge.host_cpu).
HOST_RECORD = "host.json"


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


def capture_runs(export_dir, meta, runs, write_chunk) -> list:
    """Run every ``(tokens, capture_step)`` of ``runs`` from zero state, ``capture_step +
    1`` calls each (a short document repeats, as it would wrap in a decode run), and hand
    each chunk's feeds at each run's last call to ``write_chunk(index, graph, feeds)``;
    return what it returns, per chunk.

    Chunk by chunk, as the reference run: one graph's session serves every call of every
    run and is dropped before the next opens, so the capture holds one chunk and its
    samples at a time (plus the hidden states between chunks: calls x embed per run)."""
    import numpy as np

    from npuforge.onnx_io import read_embedding_bin
    from npuforge.runtime import initial_state, onnxruntime_session, run_graph

    export_dir = Path(export_dir)
    per_call = int(meta["tokens_per_call"])
    start = initial_state(export_dir, meta)
    embedding = None
    if meta.get("embedding"):
        embedding = read_embedding_bin(export_dir / meta["embedding"]["file"])
    runs = [
        (np.resize(np.asarray(tokens, dtype=np.int64), (step + 1) * per_call), step)
        for tokens, step in runs
    ]
    carried = [[{} for _ in range(step + 1)] for _, step in runs]
    chunks, graphs = [], meta["graphs"]
    for index, graph in enumerate(graphs):
        session = onnxruntime_session(export_dir / graph["file"])
        names = [spec["name"] for spec in graph["inputs"] if spec["role"] == "state"]
        feeds_at_capture = []
        for number, (ids, capture_step) in enumerate(runs):
            done = index * len(runs) + number
            progress.stage(
                f"calibration capture: chunk {index + 1} of {len(graphs)}, "
                f"sample {number + 1} of {len(runs)}",
                done,
                len(graphs) * len(runs),
            )
            state = {name: start[name].copy() for name in names}
            for call in range(capture_step + 1):
                tokens = ids[call * per_call : (call + 1) * per_call].reshape(1, per_call)
                seen = None
                if call == capture_step:

                    def seen(feeds, kept=feeds_at_capture):
                        kept.append({k: np.array(v, copy=True) for k, v in feeds.items()})

                carried[number][call], _ = run_graph(
                    session, meta, graph, tokens, call * per_call, embedding,
                    carried[number][call], state, seen,
                )  # fmt: skip
        session = None
        chunks.append(write_chunk(index, graph, feeds_at_capture))
    progress.clear()
    return chunks


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
    """Capture ``samples`` input sets of every chunk and write them, chunk by chunk.

    ``checkpoint``: the exported checkpoint, whose family's tokenizer turns the texts
    into ids (the checkpoint's tokenizer.json for Llama-family exports; RWKV uses the
    World tokenizer).
    """

    if samples < 1 or steps < 1:
        raise NpuforgeError("--samples and --steps must be at least 1")
    meta_path = Path(export_dir) / "export.json"
    if not meta_path.is_file():
        raise NpuforgeError(f"{export_dir}: no export.json; run export_onnx.py first")
    meta = read_json(meta_path)
    if int(meta["batch"]) != 1:
        raise NpuforgeError(
            f"calibration runs batch-1 exports; {export_dir} has batch {meta['batch']}: "
            "calibrate a --batch 1 export of the same model"
        )
    per_call = int(meta["tokens_per_call"])
    check_calls_fit(meta, 1 if zero_state else steps, export_dir)
    documents = read_documents(text)
    from npuforge import models

    tokenizer, tokenizer_info = models.family(meta.get("family", "rwkv")).tokenizer(checkpoint)
    doc_tokens = tokenize_documents(documents, meta["vocab_size"], tokenizer)
    positional = any(
        spec["role"] not in RUNNER_ROLES for graph in meta["graphs"] for spec in graph["inputs"]
    )
    first_step = 0 if positional else None
    plan = plan_samples(doc_tokens, samples, steps, seed, zero_state, first_step, per_call)

    graphs = meta["graphs"]
    runs = [(doc_tokens[doc][start:], capture_step) for doc, start, capture_step in plan]

    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:

        def write_chunk(index, graph, feeds):
            return write_chunk_samples(tmp, index, graph, feeds)

        chunks = capture_runs(export_dir, meta, runs, write_chunk)
        record = {
            "layout": LAYOUT,
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
        # Beside calibration.json, not in it: builds whose bytes do not follow the
        # samples' last bits (QNN snaps its ranges) keep one record across hosts.
        write_json(tmp / HOST_RECORD, instruction_set())
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
