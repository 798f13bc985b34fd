"""Long context: prefill then decode at growing context lengths, each length bucket reported on its own.

One long document is served in rounds, MRCR style: each round extends the context to the next bucket's
length (chunked prefill) with filler text in which a few key sentences ("The code for key k4821 is QX7M2A.")
sit at random depths, then asks for one key planted so far and decodes the answer greedily. Both paths are
fed the same tokens (the reference's greedy answers), so every bucket compares them on identical contexts;
the state carried from round to round is each path's own, so errors that accumulate with length show.

Per bucket: the largest logit difference over the answer positions; greedy agreement, where a differing
argmax is excused only at a near-tie (the reference's logit of the candidate's choice within 2 * logit_atol
of its best, the only flip a within-tolerance drift can cause); the relative error of every KDA layer's
recurrent state after the decode steps (worst layer); and whether each path's answer starts with the planted
code (the candidate's answer is its argmax at each position of the reference's answer). On random weights
the answers are noise: the probe then measures agreement between the paths, not recall.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.progress import Progress
from tokenizers import Tokenizer

from .config import EvalConfig
from .paths import PathPair, Session
from .result import Check, EvalResult, Table, badness

NAME = "long_context"
SCORE_COPIES = 3  # materialized MLA prefill holds scores, masked scores and probabilities at once
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
    score_bytes: int = Field(gt=0, description="cap on the MLA prefill's fp32 score tensors; the chunk shrinks to fit")
    logit_atol: float = Field(gt=0, description="largest allowed |logit difference| at an answer position")
    state_rtol: float = Field(gt=0, description="largest allowed ||S_cand - S_ref|| / ||S_ref|| of a KDA state")

    @model_validator(mode="after")
    def _ascending(self) -> "LongContextBudget":
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"lengths: {self.lengths} must be strictly ascending")
        return self


class LongContextConfig(EvalConfig[LongContextBudget]):
    # Tiny in fp32 up to 8K: chunked KDA prefill, and 1K-token MLA prefill chunks ([4 heads, 1K, 8K] scores).
    cpu: LongContextBudget = LongContextBudget(lengths=(1024, 2048, 4096, 8192), prefill_chunk=1024,
                                               score_bytes=1 << 28, logit_atol=1e-3, state_rtol=1e-4)
    # k3 layer shapes in bf16. The reference MLA prefill materializes [96 heads, chunk, context] scores, so 16 GB
    # allows ~200-token chunks at 64K (~100 at 128K), and every chunk dequantizes most experts of the 3 MoE
    # layers: 64K keeps the eval within a 10-minute GPU command; 128K waits for a standard MLA prefill.
    # Bounds to calibrate on the H200.
    gpu: LongContextBudget = LongContextBudget(lengths=(4096, 16384, 65536), decode_steps=16, prefill_chunk=8192,
                                               score_bytes=16 << 30, logit_atol=0.25, state_rtol=2e-2)


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
    agree: int
    near_ties: int
    disagree: int
    state_rel_err: float
    ref_answer: str
    ref_correct: bool
    cand_correct: bool


def run(config: LongContextConfig, paths: PathPair, progress: Progress) -> EvalResult:
    budget = config.budget(paths.device)
    haystack = _Haystack(paths.tokenizer, config.seed)
    max_len = budget.lengths[-1] + QUESTION_ROOM + budget.decode_steps
    ref, cand = paths.reference.session(max_len), paths.candidate.session(max_len)
    task = progress.add_task(f"{NAME}: {paths.label}", total=budget.lengths[-1])
    buckets = []
    for length in budget.lengths:
        if length <= ref.length:
            raise ValueError(f"long context: bucket {length} is not past the context so far ({ref.length} tokens, "
                             f"the previous probes and answers included); space the lengths further apart")
        tokens = [paths.cfg.bos_token_id] if ref.length == 0 else []
        tokens += haystack.stretch(ref.length + len(tokens), length - ref.length - len(tokens), budget.keys_per_bucket)
        while tokens:
            n = _chunk(budget, paths.cfg.num_attention_heads, ref.length)
            ref.feed(tokens[:n])
            cand.feed(tokens[:n])
            tokens = tokens[n:]
            progress.update(task, completed=ref.length)
        buckets.append(_probe_and_answer(ref, cand, haystack, budget, paths.tokenizer))
    return _result(budget, buckets, config.seed)


def _chunk(budget: LongContextBudget, heads: int, context: int) -> int:
    """Prefill tokens for the next step: the budget's chunk, shrunk so the MLA score tensors fit score_bytes."""
    per_query = SCORE_COPIES * 4 * heads * (context + budget.prefill_chunk)
    return max(1, min(budget.prefill_chunk, budget.score_bytes // per_query))


def _probe_and_answer(ref: Session, cand: Session, haystack: _Haystack, budget: LongContextBudget,
                      tokenizer: Tokenizer) -> _Bucket:
    context = ref.length
    key, value, position, question = haystack.probe()
    ref_logits, cand_logits = ref.feed(question), cand.feed(question)
    drift, agree, near_ties = 0.0, 0, 0
    ref_answer, cand_answer = [], []
    for step in range(budget.decode_steps + 1):
        drift = max(drift, badness((cand_logits - ref_logits).abs().max().item()))
        best, chosen = int(ref_logits.argmax()), int(cand_logits.argmax())
        ref_answer.append(best)
        cand_answer.append(chosen)
        if chosen == best:
            agree += 1
        elif ref_logits[chosen] >= ref_logits[best] - 2 * budget.logit_atol:
            near_ties += 1
        if step < budget.decode_steps:
            ref_logits, cand_logits = ref.feed([best]), cand.feed([best])
    ref_states, cand_states = ref.kda_states(), cand.kda_states()
    state_err = max((badness(((cand_states[i] - s).norm() / s.norm().clamp_min(1e-30)).item())
                     for i, s in ref_states.items()), default=0.0)
    ref_text, cand_text = (tokenizer.decode(a, skip_special_tokens=True) for a in (ref_answer, cand_answer))
    steps = budget.decode_steps + 1
    return _Bucket(context=context, key_depth=position / context, drift=drift, agree=agree, near_ties=near_ties,
                   disagree=steps - agree - near_ties, state_rel_err=state_err, ref_answer=ref_text,
                   ref_correct=ref_text.strip().startswith(value), cand_correct=cand_text.strip().startswith(value))


def _result(budget: LongContextBudget, buckets: list[_Bucket], seed: int) -> EvalResult:
    steps = budget.decode_steps + 1
    table = Table(title=f"per context-length bucket ({steps} answer positions each, {budget.decode_steps} decode steps)",
                  columns=["context tokens", "key depth", "max |dlogit|", "argmax agree", "near-ties", "disagree",
                           "KDA state rel err", "ref answer", "ref correct", "cand correct"])
    metrics: dict[str, float | int] = {}
    for b in buckets:
        table.add(b.context, round(b.key_depth, 3), b.drift, f"{b.agree}/{steps}", b.near_ties, b.disagree,
                  b.state_rel_err, b.ref_answer, b.ref_correct, b.cand_correct)
        metrics.update({f"logit_drift@{b.context}": b.drift, f"greedy_agreement@{b.context}": b.agree / steps,
                        f"kda_state_rel_err@{b.context}": b.state_rel_err,
                        f"retrieval_ref@{b.context}": int(b.ref_correct),
                        f"retrieval_cand@{b.context}": int(b.cand_correct)})

    def worst(attr: str) -> _Bucket:
        return max(buckets, key=lambda b: badness(getattr(b, attr)))

    drift, state, disagree = worst("drift"), worst("state_rel_err"), worst("disagree")
    checks = [
        Check.at_most("max logit drift", drift.drift, budget.logit_atol, f"worst bucket: {drift.context} tokens"),
        Check.at_most("greedy disagreements beyond near-ties", sum(b.disagree for b in buckets), 0,
                      f"worst bucket: {disagree.context} tokens ({disagree.disagree} of {steps})"),
        Check.at_most("KDA state relative error", state.state_rel_err, budget.state_rtol,
                      f"worst bucket: {state.context} tokens (worst KDA layer)"),
    ]
    notes = ["The retrieval probe's accuracy means something only for trained weights; on random weights (every "
             "preset and `ckpt make` checkpoint) it measures agreement between the paths, not recall."]
    return EvalResult.from_checks(NAME, checks, metrics=metrics, tables=[table], notes=notes,
                                  budget={"seed": seed, **budget.model_dump()})
