# Exported graphs against BlinkDL's rwkv package on the same checkpoint.
rule verify_onnx:
    input:
        checkpoint=lambda w: checkpoint_path(w.model),
        exports=lambda w: [
            export_dir(w.model, key) for key in PLAN.verify_exports(w.model, w.key)
        ],
    output:
        f"{RESULTS}/verify/{{model}}/{{key}}.json",
    log:
        f"{RESULTS}/logs/verify/{{model}}/{{key}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/verify/{{model}}/{{key}}.tsv"
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: verify_mem_mb(w.model),
    params:
        code=step_code("verify_onnx"),
        tokens=config["verify"]["tokens"],
        exports=lambda w, input: " ".join(f"--export {d}" for d in input.exports),
    shell:
        "python workflow_scripts/verify_onnx.py --checkpoint {input.checkpoint} {params.exports} --tokens {params.tokens} --out {output} > {log} 2>&1"
