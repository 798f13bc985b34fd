"""The candidate path the evals gate builds in its sandbox sees the contract under judgment as valid on the arch
being judged, and nothing else loosened; its engine of many sequences (the accuracy eval's) generates what the same
kernel generates in the gate's process, and what the child sends back is checked."""

from __future__ import annotations

import pickle

import pytest
import torch

from gates.evals import remote
from gates.evals.paths import backend_path
from gates.evals.subject import load_subject
from kernels.contract import load_contract
from model.kimi_k3.batch import StepBatch
from model.kimi_k3.dispatch import Target, judged_here
from model.kimi_k3.drafters import NgramDrafter
from model.kimi_k3.engine import SamplingParams
from tests.gates.fixtures.helpers import CPU_EXAMPLE, CPU_EXAMPLE_CONTRACTS

H200 = Target("sm_90", "NVIDIA H200", 8, torch.bfloat16)


def test_the_judged_arch_counts_as_validated_and_nothing_else_changes():
    declared = load_contract("contracts/linear.yaml")
    declared = declared.model_copy(update={"hardware": declared.hardware.model_copy(update={"validated": []})})
    judged = judged_here(declared, H200)
    assert judged.archs_validated == ["sm_90"]
    assert [h.arch for h in judged.hardware.declared] == ["sm_100"]
    assert judged.model_dump(exclude={"hardware"}) == declared.model_dump(exclude={"hardware"})


def test_an_arch_already_validated_is_left_as_it_is():
    validated = load_contract("contracts/kda_decode.yaml")
    assert judged_here(validated, Target("sm_90", "NVIDIA H200", 1, torch.bfloat16)) is validated


class InProcessBox:
    """Serves the evals' child handlers in this process, each request's payload and reply through a pickle as the
    sandbox sends them; `reply_hook(kind, reply)` may alter a reply, as a candidate's process could."""

    def __init__(self, reply_hook=None):
        self.reply_hook = reply_hook or (lambda kind, reply: reply)

    def request(self, kind: str, **payload) -> dict:
        reply = remote.CHILD_HANDLERS[kind](**pickle.loads(pickle.dumps(payload)))
        return self.reply_hook(kind, pickle.loads(pickle.dumps(reply)))


def remote_and_local(box: InProcessBox):
    """The CPU example's attn_res kernel over the tiny preset: the remote path (its engine in `box`) and the same
    kernel's path built here."""
    subject = {"preset_name": "tiny", "device": "cpu", "dtype": torch.float32}
    model, _, _ = load_subject(**subject)
    candidate = remote.RemoteCandidate(box, load_contract(CPU_EXAMPLE), str(CPU_EXAMPLE), subject)
    local = backend_path(model, "latency_specialized", contracts_dir=CPU_EXAMPLE_CONTRACTS)
    return candidate.over(model), local


def test_an_engine_in_the_child_generates_what_the_same_kernel_generates_here():
    """Plain and speculative generation of several sequences at once (the accuracy eval's batches): the engine in
    the child, its generation code and cache bookkeeping here, gives the tokens a local engine gives."""
    candidate, local = remote_and_local(InProcessBox())
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3, 4, 3, 4]]
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    for spec in (0, 3):
        drafter = NgramDrafter() if spec else None
        outs = [path.make_engine(64, num_slots=4).generate(prompts, params, spec_tokens=spec, drafter=drafter)
                for path in (candidate, local)]
        assert [g.tokens for g in outs[0]] == [g.tokens for g in outs[1]]


def test_logits_of_the_wrong_shape_from_the_child_are_refused():
    def drop_a_row(kind, reply):
        return {**reply, "logits": reply["logits"][1:]} if kind == "eval_engine_step" else reply

    candidate, _ = remote_and_local(InProcessBox(drop_a_row))
    engine = candidate.make_engine(16, num_slots=2)
    slots = [engine.cache.allocate() for _ in range(2)]
    with pytest.raises(ValueError, match="logits of shape"):
        engine.step([1, 2], StepBatch(tuple(slots), (1, 1), (0, 0)))


def test_the_child_refuses_a_slot_its_twin_did_not_allocate():
    import pytest

    remote_and_local(InProcessBox())
    remote.eval_engine(max_len=8, num_slots=2)
    with pytest.raises(RuntimeError, match="twin"):
        remote.eval_engine_cache(action="allocate", slot=1)
