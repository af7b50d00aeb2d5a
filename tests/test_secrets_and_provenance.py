"""Secrets stay out of every output, container jobs are isolated, checkpoints load without
code, and a bundle's manifest is the same on any machine."""

import ast
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, copy_workflow, script_env
from crash_trials import release_digests
from test_fetch import COMMIT, PRIVATE_REPO, REPO_FILES, TOKEN, HubHandler, hf_env, loopback_server

from npuforge import toolchain
from npuforge.cache import cache_root
from npuforge.errors import NpuforgeError

TINY = yaml.safe_load((REPO / "config" / "models.yaml").read_text())["rwkv7-tiny"]


def tiny_checkpoint(path: Path) -> bytes:
    from npuforge.models.rwkv.synthetic import write_synthetic_checkpoint

    write_synthetic_checkpoint(path, **TINY["source"]["synthetic"], fmt="pth")
    return path.read_bytes()


def build(wf: Path, entry: dict, env: dict, target="onnx") -> Path:
    (wf / "extra.yaml").write_text(yaml.safe_dump({"models": {"m": entry}}))
    results = wf / "results"
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "extra.yaml",
         "--config", "model=m", f"target={target}", f"results={results}"],
        cwd=wf, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return results


def every_byte_written(*roots: Path):
    """(path, bytes) of every file under ``roots``, tarballs and gzip members opened."""
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            yield path, data
            if path.name.endswith(".tar.gz"):
                with tarfile.open(path) as tar:
                    for member in tar.getmembers():
                        if member.isfile():
                            yield Path(f"{path}:{member.name}"), tar.extractfile(member).read()
            elif path.suffix == ".gz":
                yield Path(f"{path}:gunzip"), gzip.decompress(data)


RKNN_NATIVE = toolchain.unavailable_reason("rknn", "native", {"target_platform": "rk3588"})


