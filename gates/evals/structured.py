"""Structured output: JSON constrained by a real grammar engine (llguidance) must parse, validate against
its schema, and be the same tokens on both paths.

For each schema (`schemas.SCHEMAS`, growing difficulty) each path decodes greedily from a prompt, every step
masked by an llguidance matcher compiled from the schema (compact JSON, no free whitespace), until the
matcher stops or `max_tokens` run out. Checks:

- 100 % of outputs parse (`json.loads`) and validate (`jsonschema`, draft 2020-12), on both paths: a failure
  means the mask or the tokenizer bridge broke, or a schema can outgrow its token budget.
- The greedy tokens are identical between paths. The one excused difference is a near-tie: the paths may
  first diverge only where the reference's two best allowed logits are within the tie tolerance (a logit
  drift inside tolerance can flip such an argmax and nothing else). With a standard path beside (the
  yardstick, on the GPU) it decodes the same runs, and the tolerance is the larger of the budget's
  `tie_tolerance` and `slack` x the standard's own largest top-2 gap shift: how far its gap moved from the
  reference's at a step where their tokens still agreed. On random weights in bf16 a top-k routing flip moves
  a legitimate path's logits by more than any fixed tolerance would allow at a few steps; the yardstick
  measures that in the same run, from code the candidate does not touch.
- A wider divergence is excused only where a routing near-tie explains it, verified rather than assumed: the
  reference's own selection keys (recorded in this process; `paths.RoutingTap`) name the MoE choices within the
  routing tolerance of going the other way (the k-th expert's key within it of the next one's) at the positions
  the parted token depends on; the reference decodes again with one such choice swapped (up to `route_swaps` of
  them, the position where the candidate's gaps first moved first), and the divergence is excused when that
  branch decodes the candidate's tokens. The routing tolerance is the larger of the budget's
  `route_tie_tolerance` and `slack` x twice the standard's largest selection-key shift from the reference (a key
  pair's margin moves by up to twice one key's shift) while their contexts agree. A candidate is so held to a
  branch the reference itself takes after a near-tie; nothing it reports about its own routing is used.

Speculative decoding: for each K > 0 in `spec_tokens` both paths decode again, each step verifying the last
token and K drafts in one verification step -- the tokens the grammar forces next (llguidance's fast-forward
tokens, as jump-forward decoding uses them), then prompt-lookup (`NgramDrafter`) continuations --; under the grammar a
draft is accepted while it equals the masked argmax of its row, the first mismatch emits the row's own token, and the
cache keeps only the accepted prefix. Its outputs must parse and validate, match between paths, and equal
the same path's plain tokens (near-ties excused as above). A path's speculative run can leave its plain run
through rounding alone (a verification step's GEMMs have other shapes; on random weights a top-k routing flip
amplifies that): where the reference's own runs part, the candidate is held to the reference's speculative
tokens instead, and a note says so.

Greedy decoding ignores a logit scale, so the logits-times-1.05 path passes here by design; a path whose
ranking changes fails.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import jsonschema
import llguidance
import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.progress import Progress
from tokenizers import Tokenizer

from model.kimi_k3.drafters import NgramDrafter
from model.kimi_k3.engine import Generation
from model.kimi_k3.tokenizer import token_bytes

from .config import EvalConfig
from .paths import PathPair, RouteSwap, RoutingTap, Session
from .result import Check, EvalResult, Table, yardstick_bound
from .schemas import SCHEMAS

NAME = "structured"
GRAMMAR_OPTIONS = {"whitespace_flexible": False}  # compact JSON: random weights cannot pad with spaces forever


class StructuredBudget(BaseModel):
    model_config = ConfigDict(frozen=True)

    schemas: tuple[str, ...] = Field(tuple(SCHEMAS), min_length=1)
    max_tokens: int = Field(256, gt=0, description="tokens a schema's output may take (every schema closes sooner)")
    spec_tokens: tuple[int, ...] = Field((0, 3), min_length=1, description="draft tokens per step; 0 = plain")
    tie_tolerance: float = Field(ge=0, description="top-2 logit gap under which a greedy divergence is a near-tie")
    route_tie_tolerance: float = Field(ge=0, description="selection-key margin under which a router choice is a "
                                                         "near-tie a divergence may be traced to")
    route_swaps: int = Field(4, ge=0, description="near-tie router choices swapped, one at a time, to explain a "
                                                 "divergence")
    slack: float = Field(1.5, ge=1, description="with a standard path beside: the tie tolerance may reach slack x "
                                               "the standard's own largest top-2 gap shift from the reference")


class StructuredConfig(EvalConfig[StructuredBudget]):
    # Twice the long-context eval's logit tolerance for the same dtype: the gap a drift within it can flip.
    # Route tolerances: fp32 rounding on the CPU; on the GPU a floor under the yardstick (bf16 router inputs).
    cpu: StructuredBudget = StructuredBudget(tie_tolerance=2e-3, route_tie_tolerance=1e-6)
    gpu: StructuredBudget = StructuredBudget(tie_tolerance=0.5, route_tie_tolerance=1e-3, route_swaps=8)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every id's bytes (b"" for ids the tokenizer leaves unused, which
    the mask then never allows; 0xff-prefixed for special tokens), EOS/BOS and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: int, bos: int):
        raw, self.special_token_ids = token_bytes(tokenizer, vocab_size)
        special = set(self.special_token_ids)
        self.tokens = [b"\xff" + t if i in special else t for i, t in enumerate(raw)]
        self.eos_token_id, self.bos_token_id = eos, bos
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False).ids


@dataclass
class _Decode:
    tokens: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # top-2 allowed-logit gap at each step
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verification step
    stopped: bool = False
    error: str = ""
    prompt_len: int = 0  # the token of step s is chosen from the logits at position prompt_len - 1 + s
    keys: dict[int, list[torch.Tensor]] | None = None  # RoutingTap.keys of a path recorded in this process


@dataclass
class _Output:
    decode: _Decode
    text: str = ""
    parsed: bool = False
    valid: bool = False
    problem: str = ""


def run(config: StructuredConfig, paths: PathPair, progress: Progress) -> EvalResult:
    budget = config.budget(paths.device)
    unknown = sorted(set(budget.schemas) - set(SCHEMAS))
    if unknown:
        raise ValueError(f"structured budget: schemas {unknown} unknown; choose from {sorted(SCHEMAS)}")
    cfg, tok = paths.cfg, paths.tokenizer
    grammar_tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
        _Vocabulary(tok, cfg.vocab_size, cfg.eos_token_id, cfg.bos_token_id)))

    generated: list[tuple[str, int, _Output, _Output, _Output | None]] = []
    redo: dict[tuple[str, int], Callable[[RouteSwap], _Output]] = {}  # the reference again, one choice swapped
    task = progress.add_task(f"{NAME}: {paths.label}", total=len(budget.schemas) * len(budget.spec_tokens))
    for k in sorted(budget.spec_tokens):
        for name in budget.schemas:
            schema = SCHEMAS[name]
            prompt = [cfg.bos_token_id] + tok.encode(f"Reply with {schema['title']} as JSON:\n",
                                                     add_special_tokens=False).ids
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=GRAMMAR_OPTIONS)
            generate = partial(_generate, grammar_tok=grammar_tok, grammar=grammar, prompt=prompt,
                               max_tokens=budget.max_tokens, schema=schema, eos=cfg.eos_token_id, spec_tokens=k)
            max_len = len(prompt) + budget.max_tokens + k
            ref = generate(paths.reference.session(max_len, RoutingTap()))
            cand = generate(paths.candidate.session(max_len))  # its process is not asked about its routing
            std = generate(paths.standard.session(max_len, RoutingTap())) if paths.standard else None
            generated.append((name, k, ref, cand, std))
            redo[name, k] = lambda swap, generate=generate, max_len=max_len: generate(
                paths.reference.session(max_len, RoutingTap(swap)))
            progress.advance(task)
    top_k = cfg.num_experts_per_token
    shifts = [_gap_shift(ref.decode, std.decode) for _, _, ref, _, std in generated if std is not None]
    standard_shift = max(shifts) if shifts else None
    tie = yardstick_bound(budget.tie_tolerance, standard_shift, budget.slack)
    key_shifts = [_key_shift(ref.decode, std.decode, top_k) for _, _, ref, _, std in generated if std is not None]
    standard_key_shift = max(key_shifts) if key_shifts else None
    route_tie = yardstick_bound(budget.route_tie_tolerance,
                                None if standard_key_shift is None else 2 * standard_key_shift, budget.slack)

    def between_paths(name: str, k: int, ref: _Output, cand: _Output) -> str:
        verdict = _compare(ref.decode, cand.decode, tie)
        if _agrees(verdict) or not budget.route_swaps:
            return verdict
        return _traced_to_routing(ref.decode, cand.decode, tie, route_tie, top_k, budget.route_swaps,
                                  redo[name, k]) or verdict

    table = Table(title="greedy JSON per schema", columns=[
        "schema", "spec tokens", "ref tokens", "cand tokens", "ref valid", "cand valid", "same tokens",
        "same as plain (ref / cand)", "drafts accepted", "ref output"])
    runs: list[tuple[str, int, _Output, _Output, str]] = []
    plain: dict[str, tuple[_Output, _Output]] = {}
    against_plain: list[tuple[str, int, str, str]] = []
    for name, k, ref, cand, _ in generated:
        verdict = between_paths(name, k, ref, cand)
        runs.append((name, k, ref, cand, verdict))
        if k == 0:
            plain[name] = (ref, cand)
            same_as_plain = "-"
        else:
            base = plain.get(name)
            ref_vs, cand_vs = ((_compare(b.decode, o.decode, tie) for b, o in zip(base, (ref, cand)))
                               if base else ("no plain run", "no plain run"))
            against_plain.append((name, k, ref_vs, cand_vs))
            same_as_plain = f"{ref_vs} / {cand_vs}"
        accepted = sum(cand.decode.accepted)
        table.add(name, k, len(ref.decode.tokens), len(cand.decode.tokens), ref.valid or ref.problem,
                  cand.valid or cand.problem, verdict, same_as_plain,
                  f"{accepted}/{k * len(cand.decode.accepted)}" if k else "-", ref.text)

    n = len(runs)
    checks = []
    for side, outs in (("reference", [r[2] for r in runs]), ("candidate", [r[3] for r in runs])):
        invalid = "; ".join(f"{name} (spec {k}): {o.problem}" for (name, k, *_), o in zip(runs, outs) if not o.valid)
        checks.append(Check.at_least(f"{side} outputs parse", sum(o.parsed for o in outs) / n, 1.0))
        checks.append(Check.at_least(f"{side} outputs valid", sum(o.valid for o in outs) / n, 1.0, invalid))
    same = [_agrees(verdict) for *_, verdict in runs]
    diverged = "; ".join(f"{name} (spec {k}): {verdict}" for (name, k, *_, verdict), ok in zip(runs, same) if not ok)
    checks.append(Check.at_least("greedy tokens identical between paths", sum(same) / n, 1.0, diverged))
    notes = []
    if against_plain:
        between = {(name, k): verdict for name, k, *_, verdict in runs}
        agree = []
        for name, k, r, c in against_plain:
            held_to_reference = _held_to_reference(r, between.get((name, 0), "identical"), between[name, k])
            agree.append(_agrees(c) or held_to_reference)
            if held_to_reference and not _agrees(c):
                plain = between.get((name, 0), "identical")
                which = (f"the reference's own speculative run left its plain run ({r})" if not _agrees(r) else
                         f"the candidate's plain run left the reference's ({plain})" if plain != "identical" else
                         "the candidate's speculative run took a routing branch of the reference's")
                notes.append(f"{name} (spec {k}): {which}; the candidate's speculative tokens match the "
                             f"reference's ({between[name, k]})")
        differ = "; ".join(f"{name} (spec {k}): reference {r}, candidate {c}, between paths {between[name, k]}"
                           for (name, k, r, c), ok in zip(against_plain, agree) if not ok)
        checks.append(Check.at_least("speculative tokens identical to plain decoding", sum(agree) / len(agree),
                                     1.0, differ))
    verify_steps = [len(r[3].decode.accepted) for r in runs if r[1]]
    metrics = {
        "outputs": n,
        "valid_rate_reference": sum(r[2].valid for r in runs) / n,
        "valid_rate_candidate": sum(r[3].valid for r in runs) / n,
        "identical_rate": sum(same) / n,
        "mean_tokens": sum(len(r[2].decode.tokens) for r in runs) / n,
        "draft_acceptance": (sum(sum(r[3].decode.accepted) for r in runs if r[1])
                             / max(1, sum(r[1] * len(r[3].decode.accepted) for r in runs if r[1]))),
        "verify_steps": sum(verify_steps),
        "tie_tolerance": tie,
        "route_tie_tolerance": route_tie,
    }
    if standard_shift is not None:
        metrics["standard_gap_shift"] = standard_shift
    if standard_key_shift is not None:
        metrics["standard_key_shift"] = standard_key_shift
    if standard_shift is not None and tie > budget.tie_tolerance:
        notes.append(f"tie tolerance {tie:.3g}: {budget.slack:g} x the yardstick's largest top-2 gap shift from "
                     f"the reference ({standard_shift:.3g}) exceeds the budget's {budget.tie_tolerance:g}")
    return EvalResult.from_checks(NAME, checks, metrics=metrics, tables=[table], notes=notes,
                                  budget={"seed": config.seed, **budget.model_dump()})


def _generate(session: Session, *, grammar_tok: llguidance.LLTokenizer, grammar: str, prompt: list[int],
              max_tokens: int, schema: dict, eos: int, spec_tokens: int) -> _Output:
    matcher = llguidance.LLMatcher(grammar_tok, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"schema {schema.get('title')!r}: llguidance refused the grammar: {matcher.get_error()}")
    decode = _greedy(session, matcher, prompt, max_tokens, spec_tokens)
    decode.prompt_len = len(prompt)
    decode.keys = session.routing.keys if session.routing is not None else None
    out = _Output(decode)
    if decode.error or not decode.stopped:
        out.problem = decode.error or f"no end within {max_tokens} tokens"
        return out
    try:
        out.text = grammar_tok.decode_bytes([t for t in decode.tokens if t != eos]).decode("utf-8")
        value = json.loads(out.text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        out.problem = f"does not parse: {e}"
        return out
    out.parsed = True
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: e.path)
    out.valid = not errors
    out.problem = errors[0].message if errors else ""
    return out


def _greedy(session: Session, matcher: llguidance.LLMatcher, prompt: list[int], max_tokens: int,
            spec_tokens: int) -> _Decode:
    """Greedy decoding under the matcher's mask until it stops (closed JSON or EOS) or max_tokens; with
    spec_tokens = K > 0 every step verifies the last token and K drafts at once and keeps the accepted prefix."""
    drafter, out = NgramDrafter(), _Decode()
    token = _choose(session.feed(prompt), matcher, out)
    while not _finished(out, max_tokens):
        drafts = _drafts(drafter, matcher, prompt, out.tokens, spec_tokens)
        rows = session.verify([token] + drafts) if drafts else session.feed([token])[None]
        accepted = 0
        for j, row in enumerate(rows):
            token = _choose(row, matcher, out)
            if _finished(out, max_tokens) or j == len(drafts) or token != drafts[j]:
                break
            accepted += 1
        if drafts:
            session.keep(1 + accepted)
            out.accepted.append(accepted)
    return out


def _drafts(drafter: NgramDrafter, matcher: llguidance.LLMatcher, prompt: list[int], tokens: list[int],
            k: int) -> list[int]:
    """K draft tokens: what the grammar forces next, then prompt lookup over everything so far."""
    if not k:
        return []
    forced = matcher.compute_ff_tokens()[:k]
    if len(forced) == k:
        return forced
    return forced + drafter.propose([Generation(prompt, tokens + forced)], k - len(forced)).tokens[0].tolist()


def _choose(logits: torch.Tensor, matcher: llguidance.LLMatcher, out: _Decode) -> int:
    """The masked argmax of one row of logits, appended to `out` and consumed by the matcher."""
    allowed = _allowed(matcher, logits.shape[-1]).to(logits.device)
    best = logits.masked_fill(~allowed, float("-inf")).topk(2)
    token = int(best.indices[0])
    out.gaps.append((best.values[0] - best.values[1]).item())
    out.tokens.append(token)
    if not matcher.consume_token(token):
        out.error = f"the matcher refused token {token}: {matcher.get_error()}"
    elif matcher.is_stopped():
        out.stopped = True
    return token


def _finished(out: _Decode, max_tokens: int) -> bool:
    return out.stopped or bool(out.error) or len(out.tokens) >= max_tokens


def _allowed(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """The matcher's next-token mask as bools [vocab] (llguidance packs 32 ids per int32, low bit first)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def _agrees(verdict: str) -> bool:
    return verdict == "identical" or verdict.startswith(("near-tie", "routing near-tie"))


