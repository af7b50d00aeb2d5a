"""Where a weight grid loses: SmolLM2's (or its twin's) projections one kind, one layer
at a time, in torch against fp32.

Every decoder projection rounded to nearest on the grid, then the same with one kind of
projection (q_proj ... down_proj) left fp32, with only one kind rounded, and with one
layer left fp32 (``--skip-layers`` leaves those out); optionally mixed rows (``--four``,
one comma list per row: these kinds on the grid, the rest 8-bit per channel, to nearest
and with GPTQ). Held-out text (``--heldout``) and figures as bench_quant.py's (top-1
agreement, perplexity change), embedding, norms and lm_head fp32.

    python bench/bench_quant_sensitivity.py [--model smollm2-135m-permuted]
        [--grid 4bit-g32] [--four gate_proj,up_proj ...] [--skip-layers]
        [--heldout text|documents] [--jobs 2]
        [--record docs/data/benches.yaml]

--record writes the rows (family quantization_sensitivity, docs/quantization.md; with
--heldout documents, quantization_sensitivity_documents).
"""

import argparse
import copy
import multiprocessing
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cases(layers: int, mixes: list, per_layer: bool = True) -> list:
    """Rows: (name, kinds on the grid in layer i, kinds 8-bit per channel, method)."""
    every = set(KINDS)
    rows = [("every projection", lambda i: every, set(), "nearest")]
    rows += [(f"all but {k}", lambda i, k=k: every - {k}, set(), "nearest") for k in KINDS]
    rows += [(f"only {k}", lambda i, k=k: {k}, set(), "nearest") for k in KINDS]
    if per_layer:
        rows += [
            (f"all but layer {n}", lambda i, n=n: set() if i == n else every, set(), "nearest")
            for n in range(layers)
        ]
    for four in mixes:
        name = f"{'/'.join(four)} on the grid, the rest 8-bit per channel"
        rows += [
            (name, lambda i, four=four: set(four), every - set(four), method)
            for method in ("nearest", "gptq")
        ]
    return rows


class Setup:
    """The model, its reference logits and the grids, loaded once per process."""

    def __init__(self, args):
        import bench_quant
        import torch

        from npuforge.models.llama.config import load_config
        from npuforge.models.llama.model import build_model
        from npuforge.models.llama.weights import checkpoint_tokenizer, load_state_dict

        torch.set_grad_enabled(False)
        torch.set_num_threads(1)
        self.bench = bench_quant
        args.models = [args.model]
        model_dir = bench_quant.checkpoints(args)[args.model]
        cfg = load_config(model_dir)
        self.layers = cfg.num_layers
        tokenizer, _ = checkpoint_tokenizer(model_dir)
        self.windows = bench_quant.held_out(tokenizer, cfg.vocab_size, args.heldout, args.positions)
        self.sequences = bench_quant.calibration(model_dir, cfg.vocab_size)
        longest = max(*map(len, self.windows), *map(len, self.sequences))
        cache_len = len(bench_quant.PREFIX) + longest
        self.model = build_model(cfg, load_state_dict(model_dir), cache_len)
        self.caches = bench_quant.prefix_caches(self.model, cache_len)
        self.reference = self.evaluate(self.model, None)
        self.grid = bench_quant.grids()[args.grid]
        self.eight = bench_quant.grids()["8bit-channel"]

    def evaluate(self, model, reference):
        return self.bench.evaluate(model, self.caches, self.windows, reference)

    def measure(self, on_grid, eight, method) -> dict:
        """Figures with the kinds ``on_grid(layer)`` on the grid and ``eight`` 8-bit per
        channel (both by ``method``, as a build's export and backend would round them),
        the rest fp32."""
        from npuforge.models.llama import rounding
        from npuforge.quantization import round_to_nearest

        model = copy.deepcopy(self.model)
        if method == "gptq":
            prefix, four = self.bench.PREFIX, on_grid(0)
            rounding.round_decoder(model, self.sequences, prefix, self.grid, names=four)
            rounding.round_decoder(model, self.sequences, prefix, self.eight, names=eight)
        for index, block in enumerate(model.layers):
            for owner in (block.self_attn, block.mlp):
                for name, linear in owner.named_children():
                    grid = self.grid if name in on_grid(index) else None
                    grid = self.eight if name in eight else grid
                    if grid is not None:
                        linear.weight.copy_(round_to_nearest(linear.weight, grid))
        return self.evaluate(model, self.reference)


