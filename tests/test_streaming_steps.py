"""Host steps that stream: the Llama export reads one chunk's weights at a time (the same
bytes as an export from the whole model in memory, a peak that follows the chunk, not the
model), and the export check holds one model at a time, its graphs one chunk at a time."""

import filecmp

import pytest
from memory_probe import peak_bytes

from npuforge.models.llama import model as llama_model
from npuforge.models.llama import onnx_export, weights
from npuforge.models.llama.onnx_export import export_llama


def whole_model(checkpoint_dir, cfg, first, last, dtype, **build):
    """Every chunk taken from the whole model in memory (how the levers' exports run)."""
    return llama_model.build_model(cfg, weights.load_state_dict(checkpoint_dir, dtype), **build)


@pytest.mark.parametrize(
    "arch, tied, options",
    [
        ("qwen2", True, {"dtype": "fp16", "kv_prefix": [1, 7], "chunks": 3}),
        ("llama", False, {"dtype": "fp32", "chunks": 2, "ext_embedding": True, "sha": True}),
        ("qwen3", True, {"dtype": "fp32", "chunks": 3, "layers_per_chunk": [2, 1, 1]}),
    ],
)
def test_chunk_by_chunk_export_writes_the_whole_models_bytes(
    tmp_path, monkeypatch, arch, tied, options
):
    checkpoint = tmp_path / "ckpt"
    weights.write_synthetic_checkpoint(
        checkpoint, layers=4, embed=64, heads=4, kv_heads=2, vocab=300, intermediate=96,
        arch=arch, tied=tied, seed=5,
    )  # fmt: skip
    common = {"variant": "prefill", "tokens": 4, "cache_len": 32, "fp16_fixes": True, **options}
    onnx_export.export_llama(checkpoint, tmp_path / "streamed", **common)
    monkeypatch.setattr(onnx_export, "load_chunk", whole_model)
    onnx_export.export_llama(checkpoint, tmp_path / "whole", **common)
    files = sorted(path.name for path in (tmp_path / "streamed").iterdir())
    assert files == sorted(path.name for path in (tmp_path / "whole").iterdir())
    assert len([name for name in files if name.endswith(".onnx")]) == options["chunks"]
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "streamed", tmp_path / "whole", files, shallow=False
    )
    assert mismatch == errors == []


def test_a_chunk_holds_only_its_own_weights(tmp_path):
    checkpoint = tmp_path / "ckpt"
    weights.write_synthetic_checkpoint(
        checkpoint, layers=3, embed=32, heads=2, kv_heads=2, vocab=50, intermediate=48, tied=True
    )
    cfg = onnx_export.load_config(checkpoint)
    middle = llama_model.load_chunk(checkpoint, cfg, 1, 2, None, cache_len=16)
    held = {llama_model.checkpoint_module(name) for name, _ in middle.named_parameters()}
    assert held == {"layers.1"}
    last = llama_model.load_chunk(checkpoint, cfg, 2, 3, None, cache_len=16)
    names = {name for name, _ in last.named_parameters()}
    # The tied head is the table: the last chunk holds it once.
    assert "embed_tokens.weight" in names and "norm.weight" in names
    assert not any(name.startswith(("layers.0", "layers.1")) for name in names)


# A first export of a tiny model loads every lazy import (torch.onnx, onnx) before the
# probe starts counting.
SETUP = """
from npuforge.models.llama.onnx_export import export_llama
export_llama({tiny!r}, {warm!r}, variant="decode", tokens=1, chunks=2, cache_len=8)
"""
RUN = """
export_llama({checkpoint!r}, {out!r}, variant="decode", tokens=1, chunks={chunks}, cache_len=8,
             ext_embedding=True, dtype="fp16")
"""


def test_the_export_peaks_at_one_chunk_not_the_model(tmp_path):
    """Peak RSS of a float16 export of one 16-layer model (float32 checkpoint; 134 MB of
    float16 weights) in 1 and in 16 chunks: the 16-chunk export holds one layer's weights,
    traced graph and serialized copy at a time, so it peaks below the model's own weights
    (an export that holds the model cannot) and at under a quarter of the 1-chunk one."""
    checkpoint, tiny = tmp_path / "ckpt", tmp_path / "tiny"
    weights.write_synthetic_checkpoint(
        checkpoint, layers=16, embed=512, heads=8, kv_heads=8, vocab=256, intermediate=2048,
    )  # fmt: skip
    weights.write_synthetic_checkpoint(
        tiny, layers=2, embed=32, heads=2, kv_heads=2, vocab=64, intermediate=48
    )
    model_bytes = 2 * 16 * (4 * 512 * 512 + 3 * 512 * 2048)
    peaks = {}
    for chunks in (1, 16):
        setup = SETUP.format(tiny=str(tiny), warm=str(tmp_path / f"warm{chunks}"))
        out = str(tmp_path / f"c{chunks}")
        peaks[chunks] = peak_bytes(
            setup, RUN.format(checkpoint=str(checkpoint), out=out, chunks=chunks)
        )
    assert peaks[16] < model_bytes and peaks[16] < peaks[1] / 4, (peaks, model_bytes)