def _held_to_reference(reference_vs_plain: str, plain_between: str, speculative_between: str) -> bool:
    """Whether the candidate's speculative run is judged by the reference's speculative run instead of by its own
    plain run: where a run took a branch of its own, the reference's (its speculative run left its plain run), or
    the candidate's (its plain run left the reference's at an excused near-tie, so its later tokens answer other
    contexts; or its speculative run took a near-tie routing branch, which the reference decoded), and the
    candidate's speculative tokens agree with the reference's."""
    own_branch = (not _agrees(reference_vs_plain) or plain_between != "identical"
                  or speculative_between.startswith("routing near-tie"))
    return own_branch and _agrees(speculative_between)


def _gap_shift(ref: _Decode, other: _Decode) -> float:
    """The largest change of the top-2 allowed-logit gap between two paths' runs over the steps where they had
    decoded the same tokens (so both gaps answer the same context), the first step they part at included: a lower
    bound on how far the other path's logits moved from the reference's there."""
    same = _first_difference(ref, other)
    # a step the grammar forces (one allowed token) has an infinite gap on both paths and says nothing
    return max((abs(a - b) for a, b in zip(ref.gaps[:same + 1], other.gaps[:same + 1])
                if math.isfinite(a) and math.isfinite(b)), default=0.0)


