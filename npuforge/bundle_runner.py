"""run.py of a release bundle: generate text with the bundle's own binaries.

Shipped as ``run.py`` in every release bundle (``npuforge.release``), so it imports
nothing from npuforge: the standard library and numpy at module level, the runtime
of the bundle's backend only when it is used. One file by design, however long: a
bundle's user runs it with no package beside it, so it is not split into modules.
Everything it needs comes from the bundle: ``manifest.json`` (the family, the
export's graph I/O with the role of every input, the compiled artifacts, the
toolchain versions), the tokenizer file and ``embedding.bin``.

    python run.py --prompt "The quick brown fox" --max-new-tokens 32
    python run.py --prompt "..." --temperature 0.8 --top-p 0.9 --seed 1 --report out.json

It prints the continuation, then one line of JSON: tokens, tokens/s, time to first
token. One code path drives every family (``Chain``: chunks chained by their
``hidden`` outputs, ``state`` outputs fed back, ``tokens``/``embedding`` and the
llama ``mask``/``rope_*``/``cache_*`` inputs computed here from the call's position,
the prefill -> decode hand-off); a thin adapter per runtime opens one graph:

    onnx    onnxruntime, CPU                       the reference bundles
    qnn     onnxruntime + onnxruntime-qnn's QNN EP the EPContext models (chunk{i}_ctx.onnx);
                                                   on x86 Linux the HTP simulator
    rknn    rknnlite (rknn-toolkit-lite2)          aarch64 boards only
    tpumlir TPU-MLIR's runtime                     not driven by this runner yet

Before any graph is loaded the runner compares the toolchain versions the manifest
records with the runtime it finds and stops with one line naming both when they do
not fit. Bad input: one line on stderr, exit status 2.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import re
import struct
import sys
import time
from pathlib import Path

import numpy as np

RUNNER_FORMAT = 1
MANIFEST = "manifest.json"
# RWKV World: id 0 ends a document (BlinkDL's pipelines stop on it).
WORLD_END_OF_TEXT = 0
QAIRT_PATTERN = re.compile(rb"v(\d+\.\d+\.\d+)\.(\d{6,})")


class RunnerError(Exception):
    """A one-line problem with the bundle, the input or the runtime."""


# --------------------------------------------------------------------------- versions


def version_tuple(text):
    """(major, minor, patch) of a version string; missing parts are 0."""
    numbers = [int(n) for n in re.findall(r"\d+", str(text or ""))[:3]]
    if not numbers:
        raise RunnerError(f"cannot read a version from {text!r}")
    return tuple(numbers + [0] * (3 - len(numbers)))


def check_version(what, built, found, rule):
    """None when ``found`` can run what ``built`` produced under ``rule``, else one line.

    rules: ``at_least`` (same major, found >= built major.minor: runtimes read what older
    compilers wrote, not what newer ones write), ``same_minor`` (equal major.minor).
    """
    b, f = version_tuple(built), version_tuple(found)
    if rule == "at_least":
        ok = f[0] == b[0] and f[:2] >= b[:2]
        need = f"{b[0]}.{b[1]} or a newer {b[0]}.x"
    elif rule == "same_minor":
        ok = f[:2] == b[:2]
        need = f"{b[0]}.{b[1]}.x"
    else:
        raise RunnerError(f"unknown version rule {rule!r}")
    if ok:
        return None
    return (
        f"version drift: this bundle was built with {what} {built}, the runtime here has "
        f"{what} {found}; use {what} {need}"
    )


# --------------------------------------------------------------------------- bundle


class Bundle:
    """The manifest and files of one unpacked release bundle."""

    def __init__(self, directory):
        self.dir = Path(directory).resolve()
        path = self.dir / MANIFEST
        if not path.is_file():
            raise RunnerError(f"{self.dir} has no {MANIFEST}: point --bundle at a release bundle")
        try:
            self.manifest = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise RunnerError(f"{path} is not JSON ({err}); unpack the bundle again") from None
        if self.manifest.get("format") != 1:
            raise RunnerError(f"{path}: manifest format {self.manifest.get('format')!r} unknown")
        self.model = self.manifest["model"]
        self.target = self.manifest["target"]
        self.backend = self.target["backend"]
        self.precision = self.manifest["precision"]
        self.compile = self.manifest.get("compile") or {}
        self.exports = {}
        for entry in self.manifest["inputs"]["exports"]:
            meta = entry["export"]
            self.exports[meta.get("variant", "decode")] = meta
        if "decode" not in self.exports:
            raise RunnerError(f"{path} lists no decode export; rebuild the bundle")

    @property
    def family(self):
        return self.exports["decode"]["family"]

    def check_files(self):
        """Every file the manifest lists against its sha256 (a damaged copy stops here)."""
        for name, digest in sorted(self.manifest.get("files", {}).items()):
            path = self.dir / name
            if not path.is_file():
                raise RunnerError(f"{path} is listed in the manifest but missing")
            sha = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    sha.update(block)
            if sha.hexdigest() != digest:
                raise RunnerError(f"{path} does not match its sha256 in the manifest: re-copy it")

    def graph_file(self, variant, chunk):
        """The file a runtime opens for chunk ``chunk`` of the ``variant`` graphs."""
        artifacts = self.compile.get("artifacts", [])
        if self.backend == "onnx":
            name = self.exports[variant]["graphs"][chunk]["file"]
        elif self.backend == "qnn":
            found = [
                a["file"]
                for a in artifacts
                if a.get("role") == "ep_context"
                and a.get("chunk") == chunk
                and a.get("variant", "decode") == variant
            ]
            if not found:
                raise RunnerError(f"the manifest lists no EPContext model for chunk {chunk}")
            name = found[0]
        elif self.backend == "rknn":
            found = [
                a["file"]
                for a in artifacts
                if a.get("role") == "binary" and a.get("chunk") == chunk
            ]
            if not found:
                raise RunnerError(f"the manifest lists no .rknn file for chunk {chunk}")
            name = found[0]
        else:
            raise RunnerError(f"no graph files for backend {self.backend!r}")
        return self.dir / name

    def embedding(self, variant="decode"):
        entry = self.exports[variant].get("embedding")
        return read_embedding_bin(self.dir / entry["file"]) if entry else None

    def start_state(self, variant="decode"):
        """A llama export's kv_prefix rows by cache name (``kv_prefix.bin``), or {}."""
        prefix = self.exports[variant].get("kv_prefix")
        if not prefix:
            return {}
        rows = np.fromfile(self.dir / prefix["file"], dtype="<f4")
        return {"tokens": list(prefix["tokens"]), "rows": rows, **prefix}


