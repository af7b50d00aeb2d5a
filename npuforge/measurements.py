"""Measured figures kept as data (the docs' tables are made from them by
``npuforge.docs_tables``).

``docs/data/builds.yaml`` holds one row per measured build: model, target, precision,
the setting built (the option values that matter, or an options digest), the figures
(positions, logits cosine, top-1 agreement, perplexity change, gate), toolchain
versions, date, npuforge commit, the command that reproduces it, and whether a later
row superseded it. ``docs/data/benches.yaml`` holds the other bench families' rows.
Rows come from three places: transcribed by hand, a release index (``snakemake docs``)
and the bench scripts (``append_rows``).

"""

import datetime
import hashlib
from pathlib import Path

import yaml

from npuforge.errors import NpuforgeError
from npuforge.fileio import atomic_path, dumps_json, read_json

BUILDS = Path("docs/data/builds.yaml")
BENCHES = Path("docs/data/benches.yaml")
# Where a build's figures were measured. The support matrix counts only the first: a
# vendor's simulator (QNN's x86 HTP simulator, rknn-toolkit2's, TPU-MLIR's cmodel) is
# what a build's gate judges.
VENDOR_SIMULATOR = "vendor simulator"
MEASURED_ON = (VENDOR_SIMULATOR, "onnxruntime CPU", "onnxruntime CPU proxy", "torch simulation")
STATUSES = ("current", "superseded")
REQUIRED = ("id", "model", "target", "precision", "setting", "measured_on", "figures",
            "date", "commit", "command", "status")  # fmt: skip
BENCH_REQUIRED = ("id", "family", "setting", "figures", "date", "commit", "command", "status")
FIGURES = ("positions", "cosine", "cosine_mean", "top1", "perplexity_delta", "passed")

HEADER = """\
# Measured builds, one row each; the docs' tables are generated from these rows
# (npuforge/docs_tables.py; python workflow_scripts/docs_data.py rewrites them).
# Rows are added by `snakemake docs` (from results/release/index.json), by the bench
# scripts (--record) or by hand. Keep superseded rows: mark them status: superseded.
#   setting        what was built: the option values that matter (markdown)
#   options_digest sha256 (12 hex) of the bundle's target options and export keys
#   measured_on    vendor simulator | onnxruntime CPU | onnxruntime CPU proxy | torch simulation
#   figures        positions, cosine (worst position), cosine_mean, top1,
#                  perplexity_delta (a fraction: -0.0024 is -0.24 %), passed (the gate),
#                  failure (the check that stopped a build, when no figure was reached)
#   series         the lever table (docs/backends/*.md) that lists the row
#   exact_on_source the lever that makes 4-bit weights exact on a 4-bit source checkpoint
#   commit         the npuforge commit the figures were measured at (or, transcribed,
#                  the commit that first recorded them); command: run at that commit
#   status         current: the latest measurement of what the registry builds;
#                  superseded: every earlier one, overlays and levers not kept
#                  (superseded_by names the row that replaced it, where recorded)
"""
BENCHES_HEADER = """\
# Measured figures of the bench scripts other than builds' fidelity (bench/*.py), one
# row each; `family` names the table (<!-- table:bench family=... -->) that lists them.
"""


# --------------------------------------------------------------------------- rows


