"""Per-layer quantization error from a vendor's analysis tool, summarised for a build log.

A table is a list of rows {op, tensor, entire_cosine, single_cosine, ...} in graph
order: ``single`` is the layer alone fed fp32 inputs (its own quantization error; None
where the tool could not isolate it), ``entire`` the layer with every earlier one
quantized too (the error so far), ``htp`` (QNN) the whole quantized model run on the
vendor's simulator, read at the same values (where the device departs from the tool's
fake quantization).
"""

import re

from npuforge.errors import NpuforgeError

_LAYER = re.compile(r"layers\.(\d+)[/._]")
WORST_ROWS = 8


def check_steps(value) -> None:
    """The ``layer_error`` target option: a number of held-out steps (0: none)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise NpuforgeError(
            f"option layer_error must be a number of held-out steps (0: none), got {value!r}"
        )


def sample_steps(steps: int, samples: int) -> list[int]:
    """``samples`` verification steps spread evenly over ``steps`` (each at most once)."""
    samples = min(int(samples), int(steps))
    return sorted({int((j + 0.5) * steps / samples) for j in range(samples)})


def kind(tensor: str) -> str:
    """The tensor's name with its decoder layer index replaced by N."""
    return _LAYER.sub(lambda m: m.group(0).replace(m.group(1), "N"), tensor, count=1)


def summarize(tables: list[list[dict]], steps: list[int]) -> dict:
    """Worst layers, worst cosine per kind of layer, and the error after each decoder layer.

    ``tables``: one table per chunk, in chunk order.
    """
    rows = [{"chunk": i, **row} for i, table in enumerate(tables) for row in table]
    isolated = [row for row in rows if row["single_cosine"] is not None]
    kinds = {}
    for row in isolated:
        entry = kinds.setdefault(kind(row["tensor"]), {"layers": 0, "worst_single": 1.0})
        entry["layers"] += 1
        entry["worst_single"] = min(entry["worst_single"], row["single_cosine"])
    worst = sorted(isolated, key=lambda row: row["single_cosine"])[:WORST_ROWS]
    summary = {
        "held_out_steps": steps,
        "worst_layers": worst,
        "by_kind": dict(sorted(kinds.items(), key=lambda item: item[1]["worst_single"])),
    }
    columns = ["entire"] + (["htp"] if any(r.get("htp_cosine") is not None for r in rows) else [])
    for column in columns:
        key = f"{column}_cosine"
        after_layer = {}
        for row in rows:
            match = _LAYER.search(row["tensor"])
            if match and row.get(key) is not None:
                after_layer[int(match.group(1))] = row[key]  # the layer's last row
        summary[f"{key}_after_layer"] = [[i, after_layer[i]] for i in sorted(after_layer)]
        # Each chunk is fed fp32 inputs: its last row is what that chunk alone loses.
        summary[f"{key}_at_chunk_end"] = [table[-1].get(key) for table in tables if table]
    if "htp" in columns:
        # Where the HTP's execution departs from the fake quantization, by kind of layer.
        departs = {}
        for row in rows:
            if row.get("htp_cosine") is not None:
                gap = row["entire_cosine"] - row["htp_cosine"]
                entry = departs.setdefault(kind(row["tensor"]), {"layers": 0, "worst_gap": gap})
                entry["layers"] += 1
                entry["worst_gap"] = max(entry["worst_gap"], gap)
        summary["htp_departs_by_kind"] = dict(
            sorted(departs.items(), key=lambda item: -item[1]["worst_gap"])
        )
    return summary


def report_lines(summary: dict, tool: str) -> list[str]:
    """What a build log shows of a summary: where the error comes from, in a few lines."""
    lines = [
        f"layer error ({tool}; simulator against fp32, worst of held-out steps "
        f"{summary['held_out_steps']}): single = the layer alone on fp32 inputs, entire = "
        "with every earlier layer quantized"
    ]
    if "htp_cosine_after_layer" in summary:
        lines.append(
            "  htp = the whole quantized model on the HTP simulator, read at the same values"
        )
    for row in summary["worst_layers"]:
        htp = row.get("htp_cosine")
        lines.append(
            f"  worst: [{row['op']}] {row['tensor']} (chunk {row['chunk']}): single "
            f"{row['single_cosine']:.5f}, entire {row['entire_cosine']:.5f}"
            + ("" if htp is None else f", htp {htp:.5f}")
        )
    for name, entry in list(summary["by_kind"].items())[:WORST_ROWS]:
        lines.append(
            f"  kind: {name}: worst single {entry['worst_single']:.5f} over {entry['layers']}"
        )
    for name, entry in list(summary.get("htp_departs_by_kind", {}).items())[:WORST_ROWS]:
        lines.append(
            f"  htp departs: {name}: entire - htp up to {entry['worst_gap']:.5f} "
            f"over {entry['layers']}"
        )
    for column in ("entire", "htp"):
        ends = summary.get(f"{column}_cosine_at_chunk_end")
        if ends is None:
            continue
        lines.append(
            f"  {column} cosine at each chunk's last layer: "
            + " ".join("-" if c is None else f"{c:.5f}" for c in ends)
        )
        after = summary[f"{column}_cosine_after_layer"]
        if after:
            lines.append(
                f"  {column} cosine after each decoder layer: "
                + " ".join(f"{layer}:{value:.4f}" for layer, value in after)
            )
    return lines
