"""What exact fp16 arithmetic reaches on an RWKV model: the ceiling of any fp16 NPU build.

Runs the model's layers in torch (npuforge.models.rwkv.model, the module the exporter
traces) over seeded random tokens from the zero state, once in fp32 and in fp16 with and
without the export's fp16 fixes (every weight and activation an fp16 tensor), and prints
per decode position the logits' cosine against fp32, the worst and mean, and top-1
agreement. An NPU's fp16 binary cannot be expected to do better than the fp16 row with
the fixes, which the exporter folds into every graph.

Then, for position 0, every head's group norm (``ln_x``) in both runs: from the zero
state a head's wkv output there is one outer product, (r.k) v, which the group norm
scales back to unit variance, so the head's output is sign(r.k) times v normalised
whatever |r.k| is, until |r.k|^2 var(v) nears the norm's eps. A head whose r.k is near
zero can change sign under fp16 rounding and put a full-size error into the stream; the
bench counts such heads and prints the worst with their input variance against eps.

    python bench/bench_fp16_arithmetic.py --model rwkv7-1.5b-shape [--steps 16]
        [--work /tmp/npuforge-bench-fp16] [--record docs/data/benches.yaml]

--model takes a registry model with a synthetic source (its checkpoint is made under
--work) or --checkpoint a .pth. A 1.5B model takes about 12 GB and 10-20 minutes on
2 cores (torch's fp16 matmuls on a CPU are slow).
"""

import argparse
import datetime
import gc
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def checkpoint_for(args) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    from npuforge.models.rwkv.synthetic import cached_synthetic_checkpoint
    from npuforge.registry import load_yaml

    model = load_yaml(REPO / "config" / "models.yaml").get(args.model)
    synthetic = (model or {}).get("source", {}).get("synthetic")
    if not synthetic or model.get("family") != "rwkv":
        sys.exit(
            f"error: {args.model} is not an RWKV model with a synthetic source; pass --checkpoint"
        )
    Path(args.work).mkdir(parents=True, exist_ok=True)
    return cached_synthetic_checkpoint(args.work, **synthetic)