def read_embedding_bin(path):
    """embedding.bin (docs/interfaces.md): 32-byte header, then rows x cols, memory-mapped."""
    header = struct.Struct("<8sIIQQ")
    with open(path, "rb") as handle:
        raw = handle.read(header.size)
    if len(raw) < header.size:
        raise RunnerError(f"{path}: too short for an embedding.bin")
    magic, version, code, rows, cols = header.unpack(raw)
    dtypes = {1: "<f4", 2: "<f2"}
    if magic != b"NPFEMB\0\0" or version != 1 or code not in dtypes:
        raise RunnerError(f"{path}: not an embedding.bin (v1) file")
    dtype = np.dtype(dtypes[code])
    if os.path.getsize(path) != header.size + rows * cols * dtype.itemsize:
        raise RunnerError(f"{path}: size does not match its header (truncated)")
    return np.memmap(path, dtype=dtype, mode="r", offset=header.size, shape=(rows, cols))


# --------------------------------------------------------------------------- tokenizers


class WorldTokenizer:
    """tokenizer.bin (npuforge.tokenizer's layout): greedy longest match over bytes."""

    def __init__(self, path):
        data = Path(path).read_bytes()
        header = struct.Struct("<8sIIII")
        if len(data) < header.size:
            raise RunnerError(f"{path}: not a tokenizer file")
        magic, version, n_ids, blob_size, _ = header.unpack_from(data)
        table_end = header.size + 4 * (n_ids + 1)
        if magic != b"NPFTOK\0\0" or version != 1 or len(data) != table_end + blob_size:
            raise RunnerError(f"{path}: not a v1 tokenizer file, or truncated")
        offsets = struct.unpack_from(f"<{n_ids + 1}I", data, header.size)
        blob = data[table_end:]
        self.id_to_bytes = {
            i: blob[offsets[i] : offsets[i + 1]]
            for i in range(n_ids)
            if offsets[i + 1] > offsets[i]
        }
        self.bytes_to_id = {v: k for k, v in self.id_to_bytes.items()}
        self.lengths = sorted({len(v) for v in self.bytes_to_id}, reverse=True)
        self.kind = "rwkv-world"
        self.stop_ids = [WORLD_END_OF_TEXT]

    def encode(self, text):
        data, ids, position = text.encode("utf-8"), [], 0
        while position < len(data):
            for length in self.lengths:
                token = self.bytes_to_id.get(data[position : position + length])
                if token is not None:
                    ids.append(token)
                    position += length
                    break
            else:
                raise RunnerError(f"byte {data[position]} has no token in {self.kind}")
        return ids

    def decode_bytes(self, ids):
        return b"".join(self.id_to_bytes.get(int(i), b"") for i in ids)


