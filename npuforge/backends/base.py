"""What every vendor backend does the same way, written once.

A compile step turns export directories into binaries and ``compile.json``:

    load_exports ─► (backend: job spec ─► run_job in the toolchain ─► simulator logits)
                 └► verification_schedule + reference_logits (onnxruntime fp32)
                                   ▼
                 npuforge.backends.gate: fidelity ─► gate (floors per precision)
                                   ▼
                                 compile record

A backend module (``npuforge.backends.<name>``) holds only its vendor steps and
declares, besides ``compile(request)``: ``NAME``, ``Options`` (a dataclass of its
target options, defaults written once), ``FLOORS`` (per precision) and
``check_target`` (its chip table). ``npuforge.backends.BACKENDS`` lists them.

Verification, identical for every backend: the binary runs on the vendor's
simulator over held-out text (``data/calibration/heldout.txt``, tokenized by the
model's own tokenizer: never calibration text), as one prefill call (when the
target compiles a prefill graph) and then decode calls carrying the recurrent
state or KV cache, and its logits are compared position by position with
``npuforge.runtime.GraphChain`` (onnxruntime, fp32) on the source exports over
the same calls. Figures: worst and mean cosine, max |Δ| / max |reference|,
top-1 agreement, NaN/Inf count, and the perplexity of the text under the binary
and under fp32 with its relative change.

No heavy imports at module level: the registry imports backends at parse time.
"""

import typing
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from npuforge import progress
from npuforge.errors import NpuforgeError

VARIANTS = ("decode", "prefill")
WEIGHTS = ("trained", "synthetic")
HELDOUT_SOURCE = "data/calibration/heldout.txt"
# Host memory per parameter of one chunk of the fp32 exports that a compile step's own
# reference run (reference_logits: onnxruntime CPU, one chunk at a time) keeps, for the
# chunk planner (npuforge.memory_plan.memory_plan). Measured by tests/test_reference_run.py's
# model: a 17 MB fp32 chunk takes 58 MB when onnxruntime loads it (3.4 x, 14 bytes per
# parameter) for the first chunk, ~4 MB more for each later one in the heap the first
# left. On Qwen2.5-0.5B's shape in 3 chunks (heaviest 255M parameters, 1.02 GB) the run
# peaks 1.84 GB above the interpreter: 7.2 bytes per parameter of that chunk.
REFERENCE_BYTES_PER_PARAM = 8.0


# --------------------------------------------------------------------------- request


@dataclass(frozen=True)
class CompileRequest:
    """Everything a compile step takes; every backend's ``compile`` reads only this."""

    exports: tuple
    target: str
    options: typing.Any
    precision: str
    out_dir: Path
    calibrations: tuple = ()
    # The same graphs before rounding at export (GPTQ), one per export: the figures are
    # measured against them, since the rounded exports' fp32 graphs are no longer the model.
    references: tuple = ()
    toolchain: Path | None = None
    heldout: Path | None = None
    # The fetched checkpoint: the onnx reference target checks its graphs against it.
    checkpoint: Path | None = None
    # RWKV state-tuned files shipped beside the binary (tpumlir).
    state_files: tuple = ()
    log_path: Path | None = None
    job_runner: typing.Callable | None = None
    # "trained" or "synthetic" (random) weights: chooses the floors (TRAINED_FLOORS).
    weights: str = "trained"
    # CPU cores the step may use (Snakemake's threads); never changes the bytes.
    threads: int = 1
    # A chunk's job (backends that compile chunk by chunk): build only this chunk's
    # graphs and keep them for the compile, which takes them back from ``chunk_builds``.
    only_chunk: int | None = None
    chunk_builds: tuple = ()

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            raise NpuforgeError(
                f"weights must be one of {', '.join(WEIGHTS)}, not {self.weights!r}"
            )
        paths = {"exports": self.exports, "calibrations": self.calibrations or ()}
        paths["references"] = self.references or ()
        paths["state_files"] = self.state_files or ()
        paths["chunk_builds"] = self.chunk_builds or ()
        for name, value in paths.items():
            object.__setattr__(self, name, tuple(Path(p) for p in value))
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.references and len(self.references) != len(self.exports):
            raise NpuforgeError(
                f"{len(self.references)} --reference-export directories for "
                f"{len(self.exports)} --export ones: give one per export"
            )


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class CommonOptions:
    """Target options every backend takes; a backend's ``Options`` adds its own."""

    # Positions of held-out text the simulator check covers (a prefill call included).
    verify_steps: int = 32
    # Floors overriding the backend's FLOORS: one number, or precision -> number.
    min_cosine: float | dict | None = None
    min_top1: float | dict | None = None
    max_perplexity_delta: float | dict | None = None


