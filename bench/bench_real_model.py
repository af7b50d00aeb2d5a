"""Wall time, peak memory and fidelity of a trained model's builds, stage by stage.

Builds one model (default smollm2-135m, the trained SmolLM2-135M-Instruct) for the
given targets and precisions with the workflow, then prints two tables:

  stages    every job the build ran (fetch, dequantize, export, calibrate, compile,
            verify, package) with its wall seconds and peak RSS, as Snakemake's
            benchmark files under <results>/benchmarks/ recorded them (RSS is
            sampled: every 0.5 s for a job's first 30 s, then every 30 s)
  fidelity  per binary: held-out positions, logits cosine (worst), top-1 agreement
            and perplexity change against fp32, the floors' verdict

    python bench/bench_real_model.py [--targets onnx,RK3588,SM8650] [--precisions all]
                                     [--model smollm2-135m] [--results /tmp/npuforge-bench-real]
                                     [--record docs/data/builds.yaml]

--record adds one row per binary's figures to the docs' data (npuforge.measurements), from
which the docs' tables are generated (python workflow_scripts/docs_data.py).

A build that fails its gate still reports its figures (the run keeps going).
Reruns reuse what the results directory holds; pass a fresh --results to time
everything again.
"""

import argparse
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# The figures a failed gate's line names (npuforge.backends.gate.check_gate).
FAILURE_FIGURES = {
    "positions": r"over (\d+) positions",
    "cosine": r"logits cosine (-?[\d.]+)",
    "top1": r"top-1 agreement ([\d.]+)",
    "ppl": r"perplexity ([+-][\d.]+%)",
}


def build_command(args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--cores",
        str(args.cores),
        "--keep-going",
        "--config",
        f"model={args.model}",
        f"target={args.targets}",
        f"precision={args.precisions}",
        f"results={args.results}",
    ]


def build(args) -> int:
    command = build_command(args)
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=REPO).returncode


def stage_rows(results: Path, model: str) -> list[tuple]:
    rows = []
    for tsv in sorted((results / "benchmarks").rglob("*.tsv")):
        job = tsv.relative_to(results / "benchmarks").with_suffix("")
        if model not in job.parts and not job.name.startswith(model):
            continue
        with tsv.open(encoding="utf-8") as handle:
            record = next(csv.DictReader(handle, delimiter="\t"), None)
        if record:
            rows.append((job.parts[0], "/".join(job.parts[1:]), record["s"], record["max_rss"]))
    return rows


def fidelity_rows(results: Path, model: str) -> list[tuple]:
    rows = []
    for compiled in sorted((results / "compile" / model).glob("*/*/compile.json")):
        record = json.loads(compiled.read_text())
        figures = record.get("verification") or {}
        ppl = figures.get("perplexity") or {}
        delta = ppl.get("delta")
        rows.append(
            (
                compiled.parent.parent.name,
                compiled.parent.name,
                figures.get("positions"),
                figures.get("cosine"),
                figures.get("top1_agreement"),
                "" if delta is None else f"{delta:+.2%}",
                "pass" if figures.get("passed") else "; ".join(figures.get("failures", [])),
            )
        )
    # Builds whose gate failed leave no compile.json: their one-line reason is in the log.
    for log in sorted((results / "logs" / "compile" / model).glob("*/*.log")):
        target, precision = log.parent.name, log.stem
        if not (results / "compile" / model / target / precision / "compile.json").exists():
            errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
            rows.append((target, precision, *failed_figures(errors[-1] if errors else "")))
    return rows


def failed_figures(line: str) -> tuple:
    """(positions, cosine, top-1, perplexity delta, verdict) from a failed gate's one line."""
    found = {}
    for key, pattern in FAILURE_FIGURES.items():
        match = re.search(pattern, line)
        found[key] = match.group(1) if match else ""
    verdict = "FAIL (gate)" if found["cosine"] else (line or "failed, no error line")
    return found["positions"], found["cosine"], found["top1"], found["ppl"], verdict


def record(args) -> list[str]:
    """One data row per binary the results hold: its verification figures, or a failed
    gate's figures from its one line."""
    from npuforge import measurements
    from npuforge.release import git_provenance

    git = git_provenance()
    commit = git["commit"] + (" (dirty)" if git["dirty"] else "")
    rows = []
    for compiled in sorted((args.results / "compile" / args.model).glob("*/*/compile.json")):
        record = json.loads(compiled.read_text())
        rows.append(
            (
                record["backend"],
                compiled.parent.parent.name,
                compiled.parent.name,
                measurements.figures_of(record.get("verification") or {}),
                (record.get("toolchain") or {}).get("versions") or {},
            )
        )
    backends = {t: e["backend"] for t, e in _targets().items()}
    for log in sorted((args.results / "logs" / "compile" / args.model).glob("*/*.log")):
        target, precision = log.parent.name, log.stem
        if (args.results / "compile" / args.model / target / precision / "compile.json").exists():
            continue
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        positions, cosine, top1, ppl, verdict = failed_figures(errors[-1] if errors else "")
        if not cosine:
            continue  # stopped before its gate: no figures to keep
        figures = {
            "positions": int(positions) if positions else None,
            "cosine": float(cosine),
            "top1": float(top1) if top1 else None,
            "perplexity_delta": float(ppl.rstrip("%")) / 100 if ppl else None,
            "passed": False,
        }
        rows.append((backends[target], target, precision, figures, {}))
    new = [
        measurements.build_row(
            model=args.model,
            target=target,
            precision=precision,
            backend=backend,
            figures=figures,
            toolchain=versions,
            date=measurements.today(),
            commit=commit,
            command=measurements.snakemake_command(args.model, target, precision),
            source="bench/bench_real_model.py",
            setting=f"the registry's settings at {commit[:7]}",
        )
        for backend, target, precision, figures, versions in rows
    ]
    return measurements.append_rows(args.record, new)


def _targets() -> dict:
    import yaml

    return yaml.safe_load((REPO / "config" / "targets.yaml").read_text())


def table(header: tuple, rows: list[tuple]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--targets", default="onnx,RK3588,SM8650")
    parser.add_argument("--precisions", default="all")
    parser.add_argument("--results", type=Path, default=Path("/tmp/npuforge-bench-real"))
    parser.add_argument("--cores", type=int, default=1, help="1: stages do not share the CPU")
    parser.add_argument("--report-only", action="store_true", help="print what --results holds")
    parser.add_argument("--record", type=Path, help="add the figures to this data file")
    args = parser.parse_args()
    code = 0 if args.report_only else build(args)
    print()
    print(table(("stage", "job", "wall s", "peak RSS MB"), stage_rows(args.results, args.model)))
    print()
    header = ("target", "precision", "positions", "cosine", "top-1", "ppl delta", "gate")
    print(table(header, fidelity_rows(args.results, args.model)))
    if args.record:
        added = record(args)
        print(f"\n{len(added)} rows added to {args.record}")
    return code


if __name__ == "__main__":
    sys.exit(main())
