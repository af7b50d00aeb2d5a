"""Deterministic synthetic RWKV checkpoints in the official key names, shapes and dtype.

Real weights cannot be downloaded on build machines, so the demo model and the
tests use these. Values come from numpy's PCG64 seeded with (seed, crc32 of the
key), so a tensor does not depend on the order or number of other keys and the
same arguments give the same bytes on any machine.

``stress=True`` makes activations that overflow fp16 unless the fp16 fixes are
applied: every block pushes the residual stream the same way on a few channels
(a large positive column in ``att.output`` and ``ffn.value``, so the hidden state
grows past 65504 within a few layers), and the wkv inputs k and v are scaled up
so that ``k v^T`` and the wkv state run past fp16 range.
"""

import zlib

from npuforge.errors import NpuforgeError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Stress factors per version: residual push of ffn.value on the stressed channels (v5/v6
# gate the ffn output with a sigmoid, so they need more) and the gain on att k and v.
STRESS_RESIDUAL = {5: 80.0, 6: 80.0, 7: 40.0}
STRESS_KV = {5: 40.0, 6: 40.0, 7: 80.0}
STRESS_CHANNELS = 4


def _rng(seed: int, key: str):
    import numpy as np

    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _tensor_values(key: str, shape: tuple, seed: int, cfg, stress: bool):
    """float32 numpy values for one official key."""
    import numpy as np

    rng = _rng(seed, key)
    leaf = key.rsplit(".", 1)[-1] if not key.endswith(".weight") else key.rsplit(".", 2)[-2]
    normal = lambda scale: rng.standard_normal(shape, dtype=np.float32) * scale  # noqa: E731
    uniform = lambda lo, hi: rng.uniform(lo, hi, size=shape).astype(np.float32)  # noqa: E731

    if key.endswith(".bias"):
        return normal(0.1)
    if key.startswith("emb."):
        return normal(1.0)
    if key.endswith(".weight") and len(shape) == 1:  # layer/group norm gains
        return 1.0 + normal(0.1)
    if key.endswith(".weight"):  # [out, in] linear layers and the head
        values = normal(1.0 / np.sqrt(shape[1]))
        if stress and leaf == "value" and ".ffn." in key:
            # relu(.)^2 >= 0, so a positive row adds ~STRESS_RESIDUAL * F / 2 every block.
            values[:STRESS_CHANNELS, :] = STRESS_RESIDUAL[cfg.version]
        elif stress and leaf in ("key", "value") and ".att." in key:
            values *= STRESS_KV[cfg.version]
        return values
    if leaf.startswith(("time_mix_", "time_maa_")) and len(shape) == 3 and shape[0] == 1:
        return uniform(0.0, 1.0)
    if leaf in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
        return uniform(0.0, 1.0)
    if leaf == "time_decay":
        # v5: per head/channel; v6: the base of a data-dependent decay.
        return uniform(-6.0, 0.5) if not stress else uniform(-0.5, 1.0)
    if leaf == "time_faaaa":
        return 0.3 + normal(0.4)
    if leaf in ("time_maa_w1", "time_decay_w1", "w1", "a1", "v1", "g1"):
        return normal(0.5 / np.sqrt(shape[0]))
    if leaf in ("time_maa_w2", "time_decay_w2", "w2", "a2", "v2", "g2"):
        return normal(0.5 / np.sqrt(shape[-2]))
    if leaf == "w0":
        return uniform(-2.0, 1.0) if not stress else uniform(2.0, 4.0)
    if leaf == "a0":
        return normal(0.5)
    if leaf == "v0":
        return 1.0 + normal(0.1)
    if leaf == "k_k":
        return 0.85 + normal(0.1)
    if leaf == "k_a":
        return 1.0 + normal(0.1)
    if leaf == "r_k":
        return normal(0.2)
    raise NpuforgeError(f"synthetic: no recipe for key {key!r}; this is a bug in npuforge")


def make_config(version: int, layers: int, embed: int, vocab: int, head_size: int):
    from npuforge.models.rwkv import layout

    if version not in (5, 6, 7):
        raise NpuforgeError(f"RWKV version {version} is not supported; use 5, 6 or 7")
    if min(layers, embed, vocab, head_size) < 1 or embed % head_size:
        raise NpuforgeError(
            f"embed {embed} must be a positive multiple of head size {head_size}; fix --embed"
        )
    return layout.RwkvConfig(
        version=version,
        n_layers=layers,
        embed_dim=embed,
        n_heads=embed // head_size,
        head_size=head_size,
        vocab_size=vocab,
        ffn_dim=layout.default_ffn_dim(version, embed),
        lora=layout.default_lora(version, embed),
    )


def synthetic_state_dict(cfg, seed: int = 0, dtype: str = "bf16", stress: bool = False) -> dict:
    """name -> torch tensor, in the official key order, for config ``cfg``."""
    import torch

    from npuforge.models.rwkv import layout

    if dtype not in DTYPES:
        raise NpuforgeError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    torch_dtype = getattr(torch, DTYPES[dtype])
    state = {}
    for key, shape in layout.expected_shapes(cfg).items():
        values = _tensor_values(key, tuple(shape), seed, cfg, stress)
        state[key] = torch.from_numpy(values).to(torch_dtype)
    return state


def write_synthetic_checkpoint(
    out, version=7, layers=4, embed=256, vocab=65536, head_size=64, seed=0, dtype="bf16",
    stress=False, fmt="pth",
):  # fmt: skip
    """Write a synthetic checkpoint to ``out`` atomically; return its config."""
    import torch

    from npuforge.fileio import atomic_path

    cfg = make_config(version, layers, embed, vocab, head_size)
    state = synthetic_state_dict(cfg, seed=seed, dtype=dtype, stress=stress)
    with atomic_path(out) as tmp:
        if fmt == "pth":
            with open(tmp, "wb") as handle:
                torch.save(state, handle)
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp))
        else:
            raise NpuforgeError(f"format {fmt!r} is not supported; use pth or safetensors")
    return cfg


def cached_synthetic_checkpoint(directory, **args):
    """Path of a synthetic checkpoint for ``args`` under ``directory``; made on first use.

    The name encodes every argument, so test modules and demo runs share one file.
    """
    from pathlib import Path

    defaults = dict(version=7, layers=4, embed=256, vocab=65536, head_size=64, seed=0,
                    dtype="bf16", stress=False, fmt="pth")  # fmt: skip
    unknown = set(args) - set(defaults)
    if unknown:
        raise NpuforgeError(f"unknown synthetic checkpoint option {sorted(unknown)[0]!r}")
    full = {**defaults, **args}
    stem = "rwkv{version}-{layers}x{embed}-v{vocab}-h{head_size}-s{seed}-{dtype}".format(**full)
    path = Path(directory) / f"{stem}{'-stress' if full['stress'] else ''}.{full['fmt']}"
    if not path.exists():
        write_synthetic_checkpoint(path, **full)
    return path
