# On-device benchmarks (snakemake bench_device --config device=adb:SERIAL): a release
# bundle pushed with adb, its run.py run on the device, the report pulled back.
rule bench:
    input:
        manifest=f"{RESULTS}/release/{{model}}/{{target}}/{{precision}}/manifest.json",
        sums=f"{RESULTS}/release/{{model}}/{{target}}/{{precision}}/SHA256SUMS",
    output:
        f"{RESULTS}/bench/{{model}}/{{target}}/{{precision}}.json",
    log:
        f"{RESULTS}/logs/bench/{{model}}/{{target}}/{{precision}}.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=500,
        # One benchmark at a time per device (the profile sets adb_device=1): two
        # sharing it would measure each other.
        adb_device=1,
    params:
        code=step_code("bench_device"),
        device=config["device"],
        prompt=config["bench"]["prompt"],
        max_new_tokens=config["bench"]["max_new_tokens"],
        python=config["bench"]["python"],
        root=config["bench"]["remote_root"],
    shell:
        "python workflow_scripts/bench_device.py --device {params.device:q} --bundle $(dirname {input.manifest}) --out {output} --prompt {params.prompt:q} --max-new-tokens {params.max_new_tokens} --python {params.python:q} --remote-root {params.root:q} > {log} 2>&1"


rule bench_device:
    input:
        bench_outputs,
