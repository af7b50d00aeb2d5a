"""The onnx reference backend refuses what it cannot ship, leaving no output."""

import json

import pytest

from npuforge.backends import onnx
from npuforge.backends.base import CompileRequest
from npuforge.errors import NpuforgeError


def export_dir(tmp_path, dtype="fp32"):
    directory = tmp_path / "export"
    directory.mkdir()
    (directory / "chunk0.onnx").write_bytes(b"graph")
    meta = {
        "dtype": dtype,
        "variant": "decode",
        "embedding": None,
        "graphs": [{"file": "chunk0.onnx"}],
    }
    (directory / "export.json").write_text(json.dumps(meta))
    return directory


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"precision": "fp16"}, "builds fp32, not 'fp16'"),
        ({"dtype": "fp16"}, "holds fp16 graphs; the reference needs dtype fp32"),
        ({"two_exports": True}, "two decode exports given"),
    ],
)
def test_refusals_leave_nothing(tmp_path, kwargs, message):
    exports = [export_dir(tmp_path, kwargs.get("dtype", "fp32"))]
    if kwargs.get("two_exports"):
        exports.append(exports[0])
    out = tmp_path / "compiled"
    with pytest.raises(NpuforgeError, match=message):
        onnx.compile(
            CompileRequest(
                exports=exports,
                checkpoint=tmp_path / "unused.pth",
                target="onnx",
                options=onnx.Options(verify_steps=2),
                precision=kwargs.get("precision", "fp32"),
                out_dir=out,
            )
        )
    assert not out.exists()
