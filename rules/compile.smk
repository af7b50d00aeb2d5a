# Builds (or checks) a vendor toolchain environment once per backend and runtime.
rule prepare_toolchain:
    output:
        f"{RESULTS}/toolchains/{{backend}}-{{runtime}}.json",
    log:
        step=f"{RESULTS}/logs/toolchains/{{backend}}-{{runtime}}.log",
        build=f"{RESULTS}/logs/toolchains/{{backend}}-{{runtime}}.build.log",
    conda:
        MAIN_ENV
    threads: 1
    resources:
        mem_mb=4000,
    params:
        # An environment for a backend, for no model.
        code=step_code("prepare_toolchain", family=None),
        options=lambda w: as_json(toolchain_options(w.backend)),
        definition=lambda w: toolchain_definition(w.backend),
    shell:
        "python workflow_scripts/prepare_toolchain.py --backend {wildcards.backend} --runtime {wildcards.runtime} --target-options {params.options:q} --out {output} --log {log.build} > {log.step} 2>&1"


rule compile:
    input:
        unpack(compile_inputs),
    output:
        directory(f"{RESULTS}/compile/{{model}}/{{target}}/{{precision}}"),
    log:
        f"{RESULTS}/logs/compile/{{model}}/{{target}}/{{precision}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/compile/{{model}}/{{target}}/{{precision}}.tsv"
    conda:
        MAIN_ENV
    threads: lambda w: TARGETS[w.target].get("compile_threads", 1)
    resources:
        mem_mb=lambda w: PLAN.compile_mem_mb(w.model, w.target, w.precision),
    params:
        code=step_code("compile"),
        options=compile_options,
        paths=compile_paths,
    shell:
        "python workflow_scripts/compile.py {params.paths} {params.options} --threads {threads} --out-dir {output} > {log} 2>&1"


# One chunk's graphs of a build whose backend compiles chunk by chunk (TPU-MLIR: the
# chunk's decode and prefill nets), kept for the compile above, which combines and
# checks them: a many-core host or a cluster builds the chunks side by side.
rule compile_chunk:
    input:
        unpack(chunk_inputs),
    output:
        temp(
            directory(
                f"{RESULTS}/compile-chunks/{{model}}/{{target}}/{{precision}}/{{chunk}}"
            )
        ),
    log:
        f"{RESULTS}/logs/compile-chunk/{{model}}/{{target}}/{{precision}}/{{chunk}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/compile-chunk/{{model}}/{{target}}/{{precision}}/{{chunk}}.tsv"
    conda:
        MAIN_ENV
    threads: lambda w: TARGETS[w.target].get("compile_threads", 1)
    resources:
        mem_mb=lambda w: PLAN.chunk_mem_mb(w.model, w.target, w.precision, int(w.chunk)),
    params:
        code=step_code("compile"),
        options=compile_options,
        paths=compile_paths,
    shell:
        "python workflow_scripts/compile.py {params.paths} {params.options} --threads {threads} --only-chunk {wildcards.chunk} --out-dir {output} > {log} 2>&1"
