"""Where a build's time and memory go as the model grows: each step's wall time, peak
memory and bytes written, per model size, and how each grows with the parameter count.

Builds each model (default: SmolLM2-135M, then the Qwen2.5-0.5B and 1.5B shapes, which
are built on request only) for the given targets and precisions with the workflow, the
toolchains run natively so that a compile's processes are the step's own children, then
prints, per model, every step the build ran:

  wall s       the step's wall time (from its log's resources line, npuforge.cli)
  CPU s        CPU seconds of the step and of the processes it ran (not a container's):
               barely moved by other work on the host, where wall time is
  step MB      peak RSS of the step's own process
  child MB     peak total RSS of the processes the step ran (its toolchain jobs),
               sampled every 0.5 s
  together MB  peak total RSS of the step and those processes at one moment (sampled;
               "–" in logs from before it was recorded, where step + child MB bounds it)
  written      bytes of the step's outputs on disk: a file hard-linked from an earlier
               step's output (an onnx compile's graphs, a bundle's binaries) counts there

then each compile's check on its simulator (positions, calls per graph variant, worst and
mean logits cosine, top-1 agreement and perplexity change against fp32, and whether it
passed its gate), and a side-by-side table of the steps every model ran, with the growth
exponent of wall time, CPU time and peak memory between consecutive sizes (1.0: linear
in parameters; CPU time's is the one to trust when the builds shared the host). A step kept
in the machine cache from an earlier build (export, calibration) has no log line in a
fresh results directory: pass a fresh --results to measure everything.

    python bench/bench_scale.py [--models smollm2-135m,qwen2.5-0.5b-shape]
                                [--targets onnx,RK3588] [--precisions fp16]
                                [--verify-steps 16] [--budget-gb 14]
                                [--results /tmp/npuforge-bench-scale]
                                [--record docs/data/benches.yaml]

Growth from rows recorded on other days (builds too long to run together, each alone):

    python bench/bench_scale.py --from-records docs/data/benches.yaml \
        --models qwen2.5-0.5b-shape,qwen2.5-1.5b-shape [--record docs/data/benches.yaml]

pairs each model's recorded steps by name (a compile by target and precision, a shared
step by the targets it was run for) and prints and records their growth exponents; the
rows keep their own dates, loads and budgets, which the exponents inherit.

--verify-steps overrides every model's verification length (positions checked on the
simulators), which dominates the wall time of the larger models' compile steps;
--budget-gb every target's memory_budget_gb (the registry's stop the seed-size shapes at
planning on most targets: npuforge plans chunks to fit the budget). A build
that fails still reports what its finished steps measured.
"""

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_real_model import table  # noqa: E402

from npuforge.cli import read_step_resources  # noqa: E402
from npuforge.measurements import figures_of  # noqa: E402

# Where each step writes, relative to the results directory, from what follows
# logs/<step>/ in its log's path (``rest``, without .log): rules/*.smk's outputs.
STEP_OUTPUTS = {
    "fetch": ["models/{model}/checkpoint.{fmt}", "models/{model}/checkpoint.{fmt}.json"],
    "dequantize": ["models/{rest}/dequantized.hf", "models/{rest}/dequantized.hf.json"],
    "permute": ["models/{rest}/permuted.hf", "models/{rest}/permuted.hf.json"],
    "export": ["export/{rest}"],
    "calibrate": ["calibration/{rest}"],
    # Removed once the compile lands (Snakemake temp): measured only while it waits.
    "compile-chunk": ["compile-chunks/{rest}"],
    "compile": ["compile/{rest}"],
    "verify": ["verify/{rest}.json"],
    "package": ["release/{rest}", "release/{rest}.tar.gz"],
    "heldout": ["heldout/{rest}.json"],
}
# Steps run once per export key are summed per model (time, bytes) or maxed (memory).
PER_KEY_STEPS = ("export", "calibrate", "verify")


def build_command(args, model: str, results: Path, overlay: Path | None) -> list[str]:
    command = [sys.executable, "-m", "snakemake", "--cores", str(args.cores), "--keep-going"]
    if overlay:
        command += ["--configfile", str(overlay)]
    return command + [
        "--config",
        f"model={model}",
        f"target={args.targets}",
        f"precision={args.precisions}",
        f"results={results}",
        "toolchain_runtime=native",
    ]


