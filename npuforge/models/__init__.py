"""Reference torch modules per model family (``rwkv``; ``llama`` lives beside it).

A family module exports graphs and may provide ``extra_inputs(meta, input_spec,
position)`` for graph input roles beyond tokens/embedding/hidden/state.
"""
