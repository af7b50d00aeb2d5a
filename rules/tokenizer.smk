# rwkv-world: the World vocabulary (rwkv_vocab_v20230424) shipped in the rwkv package.
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
    params:
        code=step_code("convert_tokenizer"),
    shell:
        "python workflow_scripts/convert_tokenizer.py --out {output} > {log} 2>&1"


# tokenizer: hf ships the checkpoint's own tokenizer.json, per model.
rule tokenizer_hf:
    input:
        checkpoint=lambda w: checkpoint_path(w.model),
    output:
        f"{RESULTS}/tokenizer/hf/{{model}}/tokenizer.json",
    log:
        f"{RESULTS}/logs/tokenizer/hf/{{model}}.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=step_code("convert_tokenizer"),
    shell:
        "python workflow_scripts/convert_tokenizer.py --hf-checkpoint {input.checkpoint} --out {output} > {log} 2>&1"


# The held-out text (never calibrated on) in the model's own tokens: every compile
# step verifies its binaries over it.
rule heldout:
    input:
        unpack(heldout_inputs),
    output:
        f"{RESULTS}/heldout/{{model}}.json",
    log:
        f"{RESULTS}/logs/heldout/{{model}}.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=1000,
    params:
        code=step_code("tokenize_heldout"),
        family=lambda w: MODELS[w.model]["family"],
        vocab=lambda w: MODELS[w.model]["arch"]["vocab"],
    shell:
        "python workflow_scripts/tokenize_heldout.py --family {params.family} --vocab {params.vocab} --checkpoint {input.checkpoint} --out {output} > {log} 2>&1"