def write_overlay(args, models: list[str]) -> Path | None:
    """A --configfile with the run's overrides: every model's verify_steps, every
    target's memory_budget_gb."""
    body = {}
    if args.verify_steps is not None:
        body["models"] = {model: {"verify_steps": args.verify_steps} for model in models}
    if args.budget_gb is not None:
        targets = args.targets.split(",")
        body["targets"] = {target: {"memory_budget_gb": args.budget_gb} for target in targets}
    if not body:
        return None
    import yaml

    overlay = args.results / "overrides.yaml"
    overlay.parent.mkdir(parents=True, exist_ok=True)
    overlay.write_text(yaml.safe_dump(body, sort_keys=False))
    return overlay


def tree_bytes(path: Path, seen: set) -> int:
    """Bytes under ``path`` (a file or a directory), following the machine cache's links;
    each file once: those whose (device, inode) is in ``seen`` are skipped, the rest added."""
    total = 0
    for item in [path] if path.is_file() else path.rglob("*"):
        if item.is_file():
            stat = item.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def written_bytes(results: Path, step: str, rest: str, model: str, seen: set) -> int:
    fmt = rest[len(model) + 1 :] if step == "fetch" else ""
    total = 0
    for pattern in STEP_OUTPUTS.get(step, []):
        path = results / pattern.format(rest=rest, model=model, fmt=fmt)
        if path.exists():
            total += tree_bytes(path, seen)
    return total


def step_rows(results: Path, model: str) -> list[dict]:
    """Every finished step of ``model`` in ``results``: its log's resources line and the
    bytes of its outputs; a step that failed after running its toolchain job, with what
    it had used, as job "<job> (failed)" (a stage of its own: never added to a finished
    one)."""
    rows, outputs = [], []
    logs = results / "logs"
    for log in sorted(logs.rglob("*.log")):
        parts = log.relative_to(logs).with_suffix("").parts
        step, rest = parts[0], "/".join(parts[1:])
        if not (rest == model or rest.startswith(f"{model}/") or rest.startswith(f"{model}.")):
            continue
        text = log.read_text(errors="replace")
        figures = read_step_resources(text)
        failed = figures is None
        figures = figures or read_step_resources(text, failed=True)
        if figures is None:
            continue
        job = rest[len(model) :].lstrip("/.") or "-"
        rows.append({"step": step, "job": f"{job} (failed)" if failed else job, **figures})
        outputs.append((rows[-1], rest))
    # Bytes in the pipeline's order, so a file linked downstream counts at its maker.
    pipeline, seen = {step: i for i, step in enumerate(STEP_OUTPUTS)}, set()
    for row, rest in sorted(outputs, key=lambda o: pipeline.get(o[0]["step"], 0)):
        row["written"] = written_bytes(results, row["step"], rest, model, seen)
    return rows


# A failed gate's line (npuforge.backends.gate.check_gate) and the figures in it.
_FAILED_CHECK = re.compile(
    r"the simulator check over (\d+) positions of held-out text failed \((.*)"
)
_FAILED_FIGURES = {
    "cosine": r"logits cosine (-?[\d.]+(?:e-?\d+)?)",
    "cosine_mean": r"the mean (-?[\d.]+(?:e-?\d+)?)",
    "top1": r"top-1 agreement ([\d.]+)",
    "perplexity": r"\(([+-][\d.]+)%\)|perplexity ([+-][\d.]+)%",
}


def verification_rows(results: Path, model: str) -> list[dict]:
    """Each compile's check on its simulator: positions, calls per variant, worst and mean
    logits cosine, top-1 agreement and perplexity change against fp32, from compile.json
    where the compile landed, else from its log's failed-gate line (no calls there)."""
    rows = []
    logs = results / "logs" / "compile" / model
    for log in sorted(logs.rglob("*.log")) if logs.is_dir() else []:
        job = log.relative_to(logs).with_suffix("").as_posix()
        record = results / "compile" / model / job / "compile.json"
        if record.is_file():
            found = json.loads(record.read_text(encoding="utf-8")).get("verification")
            if not found:
                continue
            figures = figures_of(found)
            delta = figures.pop("perplexity_delta")
            figures["perplexity"] = None if delta is None else round(delta * 100, 2)
            figures["passed"] = bool(figures["passed"])
            rows.append({"job": job, "calls": found.get("calls"), **figures})
            continue
        failed = _FAILED_CHECK.search(log.read_text(errors="replace"))
        if failed is None:
            continue  # stopped before its check
        row = {"job": job, "positions": int(failed[1]), "calls": None, "passed": False}
        for key, pattern in _FAILED_FIGURES.items():
            match = re.search(pattern, failed[2])
            value = next((g for g in match.groups() if g is not None), None) if match else None
            row[key] = None if value is None else float(value)
        rows.append(row)
    return rows


