"""The TPU-MLIR job's cmodel check: the combined bmodel's nets run on TPU-MLIR's cmodel
simulator (``pyruntime_bm``) over the spec's recurrent calls, in the tools' environment
(``tpumlir_job.py --verify`` runs it). Standard library only at module level: the
toolchain's numpy and tpu_mlir are imported by the run; it never imports npuforge.
"""

import os
import sys
import time

from job_estimates import calls_left

# How the cmodel check reports each call it runs (the job's progress reader matches it).
VERIFY_PROGRESS = "verify: call "


def _runtime_outputs(net, np, bf16_to_fp32) -> list:
    """The net's outputs as float arrays (the same conversions as TPU-MLIR's model_runner)."""
    values = []
    for tensor in net.outputs:
        data = tensor.data
        if data.dtype in (np.int8, np.uint8) and tensor.qscale != 0:
            value = (data.astype(np.float32) - tensor.qzero_point) * np.float32(tensor.qscale)
        elif tensor.dtype == "bf16":
            value = bf16_to_fp32(data)
        else:
            value = np.array(data, dtype=np.float32)
        values.append(np.array(value, dtype=np.float32))
    return values


def run_calls(spec: dict) -> None:
    """Run the combined bmodel's nets on the cmodel over the recurrent calls of the spec.

    A call runs its variant's nets in chunk order, each chunk's hidden outputs
    (``<base>_out``) the next one's hidden inputs (``<base>_in``). Each net takes its host
    inputs (from the main environment's .npz, ``chunk{i}/<name>``) by name and every state
    input from the previous call's matching output (zeros at first); outputs are matched
    to the export's by position, the order TPU-MLIR keeps.
    Writes the logits of every call, one row per token, to ``verify.outputs``.
    """
    import importlib

    import numpy as np
    import tpu_mlir

    sys.path.insert(0, os.path.join(tpu_mlir.package_path, "python"))
    from tools import model_runner
    from utils.lowering import bf16_to_fp32, lowering

    plan = spec["verify"]
    bmodel = spec["bmodel"]
    chip = model_runner.get_chip_from_model(bmodel)
    # What model_runner does before loading a bmodel: point libcmodel.so at the chip's.
    model_runner.link_cmodel_so(chip)
    model_runner.link_custom_so(chip)
    model_runner.link_bmlib_so(chip)
    runtime = importlib.import_module("pyruntime_bm")
    model_runner.bind_cmodel_so(chip)
    model = runtime.Model(bmodel, 0, "")
    chains = plan["nets"]
    wanted = [name for chain in chains.values() for name in chain]
    missing = sorted(set(wanted) - set(model.networks))
    if missing:
        raise SystemExit(f"error: {bmodel} has no net {missing} (it has {model.networks})")
    nets = {name: model.Net(name) for name in wanted}
    state = {}
    for chain in chains.values():
        for net_plan in chain.values():
            for spec_in in net_plan["inputs"]:
                if spec_in["role"] == "state":
                    state[spec_in["name"]] = np.zeros(spec_in["shape"], dtype=np.float32)
    rows = []
    total = len(plan["calls"])
    taken: dict = {}  # variant -> seconds of each finished call
    for number, call in enumerate(plan["calls"], 1):
        left = calls_left([c["variant"] for c in plan["calls"][number - 1 :]], taken)
        estimate = "" if left is None else f" [about {left:.0f} s left]"
        print(f"{VERIFY_PROGRESS}{number}/{total} ({call['variant']}){estimate}", flush=True)
        started = time.monotonic()
        with np.load(call["feeds"]) as data:
            # Host-fed inputs per chunk: chunk{i}/<input name>.
            fed = {key: data[key] for key in data.files}
        carried = {}
        for name, net_plan in chains[call["variant"]].items():
            net = nets[name]
            prefix = f"chunk{net_plan['chunk']}/"
            feeds = {k[len(prefix) :]: v for k, v in fed.items() if k.startswith(prefix)}
            for spec_in in net_plan["inputs"]:
                if spec_in["role"] == "hidden":
                    feeds[spec_in["name"]] = carried[spec_in["name"][: -len("_in")] + "_out"]
            feeds.update({k: v for k, v in state.items() if k not in feeds})
            by_name = {tensor.name: tensor for tensor in net.inputs}
            for spec_in in net_plan["inputs"]:
                tensor = by_name[spec_in["name"]]
                value = np.asarray(feeds[spec_in["name"]]).reshape(tensor.data.shape)
                tensor.data.reshape(-1)[:] = lowering(
                    value,
                    pdtype=tensor.dtype,
                    pshape=value.shape,
                    pzero_point=tensor.qzero_point,
                    pscale=tensor.qscale,
                ).flatten()
            net.forward()
            outputs = dict(
                zip(
                    [o["name"] for o in net_plan["outputs"]],
                    _runtime_outputs(net, np, bf16_to_fp32),
                    strict=True,
                )
            )
            for spec_in in net_plan["inputs"]:
                if spec_in["role"] == "state":
                    state[spec_in["name"]] = outputs[spec_in["output"]].reshape(spec_in["shape"])
            for o in net_plan["outputs"]:
                if o["role"] == "hidden":
                    carried[o["name"]] = outputs[o["name"]]
        logits = outputs[net_plan["logits"]]
        rows.append(logits.reshape(-1, logits.shape[-1]))
        taken.setdefault(call["variant"], []).append(time.monotonic() - started)
    np.save(plan["outputs"], np.concatenate(rows))
    print(f"verify: {len(plan['calls'])} calls, {sum(len(r) for r in rows)} logits rows")
