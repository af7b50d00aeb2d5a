"""The build matrix: which (model, target, precision) to build and which shared work they need.

Pure data in, data out; the Snakefile imports it while parsing, so no heavy imports.
Exports are keyed by their options, never by target, so targets with equal needs
share one export directory.
"""

import hashlib
import json
import math
from dataclasses import dataclass, field

from npuforge import backends, models
from npuforge.errors import NpuforgeError
from npuforge.memory_plan import DEFAULT_COMPILE_MEM_MB, memory_plan, plan_memory
from npuforge.registry import build_options, merged_export

# The backend that needs no vendor toolchain (onnxruntime on the CPU).
REFERENCE_BACKEND = "onnx"


@dataclass(frozen=True)
class Build:
    model: str
    target: str
    precision: str


@dataclass
class Plan:
    models: dict
    targets: dict
    builds: list[Build]
    # (model, export key) -> export options
    exports: dict = field(default_factory=dict)
    # (model, target, precision) -> export keys in variant order (decode first)
    target_exports: dict = field(default_factory=dict)
    # (model, export key) -> the decode export checked together with it (itself for decode)
    verify_partner: dict = field(default_factory=dict)
    # (model, target, precision) -> export keys of the same graphs before rounding, where
    # the build's exports are rounded at export (their fp32 graphs are no longer the model)
    reference_exports: dict = field(default_factory=dict)
    # (model, target, precision) -> MemoryPlan: chunks and the compile job's memory
    memory: dict = field(default_factory=dict)

    def compile_mem_mb(self, model: str, target: str, precision: str) -> int:
        """What the build's compile job reserves: what its plan says it needs, at least
        the target's compile_mem_mb."""
        floor = int(self.targets[target].get("compile_mem_mb", DEFAULT_COMPILE_MEM_MB))
        need = self.memory[(model, target, precision)].need_bytes
        return max(floor, math.ceil(need / 1e6))

    def chunk_mem_mb(self, model: str, target: str, precision: str, chunk: int) -> int:
        """What a chunk's own compile job reserves: its chunk's need by the plan's
        figures (the heaviest chunk's is the compile's), at least the target's
        compile_mem_mb."""
        floor = int(self.targets[target].get("compile_mem_mb", DEFAULT_COMPILE_MEM_MB))
        need = self.memory[(model, target, precision)].chunk_need_bytes[chunk]
        return max(floor, math.ceil(need / 1e6))

    def chunk_jobs(self, model: str, target: str, precision: str) -> list[int]:
        """The chunks whose compile is a job of its own, ahead of the compile that combines
        and checks them: every chunk of a build in more than one, where the target's
        backend compiles chunk by chunk for the target's options (its
        ``compiles_by_chunk``); else none."""
        chunks = self.memory[(model, target, precision)].chunks
        spec = self.targets[target]
        by_chunk = getattr(backends.get(spec["backend"]), "compiles_by_chunk", None)
        if chunks < 2 or by_chunk is None or not by_chunk(spec.get("options") or {}):
            return []
        return list(range(chunks))

    def export_keys(self, model: str, target: str, precision: str) -> list[str]:
        return self.target_exports[(model, target, precision)]

    def export_options(self, model: str, key: str) -> dict:
        return self.exports[(model, key)]

    def reference_keys(self, model: str, target: str, precision: str) -> list[str]:
        """The exports a build's simulator figures are measured against, when they are not
        its own exports: the same options without the rounding at export (GPTQ)."""
        return self.reference_exports.get((model, target, precision), [])

    def verify_exports(self, model: str, key: str) -> list[str]:
        """Export keys verify_onnx takes for ``key``: the decode export first."""
        partner = self.verify_partner[(model, key)]
        return [key] if partner == key else [partner, key]

    def needs_calibration(self, target: str, precision: str) -> bool:
        spec = self.targets[target]["precisions"].get(precision) or {}
        return bool(spec.get("calibrate", False))

    def calibration_samples(self, model: str, default: int) -> int:
        """The model's own calibration sample count (its ``calibration`` entry), else
        ``default`` (the config's)."""
        return int((self.models[model].get("calibration") or {}).get("samples", default))

    def calibration_steps(self, model: str, key: str, default: int) -> int:
        """``default`` calls of the export's graphs per sample, or as many as a KV-cache
        graph holds (SmolLM2's 32-token prefill graphs fill its 255 free slots in 7)."""
        room = cache_room(self.models[model])
        if room is None:
            return int(default)
        return min(int(default), room // int(self.exports[(model, key)]["tokens"]))

    def needs_any_calibration(self) -> bool:
        return any(self.needs_calibration(b.target, b.precision) for b in self.builds)

    def models_built(self) -> list[str]:
        return sorted({b.model for b in self.builds})

    def vendor_targets(self) -> list[str]:
        used = sorted({b.target for b in self.builds})
        return [t for t in used if self.targets[t]["backend"] != REFERENCE_BACKEND]


def parse_selection(value) -> list[str]:
    """'a,b' / ['a', 'b'] / '' / None -> list of ids (empty means: not selected)."""
    if value is None:
        return []
    if isinstance(value, str | int | float):
        items = str(value).split(",")
    else:
        items = [str(v) for v in value]
    return [item.strip() for item in items if item.strip()]


def _choose(kind: str, selection, registry: dict, where: str) -> list[str]:
    ids = parse_selection(selection)
    if not ids:
        raise NpuforgeError(f"no {kind} selected; set {kind}=<id> (valid: {', '.join(registry)})")
    listed = selection if isinstance(selection, list | tuple) else str(selection).split(",")
    if len(ids) < len(listed):
        raise NpuforgeError(
            f"{kind}={selection!r} has a blank item; remove the extra comma (e.g. "
            f"{kind}={','.join(ids)})"
        )
    if ids == ["all"]:
        # Entries built on request only (seed-size models) are left to be named.
        return [item for item, entry in registry.items() if not entry.get("on_request")]
    for item in ids:
        if item not in registry:
            raise NpuforgeError(
                f"unknown {kind} '{item}'; valid {kind}s: {', '.join(registry)} "
                f"(add one to {where} or with --configfile)"
            )
    return list(dict.fromkeys(ids))


def select_builds(config: dict, models: dict, targets: dict) -> list[Build]:
    """Turn the selection into builds, or raise one line that names the valid choices.

    Listed precisions are built on each selected target that has them, for each model
    whose registry entry allows them there. Refused: a precision no selected target has
    or no selected model is built in, and a model and target both named (not ``all``)
    that are left with nothing to build; a named target or model left with nothing too.
    """
    model_ids = _choose("model", config.get("model"), models, "config/models.yaml")
    target_ids = _choose("target", config.get("target"), targets, "config/targets.yaml")
    wanted = parse_selection(config.get("precision"))
    known = sorted({p for t in targets.values() for p in t["precisions"]})
    for precision in wanted:
        if precision != "all" and precision not in known:
            raise NpuforgeError(
                f"unknown precision '{precision}'; valid precisions: {', '.join(known)}"
            )
    listed = bool(wanted) and wanted != ["all"]
    for precision in wanted if listed else []:
        if not any(precision in targets[t]["precisions"] for t in target_ids):
            raise NpuforgeError(_no_target_has(precision, target_ids, targets))
    builds = []
    for target_id in target_ids:
        target = targets[target_id]
        if not wanted:
            precisions = list(target["default_precisions"])
        elif wanted == ["all"]:
            precisions = list(target["precisions"])
        else:
            precisions = [p for p in wanted if p in target["precisions"]]
        for model_id in model_ids:
            chosen = model_precisions(models[model_id], target_id, precisions, wanted)
            builds += [Build(model_id, target_id, precision) for precision in chosen]
    if listed:
        _check_nothing_left(config, builds, model_ids, target_ids, models, targets, wanted)
    return builds


def _check_nothing_left(config, builds, model_ids, target_ids, models, targets, wanted):
    named = {kind: parse_selection(config.get(kind)) != ["all"] for kind in ("model", "target")}
    pairs = {(b.model, b.target) for b in builds}
    built_models, built_targets = {m for m, _ in pairs}, {t for _, t in pairs}
    for target_id in target_ids:
        for model_id in model_ids:
            # Under "all", a pair left with nothing is left out; a named model or target
            # left with nothing at all is not.
            if (model_id, target_id) not in pairs and (
                (named["model"] and named["target"])
                or (named["target"] and target_id not in built_targets)
                or (named["model"] and model_id not in built_models)
            ):
                raise NpuforgeError(
                    _why_not(model_id, models[model_id], target_id, targets[target_id], wanted)
                )
    built = {b.precision for b in builds}
    for precision in wanted:
        if precision not in built:
            # A target has it (checked above): every model's entry leaves it out there.
            model_id, target_id = next(
                (m, t)
                for t in target_ids
                for m in model_ids
                if precision in targets[t]["precisions"]
            )
            raise NpuforgeError(
                _why_not(model_id, models[model_id], target_id, targets[target_id], [precision])
            )


def _no_target_has(precision: str, target_ids, targets) -> str:
    if len(target_ids) == 1:
        return _why_not(None, {}, target_ids[0], targets[target_ids[0]], [precision])
    supports = "; ".join(f"{t}: {', '.join(targets[t]['precisions'])}" for t in target_ids)
    return f"no selected target supports precision '{precision}' ({supports})"


def _why_not(model_id, model: dict, target_id: str, target: dict, precisions) -> str:
    """Why none of ``precisions`` is built for the model on the target, as one line."""
    had = [p for p in precisions if p in target["precisions"]]
    if not had:
        what = "precision" if len(precisions) == 1 else "any of the precisions"
        return (
            f"target {target_id} ({target.get('description', target['backend'])}) does not "
            f"support {what} {_quoted(precisions)}; it supports: {', '.join(target['precisions'])}"
        )
    allowed = model["precisions"][target_id]
    return (
        f"model {model_id} is built for {target_id} in {', '.join(allowed)} only "
        f"(its registry entry's precisions), not {_quoted(had)}"
    )


def _quoted(names) -> str:
    return ", ".join(f"'{name}'" for name in names)


def model_precisions(model, target_id, precisions, wanted) -> list[str]:
    """The target's precisions narrowed by the model's own ``precisions[target]`` list.

    With nothing selected: the target's defaults among the model's list (the list
    itself when none of them is in it); with ``all``: the model's list; precisions
    named on the command line: those in the list.
    """
    allowed = model.get("precisions", {}).get(target_id)
    if allowed is None:
        return precisions
    if not wanted:
        return [p for p in precisions if p in allowed] or list(allowed)
    if wanted == ["all"]:
        return list(allowed)
    return [p for p in precisions if p in allowed]


def export_variants(model: dict, target: dict, precision: str | None = None) -> list[dict]:
    """The export options a target needs from a model for ``precision``, one dict per
    graph variant. Every option that changes the exported bytes is in the dict (and so
    in the key); precisions that need nothing of their own share their target's export.
    """
    export = merged_export(model, target)
    common = {
        "family": model["family"],
        "dtype": export["dtype"],
        "ext_embedding": bool(export.get("ext_embedding", False)),
        "batch": int(export.get("batch", 1)),
    }
    plan = memory_plan(model, target, precision)
    common["chunks"] = plan.chunks
    if plan.layers_per_chunk:
        common["layers_per_chunk"] = list(plan.layers_per_chunk)
    if export.get("external_data"):
        # weights in chunkN.onnx.data even below the 2 GB protobuf limit
        common["external_data"] = True
    # The family's own options (its package is light: no torch while the workflow parses).
    common.update(models.family(model["family"]).export_options(model, export, precision))
    variants = []
    for variant in export["variants"]:
        options = dict(common, variant=variant)
        options["tokens"] = int(export["prefill_tokens"]) if variant == "prefill" else 1
        variants.append(options)
    return variants


# Export options that round the weights: the fp32 graphs of such an export are no longer
# the model, so a build from it is verified against the export without them.
ROUNDING_OPTIONS = ("gptq",)


def unrounded(options: dict) -> dict:
    """An export's options without the rounding at export (equal to ``options`` if none)."""
    return {k: v for k, v in options.items() if k not in ROUNDING_OPTIONS}


def export_key(options: dict) -> str:
    """A directory name for an export: readable prefix plus a hash of all its options."""
    canonical = json.dumps(options, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:10]
    return f"{options['variant']}-{options['dtype']}-c{options['chunks']}-{digest}"


def cache_room(model: dict) -> int | None:
    """Tokens a model's KV-cache graphs hold after its kv_prefix; None without a cache."""
    if model["family"] != "llama":
        return None
    return int(model["context_length"]) - len((model.get("export") or {}).get("kv_prefix") or ())


def check_cache_fits(config: dict, models: dict, targets: dict, builds) -> None:
    """KV-cache graphs hold ``context_length`` tokens: every verification run must fit
    (calibration runs as many calls as fit: Plan.calibration_steps)."""
    for build in builds:
        model = models[build.model]
        room = cache_room(model)
        if room is None:
            continue
        runs = {"verify.tokens": (config.get("verify") or {}).get("tokens", 0)}
        options = build_options(model, targets[build.target])
        runs[f"{build.target} verify_steps"] = options.get("verify_steps", 0)
        # A kv_prefix takes the first slots of the cache.
        prefix = int(model["context_length"]) - room
        for name, steps in runs.items():
            if int(steps) > room:
                held = f", less its {prefix} kv_prefix slots" if prefix else ""
                raise NpuforgeError(
                    f"model {build.model}: {name} ({steps}) exceeds its context_length "
                    f"({model['context_length']}{held}), the graphs' KV cache; lower it"
                )


# Decode calls a verification with prefill graphs runs after its prefill calls: a
# bundle's generation is decode calls, and a check that spends its positions on prefill
# calls would hardly exercise them.
MIN_DECODE_CALLS = 8


def check_decode_calls(models: dict, targets: dict, builds) -> None:
    """A target with prefill graphs verifies at least MIN_DECODE_CALLS decode calls after
    its prefill calls (a decode-only check is decode calls throughout)."""
    from npuforge.backends.base import CommonOptions

    for build in builds:
        model, target = models[build.model], targets[build.target]
        export = merged_export(model, target)
        if "prefill" not in export["variants"]:
            continue
        options = build_options(model, target)
        steps = int(options.get("verify_steps", CommonOptions.verify_steps))
        calls = int(options.get("verify_prefill_calls", 1))
        prefill = int(export["prefill_tokens"]) * calls
        if steps - prefill < MIN_DECODE_CALLS:
            raise NpuforgeError(
                f"model {build.model} on {build.target}: verify_steps {steps} leaves "
                f"{max(steps - prefill, 0)} decode calls after {calls} {export['prefill_tokens']}"
                f"-token prefill call(s); the check needs {MIN_DECODE_CALLS}: set verify_steps "
                f"to at least {prefill + MIN_DECODE_CALLS}"
            )


def check_batch(models: dict, targets: dict, builds) -> None:
    """A backend whose verification covers only ``MAX_BATCH`` sequences refuses more."""
    for build in builds:
        target = targets[build.target]
        limit = getattr(backends.get(target["backend"]), "MAX_BATCH", None)
        if limit is None:
            continue
        for options in export_variants(models[build.model], target):
            if options["batch"] > limit:
                raise NpuforgeError(
                    f"model {build.model} on {build.target}: export.batch is "
                    f"{options['batch']}, but the {target['backend']} backend builds and "
                    f"verifies batch {limit} only; set export.batch: {limit}"
                )


# Export options that map precisions to values: each such precision gets its own export.
PER_PRECISION_EXPORT = (
    "smoothquant", "group_offsets", "block_centres", "tanh_silu", "rotate", "awq", "gptq",
)  # fmt: skip


def check_per_precision_export(models: dict, targets: dict, builds) -> None:
    """A model's per-precision export options name precisions some target builds."""
    known = {p for target in targets.values() for p in target["precisions"]}
    for model_id in sorted({b.model for b in builds}):
        export = models[model_id].get("export") or {}
        for option in PER_PRECISION_EXPORT:
            for precision in export.get(option) or {}:
                if precision not in known:
                    raise NpuforgeError(
                        f"model {model_id}: export.{option} names precision '{precision}', "
                        f"which no target builds; use one of {', '.join(sorted(known))}"
                    )


def make_plan(config: dict, models: dict, targets: dict) -> Plan:
    builds = select_builds(config, models, targets)
    check_per_precision_export(models, targets, builds)
    check_cache_fits(config, models, targets, builds)
    check_decode_calls(models, targets, builds)
    memory = plan_memory(models, targets, builds)
    check_batch(models, targets, builds)
    plan = Plan(models=models, targets=targets, builds=builds, memory=memory)
    for build in builds:
        triple = (build.model, build.target, build.precision)
        keys, references = [], []
        for options in export_variants(models[build.model], targets[build.target], build.precision):
            key = export_key(options)
            plan.exports[(build.model, key)] = options
            keys.append(key)
            reference = unrounded(options)
            plan.exports[(build.model, export_key(reference))] = reference
            references.append(export_key(reference))
        plan.target_exports[triple] = keys
        if references != keys:
            plan.reference_exports[triple] = references
        for key in keys:
            # A prefill export is checked by continuing its state in the decode graphs.
            plan.verify_partner.setdefault((build.model, key), keys[0])
    return plan


# Chooses a runtime per target: a container image where one can run, else native.
AUTO_RUNTIME = "auto"


def choose_runtimes(plan: Plan, requested: str, unavailable_reason, engines):
    """Each selected vendor target's toolchain runtime, and notes for the user.

    ``auto`` takes the first container engine of ``engines`` that can run the target's
    toolchain here, since a container image is the runtime whose bytes a release is
    reproducible against; else native, with a note naming why no engine could.
    Any other request applies to every target as it is.
    """
    runtimes, notes = {}, []
    for target_id in plan.vendor_targets():
        if requested != AUTO_RUNTIME:
            runtimes[target_id] = requested
            continue
        target = plan.targets[target_id]
        refusals = []
        for engine in engines:
            reason = unavailable_reason(target["backend"], engine, target["options"])
            if reason is None:
                runtimes[target_id] = engine
                break
            refusals.append(reason)
        else:
            runtimes[target_id] = "native"
            notes.append(
                f"target {target_id} builds in the native toolchain environment, not in a "
                f"container image (the reference runtime): {refusals[0]}"
            )
    return runtimes, notes


def check_toolchains(plan: Plan, runtimes: dict, unavailable_reason, *, skip: bool = False):
    """Ask the toolchain module about every selected vendor target in its runtime
    (``runtimes``: target -> runtime, from ``choose_runtimes``).

    A target named on the command line whose toolchain is missing stops the run
    (one line saying how to provide it). With ``skip`` (``target=all``) such
    targets are dropped instead, so the rest of the matrix still builds; the
    dropped ``(target, reason)`` pairs are returned for the caller to report.
    """
    skipped = []
    for target_id in plan.vendor_targets():
        target = plan.targets[target_id]
        reason = unavailable_reason(target["backend"], runtimes[target_id], target["options"])
        if reason and not skip:
            raise NpuforgeError(f"target {target_id}: {reason}")
        if reason:
            skipped.append((target_id, reason))
    if skipped:
        dropped = {target_id for target_id, _ in skipped}
        plan.builds = [b for b in plan.builds if b.target not in dropped]
    return skipped
