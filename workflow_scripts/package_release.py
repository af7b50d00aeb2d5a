"""Assemble a release bundle: binaries, tokenizer, embedding, manifest.json, SHA256SUMS, tar.gz."""

import argparse
import json
import sys

from npuforge.cli import run_cli
from npuforge.errors import NpuforgeError
from npuforge.release import build_bundle


def _mapping(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise NpuforgeError(f"{flag} is not valid JSON ({err}); pass the registry entry") from err
    if not isinstance(value, dict):
        raise NpuforgeError(f"{flag} must be a JSON mapping (the registry entry)")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model id")
    parser.add_argument("--model-entry", required=True, help="the model's registry entry, JSON")
    parser.add_argument("--target", required=True, help="target id")
    parser.add_argument("--target-entry", required=True, help="the target's registry entry, JSON")
    parser.add_argument("--precision", required=True)
    parser.add_argument("--compiled", required=True, help="compile output dir with compile.json")
    parser.add_argument("--export", action="append", default=[], help="export dir (repeatable)")
    parser.add_argument(
        "--export-verification",
        action="append",
        default=[],
        help="verify_onnx report JSON (repeatable)",
    )
    shipped = parser.add_mutually_exclusive_group(required=True)
    shipped.add_argument("--tokenizer", help="tokenizer file to ship")
    shipped.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="the checkpoint has no tokenizer (registry tokenizer: none); the manifest says so",
    )
    parser.add_argument("--fetch-record", required=True, help="the checkpoint's fetch record JSON")
    parser.add_argument(
        "--dequantize-record", help="gguf.json of a dequantized GGUF checkpoint (format gguf)"
    )
    parser.add_argument("--out-dir", required=True, help="release directory to write")
    parser.add_argument("--tarball", required=True, help="tar.gz of the release directory")
    args = parser.parse_args(argv)
    build_bundle(
        model_id=args.model,
        model_entry=_mapping(args.model_entry, "--model-entry"),
        target_id=args.target,
        target_entry=_mapping(args.target_entry, "--target-entry"),
        precision=args.precision,
        compiled_dir=args.compiled,
        export_dirs=args.export,
        tokenizer=args.tokenizer,
        fetch_record=args.fetch_record,
        dequantize_record=args.dequantize_record,
        export_verification=args.export_verification,
        out_dir=args.out_dir,
        tarball=args.tarball,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
