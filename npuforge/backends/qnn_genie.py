"""Whether a QNN bundle can ship a Genie configuration (genie_config.json), and why not.

Qualcomm's Genie runs LLM context binaries with ``genie-t2t-run`` from a JSON dialog
configuration ("Genie Dialog JSON configuration string", QAIRT documentation
80-63442-100, published 2025-10-02). The configuration names the binaries; Genie's
QnnHtp engine then feeds the graphs itself, by tensor name, so a graph must follow its
I/O conventions. They are not written down as a table in that document; they are what
the Genie library source the QAIRT 2.x SDK ships as an example reads
(``examples/Genie/Genie/src/qualla/engines/qnn-htp/nsp-model.cpp`` and
``KVCache/smart-mask.cpp``):

* the first graph takes ``input_ids`` (tokens) or ``inputs_embeds`` (embedding rows);
* ``attention_mask``, and ``position_ids`` or ``position_ids_cos``/``position_ids_sin``
  (RoPE rows Genie gathers from its own table, half the head dimension wide);
* per layer ``past_key_{i}_in``/``past_value_{i}_in`` holding the cache, key cache laid
  out [heads, head_dim, context], value cache [heads, context, head_dim], and outputs
  ``past_key_{i}_out``/``past_value_{i}_out`` holding only this call's new entries,
  which Genie's KV manager writes into the cache buffers;
* ``logits`` out of the last graph.

npuforge's graphs differ (``differences`` below lists how, per bundle), so the bundle
ships no genie_config.json and its manifest says why under ``genie``; no field of a
Genie configuration is written that Genie's documentation does not define.
"""

GENIE_SOURCES = (
    "QAIRT documentation 80-63442-100, 'Genie Dialog JSON configuration string' (2025-10-02)",
    "QAIRT 2.x SDK examples/Genie/Genie/src/qualla/engines/qnn-htp/nsp-model.cpp and "
    "KVCache/smart-mask.cpp (the Genie library source example)",
)
GENIE_TOKEN_INPUTS = ("input_ids", "inputs_embeds")


def _names(graphs, key) -> set:
    return {spec["name"] for graph in graphs for spec in graph[key]}


def differences(meta: dict) -> list[str]:
    """How an export's graphs differ from what Genie's QnnHtp engine feeds (empty: none)."""
    graphs = meta.get("graphs", [])
    inputs, outputs = _names(graphs, "inputs"), _names(graphs, "outputs")
    roles = {spec["role"] for graph in graphs for spec in graph["inputs"]}
    found = []
    if meta.get("family") != "llama" or "cache_len" not in meta:
        found.append(
            f"{meta.get('family')} graphs carry a recurrent state (inputs of role 'state', "
            "fed back whole each call): Genie's QnnHtp engine carries no state from call to "
            "call but past_key/past_value caches (or none, for whole-context graphs)"
        )
    if not inputs & set(GENIE_TOKEN_INPUTS):
        first = [s["name"] for s in graphs[0]["inputs"]][:1] if graphs else []
        found.append(f"the first graph takes {first} instead of input_ids or inputs_embeds")
    if "logits" not in outputs:
        found.append("no output named logits")
    if {"rope_cos", "rope_sin"} <= roles:
        found.append(
            "RoPE rows are inputs rope_cos/rope_sin of the full head dimension (halves "
            "duplicated), not position_ids_cos/position_ids_sin"
        )
    if {"cache_write", "cache_keep"} & roles:
        found.append(
            "the graphs take cache_write/cache_keep slot inputs and return the whole "
            "updated cache (cache_{i}_k_out), where Genie feeds no slot inputs and expects "
            "past_key_{i}_out with only the new entries, written into its cache by the host"
        )
    if any(name.startswith("cache_") for name in inputs):
        found.append(
            "caches are cache_{i}_k/cache_{i}_v, both [batch, kv_heads, cache_len, head_dim]; "
            "Genie's are past_key_{i}_in [heads, head_dim, context] and past_value_{i}_in "
            "[heads, context, head_dim]"
        )
    return found


def genie_record(exports: list[dict]) -> dict:
    """The manifest's ``genie`` entry of a QNN bundle, from its exports' export.json."""
    found = []
    for meta in exports:
        found += [d for d in differences(meta) if d not in found]
    return {
        "config": None,
        "conforms": not found,
        "reason": (
            "no genie_config.json: the graphs do not follow the I/O conventions Genie's "
            "QnnHtp engine feeds; run the bundle with run.py (onnxruntime-qnn's QNN EP)"
            if found
            else "the graphs follow Genie's conventions but npuforge writes no Genie "
            "configuration yet"
        ),
        "differences": found,
        "sources": list(GENIE_SOURCES),
    }
