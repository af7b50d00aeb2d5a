"""Quantization levers in torch: SmolLM2-135M and its permuted twin against fp32.

Teacher-forced over the held-out text (data/calibration/heldout.txt, never calibrated
on) after the kv_prefix <|im_start|>, every decoder matmul's weights fake-quantized
(embedding, norms and lm_head fp32), for each weight grid and lever:

  grids   8-bit symmetric per output channel (QNN a16w8, TPU-MLIR W8F16);
          4-bit asymmetric in groups of 32 and of 64 (min..max per group, as TPU-MLIR's
          W4F16 with group_offsets and QNN's int4 blocks with block_centres see them)
  levers  round to nearest; rotation (npuforge.models.llama.rotation); GPTQ
          (npuforge.models.llama.rounding, on the project's calibration text);
          rotation then GPTQ; "range": each row's (group's) range searched
          (npuforge.quantization, search_range) for round to nearest or GPTQ;
          "generated": GPTQ's Hessians also from 64 sequences the model samples itself
          (npuforge.models.llama.sampling, gptq's generated option); "awq": input-channel
          scales searched for the row's grid on the calibration text and folded into the
          norms and up_proj (npuforge.models.llama.awq), then round to nearest or GPTQ
  w8a8    8-bit weights on RKNN's grid (asymmetric per output channel, zero on a level)
          plus every decoder matmul's input at 8 bits per tensor (zero on a level, as
          every backend's activation quantizer has it), ranges from the calibration
          samples the builds take (the registry's calibration plan: decode calls at
          seeded positions of the calibration text, each call's input only)
  w8a8-rk3588  the same, quantizing only what the registry's RK3588 w8a8 quantizes (the
          projections its float16 option does not name: q/k/v and gate/up)

Every row mirrors a build: the kv_prefix <|im_start|> never runs through the quantized
model; its cache comes from the model as the export writes it (fp32 weights, before GPTQ
rounds them), and the held-out text and calibration samples run from that cache.

Figures as the compile steps' gates judge them (npuforge.backends.gate.fidelity): top-1
agreement with fp32 and the change of the text's perplexity.

    python bench/bench_quant.py [--positions 96] [--models smollm2-135m,smollm2-135m-permuted]
                                [--results /tmp/npuforge-bench-quant] [--rows 4bit-g32:gptq,...]
                                [--heldout text|documents] [--jobs 2]
                                [--record docs/data/benches.yaml]

--heldout text (the default) scores the gates' held-out text, its first --positions
tokens; documents scores every token of the bench's own held-out documents
(data/calibration/heldout_bench: 11 documents in 7 languages, Python and C, 4.3k SmolLM2
tokens), in windows of --positions, each run from the prefix: one position there moves
top-1 by 0.0002 instead of 0.0104, so the held-out sample's own noise no longer hides
a lever's effect (GPTQ's spread between calibration sets and hosts stays).

--record writes one row per table row (family quantization_levers, the table of
docs/quantization.md; with --heldout documents, quantization_levers_documents) into the
docs' data (npuforge.measurements), replacing the rows of an earlier run.

The checkpoints are made by the workflow (fetch, dequantize, permute) into --results.
"""

import argparse
import copy
import dataclasses
import functools
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREFIX = [1]  # <|im_start|>, the registry's kv_prefix for SmolLM2
# Held-out documents only benches score (never calibrated on, no gate's input).
HELDOUT_DOCUMENTS = REPO / "data" / "calibration" / "heldout_bench"
ROTATION_SEED = 0
GENERATED = 64  # sequences the model samples for GPTQ's "generated" rows
EXPORT_CACHE = 256  # the registry's context_length for SmolLM2: the sampled sequences' cache
# Slots of the KV cache the bench runs with: the prefix, the held-out positions, and a
# calibration run (the graphs hold 256; unused slots are masked either way).
CALIBRATION_ROLES = ("mask", "rope_cos", "rope_sin", "cache_write", "cache_keep")


def checkpoints(args) -> dict:
    """Model id -> model directory, made by the workflow."""
    paths = {}
    for model in args.models:
        kind = "permuted" if model.endswith("-permuted") else "dequantized"
        paths[model] = args.results / "models" / model / f"{kind}.hf"
    missing = [str(p) for p in paths.values() if not p.is_dir()]
    if missing:
        command = [
            sys.executable, "-m", "snakemake", "--cores", "1",
            "--config", f"model={','.join(args.models)}", "target=onnx",
            f"results={args.results}", "--", *missing,
        ]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, check=True)
    return paths


