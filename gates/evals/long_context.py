"""Long context: prefill then decode at growing context lengths, each length bucket reported on its own.

One long document is served in rounds, MRCR style: each round extends the context to the next bucket's
length (chunked prefill) with filler text in which a few key sentences ("The code for key k4821 is QX7M2A.")
sit at random depths, then asks for one key planted so far and decodes the answer greedily. Both paths are
fed the same tokens (the reference's greedy answers), so every bucket compares them on identical contexts;
the state carried from round to round is each path's own, so errors that accumulate with length show.

Per bucket: the largest logit difference over the answer positions; greedy agreement, where a differing
argmax is excused only at a near-tie (the reference's logit of the candidate's choice within twice the
bucket's drift bound of its best, the only flip a within-tolerance drift can cause); the relative error of every KDA
layer's recurrent state after the decode steps (worst layer); and whether each path's answer starts with the planted
code (the candidate's answer is its argmax at each position of the reference's answer). On random weights
the answers are noise: the probe then measures agreement between the paths, not recall.

With a standard path beside (the yardstick, on the GPU) it is fed the same tokens, and the drift and state
bounds are the larger of the budget's and `slack` x the standard's own worst bucket (see `_buckets`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.progress import Progress
from tokenizers import Tokenizer

from .config import EvalConfig
from .paths import PathPair, Session
from .result import Check, EvalResult, Plot, Table, badness, yardstick_bound

NAME = "long_context"
QUESTION_ROOM = 128  # cache room for a probe's question (about 40 tokens)
FILLER_WORDS = (
    "river stone quiet morning paper window garden light under over between after before city market road "
    "music table winter summer green small large old new early late open close north south the a of and to"
).split()
ALPHANUM = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


class LongContextBudget(BaseModel):
    model_config = ConfigDict(frozen=True)

    lengths: tuple[int, ...] = Field(min_length=1, description="context length before each probe, ascending")
    keys_per_bucket: int = Field(2, gt=0, description="key sentences planted in each bucket's new stretch")
    decode_steps: int = Field(8, gt=0, description="greedy decode steps after each probe")
    prefill_chunk: int = Field(gt=0, description="tokens per prefill step at most")
    logit_atol: float = Field(gt=0, description="largest allowed |logit difference| at an answer position")
    state_rtol: float = Field(gt=0, description="largest allowed ||S_cand - S_ref|| / ||S_ref|| of a KDA state")
    slack: float = Field(1.5, ge=1, description="with a standard path beside: the candidate's drift and state error "
                                               "may reach slack x the standard's own worst bucket")

    @model_validator(mode="after")
    def _ascending(self) -> "LongContextBudget":
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"lengths: {self.lengths} must be strictly ascending")
        return self


class LongContextConfig(EvalConfig[LongContextBudget]):
    # Tiny in fp32 up to 8K: chunked KDA prefill, 1K-token MLA prefill chunks.
    cpu: LongContextBudget = LongContextBudget(lengths=(1024, 2048, 4096, 8192), prefill_chunk=1024,
                                               logit_atol=1e-3, state_rtol=1e-4)
    # k3 layer shapes in bf16 up to 128K: the MLA prefill attends in the latent space in query groups whose scores
    # fit 1 GiB (model.kimi_k3.mla), so 8K-token chunks cost the same memory at any depth; each chunk dequantizes
    # most experts of the MoE layers. The bounds are floors under the standard path's own drift (the yardstick).
    # On the H200 the whole budget takes ~6 minutes at 4 layers (NOTES.md of kda_decode, run 6).
    gpu: LongContextBudget = LongContextBudget(lengths=(4096, 16384, 65536, 131072), decode_steps=16,
                                               prefill_chunk=8192, logit_atol=0.25, state_rtol=2e-2)


class _Haystack:
    """Filler text with planted key sentences, produced stretch by stretch to an exact token count."""

    def __init__(self, tokenizer: Tokenizer, seed: int):
        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        self.keys: list[tuple[str, str, int]] = []  # (key, value, token position of its sentence)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def stretch(self, start: int, length: int, keys: int) -> list[int]:
        """`length` tokens that follow position `start`, with `keys` key sentences at random places."""
        sentences = []
        for _ in range(keys):
            key = f"k{self.rng.randrange(1000, 10000)}"
            value = "".join(self.rng.choice(ALPHANUM) for _ in range(6))
            sentences.append((key, value, self._ids(f" The code for key {key} is {value}.")))
        filler_len = length - sum(len(s[2]) for s in sentences)
        if filler_len < 0:
            raise ValueError(f"long context: a stretch of {length} tokens cannot hold {keys} key sentences")
        filler = []
        while len(filler) < filler_len:
            filler += self._ids(" " + " ".join(self.rng.choice(FILLER_WORDS) for _ in range(512)))
        cuts = sorted(self.rng.randrange(filler_len + 1) for _ in sentences)
        out, prev = [], 0
        for cut, (key, value, ids) in zip(cuts, sentences):
            out += filler[prev:cut]
            self.keys.append((key, value, start + len(out)))
            out += ids
            prev = cut
        return out + filler[prev:filler_len]

    def probe(self) -> tuple[str, str, int, list[int]]:
        """A question about one key planted so far: (key, value, its position, the question's tokens)."""
        key, value, position = self.rng.choice(self.keys)
        text = f"\nQuestion: what is the code for key {key}?\nAnswer: the code for key {key} is"
        return key, value, position, self._ids(text)


class _Bucket(BaseModel):
    context: int
    key_depth: float
    drift: float
    drift_bound: float
    agree: int
    near_ties: int
    disagree: int
    state_rel_err: float
    state_bound: float
    standard_drift: float | None
    standard_state_rel_err: float | None
    ref_answer: str
    ref_correct: bool
    cand_correct: bool


@dataclass
class _Answer:
    """One path's logits at the answer positions (fed the reference's greedy answer) and its final KDA states."""

    logits: list[torch.Tensor] = field(default_factory=list)
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def drift(self, ref: "_Answer") -> float:
        return max(badness((a - b).abs().max().item()) for a, b in zip(self.logits, ref.logits))

    def state_rel_err(self, ref: "_Answer") -> float:
        return max((badness(((self.states[i] - s).norm() / s.norm().clamp_min(1e-30)).item())
                    for i, s in ref.states.items()), default=0.0)


def run(config: LongContextConfig, paths: PathPair, progress: Progress) -> EvalResult:
    budget = config.budget(paths.device)
    haystack = _Haystack(paths.tokenizer, config.seed)
    max_len = budget.lengths[-1] + QUESTION_ROOM + budget.decode_steps
    others = [paths.candidate] + ([paths.standard] if paths.standard else [])  # the standard: the yardstick
    ref, sessions = paths.reference.session(max_len), [path.session(max_len) for path in others]
    task = progress.add_task(f"{NAME}: {paths.label}", total=budget.lengths[-1])
    probes = []
    for length in budget.lengths:
        if length <= ref.length:
            raise ValueError(f"long context: bucket {length} is not past the context so far ({ref.length} tokens, "
                             f"the previous probes and answers included); space the lengths further apart")
        tokens = [paths.cfg.bos_token_id] if ref.length == 0 else []
        tokens += haystack.stretch(ref.length + len(tokens), length - ref.length - len(tokens), budget.keys_per_bucket)
        while tokens:
            for session in (ref, *sessions):
                session.feed(tokens[:budget.prefill_chunk])
            tokens = tokens[budget.prefill_chunk:]
            progress.update(task, completed=ref.length)
        probes.append(_probe_and_answer(ref, sessions, haystack, budget))
    return _result(budget, _buckets(probes, budget, paths.tokenizer), config.seed)


@dataclass
class _Probe:
    """One bucket's probe: where it stands, the planted value asked for, and every path's answer."""

    context: int
    position: int
    value: str
    answers: list[_Answer]  # reference, candidate[, standard]

    @property
    def standard(self) -> _Answer | None:
        return self.answers[2] if len(self.answers) > 2 else None


def _probe_and_answer(ref: Session, others: list[Session], haystack: _Haystack, budget: LongContextBudget) -> _Probe:
    """Ask for one planted key and decode the reference's greedy answer on every path."""
    context = ref.length
    key, value, position, question = haystack.probe()
    answers = [_Answer() for _ in range(1 + len(others))]
    tokens = question
    for _ in range(budget.decode_steps + 1):
        for session, answer in zip((ref, *others), answers):
            answer.logits.append(session.feed(tokens))
        tokens = [int(answers[0].logits[-1].argmax())]
    for session, answer in zip((ref, *others), answers):
        answer.states = session.kda_states()
    return _Probe(context, position, value, answers)


def _bucket(probe: _Probe, drift_bound: float, state_bound: float, standard: tuple[float | None, float | None],
            tokenizer: Tokenizer) -> _Bucket:
    """The candidate against the reference in one bucket, a differing argmax excused within 2 x drift_bound;
    `standard` is the standard path's (drift, state error) there, or Nones."""
    ref, cand = probe.answers[0], probe.answers[1]
    agree = near_ties = 0
    for r, c in zip(ref.logits, cand.logits):
        best, chosen = int(r.argmax()), int(c.argmax())
        if chosen == best:
            agree += 1
        elif r[chosen] >= r[best] - 2 * drift_bound:
            near_ties += 1
    ref_text = tokenizer.decode([int(r.argmax()) for r in ref.logits], skip_special_tokens=True)
    cand_text = tokenizer.decode([int(c.argmax()) for c in cand.logits], skip_special_tokens=True)
    return _Bucket(context=probe.context, key_depth=probe.position / probe.context, drift=cand.drift(ref),
                   drift_bound=drift_bound, agree=agree, near_ties=near_ties,
                   disagree=len(cand.logits) - agree - near_ties, state_rel_err=cand.state_rel_err(ref),
                   state_bound=state_bound, standard_drift=standard[0], standard_state_rel_err=standard[1],
                   ref_answer=ref_text, ref_correct=ref_text.strip().startswith(probe.value),
                   cand_correct=cand_text.strip().startswith(probe.value))


def _buckets(probes: list[_Probe], budget: LongContextBudget, tokenizer: Tokenizer) -> list[_Bucket]:
    """Every bucket against one pair of bounds: the budget's, or slack x the standard's worst bucket when it ran
    beside. The run-wide worst, not each bucket's own: on random bf16 weights a top-k routing flip (a logit
    drift of ~2 in one bucket, 0.1 in the next, on either path) is a discrete event, not a precision level."""
    standard = [(p.standard.drift(p.answers[0]), p.standard.state_rel_err(p.answers[0])) if p.standard else
                (None, None) for p in probes]
    beside = [s for s in standard if s[0] is not None]
    worst_drift, worst_state = (max(d for d, _ in beside), max(e for _, e in beside)) if beside else (None, None)
    drift_bound = yardstick_bound(budget.logit_atol, worst_drift, budget.slack)
    state_bound = yardstick_bound(budget.state_rtol, worst_state, budget.slack)
    return [_bucket(p, drift_bound, state_bound, s, tokenizer) for p, s in zip(probes, standard)]


def _result(budget: LongContextBudget, buckets: list[_Bucket], seed: int) -> EvalResult:
    steps = budget.decode_steps + 1
    table = Table(title=f"per context-length bucket ({steps} answer positions each, "
                        f"{budget.decode_steps} decode steps)",
                  columns=["context tokens", "key depth", "max |dlogit|", "bound", "standard |dlogit|", "argmax agree",
                           "near-ties", "disagree", "KDA state rel err", "bound", "standard state err", "ref answer",
                           "ref correct", "cand correct"])
    metrics: dict[str, float | int] = {}
    for b in buckets:
        table.add(b.context, round(b.key_depth, 3), b.drift, b.drift_bound, b.standard_drift, f"{b.agree}/{steps}",
                  b.near_ties, b.disagree, b.state_rel_err, b.state_bound, b.standard_state_rel_err, b.ref_answer,
                  b.ref_correct, b.cand_correct)
        metrics.update({f"logit_drift@{b.context}": b.drift, f"greedy_agreement@{b.context}": b.agree / steps,
                        f"kda_state_rel_err@{b.context}": b.state_rel_err,
                        f"retrieval_ref@{b.context}": int(b.ref_correct),
                        f"retrieval_cand@{b.context}": int(b.cand_correct)})

    def worst(key) -> _Bucket:
        return max(buckets, key=lambda b: badness(key(b)))

    # each bucket against its own bound: the check reports the bucket closest to (or furthest past) its bound
    drift = worst(lambda b: b.drift / b.drift_bound)
    state = worst(lambda b: b.state_rel_err / b.state_bound)
    disagree = worst(lambda b: b.disagree)
    checks = [
        Check.at_most("max logit drift", drift.drift, drift.drift_bound,
                      f"tightest bucket: {drift.context} tokens{_standard(drift.standard_drift)}"),
        Check.at_most("greedy disagreements beyond near-ties", sum(b.disagree for b in buckets), 0,
                      f"worst bucket: {disagree.context} tokens ({disagree.disagree} of {steps})"),
        Check.at_most("KDA state relative error", state.state_rel_err, state.state_bound,
                      f"tightest bucket: {state.context} tokens (worst KDA layer)"
                      f"{_standard(state.standard_state_rel_err)}"),
    ]
    notes = ["The retrieval probe's accuracy means something only for trained weights; on random weights (every "
             "preset and `ckpt make` checkpoint) it measures agreement between the paths, not recall."]
    plots = [_plot("max logit drift from the reference", "max |dlogit|", buckets, "drift", drift.drift_bound),
             _plot("KDA state relative error", "relative error (worst layer)", buckets, "state_rel_err",
                   state.state_bound)]
    return EvalResult.from_checks(NAME, checks, metrics=metrics, tables=[table], plots=plots, notes=notes,
                                  budget={"seed": seed, **budget.model_dump()})


def _plot(title: str, y_label: str, buckets: list[_Bucket], stat: str, bound: float) -> Plot:
    """One statistic per context-length bucket, the candidate's beside the standard path's where it ran."""
    series = {"candidate": [getattr(b, stat) for b in buckets]}
    standard = [getattr(b, f"standard_{stat}") for b in buckets]
    if any(v is not None for v in standard):
        series["standard"] = standard
    return Plot(title=title, x_label="context tokens", y_label=y_label, categories=[str(b.context) for b in buckets],
                series=series, bound=bound)


def _standard(value: float | None) -> str:
    return "" if value is None else (f"; yardstick {value:.3g} there (bound: the larger of the budget's and "
                                     "slack x the yardstick's worst bucket)")