def run_logits(ckpt, tokens, dtype: str, fixes: bool):
    """Logits per position ([steps, vocab], float64) of the whole model in ``dtype``, and
    every group norm's input and output at position 0 ([heads, N] float64 each, per layer,
    with the eps in fp32 units)."""
    import numpy as np
    import torch

    from npuforge.models.rwkv import layout
    from npuforge.models.rwkv.model import RwkvChunk
    from npuforge.models.rwkv.onnx_export import default_rescale_every

    cfg = ckpt.config
    k_scale, v_scale = layout.fp16_scales(8.0 if fixes else 1.0)
    spec = layout.GraphSpec(
        config=cfg,
        layers=(0, cfg.n_layers),
        dtype=dtype,
        rescale_every=default_rescale_every(cfg.n_layers) if fixes else 0,
        wkv_k_scale=k_scale,
        wkv_v_scale=v_scale,
    )
    module = layout.load_weights(RwkvChunk(spec).eval(), ckpt)
    group_norm, first_position = module.group_norm, []

    def recording_group_norm(y, weight, bias, eps):
        out = group_norm(y, weight, bias, eps)
        if len(first_position) < cfg.n_layers:
            rescale = spec.wkv_scale**2  # the fixes scale the wkv output and eps alike
            rows = [t.double().reshape(-1, cfg.head_size).numpy() for t in (y, out)]
            first_position.append((rows[0] * spec.wkv_scale, rows[1], eps * rescale))
        return out

    module.group_norm = recording_group_norm
    inputs, _ = layout.io_specs(spec)
    torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
    states = [torch.zeros(i["shape"], dtype=torch_dtype) for i in inputs if i["role"] == "state"]
    rows, started = [], time.monotonic()
    with torch.no_grad():
        for step, token in enumerate(tokens):
            logits, *states = module(torch.tensor([[int(token)]]), *states)
            rows.append(logits.double().reshape(-1).numpy())
            print(f"  {dtype} {'with' if fixes else 'without'} fixes: position {step + 1} of "
                  f"{len(tokens)} ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    del module
    gc.collect()
    return np.stack(rows), first_position


def heads_at_position_0(reference, found) -> dict:
    """Per head: cosine of the group norm's output against fp32's, and the variance of
    its fp32 input; the heads sorted worst first."""
    import numpy as np

    heads = []
    for layer, ((y32, out32, eps), (_, out16, _)) in enumerate(zip(reference, found, strict=True)):
        cosine = (out32 * out16).sum(1) / (
            np.linalg.norm(out32, axis=1) * np.linalg.norm(out16, axis=1)
        )
        heads += [(float(c), layer, h, float(y32[h].var()), eps) for h, c in enumerate(cosine)]
    heads.sort()
    cosines = np.array([h[0] for h in heads])
    return {
        "heads": len(heads),
        "below 0.99": int((cosines < 0.99).sum()),
        "sign flipped": int((cosines < 0).sum()),
        "median variance": float(np.median([h[3] for h in heads])),
        "worst": heads[:5],
    }


def compare(reference, logits) -> dict:
    import numpy as np

    cosine = (reference * logits).sum(1) / (
        np.linalg.norm(reference, axis=1) * np.linalg.norm(logits, axis=1)
    )
    return {
        "cosines": [round(float(c), 6) for c in cosine],
        "worst": round(float(cosine.min()), 6),
        "mean": round(float(cosine.mean()), 6),
        "top1": round(float((reference.argmax(1) == logits.argmax(1)).mean()), 4),
        "nan_inf": int((~np.isfinite(logits)).sum()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="rwkv7-1.5b-shape")
    parser.add_argument("--checkpoint", help="an RWKV .pth instead of the model's synthetic one")
    parser.add_argument("--steps", type=int, default=16, help="decode positions")
    parser.add_argument("--work", default="/tmp/npuforge-bench-fp16")
    parser.add_argument("--record", type=Path, help="add the figures to this bench data file")
    args = parser.parse_args()

    from npuforge.models.rwkv.checkpoint import load
    from npuforge.verify import seeded_tokens

    path = checkpoint_for(args)
    ckpt = load(path)
    tokens = seeded_tokens(ckpt.config.vocab_size, 1, args.steps)[0]
    reference, reference_norms = run_logits(ckpt, tokens, "fp32", False)
    found, heads = {}, {}
    for fixes in (True, False):
        logits, norms = run_logits(ckpt, tokens, "fp16", fixes)
        found[fixes] = compare(reference, logits)
        heads[fixes] = heads_at_position_0(reference_norms, norms)
    name = args.model if not args.checkpoint else path.name
    print(f"\n{name}: logits cosine against fp32 per position, {args.steps} decode steps")
    for fixes, figures in found.items():
        label = "fp16 with the fixes" if fixes else "fp16 without them"
        print(f"{label:22} worst {figures['worst']:.6f} mean {figures['mean']:.6f} "
              f"top-1 {figures['top1']} nan/inf {figures['nan_inf']}")  # fmt: skip
        print("  " + " ".join(f"{c:.5f}" for c in figures["cosines"]))
    print("\nposition 0, each head's group norm (ln_x) output against fp32's:")
    for fixes, figures in heads.items():
        label = "fp16 with the fixes" if fixes else "fp16 without them"
        print(f"{label:22} {figures['below 0.99']} of {figures['heads']} heads below cosine "
              f"0.99, {figures['sign flipped']} with their sign flipped; median input "
              f"variance {figures['median variance']:.3g}")  # fmt: skip
        for cosine, layer, head, variance, eps in figures["worst"]:
            print(f"  layer {layer:2d} head {head:2d}: cosine {cosine:+.5f}, input variance "
                  f"{variance:.3g} (eps {eps:.3g})")  # fmt: skip
    if args.record:
        from npuforge.measurements import record_bench_rows

        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        command = f"python bench/bench_fp16_arithmetic.py --model {name} --steps {args.steps}"
        rows = [
            {
                "id": f"fp16-arithmetic-{name}-{'fixes' if fixes else 'plain'}",
                "family": "fp16_arithmetic",
                "setting": f"{name}, torch fp16 {'with' if fixes else 'without'} the fp16 fixes, "
                f"{args.steps} decode positions from the zero state",
                "figures": {
                    "worst cosine": figures["worst"],
                    "position 0": figures["cosines"][0],
                    "position 1": figures["cosines"][1],
                    "from position 3": min(figures["cosines"][3:]),
                    "top-1": figures["top1"],
                    "heads flipped at position 0": heads[fixes]["sign flipped"],
                },
                "date": datetime.date.today().isoformat(),
                "commit": commit,
                "command": command,
                "status": "current",
            }
            for fixes, figures in found.items()
        ]
        written = record_bench_rows(args.record, rows)
        print(f"\nrecorded {len(written)} rows in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
