import shutil

from npuforge.step_code import step_code_digest, step_sources


def make_checkout(root):
    (root / "npuforge" / "models").mkdir(parents=True)
    (root / "npuforge" / "__init__.py").write_text("")
    (root / "npuforge" / "models" / "llama.py").write_text("SCALE = 2\n")
    (root / "workflow_scripts").mkdir()
    (root / "workflow_scripts" / "export_onnx.py").write_text("import npuforge\n")
    (root / "workflow_scripts" / "compile.py").write_text("import npuforge\n")
    return root


def test_a_step_digest_follows_its_script_and_every_package_file(tmp_path):
    checkout = make_checkout(tmp_path / "a")
    export = checkout / "workflow_scripts" / "export_onnx.py"
    compile_ = checkout / "workflow_scripts" / "compile.py"
    before = step_code_digest(export, checkout)
    assert before != step_code_digest(compile_, checkout)  # the script's name counts

    # The same bytes in another checkout at another path give the same digest.
    other = shutil.copytree(checkout, tmp_path / "somewhere" / "much" / "longer")
    assert step_code_digest(other / "workflow_scripts" / "export_onnx.py", other) == before
    # Byte-code caches are not code.
    cached = other / "npuforge" / "__pycache__"
    cached.mkdir()
    (cached / "__init__.cpython-311.pyc").write_bytes(b"\0")
    assert [p.name for p in step_sources(other / "workflow_scripts" / "export_onnx.py", other)] == [
        "export_onnx.py",
        "__init__.py",
        "llama.py",
    ]

    # An edit to a module the script does not import by name changes it; so does one to
    # the script itself.
    module = other / "npuforge" / "models" / "llama.py"
    module.write_text("SCALE = 3\n")
    edited = step_code_digest(other / "workflow_scripts" / "export_onnx.py", other)
    assert edited != before
    (other / "workflow_scripts" / "compile.py").write_text("import npuforge  # edited\n")
    assert step_code_digest(other / "workflow_scripts" / "compile.py", other) != step_code_digest(
        compile_, checkout
    )
