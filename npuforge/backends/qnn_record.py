"""compile.json of a QNN build: artifacts, per-chunk notes, the QAIRT version and the
settings that make the context binaries repeat byte for byte."""

import sys

from npuforge.backends.qnn_spec import QUANTIZED, ctx_file
from npuforge.errors import NpuforgeError
from npuforge.fileio import sha256_file

# Context binaries are not forward compatible: the device must load them with
# the same QAIRT release's runtime libraries (or a newer one that still reads it).
DEVICE_RUNTIME_NOTE = (
    "load these context binaries with QAIRT {version} device libraries: libQnnHtp.so, "
    "libQnnSystem.so, libQnnHtpV{arch}Stub.so and hexagon-v{arch} libQnnHtpV{arch}Skel.so "
    "from the same QAIRT release (onnxruntime-qnn {ort_qnn} on Android/Windows ARM64 ships them)"
)


# A chunk's quantization keys kept out of compile.json's options: paths, and the layer
# error table (compile.json's own ``layer_error``).
UNRECORDED = ("qdq_model", "source", "layer_error")


def _weights_shared(chunk_result: dict, variants: list[str]) -> dict:
    binaries = chunk_result["binaries"]
    shared = len(variants) > 1 and len(binaries) == 1
    note = {"graphs": variants, "one_context": shared, "binary": binaries[0] if shared else None}
    if shared:
        note["how"] = "ONNX Runtime ep.share_ep_contexts: one QNN context, weights stored once"
        note["simulated"] = (
            "decode graph compiled alone from the same source and options: QAIRT 2.51's x86 "
            "simulator cannot load a multi-graph context"
        )
    return note


def heap_pinned(result: dict) -> bool:
    """Whether every chunk compiled with the heap settings that make its bytes repeat
    (``npuforge/jobs/job_stage.py``; a container that refuses personality() cannot)."""
    settings = [chunk.get("heap") or {} for chunk in result["chunks"]]
    return bool(settings) and all(
        h.get("aslr_disabled")
        and h.get("malloc_perturb")
        and h.get("tcache_disabled")
        and h.get("mmap_threshold")
        and h.get("python_hash_seed")
        and h.get("fixed_clock")
        and h.get("cpus") == 1
        and h.get("ort_telemetry_off")
        for h in settings
    )


def artifacts_and_notes(result: dict, variants: list[str], staging) -> tuple:
    """(artifacts, per-chunk notes, the one QAIRT version of the binaries)."""
    artifacts, notes, qairt = [], [], set()
    for chunk in result["chunks"]:
        index = chunk["index"]
        for binary in chunk["binaries"]:
            artifacts.append(
                {
                    "file": binary,
                    "sha256": sha256_file(staging / binary),
                    "role": "binary",
                    "chunk": index,
                    "bytes": (staging / binary).stat().st_size,
                }
            )
        for variant in variants:
            name = ctx_file(index, variant)
            artifacts.append(
                {
                    "file": name,
                    "sha256": sha256_file(staging / name),
                    "role": "ep_context",
                    "chunk": index,
                    "variant": variant,
                }
            )
        qairt.update(v for v in chunk["qairt"].values() if v)
        # Wall times go to the log, not the record: manifests must not vary run to run.
        print(f"chunk {index}: context generation {chunk['context_seconds']} s", file=sys.stderr)
        notes.append(
            {
                "chunk": index,
                "weight_sharing": _weights_shared(chunk, variants),
                "quantization": {
                    variant: {k: v for k, v in info.items() if k not in UNRECORDED}
                    for variant, info in chunk["quantization"].items()
                },
            }
        )
    if len(qairt) != 1:
        raise NpuforgeError(
            f"expected one QAIRT version in the produced binaries, found {sorted(qairt) or 'none'}"
        )
    return artifacts, notes, qairt.pop()


def options_record(options, spec, result, exports, precision, calibrations) -> dict:
    from npuforge.backends import options_dict
    from npuforge.backends.base import calibration_summary

    decode = exports["decode"]
    return {
        **options_dict(options),
        "range_margin": spec["range_margin"] if precision in QUANTIZED else None,
        "provider_options": result["provider_options"],
        "generation_options": result.get("generation_options", {}),
        "heap": [chunk.get("heap") for chunk in result["chunks"]],
        # hard-linked: the bytes do not depend on where the toolchain venv lives.
        "site_packages": sorted({c.get("site_packages", "none") for c in result["chunks"]}),
        "graphs": list(exports),
        "export": {
            "variant": decode.variant,
            "dtype": decode.meta.get("dtype"),
            "options": decode.meta.get("options", {}),
        },
        # Which samples quantized each variant's graphs (calibration.json's sha256).
        "calibration": {
            variant: calibration_summary(directory)
            for variant, directory in sorted(calibrations.items())
            if variant in exports
        }
        or None,
    }


def qairt_record(version: str, options, versions: dict) -> dict:
    return {
        "version": version,
        "source": "read from the produced context binaries",
        "device_runtime": DEVICE_RUNTIME_NOTE.format(
            version=version,
            arch=int(options.htp_arch),
            ort_qnn=versions.get("onnxruntime-qnn", "?"),
        ),
    }
