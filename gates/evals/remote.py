"""The evals' candidate in its own process: the model with the contract's kernel lives in the sandbox's spawned
child, built from the same seeded weights as the gate's own model; the gate steps it token by token and gets
back plain logits and states (copies, checked to be plain tensors), and computes every statistic itself, next
to the reference and standard paths it runs in its own process. A kernel that tampers with the interpreter so
touches only its own numbers, and a replaced timing, copy or serialization function is reported as tampering.

Parent side: `RemoteCandidate(box, contract_path, subject)` and its `path` (a `DecodePath` look-alike whose
sessions are `RemoteSession`s, and whose engines of many sequences, for the accuracy eval, are `RemoteEngine`s).
Child side: the `eval_*` handlers the worker serves (`CHILD_HANDLERS`). The child keeps one session and one engine
at a time: a new one replaces the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from gates.core.sandbox import Sandbox
from kernels.contract import Contract
from model.kimi_k3.batch import StepBatch
from model.kimi_k3.cache import ModelCache
from model.kimi_k3.dispatch import Dispatcher, Target, judged_here
from model.kimi_k3.engine import Engine, NonFiniteError
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.ops.registry import Specialized
from model.kimi_k3.sampling import sample

from .paths import DispatchedEngine, LogitTransform, Sampler, Session, dispatched_path
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

    def over(self, model: KimiK3Model) -> "RemotePath":
        """The path, given this process's copy of the subject (load_pair's candidate function)."""
        return replace(self.path, model=model)

    def chooses_kernel(self, tokens: tuple[int, ...] = (0, 1)) -> bool:
        """Whether the candidate's dispatcher picks the contract's kernel on this subject: a one-token prefill
        then one decode step of one sequence, and the child's count of specialized calls after it."""
        session = self.path.session(len(tokens))
        for t in tokens:
            session.feed([t])
        return any(counts["specialized"] for counts in self.report()["ops"].values())


@dataclass(frozen=True)
class RemotePath:
    """Stands where a DecodePath does (name, logit transforms, sampler, sessions); the engine is in the child."""

    name: str
    remote: RemoteCandidate = field(repr=False, compare=False)
    logit_transforms: tuple[LogitTransform, ...] = ()
    sampler: Sampler = sample
    ops: None = None  # the dispatcher is the child's: its counts come from `eval_report`, not from an eval's table
    # this process's copy of the subject (config, TP group and dtype: what an engine's generation code reads here)
    model: KimiK3Model | None = field(default=None, repr=False, compare=False)

    def session(self, max_len: int) -> "RemoteSession":
        return RemoteSession(self, max_len)

    def make_engine(self, max_len: int, num_slots: int = 1) -> "RemoteEngine":
        if self.model is None:
            raise TypeError(f"{self.name}: an engine of many sequences needs the model's config here "
                            "(RemoteCandidate.over(model))")
        return RemoteEngine(self.remote, self.model, max_len, num_slots)


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


class RemoteEngine(Engine):
    """An engine of `num_slots` sequences whose steps run in the child; what the accuracy eval steps many sequences
    through. Generation (drafting, verification, sampling) runs here, as Engine's own code, over this process's copy
    of the model (its config and TP group only); each forward step is one request, whose logits come back as plain
    copies. The cache's bookkeeping (lengths, verification commits) is kept here on a meta-device twin of the child's
    cache (`RemoteCache`), so the positions the steps are built from are never the child's to report."""

    def __init__(self, remote: RemoteCandidate, model: KimiK3Model, max_len: int, num_slots: int):
        self.model, self.device, self.graphs = model, remote.device, None
        self._remote = remote
        remote.box.request("eval_engine", max_len=max_len, num_slots=num_slots)
        self.cache = RemoteCache(remote, model, max_len, num_slots)

    def step(self, token_ids: list[int] | torch.Tensor, batch: StepBatch, every_token: bool = False) -> torch.Tensor:
        for slot, n in zip(batch.slots, batch.query_lens):
            self.cache.check_room(slot, n)
        logits = self._remote.box.request(
            "eval_engine_step", tokens=torch.as_tensor(token_ids).tolist(), slots=batch.slots,
            query_lens=batch.query_lens, context_lens=batch.context_lens, spec_tokens=batch.spec_tokens,
            every_token=every_token)["logits"].to(self.device)
        self.cache.advance(batch)
        rows = batch.num_tokens if every_token else batch.batch_size
        if logits.shape != (rows, self.model.cfg.vocab_size):
            raise ValueError(f"the candidate's engine returned logits of shape {tuple(logits.shape)}, expected "
                             f"({rows}, {self.model.cfg.vocab_size})")
        if not torch.isfinite(logits).all():
            raise NonFiniteError("generate: the candidate's logits are not finite")
        return logits


