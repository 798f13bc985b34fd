"""One op's calls replayed through the production dispatcher, in a process of its own (the numerics gate's
production-equivalence check, gates/PRACTICES.md).

    python -m model.kimi_k3.replay REQUEST RESULT

The gate judges a candidate in a worker that has the harness loaded beside it; a candidate that behaves only
there (it inspects its process, or the harness rewrote nothing it can see) would serve other results in
production. This process imports the model, the dispatcher and the candidate, and nothing of the gate: it builds
the dispatcher a serving engine builds for the contract (the arch under judgment counted as validated, as the
gate's own evals do), starts a decode step of the point's batch, and calls the op through `Dispatcher.call`
`calls` times, cycling through the gate's inputs with each call's state reset to its input's, inside one CUDA
graph per input on a GPU (as the engine's captured step runs it) and eagerly on a CPU. Per call it writes the
digests of the outputs and the updated state, named as the gate's worker names them, so the gate compares them
bit for bit with what the candidate returned under judgment.

REQUEST (torch.save, written by the gate): op, contract (a dict), contract_path, names, cases ([(args, state
indices)], CPU tensors), calls, device, batch, spec_tokens. RESULT (JSON): per call {name: digest}, or the
exception of the call that raised; the dispatcher's report; the gate modules this process ended up holding.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from kernels.contract import Contract
from kernels.timing import capture_graph
from kernels.trees import clone, copy_into, digest, leaves, state_leaves

from .batch import StepBatch
from .dispatch import Dispatcher, Target, detect, judged_here
from .ops.op import DTYPE_NAMES
from .ops.registry import Specialized, import_entry_point

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dispatcher_for(contract: Contract, contract_path: str, device: torch.device) -> Dispatcher:
    """The dispatcher a serving engine runs the contract's kernel through on this device (the smallest TP size
    the contract admits, its activation dtype), the arch under judgment counted as validated."""
    arch, name = detect(device)
    target = Target(arch, name, min(contract.tp_sizes), TORCH_DTYPES[contract.dtypes.activations])
    spec = Specialized(judged_here(contract, target), contract_path, import_entry_point(contract.implementation))
    return Dispatcher(target, "latency_specialized", {contract.op: spec})


def decode_step(batch: int, spec_tokens: int) -> StepBatch:
    """A decode step (or a verification step with drafts) of `batch` sequences, each with a cached token."""
    return StepBatch(tuple(range(batch)), (1 + spec_tokens,) * batch, (1,) * batch, spec_tokens)


def named_digests(out, args, state: tuple[int, ...], names: list[str]) -> dict[str, str]:
    """{name: digest} of a call's outputs and updated state, named as gates.core.worker.call names them."""
    return {n: digest(t) for n, t in (*leaves(out, "out"), *state_leaves(args, state, names))}


def replay(request: dict) -> dict:
    device = torch.device(request["device"])
    contract = Contract.model_validate(request["contract"])
    ops = dispatcher_for(contract, request["contract_path"], device)
    op, names, cases = contract.op, request["names"], request["cases"]
    pristine = [clone(args, device) for args, _ in cases]
    buffers = [clone(args) for args in pristine]
    ops.begin_step(decode_step(request["batch"], request["spec_tokens"]))
    graphs, outs, decisions = [], [], []
    if device.type == "cuda":
        for args in buffers:
            held: dict = {}
            with ops.recording() as made:
                graphs.append(capture_graph(lambda args=args, held=held: held.update(out=ops.call(op, *args))))
            decisions.append(made[-1:])  # capture_graph warms up before it captures: the captured call's decision
            outs.append(held["out"])
    calls = []
    for k in range(request["calls"]):
        i = k % len(cases)
        copy_into(buffers[i], pristine[i])
        try:
            if graphs:
                graphs[i].replay()
                torch.cuda.synchronize(device)
                ops.replayed(decisions[i])
                out = outs[i]
            else:
                out = ops.call(op, *buffers[i])
        except Exception as e:  # the candidate's failure in production: a result for the gate
            calls.append({"raised": f"{type(e).__name__}: {e}"})
            break
        calls.append(named_digests(out, buffers[i], cases[i][1], names))
    return {"calls": calls, "dispatch": ops.report(),
            "gate_modules": sorted(m for m in sys.modules if m == "gates" or m.startswith("gates."))}


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = argv if argv is not None else sys.argv[1:]
    start = time.perf_counter()
    try:
        result = replay(torch.load(request_path, weights_only=False))  # written by the gate: trusted
    except Exception:
        result = {"error": traceback.format_exc(limit=-4)}
    result["seconds"] = time.perf_counter() - start
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
