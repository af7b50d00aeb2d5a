"""Model and SoC registries: YAML files plus overlays from the workflow config.

The Snakefile imports this module while it parses, so it stays light: PyYAML
and the standard library only.
"""

import copy
from pathlib import Path

import yaml

from npuforge.errors import NpuforgeError

# Fields an overlay replaces whole instead of merging into: a new source kind must
# not leave the old kind's keys behind.
REPLACED_FIELDS = {"source"}


# libyaml's parser where PyYAML was built with it: registries of thousands of entries
# parse in milliseconds instead of a large part of a second.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """Refuses a mapping that names one key twice (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path) -> dict:
    path = Path(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except FileNotFoundError as err:
        raise NpuforgeError(f"registry file {path} not found; check the config paths") from err
    except yaml.YAMLError as err:
        problem = _first_line(err)
        raise NpuforgeError(f"{path} is not valid YAML ({problem}); fix its syntax") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise NpuforgeError(f"{path} must be a mapping of id to entry, not a {kind}; fix it")
    # Deep copy: YAML anchors share objects, and overlays must not leak between entries.
    return copy.deepcopy(data)


def check_configfiles(paths) -> None:
    """The user's --configfile files (Snakemake has read them, keeping the last of two equal
    keys): the same duplicate-key check as the registry files."""
    for path in paths:
        try:
            yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        except yaml.constructor.ConstructorError as err:
            raise NpuforgeError(
                f"--configfile {path}: {_first_line(err)}; keep one of the two"
            ) from err
        except (OSError, yaml.YAMLError):
            pass  # Snakemake read it already; nothing more to say


def _first_line(err) -> str:
    mark = getattr(err, "problem_mark", None)
    if getattr(err, "problem", None) and mark is not None:
        return f"{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(err).strip().splitlines()[0]


def merge_entry(base: dict, overlay: dict) -> dict:
    """Deep-merge ``overlay`` over ``base`` without changing either."""
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        mergeable = isinstance(value, dict) and isinstance(merged.get(key), dict)
        if mergeable and key not in REPLACED_FIELDS:
            merged[key] = _merge_plain(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge_plain(base: dict, overlay: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_plain(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def merge_registry(registry: dict, overlay: dict | None) -> dict:
    """Add overlay entries to a registry; an existing id gets its fields merged."""
    merged = copy.deepcopy(registry)
    for entry_id, entry in (overlay or {}).items():
        if not isinstance(entry, dict):
            raise NpuforgeError(f"registry overlay entry '{entry_id}' must be a mapping of fields")
        entry_id = str(entry_id)
        merged[entry_id] = merge_entry(merged[entry_id], entry) if entry_id in merged else entry
    return merged


def load_registries(config: dict, basedir=".") -> tuple[dict, dict]:
    """Return (models, targets): the registry files with the config's overlays merged in."""
    basedir = Path(basedir)
    models = load_yaml(_resolve(basedir, config["models_registry"]))
    targets = load_yaml(_resolve(basedir, config["targets_registry"]))
    models = merge_registry(models, config.get("models"))
    targets = merge_registry(targets, config.get("targets"))
    for entry in models.values():
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
            entry["sha256"] = normalized_sha256(entry["sha256"])
    return models, targets


def normalized_sha256(text: str) -> str:
    """A sha256 as written elsewhere: upper-case hex, or with a ``sha256:`` prefix."""
    text = text.strip()
    if text.lower().startswith("sha256:"):
        text = text[len("sha256:") :]
    return text.lower()


def _resolve(basedir: Path, path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else basedir / path


def check_registries(models: dict, targets: dict) -> None:
    """Consistency checks a JSON Schema cannot express; raise one line per problem found first."""
    for model_id, model in models.items():
        synthetic = model["source"].get("synthetic")
        if synthetic:
            for dim, arch_key in (("layers", "layers"), ("embed", "embed"), ("vocab", "vocab")):
                if synthetic[dim] != model["arch"][arch_key]:
                    raise NpuforgeError(
                        f"model {model_id}: source.synthetic.{dim}={synthetic[dim]} differs from "
                        f"arch.{arch_key}={model['arch'][arch_key]}; make them agree"
                    )
            if "version" in synthetic and synthetic["version"] != model.get("version"):
                raise NpuforgeError(
                    f"model {model_id}: source.synthetic.version={synthetic['version']} differs "
                    f"from version={model.get('version')}; make them agree"
                )
        snapshot = bool(model["source"].get("hf", {}).get("snapshot"))
        # A path may be a file or a directory; a synthetic llama is a model directory.
        synthetic_llama = bool(synthetic) and model["family"] == "llama"
        if synthetic_llama and model["format"] != "hf":
            raise NpuforgeError(
                f"model {model_id}: a synthetic llama checkpoint is a model directory; "
                "set format: hf"
            )
        permuted = model["source"].get("permuted")
        if permuted:
            check_permuted_source(model_id, model, models)
        if model["tokenizer"] == "hf" and model["format"] not in ("hf", "gguf"):
            raise NpuforgeError(
                f"model {model_id}: tokenizer hf ships the checkpoint's tokenizer.json, which a "
                f"single {model['format']} file does not have; set tokenizer: rwkv-world or none, "
                "or use a model directory (format hf) or a GGUF file"
            )
        if model["format"] == "gguf" and model["family"] != "llama":
            raise NpuforgeError(
                f"model {model_id}: format gguf is read for the llama family only; set family: "
                "llama or use a pth/safetensors checkpoint"
            )
        fixed_kind = "path" not in model["source"] and not synthetic_llama and not permuted
        if fixed_kind and snapshot != (model["format"] == "hf"):
            raise NpuforgeError(
                f"model {model_id}: format {model['format']} needs "
                f"{'hf.snapshot: true' if model['format'] == 'hf' else 'a single-file source'}; "
                "format hf goes with a snapshot (or a directory path), pth/safetensors/gguf with "
                "a file"
            )
        for target_id, precisions in model.get("precisions", {}).items():
            if target_id not in targets:
                raise NpuforgeError(
                    f"model {model_id}: precisions names unknown target '{target_id}'; "
                    f"valid targets: {', '.join(targets)}"
                )
            for precision in precisions:
                if precision not in targets[target_id]["precisions"]:
                    raise NpuforgeError(
                        f"model {model_id}: precision '{precision}' for {target_id} is not among "
                        f"the target's precisions ({', '.join(targets[target_id]['precisions'])})"
                    )
        path = model["source"].get("path")
        if path is not None and not Path(path).is_absolute():
            raise NpuforgeError(f"model {model_id}: source.path '{path}' must be an absolute path")
    from npuforge import backends

    for target_id, target in targets.items():
        # The backend's typed options (unknown keys refused) and its chip table.
        options = backends.options_of(target["backend"], target["options"], target_id)
        backends.get(target["backend"]).check_target(target_id, options, list(target["precisions"]))
        supported = target["precisions"]
        for precision in target["default_precisions"]:
            if precision not in supported:
                raise NpuforgeError(
                    f"target {target_id}: default precision '{precision}' is not among its "
                    f"precisions ({', '.join(supported)}); list it there or drop it"
                )
        export = target["export"]
        if "prefill" in export["variants"] and "prefill_tokens" not in export:
            raise NpuforgeError(
                f"target {target_id}: the prefill variant needs export.prefill_tokens; set it"
            )


def check_permuted_source(model_id: str, model: dict, models: dict) -> None:
    """A permuted twin names a llama registry model, is a model directory, and keeps the
    dimensions of its source (a permutation changes none)."""
    base_id = model["source"]["permuted"]["model"]
    base = models.get(base_id)
    if base is None:
        raise NpuforgeError(
            f"model {model_id}: source.permuted.model names unknown model '{base_id}'; "
            f"use one of {', '.join(sorted(models))}"
        )
    if base_id == model_id or "permuted" in base["source"]:
        raise NpuforgeError(
            f"model {model_id}: source.permuted.model must name a model with a checkpoint of "
            f"its own, not '{base_id}'"
        )
    if model["family"] != "llama" or base["family"] != "llama":
        raise NpuforgeError(
            f"model {model_id}: a permuted twin is made for the llama family only; set "
            "family: llama and name a llama model"
        )
    if model["format"] != "hf":
        raise NpuforgeError(
            f"model {model_id}: a permuted twin is a model directory; set format: hf"
        )
    for key in ("layers", "embed", "vocab"):
        if model["arch"][key] != base["arch"][key]:
            raise NpuforgeError(
                f"model {model_id}: arch.{key}={model['arch'][key]} differs from its source "
                f"{base_id}'s ({base['arch'][key]}); a permutation keeps the dimensions"
            )


def model_weights(model: dict) -> str:
    """ "synthetic" for a registry model whose checkpoint is made with random weights, else
    "trained": the compile step's floors depend on it (npuforge.backends.gate)."""
    return "synthetic" if "synthetic" in model["source"] else "trained"


def build_options(model: dict, target: dict) -> dict:
    """The target's options for one model's builds: the model's own verify_steps, where it
    sets one, replaces the target's."""
    options = dict(target["options"])
    if "verify_steps" in model:
        options["verify_steps"] = model["verify_steps"]
    return options


def merged_export(model: dict, target: dict) -> dict:
    """The target's export choices with the model's own over them (say, more chunks)."""
    export = dict(target["export"], **model.get("export", {}))
    if "chunks" in model.get("export", {}):
        export.pop("chunk_policy", None)
    elif "chunk_policy" in model.get("export", {}):
        export.pop("chunks", None)
    return export
