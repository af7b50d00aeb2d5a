# The release index over every bundle in results/release (those of earlier selections
# too), and the parts of `snakemake --report report.html`: table and plots.
rule release_index:
    input:
        # The planned bundles: the index is written once they exist.
        manifests=release_manifests(),
    output:
        f"{RESULTS}/release/index.json",
    log:
        f"{RESULTS}/logs/release/index.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=500,
    params:
        # Reads manifests: runs no backend and no model family.
        code=step_code("release_index", backend=None, family=None),
        release=lambda w, output: Path(output[0]).parent,
    shell:
        "python workflow_scripts/release_index.py --release-dir {params.release} --out {output} > {log} 2>&1"


rule release_report:
    input:
        f"{RESULTS}/release/index.json",
    output:
        table=report(
            f"{RESULTS}/report/bundles.html",
            category="Release",
            caption="../report/bundles.rst",
            labels={"figure": "bundles"},
        ),
        fidelity=report(
            f"{RESULTS}/report/fidelity.png",
            category="Release",
            caption="../report/fidelity.rst",
            labels={"figure": "fidelity"},
        ),
        size=report(
            f"{RESULTS}/report/size.png",
            category="Release",
            caption="../report/size.rst",
            labels={"figure": "binary size"},
        ),
    log:
        f"{RESULTS}/logs/release/report.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=step_code("release_report", backend=None, family=None),
        benchmarks=f"{RESULTS}/benchmarks",
    shell:
        "python workflow_scripts/release_report.py --index {input} --benchmarks {params.benchmarks} --table {output.table} --fidelity-plot {output.fidelity} --size-plot {output.size} > {log} 2>&1"


# `snakemake docs`: one row per bundle of the release index merged into the checkout's
# docs/data/builds.yaml, then every generated table of the docs rewritten from the data
# (edits of the checkout beside the output, a record of what was added: review the diff
# and commit it).
rule docs:
    input:
        f"{RESULTS}/release/index.json",
    output:
        f"{RESULTS}/docs/recorded.json",
    log:
        f"{RESULTS}/logs/docs/recorded.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=500,
    params:
        code=step_code("docs_data", backend=None, family=None),
        root=workflow.basedir,
    shell:
        "python workflow_scripts/docs_data.py --root {params.root:q} --index {input} --out {output} > {log} 2>&1"
