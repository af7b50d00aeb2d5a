"""Calibration samples in each vendor's input format (docs/interfaces.md):

    rknn/chunk{i}/dataset.txt         one line per sample: space-separated .npy files
    rknn/chunk{i}/sample{j}_{k}.npy   input k of chunk i (graph input order)
    qnn/chunk{i}/input_list.txt       one line per sample: name:=file.raw ...
    qnn/chunk{i}/sample{j}_{k}.raw    raw little-endian tensor data
    tpumlir/chunk{i}/sample{j}.npz    keys = input names

Every path in a list file is relative to that list file's directory, so the
directory can move. Byte-deterministic: .npz entries carry a fixed timestamp.
"""

import io
import zipfile
from pathlib import Path

# A zip entry's timestamp; fixed so .npz files are byte-deterministic.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


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


def write_vendor_samples(tmp: Path, graphs: list, captured: list) -> list:
    """Write every chunk's captured feeds in each vendor's layout under ``tmp``; return
    calibration.json's ``chunks`` entries."""
    import numpy as np

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
    return chunks
