"""The Genie decision recorded in QNN bundles' manifests (npuforge.backends.qnn_genie)."""

from npuforge.backends.qnn_genie import differences, genie_record


def spec(name, role, shape=(1,)):
    return {"name": name, "role": role, "shape": list(shape), "dtype": "float32"}


def rwkv_meta():
    state = {**spec("state_0_wkv", "state"), "output": "state_0_wkv_out"}
    return {
        "family": "rwkv",
        "graphs": [
            {
                "inputs": [spec("embedding", "embedding"), state],
                "outputs": [spec("logits", "logits"), spec("state_0_wkv_out", "state")],
            }
        ],
    }


def llama_meta(genie_names=False):
    """npuforge's llama I/O, or a graph named the way Genie's QnnHtp engine feeds it."""
    if genie_names:
        inputs = [spec("input_ids", "tokens"), spec("attention_mask", "mask")]
        inputs += [spec("position_ids_cos", "position"), spec("position_ids_sin", "position")]
        inputs += [spec("past_key_0_in", "past"), spec("past_value_0_in", "past")]
        outputs = [spec("logits", "logits"), spec("past_key_0_out", "past")]
    else:
        inputs = [spec("tokens", "tokens"), spec("attention_mask", "mask")]
        inputs += [spec("rope_cos", "rope_cos"), spec("rope_sin", "rope_sin")]
        inputs += [spec("cache_write", "cache_write"), spec("cache_keep", "cache_keep")]
        inputs += [{**spec("cache_0_k", "state"), "output": "cache_0_k_out"}]
        outputs = [spec("logits", "logits"), spec("cache_0_k_out", "state")]
    return {"family": "llama", "cache_len": 64, "graphs": [{"inputs": inputs, "outputs": outputs}]}


def test_rwkv_bundles_leave_genie_out_naming_the_recurrent_state():
    record = genie_record([rwkv_meta()])
    assert record["config"] is None and record["conforms"] is False
    assert any("recurrent state" in d for d in record["differences"])
    assert any("['embedding']" in d for d in record["differences"])
    assert record["sources"] and "80-63442-100" in record["sources"][0]


def test_llama_graphs_list_each_difference_from_genie_conventions():
    found = differences(llama_meta())
    assert len(found) == 4, found
    joined = " ".join(found)
    for word in ("input_ids", "position_ids_cos", "cache_write", "past_key_{i}_in"):
        assert word in joined


def test_a_graph_named_as_genie_feeds_it_shows_no_difference():
    assert differences(llama_meta(genie_names=True)) == []
    record = genie_record([llama_meta(genie_names=True)])
    # Conforming graphs still get no invented configuration.
    assert record["conforms"] is True and record["config"] is None