def grids():
    from npuforge.quantization import WeightGrid

    return {
        "8bit-channel": WeightGrid(8, symmetric=True),
        "4bit-g32": WeightGrid(4, 32),
        "4bit-g64": WeightGrid(4, 64),
        # RKNN's weight grid (docs/quantization.md, found by experiment on rk3588 w8a8).
        "w8a8": WeightGrid(8, symmetric=False, integer_zero=True),
        "w8a8-rk3588": WeightGrid(8, symmetric=False, integer_zero=True),
    }


def prefix_caches(model, cache_len):
    """The kv_prefix's cache rows as the export writes them, from ``model`` in fp32."""
    from npuforge.models.llama.onnx_export import run_from_empty_cache

    return run_from_empty_cache(model, [PREFIX], cache_len)[1]


def run_after_prefix(model, caches, tokens):
    """Logits [T, vocab] of ``model`` over ``tokens`` from the kv_prefix's ``caches``, as
    a compiled graph runs them (the prefix's slots filled, positions after it)."""
    import torch

    from npuforge.models.llama.config import host_inputs

    host = host_inputs(
        model.cfg,
        batch=1,
        tokens=len(tokens),
        cache_len=caches[0].shape[2],
        position=len(PREFIX),
    )
    roles = (torch.from_numpy(host[r]) for r in CALIBRATION_ROLES)
    with torch.no_grad():
        return model(torch.tensor([tokens], dtype=torch.int64), *roles, caches)[0][0]


def quantized_inputs(model, ranges):
    """Forward pre-hooks rounding each ranged projection's input to 8 bits per tensor."""
    from npuforge.quantization import fake_quantize_tensor

    hooks = []
    for index, block in enumerate(model.layers):
        for owner in (block.self_attn, block.mlp):
            for name, linear in owner.named_children():
                if f"{index}.{name}" not in ranges:
                    continue
                low, high = ranges[f"{index}.{name}"]

                def quantize(_module, args, low=low, high=high):
                    return (fake_quantize_tensor(args[0], low, high),)

                hooks.append(linear.register_forward_pre_hook(quantize))
    return hooks


def held_out(tokenizer, vocab, which, positions) -> list[list[int]]:
    """The token windows a row is scored over, each run from the kv_prefix.

    ``text``: the gates' held-out text, its first ``positions`` tokens (one window, as
    the table was measured). ``documents``: every bench document (HELDOUT_DOCUMENTS)
    cut into windows of ``positions`` scored tokens, each window one token longer for
    its last target, so every token of the documents is scored once."""
    from npuforge import heldout, texts

    if which == "text":
        ids = heldout.tokenize(tokenizer, vocab)[: positions + 1]
        if len(ids) < positions + 1:
            raise SystemExit(f"the held-out text has {len(ids)} tokens; lower --positions")
        return [ids[:positions]]
    windows = []
    for doc in texts.tokenize_documents(texts.read_documents(HELDOUT_DOCUMENTS), vocab, tokenizer):
        doc = [int(t) for t in doc]
        windows += [doc[i : i + positions + 1] for i in range(0, len(doc) - 1, positions)]
    return windows


def evaluate(model, caches, windows, reference, ranges=None):
    """fidelity() of ``model`` over the ``windows`` (each after the prefix's ``caches``)
    against ``reference`` (None: return the logits of each window). One window is
    scored whole (top-1 over every row); several are pooled over the rows whose next
    token is in their window: top-1 over them all, perplexity over their mean
    log-likelihood, cosine the lowest."""
    import math

    from npuforge.backends.gate import fidelity, perplexity

    hooks = quantized_inputs(model, ranges or {})
    try:
        logits = [run_after_prefix(model, caches, window).numpy() for window in windows]
    finally:
        for hook in hooks:
            hook.remove()
    if reference is None:
        return logits
    if len(windows) == 1:
        return fidelity(reference[0], logits[0], windows[0][1:])
    parts = [
        fidelity(ref[:-1], out[:-1], window[1:])
        for ref, out, window in zip(reference, logits, windows, strict=True)
    ]
    rows = sum(p["positions"] for p in parts)
    misses = sum(len(p["top1_misses"]) for p in parts)

    def pooled(windows_logits):
        logs = (
            math.log(perplexity(x[:-1], window[1:])) * (len(window) - 1)
            for x, window in zip(windows_logits, windows, strict=True)
        )
        return math.exp(sum(logs) / rows)

    fp32, quantized = pooled(reference), pooled(logits)
    return {
        "positions": rows,
        "windows": len(windows),
        "cosine": min(p["cosine"] for p in parts),
        "top1_agreement": round(1 - misses / rows, 6),
        "perplexity": {
            "reference": round(fp32, 5),
            "compiled": round(quantized, 5),
            "delta": round(quantized / fp32 - 1, 6),
            "positions": rows,
        },
    }


