"""The release index (results/release/index.json) and `snakemake --report`, on a real build
of the default model; the report is opened in headless Chromium."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from chromium import Page, unavailable_reason
from conftest import REPO, copy_workflow, run_script, snakemake

from npuforge import docs_tables, measurements
from npuforge.fileio import sha256_file
from npuforge.release_index import read_benchmark

# Screenshots of the rendered report land here (CI keeps them as test artifacts).
ARTIFACTS = Path(os.environ.get("NPUFORGE_TEST_ARTIFACTS", REPO / "test-artifacts"))
BUNDLE = ("rwkv7-demo", "onnx", "fp32")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The default matrix built once for every test here."""
    workflow = copy_workflow(tmp_path_factory.mktemp("report") / "wf")
    snakemake(workflow, check=True)
    return workflow


def test_index_row_carries_the_bundle_manifest_figures(built):
    release = built / "results" / "release"
    index = json.loads((release / "index.json").read_text())
    assert index["format"] == 1
    (row,) = index["bundles"]
    assert (row["model"], row["target"], row["precision"]) == BUNDLE
    bundle = release.joinpath(*BUNDLE)
    manifest = json.loads((bundle / "manifest.json").read_text())
    binaries = [a["file"] for a in manifest["compile"]["artifacts"] if a["role"] == "binary"]
    assert row["binaries"] == binaries == ["chunk0.onnx"]
    assert row["binary_bytes"] == (bundle / "chunk0.onnx").stat().st_size
    verification = manifest["verification"]
    assert row["fidelity"] == {
        "cosine": verification["cosine"],
        "top1": verification["top1_agreement"],
        "perplexity_delta": verification["perplexity"]["delta"],
        "positions": verification["positions"],
        "passed": True,
    }
    assert row["toolchain"] == manifest["compile"]["toolchain"]
    assert row["environment"] == manifest["environment"]["packages"]
    sums = dict(
        reversed(line.split("  ")) for line in (bundle / "SHA256SUMS").read_text().splitlines()
    )
    assert row["manifest_sha256"] == sums["manifest.json"] == sha256_file(bundle / "manifest.json")
    assert row["tarball_sha256"] == sha256_file(bundle.parent / "fp32.tar.gz")


def test_index_is_a_function_of_the_bundles(built, tmp_path):
    release = built / "results" / "release"
    again = tmp_path / "index.json"
    result = run_script("release_index.py", "--release-dir", release, "--out", again)
    assert result.returncode == 0, result.stderr
    assert again.read_bytes() == (release / "index.json").read_bytes()


def test_index_refuses_a_bundle_edited_after_packaging(built, tmp_path):
    release = tmp_path / "release"
    shutil.copytree(built / "results" / "release" / BUNDLE[0], release / BUNDLE[0])
    manifest = release.joinpath(*BUNDLE, "manifest.json")
    manifest.write_text(manifest.read_text().replace('"passed": true', '"passed": false'))
    out = tmp_path / "index.json"
    result = run_script("release_index.py", "--release-dir", release, "--out", out)
    assert result.returncode == 2
    assert "manifest.json does not match its SHA256SUMS line" in result.stderr
    assert "rebuild it" in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".index.json*"))


def test_compile_benchmark_record_reaches_the_report_table(built):
    bench = read_benchmark(
        built / "results" / "benchmarks" / "compile" / "rwkv7-demo" / "onnx" / "fp32.tsv"
    )
    assert bench["seconds"] > 0 and bench["max_rss_mb"] > 0
    table = (built / "results" / "report" / "bundles.html").read_text()
    cells = re.findall(r"<td>(.*?)</td>", table)
    assert cells[:3] == list(BUNDLE)
    assert f"{bench['seconds']:.1f}" in cells and f"{bench['max_rss_mb']:.1f}" in cells


