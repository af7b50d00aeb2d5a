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
        model_entry=lambda w: as_json(MODELS[w.model]),
        target_entry=lambda w: as_json(TARGETS[w.target]),
        exports=lambda w, input: " ".join(f"--export {d}" for d in input.exports),
        verify=lambda w, input: " ".join(
            f"--export-verification {f}" for f in input.verify
        ),
        tokenizer=package_tokenizer_arg,
        dequantized=package_dequantize_arg,
    shell:
        "python workflow_scripts/package_release.py --model {wildcards.model} --model-entry {params.model_entry:q} --target {wildcards.target} --target-entry {params.target_entry:q} --precision {wildcards.precision} --compiled {input.compiled} {params.exports} {params.verify} {params.tokenizer} --fetch-record {input.fetch_record} {params.dequantized} --out-dir $(dirname {output.manifest}) --tarball {output.tarball} > {log} 2>&1"
