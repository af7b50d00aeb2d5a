"""Read checkpoint files without executing code.

``.pth`` files (zip format, read with ``torch.load(weights_only=True, mmap=True)``)
and ``.safetensors`` (a private file mapping) become tensors; a truncated file or
a pickle that carries code is rejected with one NpuforgeError line. What the
tensors mean is the model family's business (``npuforge.models.<family>``).
"""

from pathlib import Path

from npuforge.errors import NpuforgeError


class Checkpoint:
    """Tensors of one checkpoint, read lazily (mmap) and a detected config."""

    def __init__(self, path, tensors: dict, config):
        self.path = Path(path)
        self.tensors = tensors
        self.config = config
        self.touched = set()

    def __getitem__(self, name):
        self.touched.add(name)
        return self.tensors[name]

    def __contains__(self, name):
        return name in self.tensors

    def float32(self, name):
        """One tensor as float32 (the tensor itself when it already is: never modify it)."""
        self.touched.add(name)
        return self.tensors[name].float()

    def release_touched(self):
        """Drop the file pages of the tensors read since the last call from this process
        (they stay in the page cache). The tensors are read-only views of a private
        file mapping, so the kernel re-reads them if they are touched again; without
        this a streaming export would end up with the whole file resident."""
        for name in sorted(self.touched):
            _drop_pages(self.tensors[name])
        self.touched.clear()


def _drop_pages(tensor) -> None:
    import ctypes
    import mmap

    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    begin = start - start % page
    length = (start + size) - begin
    length -= length % page  # whole pages only: a partial page may hold a neighbour
    if length > 0:
        try:  # best effort: only a memory saving, never needed for correctness
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(length), 4)  # MADV_DONTNEED
        except (OSError, AttributeError):
            pass


def _load_pth(path: Path) -> dict:
    import pickle
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):
        raise NpuforgeError(
            f"{path}: not a zip-format torch checkpoint (truncated or legacy file); "
            "re-save it with torch.save or convert it to .safetensors"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "unsafe pickle"
        raise NpuforgeError(
            f"{path}: refused to load, the pickle carries code or non-tensor objects ({first}); "
            "use a plain state-dict checkpoint"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise NpuforgeError(
            f"{path}: cannot read the checkpoint ({first}); the file is damaged or truncated, "
            "download it again"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise NpuforgeError(f"{path}: not a flat state dict of tensors; use a BlinkDL checkpoint")
    return state


# What a file that is not safetensors starts with, when it is another checkpoint format.
OTHER_FORMATS = {
    b"PK": "a torch zip checkpoint: set format: pth",
    b"GGUF": "a GGUF file: set format: gguf",
}


def _other_format(head: bytes) -> str | None:
    fixes = [fix for magic, fix in OTHER_FORMATS.items() if head.startswith(magic)]
    return f"it is {fixes[0]}" if fixes else None


SAFETENSORS_DTYPES = {
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
}


def _load_safetensors(path: Path) -> dict:
    """Tensors as zero-copy views of a private file mapping (the layout is simple:
    u64 header length, JSON header of dtype/shape/data_offsets, then the data)."""
    import json
    import mmap
    import warnings

    import torch

    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            fix = _other_format(head) or "download it again"
            raise NpuforgeError(f"{path}: not a safetensors file or truncated header; {fix}")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise NpuforgeError(
                f"{path}: unreadable safetensors header; download it again"
            ) from None
        data_start = 8 + header_len
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, itemsize = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise NpuforgeError(
                f"{path}: tensor {name!r} has an unsupported or malformed header entry"
            ) from None
        count = 1
        for dim in shape:
            count *= dim
        if end - begin != count * itemsize or begin < 0 or data_start + end > size:
            raise NpuforgeError(
                f"{path}: tensor {name!r} lies outside the file (truncated); download it again"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(
                mapping, dtype=getattr(torch, dtype_name), count=count, offset=data_start + begin
            )
        tensors[name] = flat.reshape(shape)
    return tensors


def read_tensors(path) -> dict:
    """The tensors of one .pth or .safetensors file, without executing code."""
    path = Path(path)
    if not path.is_file():
        raise NpuforgeError(f"{path}: checkpoint file not found; check the path")
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    if path.suffix == ".pth":
        return _load_pth(path)
    raise NpuforgeError(f"{path}: unknown checkpoint extension; use .pth or .safetensors")


def inspect_checkpoint(path, family: str) -> dict:
    """What ``inspect_checkpoint.py`` writes: the family's own reading of the checkpoint."""
    from npuforge import models

    return models.family(family).inspect(path)
