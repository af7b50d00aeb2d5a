"""Step code digests: a step's CLI, its rule file and the package files the CLI reaches."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, script_env

from npuforge import backends, models
from npuforge.import_graph import code_graph
from npuforge.step_code import (
    Choice,
    dispatch_choices,
    reached_files,
    step_code_digest,
    step_sources,
)

# A package shaped like npuforge's, small enough to read at once.
TOY = {
    "npuforge/__init__.py": "",
    "npuforge/cli.py": "def run_cli(main):\n    return main()\n",
    "npuforge/unrelated.py": "SCALE = 2\n",
    "npuforge/models/__init__.py": """
        import importlib
        FAMILIES = {"a": "npuforge.models.a", "b": "npuforge.models.b"}
        def family(name):
            return importlib.import_module(FAMILIES[name])
        """,
    "npuforge/models/a/__init__.py": "from npuforge.models.a import layers\n",
    "npuforge/models/a/layers.py": "WIDTH = 1\n",
    "npuforge/models/b/__init__.py": "WIDTH = 2\n",
    "npuforge/backends/__init__.py": """
        import importlib
        def get(name):
            return importlib.import_module(f"npuforge.backends.{name}")
        """,
    "npuforge/backends/x.py": """
        from pathlib import Path
        JOB_SCRIPT = Path(__file__).parents[1] / "jobs" / "x_job.py"
        """,
    # `import z` here is a third-party package of that name: y is imported as a module.
    "npuforge/backends/y.py": "import z\n",
    "npuforge/backends/z.py": "",
    "npuforge/jobs/__init__.py": "",
    "npuforge/jobs/x_job.py": "def main():\n    import stage\n",
    "npuforge/jobs/stage.py": "",
    "npuforge/jobs/unused.py": "",
    "npuforge/release.py": """
        from pathlib import Path
        RUNNER = Path(__file__).with_name("runner.py")
        """,
    "npuforge/runner.py": "",
    "workflow_scripts/export.py": """
        from npuforge.cli import run_cli
        def main():
            from npuforge import models
            return models
        """,
    "workflow_scripts/compile.py": "from npuforge import backends\n",
    "workflow_scripts/package.py": "from npuforge import release\n",
    "rules/export.smk": "rule export:\n",
}
FAMILY_A = Choice("npuforge.models.a", frozenset({"npuforge.models.a", "npuforge.models.b"}))
BACKENDS = frozenset({"npuforge.backends.x", "npuforge.backends.y"})


def make_toy(root: Path) -> Path:
    for name, text in TOY.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def reached(root, script, *choices):
    graph = code_graph(root)
    return set(reached_files(root / "workflow_scripts" / f"{script}.py", graph, choices))


def digest(root, script="export", rule="rules/export.smk", choices=()):
    graph = code_graph(root)
    return step_code_digest(root / "workflow_scripts" / f"{script}.py", graph, root / rule, choices)


def test_a_step_digest_follows_its_cli_its_rule_and_the_files_it_reaches(tmp_path):
    toy = make_toy(tmp_path / "a")
    before = digest(toy)
    assert before != digest(toy, script="compile")  # the script's name counts

    # The same bytes in another checkout at another path give the same digest.
    other = shutil.copytree(toy, tmp_path / "somewhere" / "much" / "longer")
    assert digest(other) == before
    # Byte-code caches are not code.
    cached = other / "npuforge" / "__pycache__"
    cached.mkdir()
    (cached / "__init__.cpython-311.pyc").write_bytes(b"\0")
    assert digest(other) == before
    sources = step_sources(other / "workflow_scripts" / "export.py", code_graph(other),
                           other / "rules" / "export.smk")  # fmt: skip
    assert [p.relative_to(other).as_posix() for p in sources] == [
        "workflow_scripts/export.py",
        "rules/export.smk",
        "npuforge/__init__.py",
        "npuforge/cli.py",
        "npuforge/models/__init__.py",
        "npuforge/models/a/__init__.py",
        "npuforge/models/a/layers.py",
        "npuforge/models/b/__init__.py",
    ]

    # An edit to a module the step does not reach leaves it; one to a module it
    # reaches (through a lazy import and a name), to its script or its rule changes it.
    (other / "npuforge" / "unrelated.py").write_text("SCALE = 3\n")
    assert digest(other) == before
    for edited in ("npuforge/models/a/layers.py", "workflow_scripts/export.py",
                   "rules/export.smk"):  # fmt: skip
        path = other / edited
        path.write_text(path.read_text() + "# edited\n")
        assert digest(other) != before, edited
        before = digest(other)


def test_a_dispatch_reaches_every_candidate_unless_the_step_knows_its_pick(tmp_path):
    toy = make_toy(tmp_path)
    family_b = {"npuforge/models/b/__init__.py"}
    assert family_b <= reached(toy, "export")
    narrowed = reached(toy, "export", FAMILY_A)
    assert not family_b & narrowed
    assert "npuforge/models/a/layers.py" in narrowed
    # A step for no model reaches no family, still the dispatcher it imports.
    none = reached(toy, "export", Choice(None, FAMILY_A.candidates))
    assert "npuforge/models/__init__.py" in none
    assert not any(path.startswith("npuforge/models/a/") for path in none)

    before = digest(toy, choices=(FAMILY_A,))
    (toy / "npuforge" / "models" / "b" / "__init__.py").write_text("WIDTH = 3\n")
    assert digest(toy, choices=(FAMILY_A,)) == before
    assert digest(toy) != digest(toy, choices=(FAMILY_A,))


def test_a_script_run_by_path_reaches_the_files_beside_it_it_imports(tmp_path):
    toy = make_toy(tmp_path)
    x = reached(toy, "compile", Choice("npuforge.backends.x", BACKENDS))
    assert {"npuforge/jobs/x_job.py", "npuforge/jobs/stage.py"} <= x
    assert "npuforge/jobs/unused.py" not in x
    # The dispatcher reaches only the chosen backend by name.
    assert not {"npuforge/backends/y.py", "npuforge/backends/z.py"} & x
    y = reached(toy, "compile", Choice("npuforge.backends.y", BACKENDS))
    assert "npuforge/backends/y.py" in y
    # y is imported as a module: its top-level `import z` is not the file beside it.
    assert not {"npuforge/backends/z.py", "npuforge/jobs/x_job.py"} & y
    # A file another module reads by name (shipped as the bundle's run.py).
    assert "npuforge/runner.py" in reached(toy, "package")


def test_an_f_string_pattern_names_what_it_can_match_and_no_more(tmp_path):
    toy = make_toy(tmp_path)
    (toy / "npuforge" / "backends" / "x.py").write_text(
        "def job(name):\n    return f'{name}_job.py', f'v{name}', f'{name} stage'\n"
    )
    graph = code_graph(toy)
    assert graph.edges["npuforge/backends/x.py"].by_path == {"npuforge/jobs/x_job.py"}
    assert graph.edges["npuforge/backends/__init__.py"].by_name == {
        "npuforge/backends/x.py",
        "npuforge/backends/y.py",
        "npuforge/backends/z.py",
    }


def test_scans_are_kept_by_content_between_runs(tmp_path):
    toy = make_toy(tmp_path / "toy")
    cache = tmp_path / "code_graph.json"
    first = code_graph(toy, cache)
    stored = json.loads(cache.read_text())
    assert {key.rsplit(":", 1)[0] for key in stored["scans"]} == {
        name for name in TOY if name.startswith("npuforge/")
    }
    # An edited file is scanned again: its new import is an edge at once.
    cli = toy / "npuforge" / "cli.py"
    cli.write_text(cli.read_text() + "from npuforge import unrelated\n")
    second = code_graph(toy, cache)
    assert "npuforge/unrelated.py" in second.edges["npuforge/cli.py"].imports
    assert "npuforge/unrelated.py" not in first.edges["npuforge/cli.py"].imports
    # A cache that is not one is ignored, and rewritten.
    cache.write_text("{not json")
    cli.write_text(cli.read_text() + "# again\n")
    assert code_graph(toy, cache).edges["npuforge/cli.py"] == second.edges["npuforge/cli.py"]
    assert json.loads(cache.read_text())["scans"]


# The real package.
GRAPH = code_graph(REPO)
SCRIPTS = REPO / "workflow_scripts"


def real_reached(script, **picks) -> set:
    return set(reached_files(SCRIPTS / f"{script}.py", GRAPH, dispatch_choices(picks)))


def test_a_compile_reaches_its_backend_and_job_script_and_no_other():
    for backend, job in [("qnn", "qnn_job.py"), ("rknn", "rknn_job.py"),
                         ("tpumlir", "tpumlir_job.py")]:  # fmt: skip
        found = real_reached("compile", backend=backend, family="rwkv")
        assert {f"npuforge/backends/{backend}.py", f"npuforge/jobs/{job}"} <= found
        # The job runs by path and imports its siblings as top-level modules.
        assert "npuforge/jobs/job_stage.py" in found
        others = {f"npuforge/backends/{b}.py" for b in backends.BACKENDS if b != backend}
        assert not others & found, others & found
        assert not any(p.startswith("npuforge/models/llama/") for p in found)
    reference = real_reached("compile", backend="onnx", family="llama")
    assert not any(p.startswith("npuforge/jobs/") and p.endswith("_job.py") for p in reference)


def test_packaging_reaches_the_bundle_runner_and_model_steps_no_backend():
    assert "npuforge/bundle_runner.py" in real_reached("package_release", backend="rknn",
                                                       family="llama")  # fmt: skip
    # A download runs no family's code (npuforge.fetch.runs_family_code).
    download = real_reached("fetch_model", family=None)
    assert "npuforge/fetch.py" in download
    assert not any(
        p.startswith(("npuforge/models/llama/", "npuforge/models/rwkv/")) for p in download
    )
    for script in ("fetch_model", "inspect_checkpoint", "export_onnx", "verify_onnx",
                   "make_calibration_samples", "tokenize_heldout"):  # fmt: skip
        for family in models.FAMILIES:
            found = real_reached(script, family=family)
            assert not any(p.startswith(("npuforge/backends/", "npuforge/jobs/")) for p in found)
            other = next(f for f in models.FAMILIES if f != family)
            assert not any(p.startswith(f"npuforge/models/{other}/") for p in found), script


# What each step picks by name in the workflow (rules/common.smk: a target's backend, a
# model's family, "no" what a rule declares it never runs), each alternative a line.
STEP_PICKS = {
    "fetch_model": [("family",), ("no family",)],
    "dequantize_gguf": [("family",)],
    "inspect_checkpoint": [("family",)],
    "export_onnx": [("family",)],
    "verify_onnx": [("family",)],
    "make_calibration_samples": [("family",)],
    "tokenize_heldout": [("family",)],
    "convert_tokenizer": [(), ("family",)],
    "compile": [("backend", "family")],
    "package_release": [("backend", "family")],
    "bench_device": [("backend", "family")],
    "prepare_toolchain": [("backend", "no family")],
    "release_index": [("no backend", "no family")],
    "release_report": [("no backend", "no family")],
    "docs_data": [("no backend", "no family")],
    "make_synthetic_checkpoint": [()],
    "permute_checkpoint": [("family",)],
}
RUNTIME_PROBE = """
import importlib.util, json, sys
script, picks = sys.argv[1], json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("step_cli", script)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
if "backend" in picks:
    from npuforge import backends
    backends.get(picks["backend"])
