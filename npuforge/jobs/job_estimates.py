"""How long a TPU-MLIR job's steps and cmodel calls still take, judged by the finished
ones. Standard library only: the job imports it as a sibling, inside its toolchain."""


def _kind(step: dict) -> tuple:
    """What a step's time is judged by: its stage in nets of the same variant
    (``prefill_3`` -> ``prefill``), whose chunks are alike in size."""
    graph = step.get("graph")
    variant = graph.rsplit("_", 1)[0] if graph and graph[-1].isdigit() else graph
    return variant, step.get("stage")


def time_left(steps: list, records: dict, running: dict, parallel: int, planned=None):
    """(seconds, stages left out): what the unfinished steps should still take, or None
    while a net's step has no finished step of its stage to be judged by (or no step
    left has).

    Each unfinished step costs what the finished steps of its kind took on average (of
    its stage in any variant where its own has none yet), less what a running one has
    run (``running``: index -> seconds so far); the nets' chains share ``parallel``
    slots and the graph-less steps (the combine) follow them. A graph-less step that
    has nothing to be judged by is left out and named. ``planned``: the indices this run
    runs (a chunk's job runs its nets only), default all.
    """
    by_kind: dict = {}
    by_stage: dict = {}
    for index, record in records.items():
        if record.get("passed"):
            kind = _kind(steps[index])
            by_kind.setdefault(kind, []).append(record["seconds"])
            by_stage.setdefault(kind[1], []).append(record["seconds"])
    chains, tail, open_chains, left_out, judged = 0.0, 0.0, set(), [], 0
    for index, step in enumerate(steps):
        if index in records or (planned is not None and index not in planned):
            continue
        kind = _kind(step)
        taken = by_kind.get(kind) or by_stage.get(kind[1])
        if not taken and step.get("graph") is None:
            left_out.append(step["stage"])
            continue
        if not taken:
            return None
        judged += 1
        cost = max(0.0, sum(taken) / len(taken) - running.get(index, 0.0))
        if step.get("graph") is None:
            tail += cost
        else:
            chains += cost
            open_chains.add(step["graph"])
    if not judged:
        return None
    return chains / max(1, min(parallel, len(open_chains))) + tail, left_out


def calls_left(variants: list, taken: dict) -> float | None:
    """Seconds the cmodel calls of ``variants`` should take, each as long as the finished
    calls of its variant took on average; None while a variant has none finished (a
    prefill call costs minutes where a decode call costs seconds)."""
    if any(not taken.get(variant) for variant in variants):
        return None
    return sum(sum(taken[v]) / len(taken[v]) for v in variants)
