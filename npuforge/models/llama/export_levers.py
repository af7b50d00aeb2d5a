"""The export's levers fitted on the calibration text (``npuforge.texts``): SmoothQuant's
and AWQ's scales, GPTQ's rounding. Each changes ``model`` (fp32, whole) in place and
returns its record for ``export.json``, which names the text and tokenizer used."""

from npuforge.models.llama.weights import checkpoint_tokenizer


def calibration_sequences(model, checkpoint_dir, text) -> tuple:
    """The calibration text's documents (the project's where ``text`` is empty) as token
    ids, and the record of which text and tokenizer they are."""
    from npuforge import texts

    documents = texts.read_documents(text or None)
    tokenizer, described = checkpoint_tokenizer(checkpoint_dir)
    sequences = texts.tokenize_documents(documents, model.cfg.vocab_size, tokenizer)
    record = {
        "documents": len(documents),
        "sha256": texts.text_digest(documents),
        "tokenizer": described,
    }
    return sequences, record


def smoothquant(model, checkpoint_dir, options: dict, prefix: list, cache_len: int, run) -> dict:
    """Fold SmoothQuant scales measured on the calibration text into ``model``, whose
    activations ``run(ids)`` shows its hooks (a call from an empty cache)."""
    from npuforge.models.llama import smoothing

    sequences, text = calibration_sequences(model, checkpoint_dir, options.get("text"))
    room = cache_len - len(prefix)
    ranges = smoothing.activation_ranges(model, sequences, prefix, room, run)
    summary = smoothing.smooth(model, ranges, float(options["alpha"]))
    summary["text"] = dict(text, tokens_per_document=smoothing.TOKENS_PER_DOCUMENT)
    return summary


def awq(model, checkpoint_dir, options: dict, prefix: list) -> dict:
    """Fold AWQ scales for the grid ``options`` names, searched on the calibration text
    (whole documents, after the kv_prefix), into ``model``."""
    from npuforge.models.llama import awq
    from npuforge.quantization import WeightGrid

    sequences, text = calibration_sequences(model, checkpoint_dir, options.get("text"))
    grid = WeightGrid(int(options["bits"]), options.get("group"), bool(options["symmetric"]))
    return dict(awq.scale_decoder(model, sequences, prefix, grid), text=text)


def gptq(model, checkpoint_dir, options: dict, prefix: list, mlp_only: bool) -> dict:
    """Round ``model``'s projections by GPTQ from the calibration text (whole documents,
    after the kv_prefix) onto the grid ``options`` names."""
    from npuforge.models.llama import rounding
    from npuforge.quantization import WeightGrid

    sequences, text = calibration_sequences(model, checkpoint_dir, options.get("text"))
    grid = WeightGrid(
        int(options["bits"]),
        options.get("group"),
        bool(options["symmetric"]),
        bool(options.get("integer_zero", False)),
        bool(options.get("search_range", False)),
    )
    names = options.get("projections") or (
        ("gate_proj", "up_proj", "down_proj") if mlp_only else None
    )
    sampled = []
    if options.get("generated"):
        from npuforge.models.llama import sampling

        length = model.cache_len - len(prefix)
        sampled = sampling.generate(model, sequences, int(options["generated"]), length, prefix)
    record = rounding.round_decoder(model, sequences + sampled, prefix, grid, names=names)
    record["text"] = text
    if sampled:
        record["generated"] = {
            "sequences": len(sampled),
            "tokens_each": length,
            "opening": f"the first {sampling.PROMPT_TOKENS} tokens of a calibration document",
            "sampling": "temperature 1, float64, numpy PCG64 seed 0",
            "sha256": sampling.digest(sampled),
        }
    return record
