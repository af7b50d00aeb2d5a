"""The README and docs/: generated tables agree with their data, every snakemake command in
the README plans, every page it links exists; the measurement rows' merge rules."""

import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, copy_workflow, script_env

from npuforge import docs_tables, measurements
from npuforge.errors import NpuforgeError

README = REPO / "README.md"
# Pages a user reaches from the README; their tables are generated (docs/data).
EXPECTED_PAGES = {
    "README.md",
    "docs/backends/qnn.md",
    "docs/backends/rknn.md",
    "docs/backends/tpumlir.md",
}


def test_readme_is_read_in_five_minutes():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail under docs/"


def test_generated_tables_match_their_data():
    pages = {str(p.relative_to(REPO)) for p in docs_tables.pages(REPO)}
    assert EXPECTED_PAGES <= pages
    stale = docs_tables.stale_pages(REPO)
    assert not stale, (
        f"{', '.join(str(p.relative_to(REPO)) for p in stale)}: generated tables differ from "
        f"docs/data; run python workflow_scripts/docs_data.py"
    )


def docs_copy(tmp_path):
    for part in ("README.md", "docs", "config"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / part)
    return tmp_path


def test_a_figure_edited_in_the_data_makes_its_pages_stale(tmp_path):
    root = docs_copy(tmp_path)
    data = root / measurements.BUILDS
    rows = measurements.load_rows(data)
    # The current SM8650 a16w8 build: the README's support matrix, the QNN page and the
    # quantization goals show it.
    (row,) = [r for r in rows if r["id"] == "sm8650-a16w8-mul-write"]
    row["figures"]["top1"] = 0.9454
    measurements.write_rows(data, rows)
    stale = {str(p.relative_to(root)) for p in docs_tables.stale_pages(root)}
    assert stale == {"README.md", "docs/backends/qnn.md", "docs/quantization.md"}
    check = subprocess.run(
        [sys.executable, str(REPO / "workflow_scripts" / "docs_data.py"), "--root", root,
         "--check"],
        capture_output=True, text=True, env=script_env(),
    )  # fmt: skip
    assert check.returncode == 2
    assert "generated tables differ from docs/data in README.md" in check.stderr
    changed = docs_tables.regenerate(root)
    assert {str(p.relative_to(root)) for p in changed} == stale
    assert "| 0.9454 |" in (root / "README.md").read_text()
    assert docs_tables.stale_pages(root) == []


def test_support_matrix_states_come_from_the_data():
    data = docs_tables.load_data(REPO)

    def status(target, precision):
        return docs_tables.pair_status(data["builds"], "smollm2-135m", target, precision)

    passing = ("SM8650 fp16", "RK3588 fp16", "RK3588 w16a16i_dfp", "BM1684X f16")
    for target, precision in (pair.split() for pair in passing):
        assert status(target, precision)[0] == "passes", (target, precision)
    # The 4-bit passes name the lever that makes Q4_1's blocks exact on the quantizer's grid.
    assert "`block_centres`" in status("SM8650", "a16w4")[0]
    assert "`group_offsets`" in status("BM1688", "w4f16")[0]
    text, best = status("RK3588", "w8a8")
    assert text.startswith("**fails**") and best["figures"]["top1"] == 0.969
    assert status("BM1688", "int8")[1]["figures"]["perplexity_delta"] == pytest.approx(0.0877)
    assert status("BM1684X", "int8") == ("not measured", None)
    # The smollm2-135m entry builds what passes, on its permuted twin too where measured
    # (integer precisions), and nothing else.
    model = yaml.safe_load((REPO / "config" / "models.yaml").read_text())["smollm2-135m"]
    twin = "smollm2-135m-permuted"
    # a16w8 passes on both since the KV rows are written with a Mul (2026-12-03: 0.984 and
    # 0.969): built for the model.
    assert status("SM8650", "a16w8")[0] == "passes"
    assert docs_tables.twin_status(data["builds"], twin, "SM8650", "a16w8") == (
        "passes, on its permuted twin too"
    )
    # A 4-bit build exact on the GGUF's blocks is built for this model whatever the twin
    # did (issue 41: the lever is a real feature for GGUF inputs); the matrix shows both.
    assert status("BM1688", "w4f16")[0].startswith("passes, 4-bit exact by construction")
    matrix = docs_tables.support_matrix(data["builds"], data["targets"], "smollm2-135m", twin)
    w4f16 = next(
        line for line in matrix.splitlines() if line.startswith("| BM1688 (tpumlir) | w4f16")
    )
    assert "**fails** on its permuted twin (best: top-1 0.75, perplexity +12.8 %)" in w4f16
    for target, precisions in model["precisions"].items():
        for precision in data["targets"][target]["precisions"]:
            text = status(target, precision)[0]
            passes = text.startswith("passes")
            if text == "passes" and precision not in docs_tables.FLOAT_PRECISIONS:
                on_twin = docs_tables.twin_status(data["builds"], twin, target, precision)
                passes = not on_twin.startswith("**fails")
            assert passes == (precision in precisions), (target, precision)


