"""Writing ONNX graphs and embedding tables: the pieces every model family's export uses.

* ``write_model_streaming``: a traced graph whose weights are named graph inputs
  becomes an ONNX file whose initializers are computed one tensor at a time and
  streamed straight into the file (``chunkN.onnx.data``, 64-byte aligned, when the
  graph would pass protobuf's 2 GB limit or external data is asked for; the
  ``.onnx`` itself otherwise): no second copy of the model in memory.
* ``save_onnx``: a whole in-memory ModelProto, weights beside it past the limit.
* ``split_layers``: the layer ranges of a chunked export.
* ``embedding.bin`` (``--ext-embedding``): little-endian; a 32-byte header — magic
  ``b"NPFEMB\0\0"``, uint32 format version (1), uint32 dtype code (1 = float32,
  2 = float16), uint64 rows, uint64 cols — then the row-major table, one row per
  token id, exactly what the first graph's ``embedding`` input expects (the
  family applies any input norm before writing it).

Outputs are byte-deterministic. A leaf module: it imports only errors and fileio
from npuforge, and onnx/numpy inside the functions that need them.
"""

import struct
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, sha256_file

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


def split_layers(n_layers: int, chunks: int, layers_per_chunk=None) -> list:
    """Consecutive [start, end) layer ranges: ``layers_per_chunk`` layers each where the
    plan gives them (a chunk holding the head takes fewer), else as even as possible,
    earlier ones larger."""
    if chunks < 1 or chunks > n_layers:
        raise NpuforgeError(f"--chunks {chunks} must be between 1 and the {n_layers} layers")
    if layers_per_chunk:
        sizes = [int(size) for size in layers_per_chunk]
        if len(sizes) != chunks or sum(sizes) != n_layers or min(sizes) < 1:
            raise NpuforgeError(
                f"layers_per_chunk {sizes} must give each of the {chunks} chunks at least one "
                f"of the {n_layers} layers, all of them"
            )
        ends = [sum(sizes[: i + 1]) for i in range(chunks)]
        return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]
    base, extra = divmod(n_layers, chunks)
    ranges, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# Whole-model saves: past this many bytes of weights, they go to <file>.data.
EXTERNAL_DATA_BYTES = 1_800_000_000


def save_onnx(proto, path, external: bool | None = None) -> dict | None:
    """Save ``proto``; weights go to ``<file>.data`` when asked or past the protobuf limit.

    Returns the graph's ``external_data`` entry for export.json, or None.
    """
    import onnx

    path = Path(path)
    if external is None:
        weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
        external = weight_bytes > EXTERNAL_DATA_BYTES
    if not external:
        onnx.save(proto, str(path))
        return None
    data = f"{path.name}.data"
    onnx.save(proto, str(path), save_as_external_data=True, location=data)
    return {"file": data, "sha256": sha256_file(path.parent / data)}


def embedding_entry(directory, table) -> dict:
    """Write ``table`` as ``directory/embedding.bin``; return its export.json entry."""
    import numpy as np

    path = Path(directory) / "embedding.bin"
    write_embedding_bin(path, table)
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "dtype": np.dtype(table.dtype).name,
        "rows": int(table.shape[0]),
        "cols": int(table.shape[1]),
    }
