rule tokenizer:
    output:
        f"{RESULTS}/tokenizer/{{tokenizer}}/tokenizer.bin",
    log:
        f"{RESULTS}/logs/tokenizer/{{tokenizer}}.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=1000,
    shell:
        "python workflow_scripts/convert_tokenizer.py --tokenizer {wildcards.tokenizer} --out {output} > {log} 2>&1"