def load_rows(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    try:
        rows = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    except yaml.YAMLError as err:
        raise NpuforgeError(f"{path}: not YAML ({err}); fix the file") from err
    if not isinstance(rows, list):
        raise NpuforgeError(f"{path}: expected a list of rows; fix the file")
    return rows


class _Dumper(yaml.SafeDumper):
    # Rows sharing one dict (a toolchain's versions) are written out each time, not
    # as YAML anchors a reader must follow.
    def ignore_aliases(self, data):
        return True


def dumps_rows(rows: list[dict], header: str = HEADER) -> str:
    body = yaml.dump(
        rows, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=4096,
        default_flow_style=None,
    )  # fmt: skip
    return header + body


def write_rows(path, rows: list[dict], header: str = HEADER) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(dumps_rows(rows, header), encoding="utf-8")


def check_rows(rows: list[dict], source="builds") -> None:
    """One line naming the first malformed row."""
    seen = set()
    for number, row in enumerate(rows, 1):
        where = f"{source} row {number} ({row.get('id', 'no id')})"
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            raise NpuforgeError(f"{where}: missing {', '.join(missing)}; add them")
        if row["id"] in seen:
            raise NpuforgeError(f"{where}: id used twice; give the row its own id")
        seen.add(row["id"])
        if row["status"] not in STATUSES:
            raise NpuforgeError(f"{where}: status must be one of {', '.join(STATUSES)}")
        if row["measured_on"] not in MEASURED_ON:
            raise NpuforgeError(f"{where}: measured_on must be one of {', '.join(MEASURED_ON)}")


def _pair(row: dict) -> tuple:
    return row["model"], row["target"], row["precision"], row["measured_on"]


def merge_rows(rows: list[dict], new_rows: list[dict]) -> tuple[list[dict], list[str]]:
    """``rows`` with ``new_rows`` appended (a row whose id is there already is left out);
    a new current row supersedes the current rows of its model, target, precision and
    measurement. Returns the rows and the ids added."""
    merged = [dict(row) for row in rows]
    known = {row["id"] for row in merged}
    added = []
    for new in new_rows:
        if new["id"] in known:
            continue
        if new["status"] == "current":
            for row in merged:
                if row["status"] == "current" and _pair(row) == _pair(new):
                    row["status"] = "superseded"
                    row["superseded_by"] = new["id"]
        merged.append(dict(new))
        known.add(new["id"])
        added.append(new["id"])
    check_rows(merged)
    return merged, added


def append_rows(path, new_rows: list[dict], header: str = HEADER) -> list[str]:
    """Merge ``new_rows`` into the data file at ``path`` (the bench scripts' entry)."""
    merged, added = merge_rows(load_rows(path), new_rows)
    if added:
        write_rows(path, merged, header)
    return added


def record_bench_rows(path, new_rows: list[dict]) -> list[str]:
    """Write ``new_rows`` into the bench data file at ``path``: a row whose id is there
    replaces it in place (a bench rerun measures the same setting again), the rest are
    appended. Returns the ids written."""
    rows = load_rows(path)
    for number, row in enumerate(new_rows, 1):
        missing = [key for key in BENCH_REQUIRED if key not in row]
        if missing:
            raise NpuforgeError(f"bench row {number}: missing {', '.join(missing)}; add them")
    fresh = {row["id"]: dict(row) for row in new_rows}
    if len(fresh) != len(new_rows):
        raise NpuforgeError("two new bench rows share an id; give each row its own id")
    merged = [fresh.pop(row["id"], row) for row in rows]
    merged += fresh.values()
    write_rows(path, merged, BENCHES_HEADER)
    return [row["id"] for row in new_rows]


def figures_of(verification: dict) -> dict:
    """The figures a row keeps, from a compile record's ``verification``."""
    perplexity = verification.get("perplexity") or {}
    return {
        "positions": verification.get("positions"),
        "cosine": verification.get("cosine"),
        "cosine_mean": verification.get("cosine_mean"),
        "top1": verification.get("top1_agreement"),
        "perplexity_delta": perplexity.get("delta"),
        "passed": verification.get("passed"),
    }


def measured_on(backend: str) -> str:
    return "onnxruntime CPU" if backend == "onnx" else VENDOR_SIMULATOR


def snakemake_command(model: str, target: str, precision: str) -> str:
    return (
        f".venv/bin/snakemake --cores all --config model={model} target={target} "
        f"precision={precision}"
    )


def options_digest(manifest: dict) -> str:
    """What a bundle was built with, as 12 hex digits: the target's options and export
    needs and the keys of the exports it read (each key hashes every export option)."""
    chosen = {
        "target": {k: manifest["target"].get(k) for k in ("options", "export")},
        "exports": [e["key"] for e in manifest["inputs"]["exports"]],
    }
    return hashlib.sha256(dumps_json(chosen).encode()).hexdigest()[:12]


SPLIT_LEVERS = ("group_offsets", "block_centres")


def exact_lever(manifest: dict) -> str | None:
    """The export option that put every weight group it split on the 4-bit grid (its
    ``export.json`` record: ``on_4bit_grid`` equal to ``matmuls``), if one did: such a
    build's 4-bit weights are exact by construction, which its figures should say."""
    for export in manifest["inputs"]["exports"]:
        for lever in SPLIT_LEVERS:
            record = export["export"].get(lever) or {}
            if record.get("matmuls") and record.get("on_4bit_grid") == record["matmuls"]:
                return lever
    return None


def build_row(*, model, target, precision, backend, figures, toolchain, date, commit,
              command, source, setting, digest=None, row_id=None, exact=None) -> dict:  # fmt: skip
    """A current row of one measured build. Without ``row_id`` the id is a digest of the
    build and its figures, so recording the same measurement twice adds one row."""
    if row_id is None:
        key = dumps_json([model, target, precision, figures, commit, digest])
        row_id = f"{model}/{target}/{precision}@{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    row = {
        "id": row_id,
        "model": model,
        "target": target,
        "precision": precision,
        "setting": setting,
        "options_digest": digest,
        "measured_on": measured_on(backend),
        "figures": figures,
        "toolchain": toolchain,
        "date": date,
        "commit": commit,
        "command": command,
        "source": source,
        "status": "current",
        "exact_on_source": exact,
    }
    return {key: value for key, value in row.items() if value is not None}


def today() -> str:
    return datetime.date.today().isoformat()


def rows_from_index(index: dict, release_dir, date: str | None = None) -> list[dict]:
    """One current row per bundle of a release index, with the npuforge commit and options
    its manifest records."""
    rows = []
    for bundle in index["bundles"]:
        manifest_path = Path(release_dir, bundle["model"], bundle["target"], bundle["precision"])
        manifest = read_json(manifest_path / "manifest.json")
        git = (manifest.get("npuforge") or {}).get("git") or {}
        commit = git.get("commit") or "unknown"
        if git.get("dirty"):
            commit += " (dirty)"
        verification = manifest.get("verification") or {}
        figures = figures_of(verification) if verification else dict(bundle["fidelity"])
        figures["binary_bytes"] = bundle["binary_bytes"]
        toolchain = dict(bundle["toolchain"]["versions"] or {})
        if bundle["toolchain"].get("runtime"):
            toolchain["runtime"] = bundle["toolchain"]["runtime"]
        rows.append(
            build_row(
                model=bundle["model"],
                target=bundle["target"],
                precision=bundle["precision"],
                backend=bundle["backend"],
                figures=figures,
                toolchain=toolchain,
                date=date or today(),
                commit=commit,
                command=snakemake_command(bundle["model"], bundle["target"], bundle["precision"]),
                source="release index",
                setting=f"as built at {commit[:7]} (options {options_digest(manifest)})",
                digest=options_digest(manifest),
                row_id=(
                    f"{bundle['model']}/{bundle['target']}/{bundle['precision']}"
                    f"@{bundle['manifest_sha256'][:12]}"
                ),
                exact=exact_lever(manifest),
            )
        )
    return rows


def record_index(index_path, data_path, date: str | None = None) -> list[str]:
    """Merge one row per bundle of a release index into the data file; the ids added."""
    index_path = Path(index_path)
    rows = rows_from_index(read_json(index_path), index_path.parent, date)
    return append_rows(data_path, rows)
