"""Calibration samples, stored once and converted per vendor (docs/interfaces.md):

    chunk{i}/sample{j}.npz        keys = input names; TPU-MLIR reads these as they are

A compile job that needs another format writes it into its own work directory:

    rknn:     dataset.txt, one line per sample: space-separated sample{j}_{k}.npy
    QNN SDK:  input_list.txt, one line per sample: name:=sample{j}_{k}.raw

(k: the input's index in graph input order). Storing one format, not three, keeps
a 135M model's 64 samples at 0.7 GB, not 2.2 GB. Every path in a list file is
relative to that list file's directory, so a directory can move. Byte-deterministic:
.npz entries carry a fixed timestamp.
"""

import io
import zipfile
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import read_json

# A zip entry's timestamp; fixed so .npz files are byte-deterministic.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
# The layout's name in calibration.json; a calibration step's params carry it, so a
# directory of another layout is made again, not read.
LAYOUT = "npz per chunk and sample"


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


def write_chunk_samples(tmp: Path, index: int, graph: dict, feeds: list) -> dict:
    """Write one chunk's captured feeds (one dict per sample) under ``tmp``; return its
    calibration.json ``chunks`` entry."""
    import numpy as np

    folder = tmp / f"chunk{index}"
    folder.mkdir(parents=True)
    files = []
    for j, run in enumerate(feeds):
        arrays = {
            spec["name"]: np.ascontiguousarray(run[spec["name"]], dtype=spec["dtype"])
            for spec in graph["inputs"]
        }
        _write_npz(folder / f"sample{j}.npz", arrays)
        files.append(f"chunk{index}/sample{j}.npz")
    return {
        "index": index,
        "file": graph["file"],
        "inputs": [
            {k: spec[k] for k in ("name", "shape", "dtype", "role")} for spec in graph["inputs"]
        ],
        "npz": files,
    }


def chunk_samples(calibration_dir, index: int) -> tuple[list[Path], list[dict]]:
    """(the .npz samples of chunk ``index``, that chunk's inputs) of a calibration directory."""
    calibration_dir = Path(calibration_dir)
    record = calibration_dir / "calibration.json"
    chunks = read_json(record).get("chunks", []) if record.is_file() else []
    chunk = next((c for c in chunks if c.get("index") == index), None)
    if chunk is None or "npz" not in chunk:
        raise NpuforgeError(
            f"calibration directory {calibration_dir} has no .npz samples of chunk {index} "
            "(made by an older npuforge, or for another export): rerun "
            "make_calibration_samples.py for this export"
        )
    samples = [calibration_dir / name for name in chunk["npz"]]
    missing = [str(p) for p in samples if not p.is_file()]
    if missing:
        raise NpuforgeError(
            f"calibration sample {missing[0]} is missing ({len(missing)} of {len(samples)}): "
            "rerun make_calibration_samples.py for this export"
        )
    return samples, chunk["inputs"]


def _each_input(samples: list[Path], inputs: list[dict]):
    """(sample index j, input index k, array) over every sample's inputs, in order."""
    import numpy as np

    for j, sample in enumerate(samples):
        with np.load(sample) as data:
            for k, spec in enumerate(inputs):
                yield j, k, np.ascontiguousarray(data[spec["name"]], dtype=spec["dtype"])


def write_rknn_dataset(samples: list[Path], inputs: list[dict], folder: Path) -> Path:
    """rknn-toolkit2's dataset file for ``samples`` (one .npy per input) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [[] for _ in samples]
    for j, k, value in _each_input(samples, inputs):
        (folder / f"sample{j}_{k}.npy").write_bytes(_npy_bytes(value))
        lines[j].append(f"sample{j}_{k}.npy")
    dataset = folder / "dataset.txt"
    dataset.write_text("".join(" ".join(line) + "\n" for line in lines))
    return dataset


def write_qnn_input_list(samples: list[Path], inputs: list[dict], folder: Path) -> Path:
    """The QNN SDK converter's --input_list for ``samples`` (raw little-endian tensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [[] for _ in samples]
    for j, k, value in _each_input(samples, inputs):
        little_endian = value.astype(value.dtype.newbyteorder("<"))
        (folder / f"sample{j}_{k}.raw").write_bytes(little_endian.tobytes())
        lines[j].append(f"{inputs[k]['name']}:=sample{j}_{k}.raw")
    listing = folder / "input_list.txt"
    listing.write_text("".join(" ".join(line) + "\n" for line in lines))
    return listing
