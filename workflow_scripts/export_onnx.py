"""Export a checkpoint to chunked ONNX graphs plus export.json (docs/interfaces.md)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuforge.cli import run_cli  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help=".pth/.safetensors or HF dir"
    )
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--variant", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--tokens", type=int, help="tokens per call (decode: 1, prefill: 16)")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ext-embedding", action="store_true", help="write embedding.bin")
    parser.add_argument("--no-fp16-fixes", action="store_true", help="export fp16 unprotected")
    parser.add_argument(
        "--rescale-every",
        type=int,
        help="halve the hidden state every N layers (fp16 default: L/4)",
    )
    parser.add_argument("--wkv-scale", type=float, help="power-of-two k*v scale (fp16 default: 8)")
    parser.add_argument("--last-token-logits", action="store_true")
    parser.add_argument(
        "--external-data", action="store_true", help="weights in chunkN.onnx.data even below 2 GB"
    )
    parser.add_argument("--cache-len", type=int, help="llama: KV cache slots (the context)")
    parser.add_argument("--sha", action="store_true", help="llama: apply the MHA->SHA pass")
    parser.add_argument(
        "--mask-value", type=float, help="llama: additive mask of hidden cache slots (-64)"
    )
    args = parser.parse_args(argv)

    from npuforge.export import export_checkpoint

    options = {
        "variant": args.variant,
        "tokens": args.tokens,
        "chunks": args.chunks,
        "dtype": args.dtype,
        "batch": args.batch,
        "ext_embedding": args.ext_embedding,
        "fp16_fixes": not args.no_fp16_fixes,
        "rescale_every": args.rescale_every,
        "wkv_scale": args.wkv_scale,
        "last_token_logits": args.last_token_logits,
        "external_data": True if args.external_data else None,
        "cache_len": args.cache_len,
        "sha": args.sha,
        "mask_value": args.mask_value,
    }
    export_checkpoint(args.checkpoint, args.out_dir, **options)


if __name__ == "__main__":
    sys.exit(run_cli(main))
