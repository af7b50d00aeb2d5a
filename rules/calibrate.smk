rule calibrate:
    input:
        export=f"{RESULTS}/export/{{model}}/{{key}}",
        checkpoint=lambda w: checkpoint_path(w.model),
        software=MAIN_LOCK,
    output:
        directory(f"{RESULTS}/calibration/{{model}}/{{key}}"),
    log:
        f"{RESULTS}/logs/calibrate/{{model}}/{{key}}.log",
    cache: True
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=lambda w: calibration_mem_mb(w.model, w.key),
    params:
        code=step_code("make_calibration_samples"),
        samples=lambda w: PLAN.calibration_samples(
            w.model, config["calibration"]["samples"]
        ),
        steps=lambda w: PLAN.calibration_steps(
            w.model, w.key, config["calibration"]["steps"]
        ),
        seed=config["calibration"]["seed"],
        text=calibration_text(),
        texts=calibration_text_digest(),
        layout=CALIBRATION_LAYOUT,
    shell:
        "python workflow_scripts/make_calibration_samples.py --export {input.export} --checkpoint {input.checkpoint} --out-dir {output} --samples {params.samples} --steps {params.steps} --seed {params.seed} --text {params.text} > {log} 2>&1"
