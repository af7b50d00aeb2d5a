"""Export a checkpoint to chunked ONNX graphs plus ``export.json`` (docs/interfaces.md).

How an RWKV export works, and why it is cheap in memory:

1. Each chunk's torch module (``npuforge.models.rwkv.build_chunk``) is built with
   *uninitialised* parameters (``torch.empty``: no pages touched) and traced once
   by the TorchScript exporter with ``export_params=False``, so the graph comes
   out with every weight as a named graph input and no weight data at all.
2. Those inputs become initializers whose values are computed from the
   checkpoint one tensor at a time (``rwkv.prepared_tensor``: transpose, folds,
   cast) and streamed straight into the output file: into ``chunkN.onnx.data``
   (external data, 64-byte aligned) when the graph would pass the 2 GB protobuf
   limit or ``external_data=True``, otherwise into the ``.onnx`` file itself
   (protobuf fields written in sequence; the reader does not care about order).
   At no point is a second copy of the model in memory.

The result is byte-deterministic: same checkpoint + options -> same sha256.

``embedding.bin`` (``--ext-embedding``): little-endian; a 32-byte header — magic
``b"NPFEMB\\0\\0"``, uint32 format version (1), uint32 dtype code (1 = float32,
2 = float16), uint64 rows, uint64 cols — then the row-major table. Rows are
token ids; the table already has ln0 applied, so a row is exactly what the
first graph's ``embedding`` input expects.
"""

import io
import struct
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file, write_json

EMBEDDING_MAGIC = b"NPFEMB\0\0"
EMBEDDING_HEADER = struct.Struct("<8sIIQQ")
EMBEDDING_DTYPES = {1: "float32", 2: "float16"}
OPSET = 17
PROTOBUF_LIMIT = 2**31 - 2**24  # stay clear of protobuf's 2 GiB message limit
DATA_ALIGN = 64

# Standard ops an NPU compiler is expected to take; a test checks every graph.
ALLOWED_OPS = frozenset(
    "Add Sub Mul Div MatMul Sigmoid Tanh Exp Relu Pow Sqrt Reciprocal Neg Clip Max Min "
    "ReduceMean ReduceSum LayerNormalization Reshape Transpose Concat Slice Gather "
    "Squeeze Unsqueeze Constant Cast Shape Expand Identity".split()
)


def write_embedding_bin(path, table) -> None:
    """Write a [rows, cols] float32/float16 numpy table in the embedding.bin layout."""
    import numpy as np

    table = np.ascontiguousarray(table)
    codes = {v: k for k, v in EMBEDDING_DTYPES.items()}
    if table.ndim != 2 or table.dtype.name not in codes:
        raise NpuforgeError("embedding table must be a 2-D float32/float16 array; this is a bug")
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        handle.write(
            EMBEDDING_HEADER.pack(EMBEDDING_MAGIC, 1, codes[table.dtype.name], *table.shape)
        )
        little = np.ascontiguousarray(table.astype(table.dtype.newbyteorder("<"), copy=False))
        handle.write(memoryview(little).cast("B"))


def read_embedding_bin(path, mmap: bool = True):
    """The table of an embedding.bin file as a numpy array (memory-mapped by default)."""
    import numpy as np

    path = Path(path)
    with open(path, "rb") as handle:
        header = handle.read(EMBEDDING_HEADER.size)
    if len(header) < EMBEDDING_HEADER.size:
        raise NpuforgeError(f"{path}: too short for an embedding.bin header; re-run the export")
    magic, version, code, rows, cols = EMBEDDING_HEADER.unpack(header)
    if magic != EMBEDDING_MAGIC or version != 1 or code not in EMBEDDING_DTYPES:
        raise NpuforgeError(f"{path}: not an embedding.bin (v1) file; re-run the export")
    dtype = np.dtype(EMBEDDING_DTYPES[code]).newbyteorder("<")
    expected = EMBEDDING_HEADER.size + rows * cols * dtype.itemsize
    if path.stat().st_size != expected:
        raise NpuforgeError(
            f"{path}: size does not match its header (truncated); re-run the export"
        )
    if mmap:
        return np.memmap(
            path, dtype=dtype, mode="r", offset=EMBEDDING_HEADER.size, shape=(rows, cols)
        )
    return np.fromfile(path, dtype=dtype, offset=EMBEDDING_HEADER.size).reshape(rows, cols)


# ------------------------------------------------------------------------------------------
# Protobuf streaming helpers.


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload_len: int) -> bytes:
    """Tag and length prefix of a length-delimited protobuf field."""
    return _varint((number << 3) | 2) + _varint(payload_len)


GRAPH_FIELD = 7  # ModelProto.graph
INITIALIZER_FIELD = 5  # GraphProto.initializer
RAW_DATA_FIELD = 9  # TensorProto.raw_data