if "family" in picks:
    from npuforge import models
    models.family(picks["family"])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "npuforge")))
"""


def pick_cases():
    for script, alternatives in STEP_PICKS.items():
        for kinds in alternatives:
            options = [{}]
            for kind in kinds:
                name = kind.removeprefix("no ")
                if kind.startswith("no "):
                    values = [None]
                else:
                    values = list(backends.BACKENDS if name == "backend" else models.FAMILIES)
                options = [dict(o, **{name: v}) for o in options for v in values]
            for picks in options:
                yield pytest.param(script, picks, id=f"{script}-{json.dumps(picks)}")


def test_every_step_cli_has_its_picks_listed():
    assert set(STEP_PICKS) == {path.stem for path in SCRIPTS.glob("*.py")}


@pytest.mark.parametrize(("script", "picks"), list(pick_cases()))
def test_what_a_step_imports_when_run_is_in_its_static_closure(script, picks):
    """The CLI imported as it runs (its module level), and the modules its picks load
    where it reaches their dispatcher (a step that cannot call it picks nothing)."""
    static = real_reached(script, **picks)
    dispatchers = {
        "backend": "npuforge/backends/__init__.py",
        "family": "npuforge/models/__init__.py",
    }
    dispatched = {k: v for k, v in picks.items() if v is not None and dispatchers[k] in static}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNTIME_PROBE,
            str(SCRIPTS / f"{script}.py"),
            json.dumps(dispatched),
        ],
        capture_output=True,
        text=True,
        env=script_env(),
        cwd=REPO,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    loaded = {GRAPH.modules[name] for name in json.loads(probe.stdout)}
    assert loaded - static == set()


# A job script imported as its toolchain runs it: its directory first on sys.path.
JOB_PROBE = """
import importlib, json, sys
from pathlib import Path
job = Path(sys.argv[1])
sys.path.insert(0, str(job.parent))
importlib.import_module(job.stem)
print(json.dumps([m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]))
"""


def test_what_a_job_script_imports_beside_it_is_in_its_compile_closure():
    for backend in ("qnn", "rknn", "tpumlir"):
        job = Path(backends.get(backend).JOB_SCRIPT)
        probe = subprocess.run(
            [sys.executable, "-c", JOB_PROBE, str(job)],
            capture_output=True,
            text=True,
            env=script_env(),
            cwd=REPO,
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        beside = {
            Path(f).resolve().relative_to(REPO).as_posix()
            for f in json.loads(probe.stdout)
            if Path(f).resolve().parent == job.parent
        }
        assert f"npuforge/jobs/{job.name}" in beside
        assert beside - real_reached("compile", backend=backend, family="rwkv") == set()