def calibration_runs(model_id, doc_tokens):
    """Token runs of the builds' calibration samples: the registry's plan (samples,
    steps, seed) drawn as ``make_calibration_samples`` draws it for a KV-cache decode
    export (one token per call, capture step from 0); the last token of each run is the
    sampled call."""
    import numpy as np

    from npuforge.calibration import plan_samples
    from npuforge.registry import load_yaml

    settings = load_yaml(REPO / "config" / "config.yaml")["calibration"]
    settings = {**settings, **load_yaml(REPO / "config" / "models.yaml")[model_id]["calibration"]}
    plan = plan_samples(
        doc_tokens, settings["samples"], settings["steps"], settings["seed"], False, 0
    )
    return [
        [int(t) for t in np.resize(doc_tokens[doc][start:], capture + 1)]
        for doc, start, capture in plan
    ]


def sampled_ranges(model, caches, runs, names=None) -> dict:
    """(min, max) of every decoder projection's input (or only ``names``) over the last
    position of each calibration run from the prefix's ``caches``: the per-tensor ranges
    a backend calibrating on those samples sees."""
    from npuforge.models.llama.rounding import input_ranges

    def run(tokens):
        return run_after_prefix(model, caches, tokens)

    return input_ranges(model, runs, run, names=names, positions=-1)


def rk3588_float_names():
    """The projections the registry's RK3588 w8a8 keeps in float16 (its layers_named)."""
    from npuforge.registry import load_yaml

    options = load_yaml(REPO / "config" / "targets.yaml")["RK3588"]["options"]
    return set(options["float16"]["w8a8"]["layers_named"])


def calibration(model_dir, vocab, cap=None):
    """The project's calibration documents in the model's tokens, each cut at ``cap``."""
    from npuforge import texts
    from npuforge.models.llama.weights import checkpoint_tokenizer

    tokenizer, _ = checkpoint_tokenizer(model_dir)
    sequences = texts.tokenize_documents(texts.read_documents(None), vocab, tokenizer)
    return [list(map(int, s[:cap])) for s in sequences]


