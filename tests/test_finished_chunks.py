"""The store of finished chunk jobs a compile reruns from (npuforge.jobs.finished_chunks)."""

import json

from npuforge.jobs.finished_chunks import FinishedChunks, files_in, store_beside


def chunk_job(staging, feed=b"feed"):
    """A chunk's work directory as a backend writes it before its job runs."""
    work = staging / "work" / "chunk0"
    work.mkdir(parents=True)
    (work / "model.onnx").write_bytes(b"graph")
    (work / "feed.npy").write_bytes(feed)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"onnx": str(work / "model.onnx"), "out": str(staging / "c.bin")}))
    return spec


def key(store, staging, feed=b"feed", **kwargs):
    spec = chunk_job(staging, feed)
    beside = files_in(spec.parent, but=[spec])
    inputs = beside + list(kwargs.pop("inputs", []))
    return store.key(spec.read_text(), {"staging": staging}, inputs=inputs, **kwargs)


def test_a_rerun_at_another_staging_path_finds_the_chunk_its_bytes_and_record(tmp_path):
    store = FinishedChunks(store_beside(tmp_path / "fp16"), {"toolchain": "a"})
    first, second = tmp_path / ".fp16.1.tmp", tmp_path / ".fp16.2.tmp"
    found = key(store, first)
    outputs = [first / "c.bin", first / "work" / "chunk0" / "result.json", first / "absent"]
    outputs[0].write_bytes(b"binary")
    outputs[1].write_text("{}")
    assert store.restore(found, {"staging": first}) is None
    store.keep(found, outputs, {"staging": first}, record={"seconds": 1.5})
    assert store.count() == 1 and store.dir == tmp_path / ".fp16.finished-chunks"

    assert key(store, second) == found
    assert store.restore(found, {"staging": second}) == {"seconds": 1.5}
    assert (second / "c.bin").read_bytes() == b"binary"
    assert (second / "work" / "chunk0" / "result.json").read_text() == "{}"
    store.clear()
    assert not store.dir.exists()


def test_anything_the_job_reads_changes_the_key(tmp_path):
    store = FinishedChunks(store_beside(tmp_path / "fp16"), {"toolchain": "a"})
    weights = tmp_path / "model.onnx.data"
    weights.write_bytes(b"weights")
    keys = {key(store, tmp_path / "a"), key(store, tmp_path / "b", feed=b"other")}
    keys.add(
        key(FinishedChunks(store_beside(tmp_path / "fp16"), {"toolchain": "b"}), tmp_path / "c")
    )
    keys.add(key(store, tmp_path / "d", env={"OMP_NUM_THREADS": "2"}))
    keys.add(key(store, tmp_path / "e", inputs=[weights]))
    weights.write_bytes(b"other weights")
    keys.add(key(store, tmp_path / "f", inputs=[weights]))
    assert len(keys) == 6