VERIFY_SETUP = """
import onnxruntime, torch, transformers
from npuforge.verify import verify_export
"""


def capture_call_by_call(export_dir, meta, runs, write_chunk) -> list:
    """How calibration captured before it went chunk by chunk: the whole chain held,
    each run call by call through every chunk (the reference for the bytes)."""
    import numpy as np

    from npuforge.runtime import GraphChain

    chain, captured = GraphChain(export_dir), []
    per_call = chain.tokens_per_call
    for tokens, capture_step in runs:
        ids = np.resize(np.asarray(tokens, dtype=np.int64), (capture_step + 1) * per_call)
        feeds_at = {}

        def capture(index, feeds, feeds_at=feeds_at, capture_step=capture_step):
            if chain.position == capture_step * per_call:
                feeds_at[index] = {k: np.array(v, copy=True) for k, v in feeds.items()}

        chain.capture = capture
        chain.reset()
        for call in range(capture_step + 1):
            chain.step(ids[call * per_call : (call + 1) * per_call].reshape(1, per_call))
        captured.append(feeds_at)
    return [
        write_chunk(index, graph, [run[index] for run in captured])
        for index, graph in enumerate(meta["graphs"])
    ]


@pytest.mark.parametrize("variant, tokens", [("decode", 1), ("prefill", 4)])
def test_calibration_chunk_by_chunk_writes_the_call_by_call_runs_bytes(
    tmp_path, monkeypatch, variant, tokens
):
    from npuforge import calibration

    checkpoint = tmp_path / "ckpt"
    weights.write_synthetic_checkpoint(
        checkpoint, layers=3, embed=64, heads=4, kv_heads=2, vocab=300, intermediate=96,
        arch="qwen2", tied=True, seed=2,
    )  # fmt: skip
    export = tmp_path / "export"
    export_llama(checkpoint, export, variant=variant, tokens=tokens, chunks=3, cache_len=64,
                 kv_prefix=[1, 5], ext_embedding=True)  # fmt: skip
    common = {"samples": 3, "steps": 6, "seed": 4, "checkpoint": checkpoint}
    calibration.make_calibration_samples(export, tmp_path / "chunked", **common)
    monkeypatch.setattr(calibration, "capture_runs", capture_call_by_call)
    calibration.make_calibration_samples(export, tmp_path / "whole", **common)
    files = sorted(
        str(p.relative_to(tmp_path / "whole")) for p in (tmp_path / "whole").rglob("*.*")
    )
    # calibration.json, host.json and 3 chunks x 3 samples.
    assert len(files) == 2 + 3 * 3
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "chunked", tmp_path / "whole", files, shallow=False
    )
    assert mismatch == errors == []


CALIBRATION_SETUP = """
from npuforge.calibration import make_calibration_samples
make_calibration_samples({tiny!r}, {warm!r}, samples=2, steps=2, seed=0)
"""


def sixteen_layers_and_a_tiny_export(tmp_path) -> tuple:
    """A 16-layer float32 checkpoint (268 MB of weights) and its bytes, and a tiny model's
    export in ``tmp_path / "tiny-export"`` (a first run on it loads the lazy imports
    before a probe counts)."""
    checkpoint, tiny = tmp_path / "ckpt", tmp_path / "tiny"
    weights.write_synthetic_checkpoint(
        checkpoint, layers=16, embed=512, heads=8, kv_heads=8, vocab=256, intermediate=2048,
    )  # fmt: skip
    weights.write_synthetic_checkpoint(
        tiny, layers=2, embed=32, heads=2, kv_heads=2, vocab=64, intermediate=48
    )
    export_llama(tiny, tmp_path / "tiny-export", variant="decode", tokens=1, cache_len=8)
    return checkpoint, 4 * 16 * (4 * 512 * 512 + 3 * 512 * 2048)