def run_model(model_id, model_dir, args, rows):
    import torch

    from npuforge.models.llama import awq, rotation, rounding, sampling
    from npuforge.models.llama.config import load_config
    from npuforge.models.llama.model import build_model
    from npuforge.models.llama.rounding import SUBLAYERS
    from npuforge.models.llama.weights import checkpoint_tokenizer, load_state_dict

    torch.set_grad_enabled(False)
    # One thread: GPTQ's column loop is many small ops, which a second thread only slows
    # (8-10x on a busy 2-core machine).
    torch.set_num_threads(args.threads)
    cfg = load_config(model_dir)
    tokenizer, _ = checkpoint_tokenizer(model_dir)
    windows = held_out(tokenizer, cfg.vocab_size, args.heldout, args.positions)
    # GPTQ's Hessians from whole documents, as the export takes them (5.8k tokens; cut at
    # the 255 positions the graphs hold, 2.8k, the twin's g32 top-1 fell from 0.76 to
    # 0.69); activation ranges from the builds' calibration samples.
    sequences = calibration(model_dir, cfg.vocab_size)
    runs = calibration_runs(model_id, sequences)
    cache_len = len(PREFIX) + max(*map(len, windows), *map(len, runs))
    plain = build_model(cfg, load_state_dict(model_dir), cache_len)
    rotated = copy.deepcopy(plain)
    rotation.rotate(rotated, ROTATION_SEED)
    bases = {False: plain, True: rotated}
    # The kv_prefix's rows come from the weights before any rounding, as the export
    # writes them: one cache per base model, whatever a row rounds.
    base_caches = {rotate: prefix_caches(base, cache_len) for rotate, base in bases.items()}
    reference = evaluate(plain, base_caches[False], windows, None)
    exact = evaluate(rotated, base_caches[True], windows, reference)
    yield {"model": model_id, "row": "rotation, fp32", **exact, "seconds": 0.0}
    every = {n for _, group in SUBLAYERS for n in group}

    @functools.cache
    def sampled_by(base):
        return sampling.generate(base, sequences, GENERATED, EXPORT_CACHE - len(PREFIX), PREFIX)

    @functools.cache
    def scaled_for(grid, rotate):
        scaled = copy.deepcopy(bases[rotate])
        awq.scale_decoder(scaled, sequences, PREFIX, grid)
        return scaled

    # The w8a8 rows' GPTQ'd exports, shared by the two ways of quantizing them.
    exports = {}
    for row in rows:
        name, _, lever = row.partition(":")
        grid = grids()[name]
        rotate, gptq = lever.startswith("rotation"), "gptq" in lever
        generated, scaled = lever.endswith("generated"), "awq" in lever.split("+")
        searched = dataclasses.replace(grid, search_range=lever.endswith("range"))
        start = time.perf_counter()
        # The export: fp32 weights (the backend rounds them; AWQ's scaled for its grid),
        # or the export's own rounding (GPTQ's, or to nearest on searched ranges).
        export = unrounded = scaled_for(grid, rotate) if scaled else bases[rotate]
        if gptq or searched.search_range:
            export = exports.get((searched, rotate, gptq, generated, scaled))
            if export is None:
                export = copy.deepcopy(unrounded)
                method = "gptq" if gptq else "nearest"
                texts = sequences + (sampled_by(bases[rotate]) if generated else [])
                rounding.round_decoder(export, texts, PREFIX, searched, method)
                if name.startswith("w8a8"):
                    exports[(searched, rotate, gptq, generated, scaled)] = export
        caches = base_caches[rotate]
        quantized = every - rk3588_float_names() if name == "w8a8-rk3588" else every
        ranges = None
        if name.startswith("w8a8"):
            ranges = sampled_ranges(export, caches, runs, quantized)
        # The backend's own rounding onto the grid it derives (GPTQ's weights stay put).
        model = copy.deepcopy(export)
        rounding.round_decoder(model, [], PREFIX, grid, "nearest", names=quantized)
        figures = evaluate(model, caches, windows, reference, ranges)
        seconds = time.perf_counter() - start
        yield {"model": model_id, "row": f"{name} {lever}", **figures, "seconds": seconds}
        del model


def measure_model(job) -> list[dict]:
    """Every row of one model, each printed as it is measured."""
    lines = []
    for line in run_model(*job):
        ppl = line["perplexity"]["delta"] * 100
        print(
            f"{line['model']:24} {line['row']:32} {line['top1_agreement']:6.3f} "
            f"{ppl:+8.2f}% {line['seconds']:6.0f}",
            flush=True,
        )
        lines.append(line)
    return lines


GRID_SETTINGS = {
    "8bit-channel": "8-bit symmetric per channel",
    "4bit-g32": "4-bit asymmetric, groups of 32",
    "4bit-g64": "4-bit asymmetric, groups of 64",
    "w8a8": "w8a8: 8-bit weights (RKNN's grid) and every decoder matmul's input 8-bit",
    "w8a8-rk3588": "w8a8 as RK3588 builds it: q/k/v, gate/up 8-bit; o_proj, down_proj float",
}
LEVER_SETTINGS = {
    "nearest": "round to nearest",
    "rotation": "rotation",
    "gptq": "GPTQ",
    "rotation+gptq": "rotation + GPTQ",
    "range": "round to nearest, range searched",
    "gptq+range": "GPTQ, range searched",
    "rotation+gptq+range": "rotation + GPTQ, range searched",
    "gptq+generated": "GPTQ, Hessians also from 64 sampled sequences",
    "rotation+gptq+generated": "rotation + GPTQ, Hessians also from 64 sampled sequences",
    "awq": "AWQ scales, round to nearest",
    "awq+gptq": "AWQ scales, then GPTQ",
    "rotation+awq+gptq": "rotation, AWQ scales, then GPTQ",
}