class RemoteCache(ModelCache):
    """The bookkeeping of the child's engine cache, on the meta device (no memory), each change also made there."""

    def __init__(self, remote: RemoteCandidate, model: KimiK3Model, max_len: int, num_slots: int):
        self._remote = remote
        super().__init__(model.cfg, model.tp, num_slots, max_len, model.act_dtype, "meta")

    def _mirror(self, action: str, **args) -> None:
        self._remote.box.request("eval_engine_cache", action=action, **args)

    def reserve_spec(self, spec_tokens: int) -> None:
        if spec_tokens > self.spec_tokens:
            self._mirror("reserve_spec", spec_tokens=spec_tokens)
        super().reserve_spec(spec_tokens)

    def allocate(self) -> int:
        slot = super().allocate()
        self._mirror("allocate", slot=slot)
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        self._mirror("release", slot=slot)

    def commit(self, slots: list[int], kept: list[int]) -> None:
        super().commit(slots, kept)
        self._mirror("commit", slots=list(slots), kept=list(kept))


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
    _child.update(model=model, path=path, ops=ops, kv_cache_dtype=kv_cache_dtype, session=None, id=-1, engine=None)
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


def eval_engine(*, max_len: int, num_slots: int) -> dict:
    _child.update(engine=None)  # free the last one's caches first
    _child.update(engine=DispatchedEngine(_child["model"], max_len, _child["ops"], _child["kv_cache_dtype"],
                                          num_slots=num_slots))
    return {}


def _engine() -> Engine:
    if _child.get("engine") is None:
        raise RuntimeError("no eval engine is open (eval_engine first)")
    return _child["engine"]


def eval_engine_step(*, tokens: list[int], slots: tuple[int, ...], query_lens: tuple[int, ...],
                     context_lens: tuple[int, ...], spec_tokens: int, every_token: bool) -> dict:
    batch = StepBatch(tuple(slots), tuple(query_lens), tuple(context_lens), spec_tokens=spec_tokens)
    return {"logits": _plain("logits", _engine().step(tokens, batch, every_token))}


def eval_engine_cache(*, action: str, **args) -> dict:
    """The parent's change to its twin of the cache, made to the engine's own: the same slot allocated, released,
    room for drafts reserved, a verification committed."""
    cache = _engine().cache
    if action == "allocate":
        slot = cache.allocate()
        if slot != args["slot"]:
            raise RuntimeError(f"the engine allocated slot {slot}, the gate's twin of its cache slot {args['slot']}")
    elif action == "release":
        cache.release(args["slot"])
    elif action == "reserve_spec":
        cache.reserve_spec(args["spec_tokens"])
    elif action == "commit":
        cache.commit(args["slots"], args["kept"])
    else:
        raise ValueError(f"eval_engine_cache: unknown action {action!r}")
    return {}


def eval_report() -> dict:
    return {"report": _child["ops"].report()}


CHILD_HANDLERS = {"eval_open": eval_open, "eval_session": eval_session, "eval_step": eval_step,
                  "eval_keep": eval_keep, "eval_states": eval_states, "eval_engine": eval_engine,
                  "eval_engine_step": eval_engine_step, "eval_engine_cache": eval_engine_cache,
                  "eval_report": eval_report}