def test_docs_target_records_each_bundle_once(built):
    # The checkout's docs beside the workflow copy: the target writes them.
    shutil.copytree(REPO / "docs", built / "docs", dirs_exist_ok=True)
    shutil.copy2(REPO / "README.md", built / "README.md")
    data = built / measurements.BUILDS
    before = measurements.load_rows(data)
    snakemake(built, "docs", check=True)
    (bundle,) = json.loads((built / "results" / "release" / "index.json").read_text())["bundles"]
    rows = measurements.load_rows(data)
    assert rows[: len(before)] == before
    (row,) = rows[len(before) :]
    assert row["id"] == f"rwkv7-demo/onnx/fp32@{bundle['manifest_sha256'][:12]}"
    assert (row["model"], row["target"], row["precision"]) == BUNDLE
    figures = bundle["fidelity"]
    assert row["figures"]["cosine"] == figures["cosine"]
    assert row["figures"]["top1"] == figures["top1"]
    assert row["figures"]["perplexity_delta"] == figures["perplexity_delta"]
    assert row["figures"]["passed"] is True
    assert row["figures"]["binary_bytes"] == bundle["binary_bytes"]
    assert row["measured_on"] == "onnxruntime CPU" and row["status"] == "current"
    assert row["date"] == measurements.today()
    assert "--config model=rwkv7-demo target=onnx precision=fp32" in row["command"]
    recorded = json.loads((built / "results" / "docs" / "recorded.json").read_text())
    assert recorded["rows_added"] == [row["id"]]
    assert docs_tables.stale_pages(built) == []
    # The same index again adds nothing.
    index = built / "results" / "release" / "index.json"
    result = run_script("docs_data.py", "--root", built, "--index", index)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows_added"] == []
    assert measurements.load_rows(data) == rows


def click_result(page, label):
    """Open the report's 'Results' menu and the result labelled ``label`` (waiting up to
    30 s for each to render: the report is a React app that builds itself after loading)."""
    return page.evaluate(
        f"""(async () => {{
            const sleep = ms => new Promise(r => setTimeout(r, ms));
            const waitFor = async find => {{
                for (let i = 0; i < 300; i++) {{
                    const found = find();
                    if (found) return found;
                    await sleep(100);
                }}
                return null;
            }};
            const resultRow = () => [...document.querySelectorAll("tr")].find(
                r => r.cells.length && r.cells[0].textContent.trim() === {json.dumps(label)});
            if (!resultRow()) {{
                const menu = await waitFor(() => [...document.querySelectorAll("a")]
                    .find(e => e.textContent.trim() === "Results"));
                if (!menu) return false;
                menu.click();
            }}
            const row = await waitFor(resultRow);
            if (!row) return false;
            row.querySelector("a").click();
            return true;
        }})()"""
    )


def rendered_png(page):
    """[width, height] of the report's displayed PNG once it has loaded (up to 30 s)."""
    return page.evaluate(
        """(async () => {
            for (let i = 0; i < 300; i++) {
                const img = document.querySelector('img[src^="data:image/png"]');
                if (img && img.complete && img.naturalWidth) {
                    return [img.naturalWidth, img.naturalHeight];
                }
                await new Promise(r => setTimeout(r, 100));
            }
            return null;
        })()"""
    )


def table_rows(page):
    """Cell texts of the bundle table inside the report's iframe (up to 30 s to appear)."""
    for _ in range(300):
        for context in page.frame_contexts():
            rows = page.evaluate(
                "[...document.querySelectorAll('#bundles tbody tr')]"
                ".map(r => [...r.cells].map(c => c.textContent))",
                context_id=context,
            )
            if rows:
                return rows
        time.sleep(0.1)
    return []


def test_report_renders_table_and_plots_in_chromium(built, tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    result = snakemake(built, "--report", "report.html", check=True)
    for name in ("bundles.html", "fidelity.png", "size.png"):
        assert f"Adding {name}" in result.stdout + result.stderr
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = Page(tmp_path / "chromium-profile")
    try:
        page.open((built / "report.html").as_uri())
        assert click_result(page, "bundles"), page.evaluate("document.body.innerText")
        rows = table_rows(page)
        page.screenshot(ARTIFACTS / "report-table.png")
        assert [row[:3] for row in rows] == [list(BUNDLE)]
        assert rows[0][7] == "yes"  # passed
        for plot in ("fidelity", "binary size"):
            assert click_result(page, plot), plot
            size = rendered_png(page)
            page.screenshot(ARTIFACTS / f"report-{plot.replace(' ', '-')}.png")
            assert size and size[0] >= 400 and size[1] >= 200, (plot, size)
    finally:
        page.close()
