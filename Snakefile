# npuforge: one checkpoint -> verified per-SoC NPU binaries and release bundles.
# Selection: --config model=ID[,ID] target=ID[,ID] precision=P[,P]; see README.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/fetch.smk"
include: "rules/export.smk"
include: "rules/tokenizer.smk"
include: "rules/verify.smk"
include: "rules/calibrate.smk"
include: "rules/compile.smk"
include: "rules/package.smk"
include: "rules/report.smk"
include: "rules/bench.smk"


onstart:
    lock_results()


# Downloads need the network and the user's HF cache, benchmarks the device attached
# to this machine, docs the checkout: on a cluster they run on the submit host.
localrules:
    fetch,
    fetch_tree,
    bench,
    bench_device,
    docs,


rule all:
    default_target: True
    input:
        release_outputs(),
        rules.release_report.output,