def _first_difference(ref: _Decode, other: _Decode) -> int:
    """The first step at which two runs' tokens differ (the shorter run's length if one is a prefix)."""
    return next((i for i, (a, b) in enumerate(zip(ref.tokens, other.tokens)) if a != b),
                min(len(ref.tokens), len(other.tokens)))


def _margin(keys: torch.Tensor, top_k: int) -> float:
    """How far a router choice was from going the other way: the k-th largest key minus the next one."""
    top = keys.topk(top_k + 1).values
    return float(top[top_k - 1] - top[top_k])


def _key_shift(ref: _Decode, other: _Decode, top_k: int) -> float:
    """The largest selection-key change between two paths' runs while their contexts agree: over the positions up
    to the one the first parted token was chosen at, through the first position where a MoE layer chose other
    experts (later positions see other hidden states)."""
    if ref.keys is None or other.keys is None:
        return 0.0
    last = ref.prompt_len - 1 + _first_difference(ref, other)
    shift = 0.0
    for position in range(last + 1):
        layers = list(zip(ref.keys.get(position, []), other.keys.get(position, [])))
        for a, b in layers:
            shift = max(shift, float((a - b).abs().max()))
        if any(set(a.topk(top_k).indices.tolist()) != set(b.topk(top_k).indices.tolist()) for a, b in layers):
            break
    return shift