def verification_table(rows: list[dict]) -> str:
    def cell(value):
        return "–" if value is None else str(value)

    body = [
        (
            r["job"],
            r["positions"],
            "–" if not r["calls"] else " + ".join(f"{n} {v}" for v, n in r["calls"].items()),
            cell(r["cosine"]),
            cell(r["cosine_mean"]),
            cell(r["top1"]),
            "–" if r["perplexity"] is None else f"{r['perplexity']:+.2f} %",
            "passes" if r["passed"] else "fails",
        )
        for r in rows
    ]
    header = ("job", "positions", "calls", "cosine", "mean", "top-1", "perplexity", "gate")
    return table(header, body)


def stage_of(row: dict) -> str:
    """The name a step has in every model's build: a compile or package job by its
    target and precision, a per-export-key step by its name alone."""
    if row["step"] in PER_KEY_STEPS or row["job"] == "-":
        return row["step"]
    if row["step"] == "compile-chunk":  # <target>/<precision>/<chunk>: one per build
        return f"{row['step']} {row['job'].rsplit('/', 1)[0]}"
    return f"{row['step']} {row['job']}"


def stages(rows: list[dict]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for row in rows:
        stage = merged.setdefault(
            stage_of(row),
            {
                "seconds": 0.0,
                "cpu_seconds": 0.0,
                "step_rss_mb": 0,
                "child_rss_mb": 0,
                "together_rss_mb": 0,
                "written": 0,
            },
        )
        stage["seconds"] += row["seconds"]
        # Unknown (a log from before the CPU figure) if any of its jobs' is.
        if stage["cpu_seconds"] is not None and row.get("cpu_seconds") is not None:
            stage["cpu_seconds"] += row["cpu_seconds"]
        else:
            stage["cpu_seconds"] = None
        stage["written"] += row["written"]
        stage["step_rss_mb"] = max(stage["step_rss_mb"], row["step_rss_mb"])
        stage["child_rss_mb"] = max(stage["child_rss_mb"], row["child_rss_mb"])
        if stage["together_rss_mb"] is not None and row.get("together_rss_mb") is not None:
            stage["together_rss_mb"] = max(stage["together_rss_mb"], row["together_rss_mb"])
        else:
            stage["together_rss_mb"] = None
    return merged


def cpu_figure(stage: dict):
    """A stage's CPU seconds for a data row, None where a log predates the figure."""
    cpu = stage.get("cpu_seconds")
    return None if cpu is None else round(cpu, 1)


def peak_mb(stage: dict) -> int:
    """The job's memory: the sampled peak of the step and the processes it ran together,
    or, in logs from before it was recorded, the sum of their peaks (an upper bound)."""
    together = stage.get("together_rss_mb")
    return together if together is not None else stage["step_rss_mb"] + stage["child_rss_mb"]


def exponent(small, large, params_small: int, params_large: int) -> str:
    """The growth exponent k of large = small * (params ratio)^k ("–" where either figure
    is unknown)."""
    if small is None or large is None:
        return "–"
    if small <= 0 or large <= 0 or params_large == params_small:
        return "–"
    return f"{math.log(large / small) / math.log(params_large / params_small):.2f}"


def model_table(rows: list[dict]) -> str:
    body = [
        (
            r["step"],
            r["job"],
            f"{r['seconds']:.1f}",
            "–" if r.get("cpu_seconds") is None else f"{r['cpu_seconds']:.1f}",
            r["step_rss_mb"],
            r["child_rss_mb"],
            "–" if r.get("together_rss_mb") is None else r["together_rss_mb"],
            f"{r['written'] / 1e6:.1f} MB",
        )
        for r in rows
    ]
    header = ("step", "job", "wall s", "CPU s", "step MB", "child MB", "together MB", "written")
    return table(header, body)


def growth_table(measured: list[tuple[str, int, dict]]) -> str:
    """Steps every model ran, side by side, with the growth exponents between sizes."""
    common = [s for s in measured[0][2] if all(s in stages_ for _, _, stages_ in measured)]
    header = ["stage"]
    for model, _params, _ in measured:
        header += [f"{model} s", f"{model} MB"]
    for (small, _, _), (large, _, _) in zip(measured, measured[1:], strict=False):
        header += [f"time k {small}->{large}", f"CPU k {small}->{large}"]
        header += [f"memory k {small}->{large}"]
    body = []
    for stage in common:
        row = [stage]
        for _, _, found in measured:
            row += [f"{found[stage]['seconds']:.1f}", peak_mb(found[stage])]
        for (_, p1, s1), (_, p2, s2) in zip(measured, measured[1:], strict=False):
            row += [
                exponent(s1[stage]["seconds"], s2[stage]["seconds"], p1, p2),
                exponent(s1[stage]["cpu_seconds"], s2[stage]["cpu_seconds"], p1, p2),
                exponent(peak_mb(s1[stage]), peak_mb(s2[stage]), p1, p2),
            ]
        body.append(tuple(row))
    return table(tuple(header), body)


def parameters(model: str) -> int:
    from npuforge.memory_plan import estimate_params
    from npuforge.registry import load_yaml

    return estimate_params(load_yaml(REPO / "config" / "models.yaml")[model])


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+]+", "-", text).strip("-")