# --------------------------------------------------------------------------- exports


@dataclass(frozen=True)
class Export:
    dir: Path
    meta: dict = field(repr=False)

    @property
    def variant(self) -> str:
        return self.meta.get("variant", "decode")

    @property
    def graphs(self) -> list:
        return self.meta["graphs"]

    @property
    def tokens_per_call(self) -> int:
        return int(self.meta.get("tokens_per_call", 1))


def load_exports(export_dirs, backend: str, *, prefill: bool = True) -> dict:
    """``{variant: Export}``: exactly one decode export and, if allowed, one prefill
    export with the same number of chunks."""
    from npuforge.fileio import read_json

    if not export_dirs:
        raise NpuforgeError("give at least one --export directory (the decode export)")
    by_variant = {}
    for directory in export_dirs:
        directory = Path(directory).resolve()
        meta_path = directory / "export.json"
        if not meta_path.is_file():
            raise NpuforgeError(f"{directory} has no export.json; run the export step first")
        export = Export(directory, read_json(meta_path))
        if export.variant not in VARIANTS:
            raise NpuforgeError(f"{directory}: unknown export variant {export.variant!r}")
        if export.variant in by_variant:
            raise NpuforgeError(
                f"two {export.variant} exports given ({by_variant[export.variant].dir}, "
                f"{directory}): pass one --export per variant"
            )
        by_variant[export.variant] = export
    if "decode" not in by_variant:
        raise NpuforgeError(
            f"no decode export among --export directories; the {backend} backend compiles "
            "decode graphs"
        )
    if "prefill" in by_variant:
        if not prefill:
            raise NpuforgeError(
                f"the {backend} backend compiles one decode export: remove the prefill variant "
                "from the target's export options"
            )
        decode, pre = by_variant["decode"], by_variant["prefill"]
        if len(pre.graphs) != len(decode.graphs):
            raise NpuforgeError(
                f"prefill export has {len(pre.graphs)} chunks but decode has "
                f"{len(decode.graphs)}: export both with the same chunks"
            )
        if int(pre.meta.get("batch", 1)) != int(decode.meta.get("batch", 1)):
            raise NpuforgeError(
                "prefill and decode exports have different batch sizes; export them alike"
            )
    return {v: by_variant[v] for v in VARIANTS if v in by_variant}


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Call:
    """One graph call of the verification run: ``tokens`` positions from ``position``."""

    variant: str
    position: int
    tokens: int


def verification_schedule(exports: dict, positions: int, prefill_calls: int = 1) -> list[Call]:
    """``prefill_calls`` prefill calls (with a prefill export), then decode calls up to
    ``positions``. A second prefill call starts from the state the first one left, as a
    bundle's prompt longer than one call does.

    The run covers positions 0..positions-1 either way, so a check that fits the KV
    cache by its position count fits it here too.
    """
    positions, prefill_calls = int(positions), int(prefill_calls)
    if positions < 1:
        raise NpuforgeError("verify_steps must be at least 1")
    if prefill_calls < 1:
        raise NpuforgeError("verify_prefill_calls must be at least 1")
    calls = []
    if "prefill" in exports:
        tokens = exports["prefill"].tokens_per_call
        if positions <= tokens * prefill_calls:
            raise NpuforgeError(
                f"verify_steps {positions} leaves no decode call after {prefill_calls} "
                f"{tokens}-token prefill call(s); raise verify_steps above "
                f"{tokens * prefill_calls}"
            )
        calls += [Call("prefill", i * tokens, tokens) for i in range(prefill_calls)]
    start = calls[-1].position + calls[-1].tokens if calls else 0
    calls += [Call("decode", p, 1) for p in range(start, positions)]
    return calls