def _traced_to_routing(ref: _Decode, cand: _Decode, tie: float, route_tie: float, top_k: int, swaps: int,
                       redo: Callable[[RouteSwap], _Output]) -> str | None:
    """The verdict when a swapped near-tie router choice of the reference decodes the candidate's tokens (None when
    none of the `swaps` tried does): the reference's choices within `route_tie` at the positions the parted token
    depends on, the position where the candidate's gap first left the reference's by more than `tie` first, then
    by margin."""
    if ref.keys is None:
        return None
    step = _first_difference(ref, cand)
    last = ref.prompt_len - 1 + step
    moved = next((i for i, (a, b) in enumerate(zip(ref.gaps[:step + 1], cand.gaps[:step + 1]))
                  if math.isfinite(a) and math.isfinite(b) and abs(a - b) > tie), step)
    first_moved = ref.prompt_len - 1 + moved
    near = sorted((position != first_moved, margin, position, layer)
                  for position in range(last + 1) for layer, keys in enumerate(ref.keys.get(position, []))
                  for margin in [_margin(keys, top_k)] if margin <= route_tie)
    gap = ref.gaps[step] if step < len(ref.gaps) else float("inf")
    for _, margin, position, layer in near[:swaps]:
        branch = redo(RouteSwap(position, layer)).decode
        verdict = _compare(branch, cand, tie)
        if _agrees(verdict):
            return (f"routing near-tie at step {step} (reference top-2 gap {gap:.3g}; MoE layer {layer} at position "
                    f"{position} within {margin:.3g} of another expert: the reference with it swapped: {verdict})")
    return None


def _compare(ref: _Decode, cand: _Decode, tie_tolerance: float) -> str:
    if ref.tokens == cand.tokens:
        return "identical"
    step = _first_difference(ref, cand)
    gap = ref.gaps[step] if step < len(ref.gaps) else float("inf")
    kind = "near-tie" if gap <= tie_tolerance else "diverged"
    return f"{kind} at step {step} (reference top-2 gap {gap:.3g})"