def bench_rows(measured, args, checks: dict | None = None) -> list[dict]:
    from npuforge import measurements
    from npuforge.release import git_provenance

    git = git_provenance()
    commit = git["commit"][:7] + (" (dirty)" if git["dirty"] else "")
    command = " ".join(
        ["python bench/bench_scale.py", f"--models {args.models}", f"--targets {args.targets}"]
        + [f"--precisions {args.precisions}"]
        + ([f"--verify-steps {args.verify_steps}"] if args.verify_steps is not None else [])
        + ([f"--budget-gb {args.budget_gb:g}"] if args.budget_gb is not None else [])
    )
    rows = []
    for model, params, found in measured:
        for stage, figures in found.items():
            # A step that names no target (fetch, export, verify...) was run for this
            # build's targets: a build for other targets records its own row. A compile's
            # time holds its check: checks of other lengths are other settings.
            scope = "" if "/" in stage else f" (for {args.targets})"
            if stage.startswith("compile ") and args.verify_steps is not None:
                scope = f" ({args.verify_steps} positions)"
            rows.append(
                {
                    "id": f"scale-{model}-{slug(stage + scope)}",
                    "family": "scale",
                    "setting": f"{model} ({params / 1e6:.0f}M parameters): {stage}{scope}",
                    "figures": {
                        "wall s": round(figures["seconds"], 1),
                        "CPU s": cpu_figure(figures),
                        "step MB": figures["step_rss_mb"],
                        "processes MB": figures["child_rss_mb"],
                        "together MB": figures.get("together_rss_mb"),
                        "written MB": round(figures["written"] / 1e6, 1),
                    },
                    "date": measurements.today(),
                    "commit": commit,
                    "command": command,
                    "status": "current",
                }
            )
    for model, params, _ in measured:
        for check in (checks or {}).get(model, []):
            calls = check["calls"] or {}
            length = f" ({check['positions']} positions)"
            rows.append(
                {
                    "id": f"scale-check-{model}-{slug(check['job'] + length)}",
                    "family": "scale_verification",
                    "setting": f"{model} ({params / 1e6:.0f}M parameters): {check['job']}{length}",
                    "figures": {
                        "positions": check["positions"],
                        "calls": " + ".join(f"{n} {v}" for v, n in calls.items()) or "–",
                        "cosine": check["cosine"],
                        "cosine mean": check["cosine_mean"],
                        "top-1": check["top1"],
                        "perplexity %": check["perplexity"],
                        "gate": "passes" if check["passed"] else "fails",
                    },
                    "date": measurements.today(),
                    "commit": commit,
                    "command": command,
                    "status": "current",
                }
            )
    return rows + growth_rows(measured, command)


def recorded_stages(path: Path, model: str) -> dict:
    """A model's current ``scale`` rows in a bench data file, as stages keyed by the
    step's name with its scope ("compile RK3588/fp16 (16 positions)", "export (for
    RK3588)"); a compile's key names the positions its check verified, where the row's
    command gives them."""
    from npuforge.measurements import load_rows

    found = {}
    for row in load_rows(path):
        prefix = re.match(rf"{re.escape(model)} \(\d+M parameters\): (.*)$", row["setting"])
        if row.get("family") != "scale" or row.get("status") != "current" or not prefix:
            continue
        figures = row["figures"]
        stage = prefix.group(1)
        steps = re.search(r"--verify-steps (\d+)", row.get("command", ""))
        if stage.startswith("compile") and steps and not stage.endswith(" positions)"):
            # A compile's time holds its simulator check: only checks of the same length pair.
            stage += f" ({steps.group(1)} positions)"
        found[stage] = {
            "seconds": float(figures["wall s"]),
            "cpu_seconds": None if figures.get("CPU s") is None else float(figures["CPU s"]),
            "step_rss_mb": int(figures["step MB"]),
            "child_rss_mb": int(figures["processes MB"]),
            "together_rss_mb": (
                None if figures.get("together MB") is None else int(figures["together MB"])
            ),
            "written": float(figures["written MB"]) * 1e6,
        }
    return found