@pytest.mark.parametrize(
    "target",
    [
        "onnx",
        # A vendor build too: a native toolchain job inherits the environment, token included.
        pytest.param(
            "RK3588",
            marks=[
                pytest.mark.slow,
                pytest.mark.toolchain,
                pytest.mark.skipif(RKNN_NATIVE is not None, reason=f"rknn: {RKNN_NATIVE}"),
            ],
        ),
    ],
)
def test_hf_token_appears_in_no_log_manifest_record_or_bundle(tmp_path, target):
    data = tiny_checkpoint(tmp_path / "tiny.pth")
    REPO_FILES[PRIVATE_REPO]["tiny.pth"] = data
    try:
        with loopback_server(HubHandler) as url:
            # Not set here: the steps' own setting keeps the hub client's telemetry off.
            env = hf_env(tmp_path, url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_TELEMETRY=None)
            entry = {
                **TINY,
                "source": {
                    "hf": {"repo": PRIVATE_REPO, "filename": "tiny.pth", "revision": COMMIT}
                },
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            wf = copy_workflow(tmp_path / "wf")
            results = build(wf, entry, env, target)
            seen = list(HubHandler.requests_seen)
            agents = list(HubHandler.user_agents_seen)
    finally:
        REPO_FILES[PRIVATE_REPO].pop("tiny.pth")
    assert any(auth == f"Bearer {TOKEN}" for _, _, auth in seen), "the token was not used"
    # With the hub's telemetry on, its user agent names the machine's torch (installed here).
    assert agents and all("hf_hub/" in ua and "torch/" not in ua for ua in agents), agents
    checked = 0
    for path, content in every_byte_written(results, wf / ".snakemake"):
        assert TOKEN.encode() not in content, f"HF_TOKEN written to {path}"
        checked += 1
    assert checked > 20 and any(results.rglob("manifest.json")) and any(results.rglob("*.log"))
    if target == "RK3588":
        assert any(results.rglob("*.rknn")) and any(results.rglob("compile.json"))


def test_a_manifest_names_no_path_and_travels_between_machines(tmp_path):
    """Two checkouts at different paths, the source file at different paths: same bundle."""

    bundles = []
    for name in ("first", "second-machine"):
        home = tmp_path / name
        source = home / "models" / "tiny.pth"
        source.parent.mkdir(parents=True)
        data = tiny_checkpoint(source)
        entry = {
            **TINY,
            "source": {"path": str(source)},
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        env = script_env(NPUFORGE_CACHE=str(home / "cache"))
        wf = copy_workflow(home / "checkout")
        bundles.append((home, build(wf, entry, env)))
    (home_a, results_a), (home_b, results_b) = bundles
    manifest_a = next(results_a.rglob("manifest.json")).read_text()
    manifest_b = next(results_b.rglob("manifest.json")).read_text()
    for text in (manifest_a, manifest_b):
        for where in (str(tmp_path), str(REPO), os.path.expanduser("~"), "/tmp/"):
            assert where not in text, f"the manifest names {where}"
    assert json.loads(manifest_a)["model"]["source"] == {"path": "tiny.pth"}
    assert manifest_a == manifest_b
    assert release_digests(results_a) == release_digests(results_b)


def test_a_build_keeps_no_telemetry(tmp_path):
    # onnxruntime's Linux wheels keep a telemetry database under ~/.cache and try to send
    # it; every step runs with it off.
    home = tmp_path / "home"
    source = tmp_path / "tiny.pth"
    entry = {**TINY, "source": {"path": str(source)}}
    entry["sha256"] = hashlib.sha256(tiny_checkpoint(source)).hexdigest()
    env = script_env(HOME=str(home), NPUFORGE_CACHE=str(cache_root()))
    results = build(copy_workflow(tmp_path / "wf"), entry, env)
    assert any(results.rglob("manifest.json"))
    assert not (home / ".cache" / "Microsoft").exists()


def rknn_podman_reason():
    return toolchain.unavailable_reason("rknn", "podman", {"target_platform": "rk3588"})


@pytest.mark.toolchain
@pytest.mark.skipif(rknn_podman_reason() is not None, reason=f"podman: {rknn_podman_reason()}")
def test_container_jobs_cannot_write_inputs_or_open_a_socket_and_never_run_as_root(tmp_path):
    """A real job in the rknn image (built here if missing, as the first RK3588 podman
    build would) tries to write its input and to open a socket; it runs as a non-root uid
    even when the caller is root, and its outputs belong to the caller afterwards."""
    stamp = tmp_path / "stamp.json"
    toolchain.prepare("rknn", "podman", stamp, target_options={"target_platform": "rk3588"},
                      log_path=tmp_path / "prepare.log")  # fmt: skip
    jobs, inputs, out = tmp_path / "jobs", tmp_path / "inputs", tmp_path / "out"
    for d in (jobs, inputs, out):
        d.mkdir()
    model = inputs / "model.onnx"
    model.write_bytes(b"weights")
    model.chmod(0o666)  # only the read-only mount stands between the job and this file
    (jobs / "probe.py").write_text(
        "import json, os, socket, sys\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "seen = {'uid': os.getuid(), 'gid': os.getgid()}\n"
        "try:\n"
        "    open(os.path.join(spec['input'], 'model.onnx'), 'ab').write(b'x')\n"
        "    seen['wrote_input'] = True\n"
        "except OSError as err:\n"
        "    seen['wrote_input'] = err.strerror\n"
        "for name, address in (('internet', ('1.1.1.1', 53)), ('host', ('10.0.2.2', 22))):\n"
        "    try:\n"
        "        socket.create_connection(address, timeout=3).close()\n"
        "        seen[name] = True\n"
        "    except OSError as err:\n"
        "        seen[name] = err.strerror or str(err)\n"
        "seen['interfaces'] = sorted(n for _, n in socket.if_nameindex())\n"
        "os.mkdir(os.path.join(spec['out'], 'made'))\n"
        "json.dump(seen, open(os.path.join(spec['out'], 'made', 'seen.json'), 'w'))\n"
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"input": str(inputs), "out": str(out)}))
    toolchain.run_job(stamp, jobs / "probe.py", spec, read_only=[inputs], writable=[out])
    seen = json.loads((out / "made" / "seen.json").read_text())
    assert seen["wrote_input"] == "Read-only file system", seen
    assert model.read_bytes() == b"weights"
    assert seen["internet"] is not True and seen["host"] is not True, seen
    assert seen["interfaces"] == ["lo"], seen
    assert seen["uid"] != 0 and seen["gid"] != 0, seen
    assert (seen["uid"], seen["gid"]) == toolchain.job_user(), seen
    for made in (out, out / "made", out / "made" / "seen.json"):
        assert (made.stat().st_uid, made.stat().st_gid) == (os.getuid(), os.getgid()), made

    # A failing job hands its directories back too.
    (jobs / "fail.py").write_text(
        "import json, os, sys\n"
        "open(os.path.join(json.load(open(sys.argv[1]))['out'], 'partial'), 'w').write('x')\n"
        "sys.exit('error: the compiler gave up')\n"
    )
    with pytest.raises(NpuforgeError, match="the compiler gave up"):
        toolchain.run_job(stamp, jobs / "fail.py", spec, read_only=[inputs], writable=[out])
    assert (out / "partial").stat().st_uid == os.getuid()


def test_every_torch_load_is_weights_only():
    """Pickled checkpoints are read only through torch.load(weights_only=True); nothing
    calls pickle.load or torch.load without it (jobs and scripts included)."""
    calls = 0
    for path in [*(REPO / "npuforge").rglob("*.py"), *(REPO / "workflow_scripts").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = getattr(node.func.value, "id", None)
            if (owner, node.func.attr) in (("pickle", "load"), ("pickle", "loads")):
                raise AssertionError(f"{path}:{node.lineno} unpickles without weights_only")
            if (owner, node.func.attr) == ("torch", "load"):
                calls += 1
                flags = {k.arg: k.value for k in node.keywords}
                value = flags.get("weights_only")
                assert isinstance(value, ast.Constant) and value.value is True, (
                    f"{path}:{node.lineno} torch.load without weights_only=True"
                )
    assert calls >= 1
