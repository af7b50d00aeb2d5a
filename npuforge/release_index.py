"""The release index and report: one row per built bundle, from the bundles themselves.

``results/release/index.json`` lists every bundle under ``results/release`` (model,
target, precision, binary size, fidelity, toolchain versions, sha256). It is a pure
function of the bundles' bytes, so a rebuild that reproduces the bundles reproduces the
index. Compile wall time and peak memory vary run to run, so they join the report's
table (from Snakemake's benchmark records), not the index.
"""

import csv
import html
import math
from pathlib import Path

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, read_json, sha256_file, write_json
from npuforge.release import MANIFEST, SUMS

INDEX_FORMAT = 1
# Snakemake benchmark columns: wall seconds and peak resident set size (MB).
WALL_COLUMN, RSS_COLUMN = "s", "max_rss"


def _manifest(path: Path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError) as err:
        raise NpuforgeError(
            f"{path}: unreadable bundle manifest ({err}); rebuild the bundle "
            f"(delete its directory and rerun snakemake)"
        ) from err


def _listed_sha256(bundle: Path, name: str) -> str | None:
    for line in (bundle / SUMS).read_text(encoding="utf-8").splitlines():
        digest, _, listed = line.partition("  ")
        if listed == name:
            return digest
    return None


def bundle_row(bundle: Path) -> dict:
    """One index row from a bundle directory ({model}/{target}/{precision})."""
    manifest_path = bundle / MANIFEST
    manifest = _manifest(manifest_path)
    manifest_sha256 = sha256_file(manifest_path)
    if (bundle / SUMS).is_file() and _listed_sha256(bundle, MANIFEST) != manifest_sha256:
        raise NpuforgeError(
            f"{bundle}: manifest.json does not match its SHA256SUMS line; the bundle was "
            f"edited after packaging, rebuild it (delete the directory and rerun snakemake)"
        )
    compiled = manifest["compile"]
    verification = manifest.get("verification") or compiled.get("verification") or {}
    perplexity = verification.get("perplexity") or {}
    toolchain = compiled.get("toolchain") or {}
    binaries = [a["file"] for a in compiled.get("artifacts", []) if a.get("role") == "binary"]
    tarball = bundle.parent / f"{bundle.name}.tar.gz"
    return {
        "model": manifest["model"]["id"],
        "target": manifest["target"]["id"],
        "backend": manifest["target"]["backend"],
        "precision": manifest["precision"],
        "binaries": binaries,
        "binary_bytes": sum((bundle / name).stat().st_size for name in binaries),
        "fidelity": {
            "cosine": verification.get("cosine"),
            "top1": verification.get("top1_agreement"),
            "perplexity_delta": perplexity.get("delta"),
            "positions": verification.get("positions"),
            "passed": verification.get("passed"),
        },
        "toolchain": {
            "runtime": toolchain.get("runtime"),
            "versions": toolchain.get("versions") or {},
        },
        "environment": manifest.get("environment", {}).get("packages", {}),
        "manifest_sha256": manifest_sha256,
        "tarball": tarball.name if tarball.is_file() else None,
        "tarball_sha256": sha256_file(tarball) if tarball.is_file() else None,
    }


def find_bundles(release_dir) -> list[Path]:
    """Every bundle directory under release_dir, sorted by model, target, precision."""
    return sorted(p.parent for p in Path(release_dir).glob(f"*/*/*/{MANIFEST}"))


def build_index(release_dir) -> dict:
    bundles = find_bundles(release_dir)
    if not bundles:
        raise NpuforgeError(
            f"{release_dir}: no release bundles (*/*/*/manifest.json); build some first "
            f"(snakemake --cores all)"
        )
    return {"format": INDEX_FORMAT, "bundles": [bundle_row(b) for b in bundles]}


def write_index(release_dir, out) -> dict:
    index = build_index(release_dir)
    write_json(out, index)
    return index


def read_benchmark(path) -> dict:
    """Wall seconds and peak RSS (MB) of a Snakemake benchmark record; {} when absent."""
    path = Path(path)
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    if not rows:
        return {}

    def number(column):
        try:
            return float(rows[-1][column])
        except (KeyError, TypeError, ValueError):
            return None  # "NA": the job ended before psutil sampled it

    return {"seconds": number(WALL_COLUMN), "max_rss_mb": number(RSS_COLUMN)}


def compile_benchmark(benchmarks_dir, row: dict) -> dict:
    path = Path(benchmarks_dir) / "compile" / row["model"] / row["target"]
    return read_benchmark(path / f"{row['precision']}.tsv")


