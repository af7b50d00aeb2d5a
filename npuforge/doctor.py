"""``npuforge doctor``: which vendor toolchains this machine has, in which runtime, which version.

It only looks: a toolchain counts as found when its stamp (written by
prepare_toolchain.py) exists and the environment it names is still there. A
backend module that fails to import is reported, never fatal.
"""

import json
import os
from pathlib import Path

from npuforge.toolchain import REPO_ROOT, environment_present

NOT_BACKENDS = {"main", "base"}


def backends(repo_root=None) -> list[str]:
    """Backends with a toolchain definition under envs/ (a lock or a Containerfile)."""
    envs = Path(repo_root or REPO_ROOT) / "envs"
    found = []
    for path in sorted(envs.iterdir()) if envs.is_dir() else []:
        defined = (path / "requirements.lock").is_file() or (path / "Containerfile").is_file()
        if path.is_dir() and path.name not in NOT_BACKENDS and defined:
            found.append(path.name)
    return found


def configured_runtime(repo_root=None) -> str:
    config = Path(repo_root or REPO_ROOT) / "config" / "config.yaml"
    try:
        import yaml

        return (
            (yaml.safe_load(config.read_text()) or {}).get("toolchain", {}).get("runtime", "native")
        )
    except (OSError, ImportError, AttributeError):
        return "native"


def target_options(backend: str, repo_root=None) -> dict:
    """Options of the first registered target of this backend: backend checks need them."""
    registry = Path(repo_root or REPO_ROOT) / "config" / "targets.yaml"
    try:
        import yaml

        targets = yaml.safe_load(registry.read_text()) or {}
    except (OSError, ImportError):
        return {}
    for target in targets.values():
        if isinstance(target, dict) and target.get("backend") == backend:
            return dict(target.get("options") or {})
    return {}


def _unavailable(backend: str, runtime: str, repo_root=None) -> str | None:
    try:
        from npuforge import toolchain

        options = target_options(backend, repo_root)
        return toolchain.unavailable_reason(backend, runtime, options)
    except Exception as err:  # a half-written backend module must not break the doctor
        return f"backend check raised {type(err).__name__}: {err}"


def probe(backend: str, runtime: str, results_dir, repo_root=None) -> dict:
    stamp_path = Path(results_dir) / "toolchains" / f"{backend}-{runtime}.json"
    info = {"backend": backend, "runtime": runtime, "found": False, "versions": {}, "note": None}
    problem = _unavailable(backend, runtime, repo_root)
    if stamp_path.is_file():
        try:
            stamp = json.loads(stamp_path.read_text())
        except json.JSONDecodeError:
            info["note"] = f"{stamp_path} is not JSON: prepare the toolchain again"
            return info
        info["versions"] = stamp.get("versions", {})
        info["found"] = environment_present(stamp)
        if not info["found"]:
            info["note"] = f"stamp {stamp_path} names an environment that is gone: prepare again"
    else:
        info["note"] = (
            f"not prepared: python workflow_scripts/prepare_toolchain.py --backend {backend} "
            f"--runtime {runtime} --out {stamp_path}"
        )
    if problem:
        info["note"] = f"{info['note']}; {problem}" if info["note"] else problem
    return info


def report(runtime=None, results_dir=None, repo_root=None) -> list[dict]:
    runtime = runtime or configured_runtime(repo_root)
    results_dir = results_dir or Path(repo_root or REPO_ROOT) / "results"
    rows = [probe(b, runtime, results_dir, repo_root) for b in backends(repo_root)]
    sdk = os.environ.get("QNN_SDK_ROOT")
    rows.append(
        {
            "backend": "qnn-sdk",
            "runtime": "native",
            "found": bool(sdk) and Path(sdk).is_dir(),
            "versions": {"QNN_SDK_ROOT": sdk} if sdk else {},
            "note": None if sdk else "QNN SDK route: set QNN_SDK_ROOT to an installed SDK",
        }
    )
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'backend':<10} {'runtime':<8} {'found':<6} versions / note"]
    for row in rows:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(row["versions"].items()) if v)
        detail = versions or "-"
        if row["note"]:
            detail += f"  ({row['note']})"
        found = "yes" if row["found"] else "no"
        lines.append(f"{row['backend']:<10} {row['runtime']:<8} {found:<6} {detail}")
    return "\n".join(lines)