_SETUP = None


def measure_rows(job) -> list:
    """One process's share of the rows (every ``parts``-th from ``part``)."""
    global _SETUP
    args, part, parts = job
    _SETUP = _SETUP or Setup(args)
    lines = []
    rows = cases(_SETUP.layers, args.four, not args.skip_layers)
    for number, (name, on_grid, eight, method) in enumerate(rows):
        if number % parts != part:
            continue
        figures = _SETUP.measure(on_grid, eight, method)
        row = f"{name} ({'GPTQ' if method == 'gptq' else 'to nearest'})"
        line = {"number": number, "row": row, **figures}
        print(f"{row:64} {line['top1_agreement']:6.3f} {line['perplexity']['delta'] * 100:+8.2f}%",
              flush=True)  # fmt: skip
        lines.append(line)
    return lines


def record(path, args, results, argv) -> list:
    import bench_quant

    from npuforge import docs_tables, measurements
    from npuforge.release import git_provenance

    git = git_provenance()
    rows = []
    for line in sorted(results, key=lambda x: x["number"]):
        slug = line["row"].replace(" ", "-").replace("/", "-").replace(",", "")
        family, ident = bench_quant.scored_on(
            args.heldout,
            "quantization_sensitivity",
            "quant-sensitivity",
            f"{args.model}-{args.grid}-{slug}",
        )
        rows.append(
            {
                "id": ident,
                "family": family,
                "setting": f"{args.model}, {args.grid}: {line['row']}",
                "figures": {
                    "top-1": round(line["top1_agreement"], 3),
                    "perplexity": docs_tables.percent(line["perplexity"]["delta"]),
                },
                "date": measurements.today(),
                "commit": git["commit"] + (" (dirty)" if git["dirty"] else ""),
                "command": "python bench/bench_quant_sensitivity.py " + " ".join(argv),
                "status": "current",
            }
        )
    return measurements.record_bench_rows(path, rows)


def main():
    import bench_quant

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-permuted")
    parser.add_argument("--grid", default="4bit-g32", choices=("4bit-g32", "4bit-g64"))
    parser.add_argument(
        "--four", nargs="*", default=[], help="mixed rows: each the kinds (a,b,..) on the grid"
    )
    parser.add_argument("--skip-layers", action="store_true", help="no one-layer-fp32 rows")
    parser.add_argument("--positions", type=int, default=96, help="positions per window")
    parser.add_argument("--heldout", default="text", choices=bench_quant.HELDOUT_CHOICES)
    parser.add_argument("--results", type=Path, default=Path("/tmp/npuforge-bench-quant"))
    parser.add_argument("--jobs", type=int, default=1, help="processes side by side")
    parser.add_argument("--record", type=Path, help="write the rows into this bench data file")
    args = parser.parse_args()
    args.four = [[k for k in mix.split(",") if k] for mix in args.four]
    unknown = [k for mix in args.four for k in mix if k not in KINDS]
    if unknown:
        raise SystemExit(f"unknown projection {unknown[0]}; kinds: {', '.join(KINDS)}")

    args.models = [args.model]
    bench_quant.checkpoints(args)  # made once, before the processes share them
    jobs = [(args, part, args.jobs) for part in range(args.jobs)]
    results = []
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for lines in pool.imap(measure_rows, jobs):
                results += lines
    else:
        results = measure_rows(jobs[0])
    if args.record:
        argv = sys.argv[1:]
        if "--record" in argv:  # the command that reproduces the rows, not rewrites them
            del argv[argv.index("--record") : argv.index("--record") + 2]
        written = record(args.record, args, results, argv)
        print(f"\n{len(written)} rows written to {args.record}")


if __name__ == "__main__":
    main()
