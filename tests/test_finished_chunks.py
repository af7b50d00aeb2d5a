"""The store of finished chunk jobs a compile reruns from (npuforge.backends.finished_chunks)."""

import json

from npuforge.backends.finished_chunks import FinishedChunks


def chunk_job(staging, feed=b"feed"):
    """A chunk's work directory as a backend writes it before its job runs."""
    work = staging / "work" / "chunk0"
    work.mkdir(parents=True)
    (work / "model.onnx").write_bytes(b"graph")
    (work / "feed.npy").write_bytes(feed)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"onnx": str(work / "model.onnx"), "out": str(staging / "c.bin")}))
    return spec


def test_a_rerun_at_another_staging_path_finds_the_chunk_and_its_bytes(tmp_path):
    out = tmp_path / "fp16"
    store = FinishedChunks(out, {"toolchain": "a"})
    first, second = tmp_path / ".fp16.1.tmp", tmp_path / ".fp16.2.tmp"
    key = store.key(chunk_job(first), {"staging": first})
    outputs = [first / "c.bin", first / "work" / "chunk0" / "result.json", first / "absent"]
    outputs[0].write_bytes(b"binary")
    outputs[1].write_text("{}")
    assert not store.restore(key, {"staging": first})
    store.keep(key, outputs, {"staging": first})
    assert store.count() == 1 and store.dir == tmp_path / ".fp16.finished-chunks"

    assert store.key(chunk_job(second), {"staging": second}) == key
    assert store.restore(key, {"staging": second})
    assert (second / "c.bin").read_bytes() == b"binary"
    assert (second / "work" / "chunk0" / "result.json").read_text() == "{}"
    store.clear()
    assert not store.dir.exists()


def test_anything_the_job_reads_changes_the_key(tmp_path):
    out = tmp_path / "fp16"
    base = FinishedChunks(out, {"toolchain": "a"})

    def key(store, name, **kwargs):
        staging = tmp_path / name
        feed = kwargs.pop("feed", b"feed")
        return store.key(chunk_job(staging, feed), {"staging": staging}, **kwargs)

    source = tmp_path / "model.onnx.data"
    source.write_bytes(b"weights")
    keys = {key(base, "a"), key(base, "b", feed=b"other")}
    keys.add(key(FinishedChunks(out, {"toolchain": "b"}), "c"))
    keys.add(key(base, "d", env={"OMP_NUM_THREADS": "2"}))
    keys.add(key(base, "e", inputs=[source]))
    source.write_bytes(b"other weights")
    keys.add(key(base, "f", inputs=[source]))
    assert len(keys) == 6