class HashingWriter:
    """A file writer that hashes what it writes and does the writing on a thread.

    Producing the next tensor (conversion, transposition) overlaps with writing the
    previous one; the queue is short, so at most a few blocks are in flight.
    """

    def __init__(self, path, depth: int = 3):
        import hashlib
        import queue
        import threading

        self.path = Path(path)
        self.digest = hashlib.sha256()
        self.handle = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self.queue = queue.Queue(maxsize=depth)
        self.error = None
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self):
        while (item := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.digest.update(item)
                    self.handle.write(item)
                except BaseException as err:  # reported by close()
                    self.error = err

    def write(self, data) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(data)

    def close(self) -> str:
        """Flush, close and return the sha256 of everything written."""
        self.queue.put(None)
        self.thread.join()
        self.handle.close()
        if self.error is not None:
            raise self.error
        return self.digest.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.sha256 = self.close()
        else:
            self.queue.put(None)
            self.thread.join()
            self.handle.close()


def _tensor_header(name, dims, data_type):
    import onnx

    tensor = onnx.TensorProto()
    tensor.name = name
    tensor.data_type = data_type
    tensor.dims.extend(dims)
    return tensor


def _split_params(model, param_names):
    """Drop the parameter inputs the tracer left on the graph; return their dims/types."""
    by_name = {inp.name: inp for inp in model.graph.input}
    missing = [n for n in param_names if n not in by_name]
    if missing:
        raise NpuforgeError(f"export: traced graph lacks parameter {missing[0]!r}; this is a bug")
    info = {}
    for name in param_names:
        tensor_type = by_name[name].type.tensor_type
        info[name] = (
            [d.dim_value for d in tensor_type.shape.dim],
            tensor_type.elem_type,
        )
    keep = [inp for inp in model.graph.input if inp.name not in info]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    return info


def write_model_streaming(model, params, tensor_fn, out_path, external: bool) -> dict:
    """Write ``model`` plus initializers ``params`` (name -> (dims, type)) to ``out_path``.

    ``tensor_fn(name)`` yields the numpy row blocks of one initializer (C order); it is
    called once per tensor and every block is dropped once it is written.
    Returns {file name: sha256} of the files written (graph first).
    """
    import numpy as np
    import onnx

    out_path = Path(out_path)
    headers = []
    for name, (dims, data_type) in params.items():
        nbytes = (
            int(np.prod(dims, dtype=np.int64))
            * onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
        )
        headers.append((name, _tensor_header(name, dims, data_type), nbytes))

    if external:
        data_path = out_path.with_name(out_path.name + ".data")
        offset = 0
        with HashingWriter(data_path) as data:
            for name, header, nbytes in headers:
                pad = (-offset) % DATA_ALIGN
                data.write(b"\0" * pad)
                offset += pad
                _write_blocks(data, tensor_fn(name), header, nbytes)
                header.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (
                    ("location", data_path.name),
                    ("offset", str(offset)),
                    ("length", str(nbytes)),
                ):
                    entry = header.external_data.add()
                    entry.key, entry.value = key, value
                offset += nbytes
        model.graph.initializer.extend(h for _, h, _ in headers)
        with HashingWriter(out_path) as handle:
            handle.write(model.SerializeToString(deterministic=True))
        return {out_path.name: handle.sha256, data_path.name: data.sha256}

    graph = model.graph
    model_rest = onnx.ModelProto()
    model_rest.CopyFrom(model)
    model_rest.ClearField("graph")
    graph_bytes = graph.SerializeToString(deterministic=True)
    pieces = []
    graph_len = len(graph_bytes)
    for name, header, nbytes in headers:
        head = header.SerializeToString(deterministic=True)
        tensor_len = len(head) + len(_field(RAW_DATA_FIELD, nbytes)) + nbytes
        pieces.append((name, header, head, nbytes, tensor_len))
        graph_len += len(_field(INITIALIZER_FIELD, tensor_len)) + tensor_len
    if graph_len > PROTOBUF_LIMIT:
        raise NpuforgeError("graph exceeds the 2 GB protobuf limit inline; use external data")
    with HashingWriter(out_path) as handle:
        handle.write(model_rest.SerializeToString(deterministic=True))
        handle.write(_field(GRAPH_FIELD, graph_len))
        handle.write(graph_bytes)
        for name, header, head, nbytes, tensor_len in pieces:
            handle.write(_field(INITIALIZER_FIELD, tensor_len))
            handle.write(head)
            handle.write(_field(RAW_DATA_FIELD, nbytes))
            _write_blocks(handle, tensor_fn(name), header, nbytes)
    return {out_path.name: handle.sha256}


def _write_blocks(handle, blocks, header, nbytes) -> None:
    """Write row blocks of one tensor; check they add up to the declared shape."""
    import numpy as np

    written, rows = 0, 0
    for block in blocks:
        block = np.ascontiguousarray(block)
        if block.dtype.byteorder == ">":
            block = block.byteswap().view(block.dtype.newbyteorder("<"))
        if list(block.shape[1:]) != list(header.dims[1:]):
            break
        handle.write(memoryview(block).cast("B"))
        written += block.nbytes
        rows += block.shape[0] if block.ndim else 1
        del block
    if written != nbytes:
        raise NpuforgeError(
            f"export: tensor {header.name!r} came out with {written} bytes, the graph expects "
            f"{nbytes} ({list(header.dims)}); this is a bug"
        )


# ------------------------------------------------------------------------------------------
# RWKV export.


def split_layers(n_layers: int, chunks: int) -> list:
    """Consecutive [start, end) layer ranges, as even as possible, earlier ones larger."""
    if chunks < 1 or chunks > n_layers:
        raise NpuforgeError(f"--chunks {chunks} must be between 1 and the {n_layers} layers")
    base, extra = divmod(n_layers, chunks)
    ranges, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def default_rescale_every(n_layers: int) -> int:
    """Halve the residual stream about four times over the depth (6 for 24 layers)."""
    return max(1, -(-n_layers // 4))


def trace_chunk(spec):
    """Trace one chunk to an ONNX ModelProto with weights as named graph inputs."""
    import warnings

    import onnx
    import torch

    from npuforge.models import rwkv

    # Traced on the meta device: shapes only, no weight memory and no arithmetic.
    module = rwkv.build_chunk(spec, device="meta").eval()
    inputs, outputs = rwkv.io_specs(spec)
    args = []
    for item in inputs:
        dtype = getattr(torch, item["dtype"])
        args.append(torch.zeros(item["shape"], dtype=dtype, device="meta"))
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        # The TorchScript exporter gives plain standard ops with int64 indices and
        # deterministic names; the dynamo exporter is slower and its output less stable.
        torch.onnx.export(
            module,
            tuple(args),
            buffer,
            dynamo=False,
            export_params=False,
            # Weights stay named graph inputs; this also skips the initializer
            # de-duplication pass, which would read (meta) tensor values.
            keep_initializers_as_inputs=True,
            do_constant_folding=True,
            opset_version=OPSET,
            input_names=[i["name"] for i in inputs],
            output_names=[o["name"] for o in outputs],
        )
    model = onnx.load_from_string(buffer.getvalue())
    del module
    bad = sorted({n.op_type for n in model.graph.node} - ALLOWED_OPS)
    if bad:
        raise NpuforgeError(f"export: graph uses non-standard ops {bad}; this is a bug")
    model.producer_name = "npuforge"
    model.producer_version = "0.1"
    return model, inputs, outputs


def export_rwkv(
    checkpoint,
    out_dir,
    variant="decode",
    tokens=None,
    chunks=1,
    dtype="fp32",
    batch=1,
    ext_embedding=False,
    fp16_fixes=True,
    rescale_every=None,
    wkv_scale=None,
    last_token_logits=False,
    external_data=None,
) -> dict:
    """Export an RWKV checkpoint; returns the export.json content."""
    import numpy as np

    from npuforge.checkpoint import load_checkpoint
    from npuforge.models import rwkv

    if variant not in ("decode", "prefill"):
        raise NpuforgeError(f"--variant {variant!r} is unknown; use decode or prefill")
    if dtype not in ("fp32", "fp16"):
        raise NpuforgeError(f"--dtype {dtype!r} is unknown; use fp32 or fp16")
    if tokens is None:
        tokens = 1 if variant == "decode" else 16
    if variant == "decode" and tokens != 1:
        raise NpuforgeError("--tokens must be 1 for a decode graph; use --variant prefill")
    if tokens < 1 or batch < 1:
        raise NpuforgeError("--tokens and --batch must be at least 1")
    ckpt = load_checkpoint(checkpoint)
    cfg = ckpt.config
    fixes = fp16_fixes and dtype == "fp16"
    if rescale_every is None:
        rescale_every = default_rescale_every(cfg.n_layers) if fixes else 0
    if wkv_scale is None:
        wkv_scale = 8.0 if fixes else 1.0
    k_scale, v_scale = rwkv.fp16_scales(float(wkv_scale))
    np_dtype = np.float16 if dtype == "fp16" else np.float32

    def prepare(spec, name):
        for block in rwkv.prepared_blocks(ckpt, spec, name):
            yield block.contiguous().numpy().astype(np_dtype, copy=False)
        ckpt.release_touched()

    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        graphs = []
        embedding = None
        if ext_embedding:
            write_embedding_bin(
                tmp / "embedding.bin", rwkv.prepared_embedding(ckpt).numpy().astype(np_dtype)
            )
            ckpt.release_touched()
            embedding = {
                "file": "embedding.bin",
                "sha256": sha256_file(tmp / "embedding.bin"),
                "dtype": np.dtype(np_dtype).name,
                "rows": cfg.vocab_size,
                "cols": cfg.embed_dim,
            }
        for index, layers in enumerate(split_layers(cfg.n_layers, chunks)):
            spec = rwkv.GraphSpec(
                config=cfg,
                layers=layers,
                tokens=tokens,
                batch=batch,
                dtype=dtype,
                ext_embedding=ext_embedding,
                last_token_logits=last_token_logits,
                rescale_every=rescale_every,
                wkv_k_scale=k_scale,
                wkv_v_scale=v_scale,
            )
            model, inputs, outputs = trace_chunk(spec)
            params = _split_params(model, list(rwkv.param_shapes(spec)))
            weight_bytes = sum(
                int(np.prod(d)) * np.dtype(np_dtype).itemsize for d, _ in params.values()
            )
            external = bool(external_data) or (
                external_data is None and weight_bytes > PROTOBUF_LIMIT - (64 << 20)
            )
            name = f"chunk{index}.onnx"
            hashes = write_model_streaming(
                model, params, lambda n, s=spec: prepare(s, n), tmp / name, external
            )
            graph = {
                "file": name,
                "sha256": hashes[name],
                "layers": list(layers),
                "inputs": inputs,
                "outputs": outputs,
            }
            if external:
                data_name = name + ".data"
                graph["external_data"] = {"file": data_name, "sha256": hashes[data_name]}
            graphs.append(graph)
        meta = {
            "family": "rwkv",
            "version": cfg.version,
            "variant": variant,
            "dtype": dtype,
            "batch": batch,
            "tokens_per_call": tokens,
            "chunks": chunks,
            "vocab_size": cfg.vocab_size,
            "embed_dim": cfg.embed_dim,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "head_size": cfg.head_size,
            "options": {
                "ext_embedding": bool(ext_embedding),
                "fp16_fixes": fixes,
                "rescale_every": rescale_every,
                "wkv_scale": float(wkv_scale),
                "last_token_logits": bool(last_token_logits),
                "external_data": any("external_data" in g for g in graphs),
                "opset": OPSET,
            },
            "embedding": embedding,
            "checkpoint": {"file": Path(checkpoint).name, "bytes": Path(checkpoint).stat().st_size},
            "graphs": graphs,
        }
        write_json(tmp / "export.json", meta)
    return meta


LLAMA_OPTIONS = (
    "variant",
    "tokens",
    "dtype",
    "chunks",
    "batch",
    "ext_embedding",
    "external_data",
    "cache_len",
    "sha",
    "mask_value",
)
RWKV_ONLY_OPTIONS = ("rescale_every", "wkv_scale", "last_token_logits")
LLAMA_ONLY_OPTIONS = ("cache_len", "sha", "mask_value")


def export_checkpoint(checkpoint, out_dir, **options) -> dict:
    """Pick the model family from the checkpoint and export it.

    A directory with config.json is a Hugging Face Llama-family checkpoint
    (``npuforge.models.llama.export_llama``); a file is an RWKV checkpoint. The
    RWKV fp16 fixes have no Llama counterpart, so ``fp16_fixes`` is ignored there.
    """
    path = Path(checkpoint)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            from npuforge.models import llama
        except ImportError:
            raise NpuforgeError(
                f"{path}: Llama-family checkpoints need npuforge.models.llama, which is not "
                "installed; export an RWKV checkpoint instead"
            ) from None
        unsupported = [k for k in RWKV_ONLY_OPTIONS if options.get(k)]
        if unsupported:
            flag = "--" + unsupported[0].replace("_", "-")
            raise NpuforgeError(f"{flag} applies to RWKV exports only; drop it for {path.name}")
        # None means "the family's default" (argparse gives None for flags not passed).
        llama_options = {
            k: options[k] for k in LLAMA_OPTIONS if k in options and options[k] is not None
        }
        return llama.export_llama(path, out_dir, **llama_options)
    if path.is_dir():
        raise NpuforgeError(f"{path}: a directory without config.json; pass a checkpoint file")
    unsupported = [k for k in LLAMA_ONLY_OPTIONS if options.get(k)]
    if unsupported:
        flag = "--" + unsupported[0].replace("_", "-")
        raise NpuforgeError(f"{flag} applies to Llama-family exports only; drop it for {path.name}")
    options = {k: v for k, v in options.items() if k not in LLAMA_ONLY_OPTIONS}
    return export_rwkv(path, out_dir, **options)
