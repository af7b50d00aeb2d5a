rule export:
    input:
        checkpoint=lambda w: checkpoint_path(w.model),
        inspect=f"{RESULTS}/models/{{model}}/inspect.json",
        software=MAIN_LOCK,
    output:
        directory(f"{RESULTS}/export/{{model}}/{{key}}"),
    log:
        f"{RESULTS}/logs/export/{{model}}/{{key}}.log",
    # Between workflows: snakemake --cache with SNAKEMAKE_OUTPUT_CACHE set
    # (docs/planning-and-caches.md); a cached rule cannot have a benchmark record (a
    # cache hit has no run to measure).
    cache: True
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: export_mem_mb(w.model, w.key),
    params:
        code=step_code("export_onnx"),
        options=lambda w: export_options_json(w.model, w.key),
    shell:
        "python workflow_scripts/export_onnx.py --checkpoint {input.checkpoint} --options {params.options:q} --out-dir {output} > {log} 2>&1"