def calls_per_variant(schedule) -> dict:
    variants = [c.variant for c in schedule]
    return {v: variants.count(v) for v in VARIANTS if v in variants}


# --------------------------------------------------------------------------- held-out text


def verification_tokens(count: int, export: Export, heldout=None, calibrations=()) -> dict:
    """``count`` + 1 held-out token ids (the +1 scores the last position's prediction) and
    where they come from.

    ``heldout``: the model's held-out token file (``npuforge.heldout``), the workflow's
    source. Without it: the ids a calibration.json recorded (the model's tokenizer),
    else the held-out text tokenized for the export's family here (RWKV: the World
    tokenizer; a tokenizer-less export: UTF-8 bytes, labelled so).
    """
    from npuforge import heldout as held

    wanted = int(count) + 1
    if heldout is not None:
        record = held.read(heldout)
        if len(record["ids"]) < wanted:
            raise NpuforgeError(
                f"{heldout} holds {len(record['ids'])} held-out tokens; the verification needs "
                f"{wanted}: lower verify_steps or use a longer held-out text"
            )
        return {"ids": record["ids"][:wanted], "text": held.describe(record)}
    return held.fallback_tokens(wanted, export.meta, calibrations)


# --------------------------------------------------------------------------- reference


def reference_logits(exports: dict, schedule, ids, capture=None):
    """The fp32 exports run by onnxruntime (CPU) over ``schedule``: one row of logits per
    position, ``[positions, batch * vocab]``; the prefill calls' state and position go on
    to the decode calls, as ``GraphChain`` carries them. ``capture(variant, chunk,
    feeds)`` sees every graph's feeds, each chunk's in call order.

    Chunk by chunk (``npuforge.runtime.run_chunk_by_chunk``): the run holds one chunk of
    one variant at a time however many chunks the export has."""
    import numpy as np

    from npuforge.runtime import run_chunk_by_chunk

    ids = np.asarray(ids, dtype=np.int64)
    calls = []
    for call in schedule:
        batch = int(exports[call.variant].meta["batch"])
        row = ids[call.position : call.position + call.tokens].reshape(1, call.tokens)
        calls.append((call.variant, np.repeat(row, batch, axis=0)))
    rows = run_chunk_by_chunk(
        {variant: (export.dir, export.meta) for variant, export in exports.items()},
        calls,
        capture=capture,
        label="fp32 reference run",
    )
    progress.clear()
    return np.concatenate([np.moveaxis(row, 1, 0).reshape(row.shape[1], -1) for row in rows])


def write_call_feeds(exports: dict, schedule, ids, work_dir) -> list[dict]:
    """One ``.npz`` per call with every host-fed input of every chunk (``chunk{i}/{name}``),
    from ``npuforge.runtime.host_feeds``: the simulator sees the same tokens, embedding rows
    and family inputs (a KV cache's mask, RoPE rows, write slots) as onnxruntime. An
    export with a ``kv_prefix`` also has its starting state in the first call's file: a
    state input found in a call's feeds replaces the carried one."""
    import numpy as np

    from npuforge.onnx_io import read_embedding_bin
    from npuforge.runtime import host_feeds, initial_state

    tables = {}
    calls = []
    ids = np.asarray(ids, dtype=np.int64)
    for number, call in enumerate(schedule):
        export = exports[call.variant]
        if call.variant not in tables:
            embedding = export.meta.get("embedding")
            tables[call.variant] = (
                read_embedding_bin(export.dir / embedding["file"]) if embedding else None
            )
        call_ids = ids[call.position : call.position + call.tokens].reshape(1, call.tokens)
        call_ids = np.repeat(call_ids, int(export.meta.get("batch", 1)), axis=0)
        arrays = {}
        # The first call starts from the precomputed prefix rows, not zeros.
        prefixed = number == 0 and export.meta.get("kv_prefix")
        start = initial_state(export.dir, export.meta) if prefixed else {}
        for index, graph in enumerate(export.graphs):
            feeds = host_feeds(export.meta, graph, call_ids, call.position, tables[call.variant])
            names = [spec["name"] for spec in graph["inputs"]]
            feeds.update({name: start[name] for name in names if name in start})
            arrays.update({f"chunk{index}/{name}": value for name, value in feeds.items()})
        path = (Path(work_dir) / f"verify_call{number:04d}.npz").resolve()
        np.savez(path, **arrays)
        # Absolute: the job runs in a scratch directory of its own (or a container).
        calls.append({"variant": call.variant, "position": call.position, "feeds": str(path)})
    return calls