TABLE_COLUMNS = (
    ("model", "Model"),
    ("target", "Target"),
    ("precision", "Precision"),
    ("binary_bytes", "Binary (MB)"),
    ("cosine", "Cosine"),
    ("top1", "Top-1"),
    ("perplexity_delta", "Perplexity Δ"),
    ("passed", "Passed"),
    ("compile_seconds", "Compile (s)"),
    ("compile_max_rss_mb", "Peak RSS (MB)"),
    ("toolchain", "Toolchain"),
    ("manifest_sha256", "manifest.json sha256"),
    ("tarball_sha256", "Tarball sha256"),
)


def table_rows(index: dict, benchmarks_dir) -> list[dict]:
    """The report's rows: the index joined with each compile's benchmark record."""
    rows = []
    for bundle in index["bundles"]:
        bench = compile_benchmark(benchmarks_dir, bundle)
        versions = bundle["toolchain"]["versions"] or bundle["environment"]
        rows.append(
            {
                "model": bundle["model"],
                "target": bundle["target"],
                "precision": bundle["precision"],
                "binary_bytes": bundle["binary_bytes"],
                **{k: bundle["fidelity"][k] for k in ("cosine", "top1", "perplexity_delta")},
                "passed": bundle["fidelity"]["passed"],
                "compile_seconds": bench.get("seconds"),
                "compile_max_rss_mb": bench.get("max_rss_mb"),
                "toolchain": ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
                "manifest_sha256": bundle["manifest_sha256"],
                "tarball_sha256": bundle["tarball_sha256"],
            }
        )
    return rows


def _cell(key: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key == "binary_bytes":
        return f"{value / 1e6:.2f}"
    if key in ("cosine", "top1"):
        return f"{value:.5f}"
    if key == "perplexity_delta":
        return f"{value * 100:+.3f} %"
    if key in ("compile_seconds", "compile_max_rss_mb"):
        return f"{value:.1f}"
    if key == "passed":
        return "yes" if value else "NO"
    return str(value)


def write_table_html(rows: list[dict], out) -> None:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in TABLE_COLUMNS)
    body = "\n".join(
        "<tr>"
        + "".join(f"<td>{html.escape(_cell(key, row[key]))}</td>" for key, _ in TABLE_COLUMNS)
        + "</tr>"
        for row in rows
    )
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>npuforge bundles</title>'
        "<style>body{font-family:sans-serif;font-size:13px}"
        "table{border-collapse:collapse}th,td{border:1px solid #bbb;padding:3px 6px;"
        "text-align:left;white-space:nowrap}th{background:#eee}</style></head><body>\n"
        f'<table id="bundles">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n'
        "</tbody>\n</table>\n</body></html>\n"
    )
    with atomic_path(out) as tmp:
        Path(tmp).write_text(page, encoding="utf-8")


def _grouped_bars(ax, rows, value, ylabel):
    """Bars per target/precision (x), one bar per model."""
    groups = sorted({(r["target"], r["precision"]) for r in rows})
    models = sorted({r["model"] for r in rows})
    width = 0.8 / len(models)
    for i, model in enumerate(models):
        by_group = {(r["target"], r["precision"]): value(r) for r in rows if r["model"] == model}
        xs = [g + i * width for g in range(len(groups))]
        ys = [by_group.get(group) for group in groups]
        ax.bar(
            [x for x, y in zip(xs, ys, strict=True) if y is not None],
            [y for y in ys if y is not None],
            width,
            label=model,
        )
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{t}\n{p}" for t, p in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def _zoom_to_fidelity(ax, values):
    # Fidelity sits near 1: an axis from 0 would hide a 0.988 next to a 0.9994.
    values = [v for v in values if v is not None]
    if values:
        ax.set_ylim(max(0.0, min(min(values) - 0.002, 0.99)), 1.0005)


def write_plots(rows: list[dict], fidelity_out, size_out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    # PNG metadata without the matplotlib version string: the same rows give the same bytes.
    metadata = {"Software": None}
    fig, (cosine_ax, top1_ax) = plt.subplots(2, 1, figsize=(8, 6), constrained_layout=True)
    _grouped_bars(cosine_ax, rows, lambda r: r["cosine"], "cosine vs reference")
    _grouped_bars(top1_ax, rows, lambda r: r["top1"], "top-1 agreement")
    _zoom_to_fidelity(cosine_ax, [r["cosine"] for r in rows])
    _zoom_to_fidelity(top1_ax, [r["top1"] for r in rows])
    cosine_ax.set_title("Fidelity per target and precision")
    with atomic_path(fidelity_out) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata=metadata)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
    _grouped_bars(ax, rows, lambda r: r["binary_bytes"] / 1e6, "binary size (MB)")
    ax.set_title("Binary size per target and precision")
    with atomic_path(size_out) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata=metadata)
    plt.close(fig)


def write_report_parts(index_path, benchmarks_dir, table_out, fidelity_out, size_out) -> None:
    rows = table_rows(read_json(index_path), benchmarks_dir)
    write_table_html(rows, table_out)
    write_plots(rows, fidelity_out, size_out)