class HfTokenizer:
    """A Hugging Face tokenizer.json through the ``tokenizers`` package (imported here)."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RunnerError(
                "this bundle's tokenizer.json needs the 'tokenizers' package: pip install "
                "tokenizers (or pass --prompt-ids)"
            ) from None
        self._tokenizer = Tokenizer.from_file(str(path))
        self.kind = "hf"
        # End-of-sequence ids are not in tokenizer.json; give them with --stop-token.
        self.stop_ids = []

    def encode(self, text):
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, ids):
        return self._tokenizer.decode([int(i) for i in ids]).encode("utf-8")


class IdsOnly:
    """--prompt-ids where the bundle's tokenizer cannot load: ids in, ids out, no text."""

    kind = "none loaded (ids only)"
    stop_ids = []

    def decode_bytes(self, ids):
        return b""


class ByteTokenizer:
    """No tokenizer in the bundle (tokenizer: none): UTF-8 bytes folded into the
    vocabulary, as npuforge's calibration and verification runs tokenize for such models."""

    def __init__(self, vocab):
        self.vocab = int(vocab)
        self.kind = "bytes"
        self.stop_ids = []

    def encode(self, text):
        return [b % self.vocab for b in text.encode("utf-8")]

    def decode_bytes(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256)


def load_tokenizer(bundle):
    entry = bundle.manifest["inputs"].get("tokenizer") or {}
    name = entry.get("file")
    if not name:
        return ByteTokenizer(bundle.exports["decode"]["vocab_size"])
    path = bundle.dir / name
    if name.endswith(".json"):
        return HfTokenizer(path)
    return WorldTokenizer(path)


# --------------------------------------------------------------------------- family inputs