def row(row_id, status="current", top1=0.96, **keys):
    return {
        "id": row_id, "model": "m", "target": "T", "precision": "p", "setting": "s",
        "measured_on": measurements.VENDOR_SIMULATOR, "date": "2026-11-30", "commit": "abc",
        "command": "c", "status": status,
        "figures": {"positions": 64, "top1": top1, "perplexity_delta": 0.01, "passed": True},
        **keys,
    }  # fmt: skip


def test_a_new_current_row_supersedes_the_current_one_and_a_known_row_is_not_added():
    rows, added = measurements.merge_rows([row("a"), row("old", status="superseded")], [row("b")])
    assert added == ["b"]
    assert [(r["id"], r["status"], r.get("superseded_by")) for r in rows] == [
        ("a", "superseded", "b"), ("old", "superseded", None), ("b", "current", None)
    ]  # fmt: skip
    again, added = measurements.merge_rows(rows, [row("b", top1=0.5)])
    assert added == [] and again == rows
    other = row("c", measured_on="onnxruntime CPU proxy")
    rows, _ = measurements.merge_rows(rows, [other])
    assert rows[2]["status"] == "current"  # a proxy supersedes no simulator build


def test_append_rows_writes_the_data_file_a_bench_script_shares(tmp_path):
    data = tmp_path / "builds.yaml"
    measured = measurements.build_row(
        model="m", target="T", precision="p", backend="qnn", figures={"top1": 0.97},
        toolchain={"onnxruntime-qnn": "2.7.0"}, date="2026-11-30", commit="abc",
        command="c", source="bench", setting="s",
    )  # fmt: skip
    assert measurements.append_rows(data, [measured]) == [measured["id"]]
    assert measurements.append_rows(data, [dict(measured)]) == []
    assert measurements.load_rows(data) == [measured]
    assert data.read_text().startswith(measurements.HEADER)


def test_a_bench_rerun_replaces_its_rows_in_place_and_keeps_the_others(tmp_path):
    data = tmp_path / "benches.yaml"

    def row(ident, top1):
        return {"id": ident, "family": "quantization_levers", "setting": ident,
                "figures": {"top1": top1}, "date": "2026-12-02", "commit": "abc",
                "command": "c", "status": "current"}  # fmt: skip

    measurements.record_bench_rows(data, [row("a", 0.5), row("b", 0.6), row("c", 0.7)])
    assert measurements.record_bench_rows(data, [row("b", 0.9), row("d", 1.0)]) == ["b", "d"]
    rows = measurements.load_rows(data)
    assert [(r["id"], r["figures"]["top1"]) for r in rows] == [
        ("a", 0.5), ("b", 0.9), ("c", 0.7), ("d", 1.0)
    ]  # fmt: skip
    assert data.read_text().startswith(measurements.BENCHES_HEADER)
    with pytest.raises(NpuforgeError, match="bench row 1: missing commit"):
        measurements.record_bench_rows(
            data, [{k: v for k, v in row("e", 1).items() if k != "commit"}]
        )
    with pytest.raises(NpuforgeError, match="share an id"):
        measurements.record_bench_rows(data, [row("f", 1), row("f", 2)])
    assert len(measurements.load_rows(data)) == 4


