rule fetch:
    output:
        checkpoint=f"{RESULTS}/models/{{model}}/checkpoint.{{fmt}}",
        record=f"{RESULTS}/models/{{model}}/checkpoint.{{fmt}}.json",
    log:
        f"{RESULTS}/logs/fetch/{{model}}.{{fmt}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/fetch/{{model}}.{{fmt}}.tsv"
    wildcard_constraints:
        fmt="pth|safetensors|gguf",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: fetch_mem_mb(w.model),
    params:
        code=step_code("fetch_model", family=fetched_family),
        source=lambda w: as_json(MODELS[w.model]["source"]),
        source_stamp=lambda w: local_source_stamp(w.model),
        sha256=lambda w: MODELS[w.model].get("sha256") or "",
        family=lambda w: MODELS[w.model]["family"],
    shell:
        "python workflow_scripts/fetch_model.py --source {params.source:q} --family {params.family} --sha256={params.sha256} --out {output.checkpoint} --record {output.record} > {log} 2>&1"


# A Hugging Face model directory (config.json + safetensors shards + tokenizer files).
rule fetch_tree:
    output:
        checkpoint=directory(f"{RESULTS}/models/{{model}}/checkpoint.hf"),
        record=f"{RESULTS}/models/{{model}}/checkpoint.hf.json",
    log:
        f"{RESULTS}/logs/fetch/{{model}}.hf.log",
    benchmark:
        f"{RESULTS}/benchmarks/fetch/{{model}}.hf.tsv"
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: fetch_mem_mb(w.model),
    params:
        code=step_code("fetch_model", family=fetched_family),
        source=lambda w: as_json(MODELS[w.model]["source"]),
        source_stamp=lambda w: local_source_stamp(w.model),
        sha256=lambda w: MODELS[w.model].get("sha256") or "",
        family=lambda w: MODELS[w.model]["family"],
    shell:
        "python workflow_scripts/fetch_model.py --source {params.source:q} --family {params.family} --sha256={params.sha256} --out {output.checkpoint} --record {output.record} > {log} 2>&1"


# A GGUF checkpoint, dequantized to a Hugging Face model directory that every later
# stage reads; the pinned GGUF stays the source of record.
rule dequantize:
    input:
        f"{RESULTS}/models/{{model}}/checkpoint.gguf",
    output:
        checkpoint=directory(f"{RESULTS}/models/{{model}}/dequantized.hf"),
        record=f"{RESULTS}/models/{{model}}/dequantized.hf.json",
    log:
        f"{RESULTS}/logs/dequantize/{{model}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/dequantize/{{model}}.tsv"
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: whole_model_mem_mb(w.model),
    params:
        code=step_code("dequantize_gguf"),
    shell:
        "python workflow_scripts/dequantize_gguf.py --gguf {input} --out {output.checkpoint} --record {output.record} > {log} 2>&1"


# A permuted twin (a test fixture of quantization): the same function on weights that lie
# on no grid the source checkpoint was quantized to.
rule permute:
    input:
        lambda w: checkpoint_path(permuted_source(w.model)),
    output:
        checkpoint=directory(f"{RESULTS}/models/{{model}}/permuted.hf"),
        record=f"{RESULTS}/models/{{model}}/permuted.hf.json",
    log:
        f"{RESULTS}/logs/permute/{{model}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/permute/{{model}}.tsv"
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: whole_model_mem_mb(w.model),
    params:
        code=step_code("permute_checkpoint"),
        source=lambda w: as_json(MODELS[w.model]["source"]),
        sha256=lambda w: MODELS[w.model].get("sha256") or "",
    shell:
        "python workflow_scripts/permute_checkpoint.py --checkpoint {input} --source {params.source:q} --sha256={params.sha256} --out {output.checkpoint} --record {output.record} > {log} 2>&1"


rule inspect:
    input:
        checkpoint=lambda w: checkpoint_path(w.model),
    output:
        f"{RESULTS}/models/{{model}}/inspect.json",
    log:
        f"{RESULTS}/logs/inspect/{{model}}.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: inspect_mem_mb(w.model),
    params:
        code=step_code("inspect_checkpoint"),
        arch=lambda w: as_json(MODELS[w.model]["arch"]),
        family=lambda w: MODELS[w.model]["family"],
    shell:
        "python workflow_scripts/inspect_checkpoint.py --checkpoint {input.checkpoint} --family {params.family} --model {wildcards.model} --arch {params.arch:q} --out {output} > {log} 2>&1"