def rope_inv_freq(config):
    """RoPE inverse frequencies (float64), llama3 scaling when the config has it."""
    dim, theta = int(config["head_dim"]), float(config["rope_theta"])
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = config.get("rope_scaling")
    if not scaling:
        return inv_freq
    original = scaling["original_max_position_embeddings"]
    low_wavelen = original / scaling["low_freq_factor"]
    high_wavelen = original / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling["factor"], inv_freq)
    smooth = (original / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    blended = (1 - smooth) * scaled / scaling["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def llama_inputs(meta, position):
    """The llama graphs' host inputs of a call whose first token is at ``position``, by role
    (docs/interfaces.md): additive mask, RoPE rows (HF layout), one-hot cache slots."""
    tokens, cache_len, batch = meta["tokens_per_call"], meta["cache_len"], meta["batch"]
    # Positions count the prompt's tokens; a kv_prefix sits in the slots before them.
    position += len(meta.get("kv_prefix", {}).get("tokens", ()))
    if position + tokens > cache_len:
        raise RunnerError(f"position {position} + {tokens} is past the {cache_len}-slot cache")
    mask_value = meta.get("options", {}).get("mask_value", -64.0)
    positions = position + np.arange(tokens)
    slots = np.arange(cache_len)
    inv_freq = rope_inv_freq(meta["config"]).astype(np.float32)
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    write = (slots[:, None] == positions[None, :]).astype(np.float64)
    values = {
        "mask": np.where(slots[None, :] <= positions[:, None], 0.0, mask_value),
        "rope_cos": np.cos(angles).astype(np.float32),
        "rope_sin": np.sin(angles).astype(np.float32),
        "cache_write": write,
        "cache_keep": 1.0 - write.sum(-1, keepdims=True),
    }
    return {role: np.broadcast_to(v, (batch, 1, *v.shape)) for role, v in values.items()}


def context_limit(meta):
    """Positions the graphs can hold: the llama KV cache (less its kv_prefix slots); RWKV
    state has no limit."""
    if meta.get("family") != "llama":
        return None
    return int(meta["cache_len"]) - len(meta.get("kv_prefix", {}).get("tokens", ()))


def host_feeds(meta, graph, tokens, position, embedding):
    """Inputs of one graph call that come from the host: tokens, embedding rows, and the
    family's position inputs (every role but ``state`` and ``hidden``)."""
    feeds, family_values = {}, None
    for spec in graph["inputs"]:
        role, name, dtype = spec["role"], spec["name"], spec["dtype"]
        if role in ("state", "hidden"):
            continue
        if role == "tokens":
            feeds[name] = tokens.astype(np.int64)
        elif role == "embedding":
            if embedding is None:
                raise RunnerError(f"input {name} takes embedding rows; the bundle has none")
            feeds[name] = np.asarray(embedding[tokens], dtype=dtype)
        elif meta["family"] == "llama":
            if family_values is None:
                family_values = llama_inputs(meta, position)
            if role not in family_values:
                raise RunnerError(f"llama graphs have no input role {role!r} ({name})")
            feeds[name] = np.ascontiguousarray(family_values[role], dtype=dtype)
        else:
            raise RunnerError(f"{meta['family']} graphs take no input of role {role!r} ({name})")
    return feeds


# --------------------------------------------------------------------------- the chain


class Chain:
    """One variant's chunks: hidden outputs feed the next chunk, state outputs feed the
    next call, logits come out of the last chunk."""

    def __init__(self, meta, sessions, embedding, prefix=None):
        self.meta, self.sessions, self.embedding = meta, sessions, embedding
        self.prefix = prefix or {}
        self.batch = int(meta.get("batch", 1))
        self.tokens_per_call = int(meta.get("tokens_per_call", 1))
        self.reset()

    def reset(self):
        """Every recurrent state (or KV cache) to its start: zeros, with the kv_prefix
        rows (``kv_prefix.bin``: per cache, slots 0..P-1) in place."""
        self.state = {
            spec["name"]: np.zeros(spec["shape"], dtype=spec["dtype"])
            for graph in self.meta["graphs"]
            for spec in graph["inputs"]
            if spec["role"] == "state"
        }
        offset, slots = 0, int(self.prefix.get("slots", 0))
        for name in self.prefix.get("tensors", ()):
            if name not in self.state:
                raise RunnerError(f"kv_prefix names {name!r}, which no graph takes; rebuild")
            batch, heads, _, width = self.state[name].shape
            size = batch * heads * slots * width
            block = self.prefix["rows"][offset : offset + size]
            self.state[name][:, :, :slots, :] = block.reshape(batch, heads, slots, width)
            offset += size

    def take_state(self, other):
        """The prefill -> decode hand-off: the same state names, cast to this chain's dtype."""
        self.state = {k: np.asarray(other.state[k], dtype=v.dtype) for k, v in self.state.items()}

    def step(self, ids, position):
        """One call of ``tokens_per_call`` ids at ``position``; logits ``[T, V]`` (row 0 of
        the batch)."""
        tokens = np.repeat(np.asarray(ids, dtype=np.int64).reshape(1, -1), self.batch, axis=0)
        carried, logits = {}, None
        for graph, session in zip(self.meta["graphs"], self.sessions, strict=True):
            feeds = host_feeds(self.meta, graph, tokens, position, self.embedding)
            for spec in graph["inputs"]:
                if spec["role"] == "hidden":
                    feeds[spec["name"]] = carried[spec["name"][: -len("_in")] + "_out"]
                elif spec["role"] == "state":
                    feeds[spec["name"]] = self.state[spec["name"]]
            names = [o["name"] for o in graph["outputs"]]
            results = dict(zip(names, session.run(names, feeds), strict=True))
            for spec in graph["inputs"]:
                if spec["role"] == "state":
                    self.state[spec["name"]] = results[spec["output"]]
            for spec in graph["outputs"]:
                if spec["role"] == "hidden":
                    carried[spec["name"]] = results[spec["name"]]
                elif spec["role"] == "logits":
                    logits = results[spec["name"]]
        logits = np.asarray(logits, dtype=np.float32)[0]
        return logits.reshape(-1, logits.shape[-1])


# --------------------------------------------------------------------------- runtimes


def _site_version(package):
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


class OnnxRuntime:
    """onnxruntime on the CPU: the onnx reference bundles."""

    name = "onnxruntime"

    def __init__(self, bundle, threads):
        try:
            import onnxruntime
        except ImportError:
            raise RunnerError(
                "this onnx bundle needs onnxruntime: pip install onnxruntime"
            ) from None
        self.ort, self.threads = onnxruntime, threads
        self.version = onnxruntime.__version__
        built = (bundle.compile.get("toolchain") or {}).get("versions", {}).get("onnxruntime")
        self.versions = {"built": {"onnxruntime": built}, "found": {"onnxruntime": self.version}}
        if built:
            problem = check_version("onnxruntime", built, self.version, "at_least")
            if problem:
                raise RunnerError(problem)
        self.label = f"onnxruntime {self.version} CPU"

    def session(self, path):
        options = self.ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.log_severity_level = 3
        return self.ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def qairt_version_of(library):
    """The QAIRT build a QNN library names inside (e.g. '2.51.0.260929181845')."""
    import mmap

    with open(library, "rb") as handle:
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            match = QAIRT_PATTERN.search(mapped)
            # Read the groups while the mapping is open: the match refers to it.
            return f"{match.group(1).decode()}.{match.group(2).decode()}" if match else None


class QnnRuntime:
    """onnxruntime with onnxruntime-qnn's QNN execution provider loading the bundle's
    EPContext models; on x86_64 Linux its HTP backend is the x86 simulator."""

    name = "onnxruntime-qnn"
    EP_NAME = "QNNExecutionProvider"

    def __init__(self, bundle, threads):
        try:
            import onnxruntime
            import onnxruntime_qnn
        except ImportError:
            raise RunnerError(
                "this QNN bundle needs onnxruntime-qnn (its QNN execution provider and QAIRT "
                "libraries): pip install onnxruntime-qnn"
            ) from None
        built_qairt = (bundle.compile.get("qairt") or {}).get("version")
        htp = onnxruntime_qnn.get_qnn_htp_path()
        found_qairt = qairt_version_of(htp)
        self.versions = {
            "built": {
                "qairt": built_qairt,
                "onnxruntime-qnn": (bundle.compile.get("toolchain") or {})
                .get("versions", {})
                .get("onnxruntime-qnn"),
            },
            "found": {"qairt": found_qairt, "onnxruntime-qnn": _site_version("onnxruntime-qnn")},
        }
        if built_qairt:
            if not found_qairt:
                raise RunnerError(
                    f"cannot read the QAIRT version of {htp}; reinstall onnxruntime-qnn"
                )
            # Context binaries are not forward compatible (a newer QAIRT reads older ones).
            problem = check_version("QAIRT", built_qairt, found_qairt, "at_least")
            if problem:
                raise RunnerError(problem)
        try:
            onnxruntime.register_execution_provider_library(
                self.EP_NAME, onnxruntime_qnn.get_library_path()
            )
        except Exception as err:  # registering twice in one process is harmless
            if "already registered" not in str(err).lower():
                raise
        self.devices = [d for d in onnxruntime.get_ep_devices() if d.ep_name == self.EP_NAME]
        if not self.devices:
            raise RunnerError("the QNN execution provider exposes no device")
        options = dict((bundle.compile.get("options") or {}).get("provider_options") or {})
        options["backend_path"] = htp
        self.ort, self.options = onnxruntime, options
        simulated = platform.machine() in ("x86_64", "AMD64")
        where = "x86 HTP simulator" if simulated else "HTP"
        self.label = f"onnxruntime-qnn {self.versions['found']['onnxruntime-qnn']} ({where})"
        self.simulated = simulated

    def session(self, path):
        options = self.ort.SessionOptions()
        options.log_severity_level = 3
        # A graph the HTP does not run must fail, not run on the CPU unseen.
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        options.add_provider_for_devices(self.devices, self.options)
        return self.ort.InferenceSession(str(path), options)


class RknnLiteSession:
    """One .rknn through rknnlite: inputs in graph order, outputs in graph order."""

    def __init__(self, api, path, graph):
        self.rknn, self.graph = api(), graph
        if self.rknn.load_rknn(str(path)) != 0 or self.rknn.init_runtime() != 0:
            raise RunnerError(f"rknnlite could not load {path}")

    def run(self, names, feeds):
        outputs = self.rknn.inference(inputs=[feeds[s["name"]] for s in self.graph["inputs"]])
        by_name = dict(zip([o["name"] for o in self.graph["outputs"]], outputs, strict=True))
        return [by_name[n] for n in names]


class RknnLiteRuntime:
    """rknnlite from rknn-toolkit-lite2: RK3588/RK3576 boards (aarch64 Linux) only."""

    name = "rknnlite"

    def __init__(self, bundle, threads):
        machine = platform.machine()
        if machine not in ("aarch64", "arm64"):
            raise RunnerError(
                f"this RKNN bundle runs on a Rockchip board (aarch64 Linux) with "
                f"rknn-toolkit-lite2 installed; this host is {platform.system()} {machine}"
            )
        try:
            from rknnlite.api import RKNNLite
        except ImportError:
            raise RunnerError(
                "this RKNN bundle needs rknn-toolkit-lite2 (rknnlite) and the board's librknnrt"
            ) from None
        built = (bundle.compile.get("toolchain") or {}).get("versions", {}).get("rknn-toolkit2")
        found = _site_version("rknn-toolkit-lite2")
        self.versions = {"built": {"rknn-toolkit2": built}, "found": {"rknn-toolkit-lite2": found}}
        if built and found:
            # librknnrt refuses models of a newer toolkit ("model version too old" errors).
            problem = check_version("rknn toolkit", built, found, "at_least")
            if problem:
                raise RunnerError(problem)
        self.api, self.label = RKNNLite, f"rknnlite {found}"
        self.graphs = {}

    def session(self, path):
        return RknnLiteSession(self.api, path, self.graphs[Path(path).name])


class TpuMlirRuntime:
    name = "tpu-mlir"

    def __init__(self, bundle, threads):
        raise RunnerError(
            "this runner does not drive TPU-MLIR bmodels yet: run the combined bmodel with "
            f"TPU-MLIR's runtime (built with tpu_mlir "
            f"{(bundle.compile.get('toolchain') or {}).get('versions', {}).get('tpu_mlir', '?')})"
        )


RUNTIMES = {
    "onnx": OnnxRuntime,
    "qnn": QnnRuntime,
    "rknn": RknnLiteRuntime,
    "tpumlir": TpuMlirRuntime,
}


# --------------------------------------------------------------------------- generation


def sample(logits, temperature, top_p, rng):
    """Greedy at temperature 0; otherwise temperature then nucleus (top-p) sampling."""
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)
        chosen = order[:keep]
        kept = probs[chosen] / probs[chosen].sum()
        return int(chosen[rng.choice(len(chosen), p=kept)])
    return int(rng.choice(len(probs), p=probs))


class Generator:
    def __init__(self, bundle, runtime):
        self.bundle, self.runtime = bundle, runtime
        self.chains = {}
        for variant, meta in bundle.exports.items():
            if isinstance(runtime, RknnLiteRuntime):
                for i, graph in enumerate(meta["graphs"]):
                    runtime.graphs[bundle.graph_file(variant, i).name] = graph
            sessions = [
                runtime.session(bundle.graph_file(variant, i)) for i in range(len(meta["graphs"]))
            ]
            self.chains[variant] = Chain(
                meta, sessions, bundle.embedding(variant), bundle.start_state(variant)
            )
        self.limit = context_limit(bundle.exports["decode"])

    def prompt(self, ids):
        """Run the prompt; return the logits of its last token and the next position.

        Whole prefill calls while at least T tokens remain, then decode calls."""
        decode, prefill = self.chains["decode"], self.chains.get("prefill")
        for chain in self.chains.values():
            chain.reset()
        position, logits, calls = 0, None, {"prefill": 0, "decode": 0}
        if prefill is not None:
            t = prefill.tokens_per_call
            while len(ids) - position >= t:
                logits = prefill.step(ids[position : position + t], position)
                position += t
                calls["prefill"] += 1
            if position:
                decode.take_state(prefill)
        while position < len(ids):
            logits = decode.step(ids[position : position + 1], position)
            position += 1
            calls["decode"] += 1
        return logits[-1], position, calls

    def generate(self, ids, max_new_tokens, temperature, top_p, seed, stop_ids):
        if not ids:
            raise RunnerError("the prompt encodes to no tokens: give a non-empty --prompt")
        if self.limit is not None and len(ids) >= self.limit:
            raise RunnerError(
                f"the prompt has {len(ids)} tokens; the graphs hold {self.limit} positions"
            )
        rng = np.random.default_rng(seed)
        started = time.perf_counter()
        logits, position, calls = self.prompt(ids)
        out, stopped, first_at = [], "max_new_tokens", None
        while len(out) < max_new_tokens:
            token = sample(logits, temperature, top_p, rng)
            if first_at is None:
                first_at = time.perf_counter()
            out.append(token)
            if token in stop_ids:
                stopped = "stop_token"
                break
            if len(out) == max_new_tokens:
                break
            if self.limit is not None and position >= self.limit:
                stopped = "context_full"
                break
            logits = self.chains["decode"].step([token], position)[-1]
            position += 1
        ended = time.perf_counter()
        first_at = first_at or ended
        decode_seconds = ended - first_at
        return {
            "tokens": out,
            "stopped": stopped,
            "prompt_calls": calls,
            "time_to_first_token_s": round(first_at - started, 6),
            "decode_seconds": round(decode_seconds, 6),
            # Tokens after the first, over the time after it: the decode rate.
            "tokens_per_s": round((len(out) - 1) / decode_seconds, 3)
            if len(out) > 1 and decode_seconds > 0
            else None,
            "prompt_tokens_per_s": round(len(ids) / (first_at - started), 3)
            if first_at > started
            else None,
        }


# --------------------------------------------------------------------------- main


def peak_rss_mb():
    """The process's peak resident memory (MB), where the platform reports it."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux and Android report kilobytes, macOS bytes.
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="run.py", description="Generate text with this npuforge release bundle."
    )
    parser.add_argument("--prompt", help="prompt text (encoded with the bundle's tokenizer)")
    parser.add_argument("--prompt-ids", help="prompt as comma-separated token ids instead")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--stop-token", type=int, action="append", default=None,
        help="token id that ends generation (repeatable; default: the tokenizer's own, "
        "RWKV World 0)",
    )  # fmt: skip
    parser.add_argument("--no-default-stop", action="store_true", help="drop the default stops")
    parser.add_argument("--bundle", default=None, help="bundle directory (default: run.py's)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (onnx bundles)")
    parser.add_argument("--report", help="also write the JSON report to this file")
    parser.add_argument("--no-check", action="store_true", help="skip the files' sha256 check")
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.prompt_ids is None):
        parser.error("give exactly one of --prompt and --prompt-ids")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


def run(args):
    bundle = Bundle(args.bundle or Path(__file__).resolve().parent)
    runtime_class = RUNTIMES.get(bundle.backend)
    if runtime_class is None:
        raise RunnerError(f"backend {bundle.backend!r} has no runtime adapter in this runner")
    # Versions and the device first: a wrong runtime stops before anything loads.
    runtime = runtime_class(bundle, args.threads)
    if not args.no_check:
        bundle.check_files()
    try:
        tokenizer = load_tokenizer(bundle)
    except RunnerError:
        if args.prompt_ids is None:
            raise
        tokenizer = IdsOnly()  # e.g. a toolchain env without the tokenizers package
    vocab = int(bundle.exports["decode"]["vocab_size"])
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise RunnerError("--prompt-ids takes comma-separated integers") from None
    else:
        ids = tokenizer.encode(args.prompt)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RunnerError(f"token id {bad[0]} is outside the vocabulary of {vocab}")
    stops = [] if args.no_default_stop else list(tokenizer.stop_ids)
    stops += args.stop_token or []
    loading = time.perf_counter()
    generator = Generator(bundle, runtime)
    load_seconds = time.perf_counter() - loading
    result = generator.generate(
        ids, args.max_new_tokens, args.temperature, args.top_p, args.seed, set(stops)
    )
    shown = [t for t in result["tokens"] if t not in stops]
    text = tokenizer.decode_bytes(shown).decode("utf-8", errors="replace")
    report = {
        "runner_format": RUNNER_FORMAT,
        "model": bundle.model.get("id"),
        "target": bundle.target.get("id"),
        "backend": bundle.backend,
        "precision": bundle.precision,
        "runtime": runtime.label,
        "simulator": bool(getattr(runtime, "simulated", False)),
        "versions": runtime.versions,
        "tokenizer": tokenizer.kind,
        "prompt_ids": ids,
        "sampling": {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
            "stop_tokens": sorted(set(stops)),
        },
        "load_seconds": round(load_seconds, 6),
        **result,
        "peak_rss_mb": peak_rss_mb(),
        "text": text,
    }
    return report


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = run(args)
    except RunnerError as err:
        print(f"run.py: error: {err}", file=sys.stderr)
        return 2
    line = json.dumps(report, sort_keys=True)
    if args.report:
        Path(args.report).write_text(line + "\n", encoding="utf-8")
    print(report["text"])
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
