"""The evals' candidate in its own process: the model with the contract's kernel lives in the sandbox's spawned
child, built from the same seeded weights as the gate's own model; the gate steps it token by token and gets
back plain logits and states (copies, checked to be plain tensors), and computes every statistic itself, next
to the reference and standard paths it runs in its own process. A kernel that tampers with the interpreter so
touches only its own numbers, and a replaced timing, copy or serialization function is reported as tampering.

Parent side: `RemoteCandidate(box, contract_path, subject)` and its `path` (a `DecodePath` look-alike whose
sessions are `RemoteSession`s). Child side: the `eval_*` handlers the worker serves (`CHILD_HANDLERS`). The child
keeps one session at a time (every eval steps one candidate sequence at a time): a new one replaces the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gates.core.sandbox import Sandbox
from kernels.contract import Contract
from model.kimi_k3.dispatch import Dispatcher, Target, judged_here
from model.kimi_k3.ops.registry import Specialized
from model.kimi_k3.sampling import sample

from .paths import LogitTransform, Sampler, Session, dispatched_path
from .subject import load_subject


class RemoteCandidate:
    """The candidate path of one contract over the model `subject` (load_subject's arguments) in the sandbox."""

    def __init__(self, box: Sandbox, contract: Contract, contract_path: str, subject: dict,
                 kv_cache_dtype: str = "auto"):
        self.box, self.device = box, torch.device(subject.get("device", "cpu"))
        name = box.request("eval_open", contract=contract.model_dump(mode="json"), contract_path=contract_path,
                           subject=subject, kv_cache_dtype=kv_cache_dtype)["name"]
        self.path = RemotePath(name, self)

    def report(self) -> dict:
        """The child's dispatcher report: how often the kernel was chosen, and every fallback."""
        return self.box.request("eval_report")["report"]


@dataclass(frozen=True)
class RemotePath:
    """Stands where a DecodePath does (name, logit transforms, sampler, sessions); the engine is in the child."""

    name: str
    remote: RemoteCandidate = field(repr=False, compare=False)
    logit_transforms: tuple[LogitTransform, ...] = ()
    sampler: Sampler = sample
    ops: None = None  # the dispatcher is the child's: its counts come from `eval_report`, not from an eval's table

    def session(self, max_len: int) -> "RemoteSession":
        return RemoteSession(self, max_len)


class RemoteSession(Session):
    """A Session whose engine runs in the child: the same calls, each one request."""

    def __init__(self, path: RemotePath, max_len: int):
        self.path, self._remote, self._length = path, path.remote, 0
        self.routing = None  # what the child would report of its routing is the candidate's to forge
        self.id = self._request("eval_session", max_len=max_len)["id"]

    @property
    def length(self) -> int:
        return self._length

    def keep(self, n: int) -> None:
        self._request("eval_keep", id=self.id, n=n)

    def kda_states(self) -> dict[int, torch.Tensor]:
        states = self._request("eval_states", id=self.id)["states"]
        return {layer: s.to(self._remote.device) for layer, s in states}

    def _run(self, tokens: list[int], verify: bool) -> torch.Tensor:
        return self._request("eval_step", id=self.id, tokens=tokens, verify=verify)["logits"].to(self._remote.device)

    def _request(self, kind: str, **payload) -> dict:
        reply = self._remote.box.request(kind, **payload)
        self._length = reply.get("length", self._length)
        return reply


# ---- the child's side -------------------------------------------------------------------------------------

_child: dict = {}


def _plain(name: str, t: torch.Tensor) -> torch.Tensor:
    from gates.core.worker import plain_copy

    problems: list[str] = []
    copy = plain_copy(name, t, t.device.type, problems)
    if copy is None:
        raise TypeError(f"the candidate path returned {'; '.join(problems)}")
    return copy


def eval_open(*, contract: dict, contract_path: str, subject: dict, kv_cache_dtype: str = "auto") -> dict:
    """Build the model and the candidate path: this contract's kernel specialized, every other op standard, its
    engines' MLA cache of `kv_cache_dtype`."""
    from gates.core.worker import load

    _child.clear()
    contract = Contract.model_validate(contract)
    model, _, _ = load_subject(**subject)
    target = Target.of(model)
    contract = judged_here(contract, target)
    spec = Specialized(contract, contract_path, load(contract.implementation))
    ops = Dispatcher(target, "latency_specialized", {contract.op: spec})
    path = dispatched_path(model, ops, f"latency_specialized[{contract.op}]", kv_cache_dtype)
    _child.update(path=path, ops=ops, session=None, id=-1)
    return {"name": path.name}


def _session(id: int) -> Session:  # noqa: A002 - the request's field
    if id != _child["id"]:
        raise RuntimeError(f"eval session {id} was replaced by session {_child['id']} (one at a time)")
    return _child["session"]


def eval_session(*, max_len: int) -> dict:
    _child.update(session=None)  # free the last one's caches first
    _child.update(session=_child["path"].session(max_len), id=_child["id"] + 1)
    return {"id": _child["id"], "length": 0}


def eval_step(*, id: int, tokens: list[int], verify: bool) -> dict:  # noqa: A002
    session = _session(id)
    logits = session.verify(tokens) if verify else session.feed(tokens)
    return {"logits": _plain("logits", logits), "length": session.length}


def eval_keep(*, id: int, n: int) -> dict:  # noqa: A002
    session = _session(id)
    session.keep(n)
    return {"length": session.length}


def eval_states(*, id: int) -> dict:  # noqa: A002
    session = _session(id)
    return {"states": [(layer, _plain(f"KDA state of layer {layer}", s)) for layer, s in session.kda_states().items()],
            "length": session.length}


def eval_report() -> dict:
    return {"report": _child["ops"].report()}


CHILD_HANDLERS = {"eval_open": eval_open, "eval_session": eval_session, "eval_step": eval_step,
                  "eval_keep": eval_keep, "eval_states": eval_states, "eval_report": eval_report}
