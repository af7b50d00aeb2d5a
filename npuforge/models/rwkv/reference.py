"""The parity oracle for RWKV: BlinkDL's ``rwkv`` package (cpu fp32) on the same checkpoint."""

import contextlib
import importlib.util
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from npuforge.errors import NpuforgeError


def name() -> str:
    return f"rwkv {metadata.version('rwkv')} (BlinkDL's package), cpu fp32"


@contextlib.contextmanager
def _reference_env(version: int):
    """The package reads its switches from the environment at import and at load."""
    keys = ("RWKV_V7_ON", "RWKV_JIT_ON", "RWKV_CUDA_ON", "RWKV_RESCALE_LAYER")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(
        {
            "RWKV_V7_ON": "1" if version == 7 else "0",
            # TorchScript only costs compile time here (v7 scripts regardless).
            "RWKV_JIT_ON": "0",
            "RWKV_CUDA_ON": "0",
            "RWKV_RESCALE_LAYER": "0",  # no fp16 rescaling in the fp32 reference
        }
    )
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _load_reference_module(version: int):
    """BlinkDL's rwkv.model, imported privately with the switches this version needs.

    The package decides at import time between v7 and v4-v6 (``RWKV_V7_ON``), so each
    flavour gets its own module object instead of sharing ``rwkv.model``.
    """
    spec = importlib.util.find_spec("rwkv")
    if spec is None:
        raise NpuforgeError("the rwkv package is not installed; pip install rwkv")
    path = Path(list(spec.submodule_search_locations)[0]) / "model.py"
    name = f"_npuforge_rwkv_reference_v{7 if version == 7 else 6}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        with _reference_env(version):
            module_spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def reference_logits(checkpoint, tokens):
    """Logits [B, S, V] of BlinkDL's rwkv package (cpu fp32), one token at a time."""
    import numpy as np
    import torch

    from npuforge.models.rwkv.checkpoint import load

    ckpt = load(checkpoint)
    version = ckpt.config.version
    module = _load_reference_module(version)
    with tempfile.TemporaryDirectory() as tmp:
        # The package reads only .pth, and applies v5/v6's ln0 in the file's dtype: give
        # it an exact float32 copy so both sides compute the same model in fp32.
        path = Path(tmp) / "reference.pth"
        torch.save({k: v.float() for k, v in ckpt.tensors.items()}, path)
        del ckpt
        with _reference_env(version):
            if version == 7:
                model = module.RWKV_x070(str(path)[: -len(".pth")], "cpu fp32")
            else:
                model = module.RWKV(str(path), "cpu fp32", verbose=False)
    rows = []
    with torch.no_grad():
        for row in np.asarray(tokens):
            state, out = None, []
            for token in row:
                logits, state = model.forward([int(token)], state)
                out.append(logits.float().numpy())
            rows.append(np.stack(out))
    return np.stack(rows)