def test_a_build_whose_4bit_groups_all_sit_on_the_grid_names_its_lever():
    def manifest(**record):
        return {"inputs": {"exports": [{"key": "k", "export": record}]}}

    on_grid = {"group": 32, "matmuls": 210, "on_4bit_grid": 210}
    assert measurements.exact_lever(manifest(group_offsets=on_grid)) == "group_offsets"
    assert measurements.exact_lever(manifest(block_centres=on_grid)) == "block_centres"
    off_grid = dict(on_grid, on_4bit_grid=209)
    assert measurements.exact_lever(manifest(group_offsets=off_grid)) is None
    assert measurements.exact_lever(manifest()) is None


def test_malformed_rows_are_refused_in_one_line():
    with pytest.raises(NpuforgeError, match="missing commit"):
        measurements.check_rows([{k: v for k, v in row("a").items() if k != "commit"}])
    with pytest.raises(NpuforgeError, match="id used twice"):
        measurements.check_rows([row("a"), row("a", status="superseded")])
    with pytest.raises(NpuforgeError, match="no data rows of series 'nope'"):
        docs_tables.generated_text(
            "<!-- table:series name=nope -->\n<!-- /table -->", docs_tables.load_data(REPO)
        )


@pytest.mark.parametrize(
    "delta,text",
    [(-0.0024, "-0.24 %"), (0.0366, "+3.66 %"), (-0.00024, "-0.024 %"), (0.109, "+10.9 %"),
     (21556.11, "+2,155,611 %"), (None, "–")],
)  # fmt: skip
def test_perplexity_cells(delta, text):
    assert docs_tables.percent(delta) == text


# --------------------------------------------------------------------------- README links


def readme_links():
    return re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())


def test_the_pages_the_readme_links_exist():
    links = [link for link in readme_links() if "://" not in link]
    assert "docs/fidelity.md" in links and "docs/backends/qnn.md" in links
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"README links to missing pages: {missing}"
    for page in sorted((REPO / "docs").rglob("*.md")):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.relative_to(REPO)}: {link}"


# --------------------------------------------------------------------------- README commands


def readme_snakemake_commands() -> list[str]:
    """Every command in a README code block that runs snakemake (after `&&` too)."""
    commands, fenced = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        for part in re.sub(r"\s#.*", "", line).split("&&"):
            part = part.strip()
            if part.split(" ", 1)[0] in (".venv/bin/snakemake", "snakemake"):
                commands.append(part)
    return commands


def expected_refusals(args: list[str]) -> list[str]:
    """The lines a dry run of ``args`` may stop with here, one of which it must: a selected
    toolchain or the benchmark device this machine lacks (none: it must plan)."""
    from npuforge.bench import device_problem
    from npuforge.toolchain import unavailable_reason

    config = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
    if "bench_device" in args and device_problem(config.get("device")):
        return [f"npuforge: {device_problem(config.get('device'))}"]
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    targets = yaml.safe_load((REPO / "config" / "targets.yaml").read_text())
    selected = config.get("target", shipped["target"]).split(",")
    if selected == ["all"]:
        return []  # unavailable targets are skipped, not refused
    runtime = config.get("toolchain_runtime", "native")  # copy_workflow pins native
    refusals = []
    for target in selected:
        entry = targets[target]
        reason = unavailable_reason(entry["backend"], runtime, entry.get("options"))
        if reason:
            refusals.append(f"npuforge: target {target}: {reason}")
    return refusals


def test_readme_commands_include_the_fresh_clone_build_and_the_troubleshooting_ones():
    commands = readme_snakemake_commands()
    assert ".venv/bin/snakemake --cores all" in commands
    assert ".venv/bin/snakemake --unlock" in commands
    assert len(commands) >= 8


@pytest.fixture(scope="module")
def readme_workflow(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("readme") / "wf")


@pytest.mark.parametrize("command", readme_snakemake_commands())
def test_readme_snakemake_command_plans(command, readme_workflow):
    args = shlex.split(command, comments=True)[1:]
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args, "--dry-run"],
        cwd=readme_workflow, capture_output=True, text=True, env=script_env(),
    )  # fmt: skip
    output = result.stdout + result.stderr
    refusals = expected_refusals(args)
    if not refusals:
        assert result.returncode == 0, f"{command}:\n{output[-3000:]}"
    else:
        assert result.returncode != 0, output[-3000:]
        assert set(refusals) & set(result.stderr.splitlines()), output[-3000:]
        assert "Job stats" not in output