def test_calibration_holds_one_chunk_not_the_model(tmp_path):
    """Peak RSS of capturing 4 samples from a 16-layer float32 export (268 MB of weights)
    in 1 and in 16 chunks: chunk by chunk, one graph's session is open at a time."""
    checkpoint, model_bytes = sixteen_layers_and_a_tiny_export(tmp_path)
    peaks = {}
    for chunks in (1, 16):
        export = tmp_path / f"c{chunks}"
        export_llama(checkpoint, export, variant="decode", tokens=1, chunks=chunks, cache_len=8)
        setup = CALIBRATION_SETUP.format(
            tiny=str(tmp_path / "tiny-export"), warm=str(tmp_path / f"warm{chunks}")
        )
        run = f"make_calibration_samples({str(export)!r}, {str(tmp_path / f'cal{chunks}')!r}, "
        run += "samples=4, steps=4, seed=0)"
        peaks[chunks] = peak_bytes(setup, run)
    assert peaks[16] < model_bytes / 2 and peaks[16] < peaks[1] / 4, (peaks, model_bytes)


def test_the_export_check_chunk_by_chunk_gives_the_call_by_call_logits(tmp_path):
    """The check's chunk-by-chunk run of decode graphs, and of prefill graphs continued by
    decode graphs chunked otherwise, gives a GraphChain's call-by-call logits exactly."""
    import numpy as np

    from npuforge.runtime import GraphChain, run_chunk_by_chunk
    from npuforge.verify import open_session, read_export, run_decode

    checkpoint = tmp_path / "ckpt"
    weights.write_synthetic_checkpoint(
        checkpoint, layers=4, embed=64, heads=4, kv_heads=2, vocab=200, intermediate=96,
        arch="qwen2", tied=True, seed=2,
    )  # fmt: skip
    common = {"cache_len": 32, "kv_prefix": [3], "ext_embedding": True}
    export_llama(checkpoint, tmp_path / "d", variant="decode", tokens=1, chunks=3, **common)
    export_llama(checkpoint, tmp_path / "p", variant="prefill", tokens=4, chunks=2, **common)
    tokens = np.random.default_rng(1).integers(0, 200, size=(1, 10))
    decode = GraphChain(tmp_path / "d")
    want = decode.run(tokens)
    got = run_decode(read_export(tmp_path / "d"), tokens, "decode graphs")
    assert np.array_equal(got, want)

    prefill = GraphChain(tmp_path / "p")
    pieces = [prefill.step(tokens[:, :4]), prefill.step(tokens[:, 4:8])]
    decode.reset()
    decode.state, decode.position = dict(prefill.state), prefill.position
    pieces += [decode.step(tokens[:, 8:9]), decode.step(tokens[:, 9:10])]
    calls = [("prefill", tokens[:, :4]), ("prefill", tokens[:, 4:8])]
    calls += [("decode", tokens[:, 8:9]), ("decode", tokens[:, 9:10])]
    exports = {"prefill": read_export(tmp_path / "p"), "decode": read_export(tmp_path / "d")}
    for got, want in zip(run_chunk_by_chunk(exports, calls, open_session), pieces, strict=True):
        assert np.array_equal(got, want)


CHECK_SETUP = """
from npuforge.verify import verify_export
verify_export([{tiny!r}], None, 2, reference="onnx-fp32:" + {tiny!r})
"""


def test_the_export_check_holds_one_model_then_one_chunk_at_a_time(tmp_path):
    """Peak RSS of verify_onnx's check of a 16-layer float32 model (268 MB) exported in
    16 chunks: the decode graphs, then prefill graphs continued by decode ones. Against
    transformers' reference, the reference is released before the graphs load: near one
    model (1.5 times its weights; 2.4 when the reference and both exports' graphs sat in
    memory together). Against the same graphs (``onnx-fp32:``), one graph's session is
    open at a time: a fraction of the model (every chunk open at once held 1.4 times it,
    7.3 GB at Qwen2.5-1.5B)."""
    checkpoint, model_bytes = sixteen_layers_and_a_tiny_export(tmp_path)
    decode, prefill = tmp_path / "decode", tmp_path / "prefill"
    for variant, out, tokens in (("decode", decode, 1), ("prefill", prefill, 4)):
        export_llama(checkpoint, out, variant=variant, tokens=tokens, chunks=16, cache_len=16,
                     kv_prefix=[1])  # fmt: skip
    exports = [str(decode), str(prefill)]
    with_reference = peak_bytes(
        VERIFY_SETUP, f"verify_export({exports!r}, {str(checkpoint)!r}, 12)"
    )
    assert with_reference < 1.8 * model_bytes, (with_reference, model_bytes)
    run = f"verify_export({exports!r}, None, 12, reference='onnx-fp32:{decode}')"
    graphs_only = peak_bytes(CHECK_SETUP.format(tiny=str(tmp_path / "tiny-export")), run)
    assert graphs_only < model_bytes / 2, (graphs_only, model_bytes)