def reference_name() -> str:
    return (
        f"onnxruntime {metadata.version('onnxruntime')} CPU, fp32 export graphs "
        "(npuforge.runtime.GraphChain)"
    )


# --------------------------------------------------------------------------- toolchain


def read_toolchain(stamp_path, backend: str) -> dict:
    from npuforge.toolchain import read_stamp

    if not stamp_path:
        raise NpuforgeError(
            f"no toolchain given: pass --toolchain results/toolchains/{backend}-<runtime>.json"
        )
    return read_stamp(stamp_path)


def version(stamp: dict, package: str) -> str:
    """A toolchain package's version as its stamp recorded it."""
    return stamp.get("versions", {}).get(package, "?")


def toolchain_record(stamp: dict, extra_versions=None) -> dict:
    """The runtime that built a binary, named by what it is built from: the content hash
    of envs/<backend>/ (lock, Containerfile, versions.py) and, in a container, the image
    tagged with it and the digest of its Debian package list; never an image ID, which a
    rebuild of the same inputs changes."""
    record = {
        "runtime": stamp.get("runtime"),
        "definition": stamp.get("env_hash"),
        "versions": {**stamp.get("versions", {}), **(extra_versions or {})},
    }
    if stamp.get("image"):
        record["image"] = stamp["image"]
    for key in ("debian_packages", "image_inputs"):
        if stamp.get(key):
            record[key] = stamp[key]
    return record


def run_job(request: CompileRequest, job_script, spec_path, *, read_only, writable, env=None):
    """The job in the request's toolchain (or the request's own runner, for tests)."""
    if request.job_runner is not None:
        runner = request.job_runner
        return runner(request.toolchain, spec_path, read_only, writable, request.log_path)
    from npuforge import toolchain

    return toolchain.run_job(
        request.toolchain,
        job_script,
        spec_path,
        read_only=read_only,
        writable=writable,
        env=env,
        log_path=request.log_path,
    )


def calibration_summary(directory, hosts=False) -> dict:
    """Which samples quantized a graph: counts and the sha256 of calibration.json.

    ``hosts``: for a toolkit that keeps the ranges it measures (its bytes follow the
    samples' last bits), the instruction sets the samples and the ranges were computed on.
    """
    from npuforge.calibration import HOST_RECORD, read_calibration
    from npuforge.fileio import read_json, sha256_file
    from npuforge.host_cpu import instruction_set

    record = read_calibration(directory)
    host_file = Path(directory) / HOST_RECORD
    return {
        "samples": record.get("samples"),
        "steps": record.get("steps"),
        "seed": record.get("seed"),
        "zero_state": bool(record.get("zero_state", False)),
        "tokens_per_call": record.get("tokens_per_call", 1),
        "sha256": sha256_file(Path(directory) / "calibration.json"),
        **(
            {
                "hosts": {
                    # None: samples made before npuforge recorded their host.
                    "samples": read_json(host_file) if host_file.is_file() else None,
                    "ranges": instruction_set(),
                }
            }
            if hosts
            else {}
        ),
    }