def test_a_series_table_gives_each_rows_command_when_asked():
    rows = [row("a", series="s", command="snakemake --config model=m"), row("b", series="s")]
    data = {"builds": rows}
    plain = docs_tables.generated_text("<!-- table:series name=s -->\n<!-- /table -->", data)
    assert "command" not in plain.splitlines()[1]
    marked = "<!-- table:series name=s commands=yes -->\n<!-- /table -->"
    lines = docs_tables.generated_text(marked, data).splitlines()
    assert lines[1].endswith("| command |")
    assert lines[3].endswith("| `snakemake --config model=m` |") and lines[4].endswith("| `c` |")


def test_an_integer_pass_counts_only_if_the_permuted_twin_passes_too():
    """The support matrix says what an integer precision that passes on the model did on
    its permuted twin; float precisions and 4-bit-exact levers are left as they are."""
    rows = [
        row("m8", model="m", precision="a16w8"),
        row("t8", model="twin", precision="a16w8", figures={"top1": 0.89, "passed": False}),
        row("m16", model="m", precision="w16"),
        row("t16", model="twin", precision="w16"),
        row("mw8", model="m", precision="w8f16"),
        row("mf", model="m", precision="fp16"),
    ]
    targets = {
        "T": {"backend": "qnn", "precisions": dict.fromkeys(["a16w8", "w16", "w8f16", "fp16"])}
    }
    table = docs_tables.support_matrix(rows, targets, "m", twin="twin").splitlines()
    status = {line.split(" | ")[1]: line.split(" | ")[2] for line in table[2:]}
    assert status["a16w8"].startswith("**fails** on its permuted twin")
    assert status["w16"] == "passes, on its permuted twin too"
    assert status["w8f16"] == "passes; its permuted twin not measured"
    assert status["fp16"] == "passes"
    plain = docs_tables.support_matrix(rows, targets, "m").splitlines()
    assert all(" | passes | " in line for line in plain[2:])


def test_the_goals_table_gives_each_model_its_build_nearest_the_goal():
    """Issue 41's goals: a build meets one only with its gate passed over 64 positions;
    the best build is the one nearest the goal, and a model never built says so."""
    fig = lambda top1, delta, passed=True, positions=64: {  # noqa: E731
        "positions": positions,
        "top1": top1,
        "perplexity_delta": delta,
        "passed": passed,
    }
    rows = [
        row("short", precision="a16w8", figures=fig(1.0, 0.0, positions=32)),
        row("near", precision="a16w8", figures=fig(0.96, 0.01)),
        row("failed", precision="a16w8", figures=fig(0.99, 0.05, passed=False)),
        row("t-best", model="twin", precision="a16w8", figures=fig(0.98, 0.015)),
        row("t-old", model="twin", precision="a16w8", status="superseded", figures=fig(0.97, 0.0)),
        row("exact", precision="w4f16", figures=fig(1.0, 0.0), exact_on_source="group_offsets"),
        row("crash", model="twin", precision="w4f16", figures={"passed": False}),
        row("fp16", precision="fp16"),
    ]
    targets = {"T": {"precisions": dict.fromkeys(["fp16", "a16w8", "w4f16", "w8a8"])}}
    lines = docs_tables.goals_table(rows, targets, ["m", "twin"]).splitlines()[2:]
    cells = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in lines}
    assert list(cells) == [("| T a16w8", "m"), ("| T a16w8", "twin"), ("| T w4f16", "m"),
                           ("| T w4f16", "twin")]  # fmt: skip
    assert cells["| T a16w8", "m"][3:5] == ["misses it", "0.96"]  # not the 32-position pass
    assert cells["| T a16w8", "m"][7].startswith("`near`")
    assert cells["| T a16w8", "twin"][3:5] == ["**meets it**", "0.98"]
    assert cells["| T a16w8", "twin"][8] == "2"
    assert cells["| T w4f16", "m"][3] == "**meets it**, exact by construction (`group_offsets`)"
    assert cells["| T w4f16", "twin"][3] == "misses it: no binary"
    del rows[-2]
    lines = docs_tables.goals_table(rows, targets, ["m", "twin"]).splitlines()[2:]
    assert [line.split(" | ")[3] for line in lines][-1] == "not measured"