def record(path, results, models, argv, heldout="text") -> list[str]:
    """The table's rows as bench data rows (``npuforge.measurements``)."""
    from npuforge import docs_tables, measurements
    from npuforge.release import git_provenance

    git = git_provenance()
    names = {"smollm2-135m-permuted": "twin"}
    rows = []
    for row in dict.fromkeys(line["row"] for line in results):
        figures = {}
        for model in models:
            line = next(x for x in results if x["model"] == model and x["row"] == row)
            label = names.get(model, model)
            figures[f"{label} top-1"] = round(line["top1_agreement"], 3)
            figures[f"{label} perplexity"] = docs_tables.percent(line["perplexity"]["delta"])
        name, _, lever = row.partition(" ")
        setting = "fp32, rotated (exactness)"
        if name in GRID_SETTINGS:
            setting = f"{GRID_SETTINGS[name]}: {LEVER_SETTINGS[lever]}"
        family, ident = scored_on(
            heldout,
            "quantization_levers",
            "quant-levers",
            row.replace(" ", "-").replace("+", "-").replace(",", ""),
        )
        rows.append(
            {
                "id": ident,
                "family": family,
                "setting": setting,
                "figures": figures,
                "date": measurements.today(),
                "commit": git["commit"] + (" (dirty)" if git["dirty"] else ""),
                "command": "python bench/bench_quant.py " + " ".join(argv),
                "status": "current",
            }
        )
    # A run of fewer models leaves alone a row that holds figures of more (the exactness
    # row every run measures), rather than drop their figures.
    held = {row["id"]: row for row in measurements.load_rows(path)}
    rows = [row for row in rows if set(held.get(row["id"], row)["figures"]) <= set(row["figures"])]
    return measurements.record_bench_rows(path, rows)


HELDOUT_CHOICES = ("text", "documents")


def scored_on(heldout: str, family: str, bench: str, row: str) -> tuple[str, str]:
    """(family, id) of a bench row scored on ``heldout``: the documents' rows are a table
    of their own, their ids marked so."""
    if heldout == "text":
        return family, f"{bench}-{row}"
    return f"{family}_{heldout}", f"{bench}-{heldout}-{row}"


ALL_ROWS = [
    f"{grid}:{lever}"
    for grid in ("8bit-channel", "4bit-g32", "4bit-g64", "w8a8", "w8a8-rk3588")
    for lever in LEVER_SETTINGS
]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=96, help="positions per window")
    parser.add_argument("--heldout", default="text", choices=HELDOUT_CHOICES)
    parser.add_argument("--models", default="smollm2-135m,smollm2-135m-permuted")
    parser.add_argument("--results", type=Path, default=Path("/tmp/npuforge-bench-quant"))
    parser.add_argument("--rows", default=",".join(ALL_ROWS), help="grid:lever, comma list")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model")
    parser.add_argument("--jobs", type=int, default=1, help="models measured side by side")
    parser.add_argument("--record", type=Path, help="write the table into this bench data file")
    args = parser.parse_args()
    args.models = args.models.split(",")
    if args.positions < 64:
        raise SystemExit("--positions below 64 is too few for the perplexity gate's figures")
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ALL_ROWS]
    if unknown:
        raise SystemExit(f"unknown row {unknown[0]}; rows: {', '.join(ALL_ROWS)}")
    paths = checkpoints(args)
    results = []
    print(f"{'model':24} {'weights / lever':32} {'top-1':>6} {'ppl':>9} {'s':>6}", flush=True)
    jobs = [(model_id, model_dir, args, rows) for model_id, model_dir in paths.items()]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for lines in pool.imap(measure_model, jobs):
                results += lines
    else:
        for job in jobs:
            results += measure_model(job)
    print(f"\n| weights / lever | {' | '.join(args.models)} |")
    print(f"|---|{'---|' * len(args.models)}")
    for row in dict.fromkeys(line["row"] for line in results):
        cells = []
        for model_id in args.models:
            line = next(x for x in results if x["model"] == model_id and x["row"] == row)
            cells.append(
                f"{line['top1_agreement']:.3f} / {line['perplexity']['delta'] * 100:+.2f} %"
            )
        print(f"| {row} | {' | '.join(cells)} |")
    if args.record:
        argv = sys.argv[1:]
        if "--record" in argv:  # the command that reproduces the rows, not rewrites them
            del argv[argv.index("--record") : argv.index("--record") + 2]
        written = record(args.record, results, args.models, argv, args.heldout)
        print(f"\n{len(written)} rows written to {args.record}")


if __name__ == "__main__":
    main()
