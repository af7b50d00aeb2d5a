rule package:
    input:
        unpack(package_inputs),
    output:
        # The bundle directory is written whole by the step; naming its two index
        # files (not the directory) keeps Snakemake's timestamp file out of releases.
        manifest=f"{RESULTS}/release/{{model}}/{{target}}/{{precision}}/manifest.json",
        sums=f"{RESULTS}/release/{{model}}/{{target}}/{{precision}}/SHA256SUMS",
        tarball=f"{RESULTS}/release/{{model}}/{{target}}/{{precision}}.tar.gz",
    log:
        f"{RESULTS}/logs/package/{{model}}/{{target}}/{{precision}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/package/{{model}}/{{target}}/{{precision}}.tsv"
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=step_code("package_release"),
        options=package_options,
        paths=package_paths,
    shell:
        "python workflow_scripts/package_release.py {params.options} {params.paths} > {log} 2>&1"
