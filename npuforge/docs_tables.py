"""The docs' tables, generated from the measured rows (``npuforge.measurements``).

Every table of the docs is generated from the rows, between marker comments::

    <!-- table:support-matrix model=smollm2-135m -->
    ...
    <!-- /table -->

``regenerate`` rewrites them; ``stale_pages`` says which pages disagree with the data.
"""

import json
import re
from pathlib import Path

import yaml

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path
from npuforge.measurements import BENCHES, BUILDS, VENDOR_SIMULATOR, check_rows, load_rows

# The pages whose tables are generated (relative to the checkout).
PAGES = ("README.md", "envs/*/README.md", "docs/**/*.md")


# --------------------------------------------------------------------------- cells


def _number(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return repr(value) if isinstance(value, float) else str(value)


def percent(delta) -> str:
    """A perplexity change (a fraction) as the docs write it: +0.42 %, -0.024 %, +445 %."""
    if delta is None:
        return "–"
    value = delta * 100
    size = abs(value)
    if size >= 1000:
        return f"{value:+,.0f} %"
    decimals = 0 if size >= 100 else 1 if size >= 10 else 2 if size >= 0.1 else 3
    return f"{value:+.{decimals}f} %"


def cosine_cell(figures: dict) -> str:
    worst, mean = figures.get("cosine"), figures.get("cosine_mean")
    if mean is None:
        return _number(worst)
    return f"{_number(worst)} / {_number(mean)}"


def gate_cell(figures: dict) -> str:
    passed = figures.get("passed")
    if passed is None:
        return "–"
    return "passes" if passed else "**fails**"


def escape(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


# --------------------------------------------------------------------------- tables


def _vendor_rows(rows, model, target, precision):
    return [
        row
        for row in rows
        if (row["model"], row["target"], row["precision"]) == (model, target, precision)
        and row["measured_on"] == VENDOR_SIMULATOR
    ]


def _best_failure(rows):
    """The failed build with the highest top-1 (then the smallest perplexity change)."""
    failed = [r for r in rows if r["figures"].get("passed") is False]
    scored = [r for r in failed if r["figures"].get("top1") is not None]
    if not scored:
        return failed[-1] if failed else None
    return max(
        scored,
        key=lambda r: (r["figures"]["top1"], -abs(r["figures"].get("perplexity_delta") or 0)),
    )


def pair_status(rows, model, target, precision) -> tuple[str, dict | None]:
    """(status, the row its figures come from) of one SoC and precision on ``model``."""
    measured = _vendor_rows(rows, model, target, precision)
    if not measured:
        return "not measured", None
    current = [r for r in measured if r["status"] == "current"]
    passing = [r for r in current if r["figures"].get("passed")]
    if passing:
        row = passing[-1]
        lever = row.get("exact_on_source")
        if lever:
            return f"passes, 4-bit exact by construction (`{lever}`)†", row
        return "passes", row
    best = _best_failure(measured)
    if best is None:
        return "no current measurement", None
    if best["status"] == "current":
        return "**fails**", best
    tried = len([r for r in measured if r["figures"].get("passed") is False])
    return f"**fails**; best of {tried} builds: {best['setting']}", best


# Precisions whose weights are floats: the permuted twin judges only integer ones.
FLOAT_PRECISIONS = ("fp32", "fp16", "f16", "bf16")


def _twin_result(rows, twin: str, target: str, precision: str):
    """None (the twin not measured), True (it passes) or its best failing row."""
    measured = _vendor_rows(rows, twin, target, precision)
    if not measured:
        return None
    if any(r["figures"].get("passed") for r in measured):
        return True
    return _best_failure(measured) or measured[-1]


def twin_status(rows, twin: str, target: str, precision: str) -> str:
    """What an integer precision that passes on a model did on its permuted ``twin``
    (the same function off a quantized source's grid): a pass counts only on both."""
    result = _twin_result(rows, twin, target, precision)
    if result is None:
        return "passes; its permuted twin not measured"
    if result is True:
        return "passes, on its permuted twin too"
    return "**fails** on its permuted twin (passes on these weights only): not built"


def twin_figures(rows, twin: str, target: str, precision: str) -> str:
    """What a 4-bit build exact on a quantized source did on the permuted ``twin``."""
    result = _twin_result(rows, twin, target, precision)
    if result is None:
        return "its permuted twin not measured"
    if result is True:
        return "passes on its permuted twin too"
    best = result["figures"]
    return (
        f"**fails** on its permuted twin (best: top-1 {_number(best.get('top1'))}, "
        f"perplexity {percent(best.get('perplexity_delta'))})"
    )


def support_matrix(rows, targets: dict, model: str, twin: str | None = None) -> str:
    """SoC x precision x status on ``model``: every registry target but the reference, in
    registry order; targets never measured on the model share one line per backend. With
    ``twin``, an integer precision's pass says what it did on the permuted twin."""
    body, unmeasured = [], {}
    for target, entry in targets.items():
        backend = entry.get("backend")
        if backend == "onnx":
            continue
        precisions = list(entry.get("precisions") or {})
        if not any(_vendor_rows(rows, model, target, p) for p in precisions):
            unmeasured.setdefault(backend, ([], []))
            names, union = unmeasured[backend]
            names.append(target)
            union += [p for p in precisions if p not in union]
            continue
        for precision in precisions:
            status, row = pair_status(rows, model, target, precision)
            if twin and status == "passes" and precision not in FLOAT_PRECISIONS:
                status = twin_status(rows, twin, target, precision)
            elif twin and row and row.get("exact_on_source"):
                # Exact on the GGUF's blocks: built for this model, the twin's figure shown.
                status += "; " + twin_figures(rows, twin, target, precision)
            figures = row["figures"] if row else {}
            measured = f"{row['date']}, {figures.get('positions')} positions" if row else "–"
            body.append(
                [
                    f"{target} ({backend})",
                    precision,
                    status,
                    _number(figures.get("top1")) if row else "–",
                    percent(figures.get("perplexity_delta")) if row else "–",
                    _number(figures.get("cosine")) if row else "–",
                    measured,
                ]
            )
    for backend, (names, union) in unmeasured.items():
        body.append([f"{', '.join(names)} ({backend})", ", ".join(union), "not measured"])
        body[-1] += ["–"] * 4
    header = ["SoC", "precision", f"on {model}", "top-1", "perplexity", "worst cosine",
              "measured"]  # fmt: skip
    table = markdown_table(header, body)
    if any("†" in row[2] for row in body):
        table += (
            "\n\n† The checkpoint is a Q4_1 GGUF: its weights are already 4-bit in blocks "
            "of 32 with a scale and minimum each, and the lever named puts those blocks on "
            "the quantizer's grid, so the 4-bit weights lose nothing here. A model not "
            "stored in 4-bit blocks has no such guarantee."
        )
    return table


# The fidelity goals of a trained model's integer precisions (issue 41), beside the gates
# a build must pass: (weights, top-1 agreement at least, perplexity change at most).
EIGHT_BIT = ("8-bit", 0.97, 0.02)
FOUR_BIT = ("4-bit", 0.92, 0.06)
PRECISION_GOALS = {
    **dict.fromkeys(("a16w8", "w8a8", "int8", "w8f16"), EIGHT_BIT),
    **dict.fromkeys(("a16w4", "w4f16"), FOUR_BIT),
}


# Positions a build must judge for its figures to meet a goal.
GOAL_POSITIONS = 64


def meets_goal(figures: dict, precision: str) -> bool:
    _, top1, perplexity = PRECISION_GOALS[precision]
    delta = figures.get("perplexity_delta")
    return bool(
        figures.get("passed")
        and (figures.get("positions") or 0) >= GOAL_POSITIONS
        and (figures.get("top1") or 0) >= top1
        and delta is not None
        and delta <= perplexity
    )


def _best_build(measured: list, precision: str):
    """The row nearest the goal: meeting it, else over the goal's positions, passing the
    gate, the highest top-1 (then the smallest perplexity change); the latest of equals."""
    return max(
        reversed(measured),
        key=lambda r: (
            meets_goal(r["figures"], precision),
            (r["figures"].get("positions") or 0) >= GOAL_POSITIONS,
            bool(r["figures"].get("passed")),
            r["figures"].get("top1") or 0,
            -abs(r["figures"].get("perplexity_delta") or 0),
        ),
    )


def goals_table(rows, targets: dict, models: list[str]) -> str:
    """Every integer precision with a goal, on every registry SoC and each of ``models``:
    the best simulator build measured, whether it meets the goal, and how many builds
    tried (the row id names the build in docs/data/builds.yaml)."""
    body = []
    for target, entry in targets.items():
        for precision in entry.get("precisions") or {}:
            if precision not in PRECISION_GOALS:
                continue
            kind, top1, perplexity = PRECISION_GOALS[precision]
            goal = f"{kind}: >= {top1}, <= {percent(perplexity)} over {GOAL_POSITIONS}"
            by_model = {m: _vendor_rows(rows, m, target, precision) for m in models}
            if not any(by_model.values()):
                continue
            for model, measured in by_model.items():
                if not measured:
                    body.append([f"{target} {precision}", model, goal, "not measured"] + ["–"] * 6)
                    continue
                best = _best_build(measured, precision)
                figures = best["figures"]
                if figures.get("top1") is None:
                    verdict = "misses it: no binary"
                elif not meets_goal(figures, precision):
                    verdict = "misses it"
                elif best.get("exact_on_source"):
                    verdict = f"**meets it**, exact by construction (`{best['exact_on_source']}`)"
                else:
                    verdict = "**meets it**"
                body.append(
                    [
                        f"{target} {precision}",
                        model,
                        goal,
                        verdict,
                        _number(figures.get("top1")),
                        percent(figures.get("perplexity_delta")),
                        gate_cell(figures),
                        f"`{best['id']}` ({best['status']}, {best['date']})",
                        str(len(measured)),
                        _number(figures.get("positions")),
                    ]
                )
    header = ["SoC and precision", "model", "goal", "best build", "top-1", "perplexity",
              "gate", "that build", "builds", "positions"]  # fmt: skip
    return markdown_table(header, body)


def series_table(rows, name: str, commands: bool = False) -> str:
    """A lever table: the rows of one series in data order, their columns as needed;
    with ``commands`` a last column gives the command that reproduces each row."""
    chosen = [row for row in rows if row.get("series") == name]
    if not chosen:
        raise NpuforgeError(f"no data rows of series '{name}'; add them or fix the marker")
    columns = [("setting", lambda r: r["setting"])]
    if len({r["target"] for r in chosen}) > 1 or len({r["precision"] for r in chosen}) > 1:
        columns.insert(0, ("build", lambda r: f"{r['model']} {r['target']} {r['precision']}"))
    if len({r["measured_on"] for r in chosen}) > 1:
        columns.append(("on", lambda r: r["measured_on"]))
    columns += [
        ("positions", lambda r: _number(r["figures"].get("positions"))),
        ("cosine (worst / mean)", lambda r: cosine_cell(r["figures"])),
        ("top-1", lambda r: _number(r["figures"].get("top1"))),
        ("perplexity", lambda r: percent(r["figures"].get("perplexity_delta"))),
        ("gate", lambda r: gate_cell(r["figures"])),
    ]
    if any(r["figures"].get("binary_bytes") for r in chosen):
        columns.append(("binary", lambda r: _bytes(r["figures"].get("binary_bytes"))))
    if any(r.get("note") or r["figures"].get("failure") for r in chosen):
        columns.append(("note", _note))
    columns += [
        ("date", lambda r: r["date"]),
        ("status", lambda r: r["status"]),
    ]
    if commands:
        columns.append(("command", lambda r: f"`{r['command']}`"))
    return markdown_table(
        [title for title, _ in columns], [[cell(r) for _, cell in columns] for r in chosen]
    )


def _bytes(value) -> str:
    return "–" if not value else f"{value:,} B"


def _note(row) -> str:
    parts = [row["figures"].get("failure"), row.get("note")]
    return "; ".join(str(p) for p in parts if p) or ""


BENCH_LABELS = {"tokens_per_s": "tokens/s"}


def bench_table(bench_rows, family: str) -> str:
    """One bench family's rows: its setting, then each figure any row has, in the order
    the rows first name them ("–" where a row lacks one: a figure added since)."""
    chosen = [row for row in bench_rows if row.get("family") == family]
    if not chosen:
        raise NpuforgeError(f"no bench rows of family '{family}'; add them or fix the marker")
    keys = list(dict.fromkeys(key for row in chosen for key in row["figures"]))
    header = ["setting", *(BENCH_LABELS.get(k, k.replace("_", " ")) for k in keys), "date"]
    body = [
        [row["setting"], *(_number(row["figures"].get(k)) for k in keys), row["date"]]
        for row in chosen
    ]
    return markdown_table(header, body)


# --------------------------------------------------------------------------- pages

MARKER = re.compile(
    r"(?P<open><!-- table:(?P<kind>[\w-]+)(?P<params>(?: [\w-]+=[^ ]+)*) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /table -->)",
    re.S,
)


def render(kind: str, params: dict, data: dict) -> str:
    if kind == "support-matrix":
        return support_matrix(data["builds"], data["targets"], params["model"], params.get("twin"))
    if kind == "series":
        commands = params.get("commands") == "yes"
        return series_table(data["builds"], params["name"], commands=commands)
    if kind == "bench":
        return bench_table(data["benches"], params["family"])
    if kind == "goals":
        return goals_table(data["builds"], data["targets"], params["models"].split(","))
    raise NpuforgeError(f"unknown table kind '{kind}' (support-matrix, series, bench, goals)")


def generated_text(text: str, data: dict) -> str:
    """``text`` with every marked table rewritten from ``data``."""

    def replace(match):
        params = dict(p.split("=", 1) for p in match["params"].split())
        return f"{match['open']}{render(match['kind'], params, data)}\n{match['close']}"

    return MARKER.sub(replace, text)


def load_data(root) -> dict:
    root = Path(root)
    builds = load_rows(root / BUILDS)
    check_rows(builds)
    benches = load_rows(root / BENCHES)
    targets = yaml.safe_load((root / "config" / "targets.yaml").read_text(encoding="utf-8"))
    return {"builds": builds, "benches": benches, "targets": targets}


def pages(root) -> list[Path]:
    root = Path(root)
    found = {path for pattern in PAGES for path in root.glob(pattern)}
    return sorted(path for path in found if MARKER.search(path.read_text(encoding="utf-8")))


def stale_pages(root) -> list[Path]:
    """The pages whose generated tables differ from what the data gives."""
    data = load_data(root)
    return [
        page
        for page in pages(root)
        if generated_text(page.read_text(encoding="utf-8"), data)
        != page.read_text(encoding="utf-8")
    ]


def regenerate(root) -> list[Path]:
    """Rewrite every generated table under ``root`` from the data; the pages changed."""
    data = load_data(root)
    changed = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new = generated_text(text, data)
        if new != text:
            with atomic_path(page) as tmp:
                Path(tmp).write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


def summary(added: list[str], changed: list[Path], root) -> str:
    return json.dumps(
        {"rows_added": added, "pages_rewritten": [str(p.relative_to(root)) for p in changed]},
        indent=2,
    )