def growth_rows(measured, command: str) -> list[dict]:
    """The growth exponents between consecutive sizes of every step both measured."""
    from npuforge import measurements
    from npuforge.release import git_provenance

    git = git_provenance()
    commit = git["commit"][:7] + (" (dirty)" if git["dirty"] else "")
    rows = []
    for (small, p1, s1), (large, p2, s2) in zip(measured, measured[1:], strict=False):
        for stage in (s for s in s1 if s in s2):
            rows.append(
                {
                    "id": f"scale-growth-{small}-{large}-{slug(stage)}",
                    "family": "scale_growth",
                    "setting": f"{stage}: {small} -> {large}",
                    "figures": {
                        "time k": exponent(s1[stage]["seconds"], s2[stage]["seconds"], p1, p2),
                        "CPU k": exponent(
                            s1[stage]["cpu_seconds"], s2[stage]["cpu_seconds"], p1, p2
                        ),
                        "memory k": exponent(peak_mb(s1[stage]), peak_mb(s2[stage]), p1, p2),
                    },
                    "date": measurements.today(),
                    "commit": commit,
                    "command": command,
                    "status": "current",
                }
            )
    return rows


def from_records(args) -> int:
    """Growth between models from their recorded rows (--from-records)."""
    measured = []
    for model in args.models.split(","):
        found = recorded_stages(args.from_records, model)
        if not found:
            print(f"error: {args.from_records} has no current scale rows of {model}; "
                  "record its build with --record first", file=sys.stderr)  # fmt: skip
            return 1
        measured.append((model, parameters(model), found))
    measured.sort(key=lambda m: m[1])
    print("Growth (k: wall time, CPU time or peak memory ~ parameters^k), from recorded rows")
    print(growth_table(measured))
    if args.record:
        from npuforge.measurements import record_bench_rows

        command = (
            f"python bench/bench_scale.py --from-records {args.from_records} --models {args.models}"
        )
        written = record_bench_rows(args.record, growth_rows(measured, command))
        print(f"\nrecorded {len(written)} rows in {args.record}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b-shape,qwen2.5-1.5b-shape")
    parser.add_argument("--targets", default="onnx")
    parser.add_argument("--precisions", default="all")
    parser.add_argument("--verify-steps", type=int, help="positions every build verifies")
    parser.add_argument("--budget-gb", type=float, help="every target's memory_budget_gb")
    parser.add_argument("--results", type=Path, default=Path("/tmp/npuforge-bench-scale"))
    parser.add_argument("--cores", type=int, default=1, help="1: steps do not share the CPU")
    parser.add_argument("--report-only", action="store_true", help="print what --results holds")
    parser.add_argument("--record", type=Path, help="add the figures to this bench data file")
    parser.add_argument(
        "--from-records", type=Path, help="growth from this file's recorded rows: build nothing"
    )
    args = parser.parse_args()
    if args.from_records:
        return from_records(args)
    models = args.models.split(",")
    overlay = write_overlay(args, models)
    code = 0
    measured, checks = [], {}
    for model in models:
        results = args.results / model
        if not args.report_only:
            command = build_command(args, model, results, overlay)
            print("$", " ".join(command), flush=True)
            code = subprocess.run(command, cwd=REPO).returncode or code
        rows = step_rows(results, model)
        params = parameters(model)
        print(f"\n{model}: {params / 1e6:.0f}M parameters")
        print(model_table(rows))
        measured.append((model, params, stages(rows)))
        checks[model] = verification_rows(results, model)
        if checks[model]:
            print(f"\n{model}: the simulator checks")
            print(verification_table(checks[model]))
    measured = [m for m in measured if m[2]]
    if len(measured) > 1:
        measured.sort(key=lambda m: m[1])
        print("\nGrowth (k: wall time, CPU time or peak memory ~ parameters^k)")
        print(growth_table(measured))
    if args.record:
        from npuforge.measurements import record_bench_rows

        written = record_bench_rows(args.record, bench_rows(measured, args, checks))
        print(f"\nrecorded {len(written)} rows in {args.record}")
    return code


if __name__ == "__main__":
    sys.exit(main())
