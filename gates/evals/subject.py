"""What the evals run on: a model with its tokenizer, from a checkpoint directory or from a preset's random
weights drawn directly on the device (no file), and the decode paths to compare over it.

The GPU evals use the real `k3` layer shapes on the first few layers (`first_layers`): every dimension is
K3's, only the depth is cut, so one MoE layer of MXFP4 experts is ~15 GB and 4 layers fit an H200. Never on
CPU: those shapes are refused there.

A subject with `tp` > 1 is one rank's model (`random_model`): its decoder layers at the rank-local shapes of a
TP group, so a kernel contracted for TP8 shapes (the projections) is chosen on it; the vocabulary stays whole so
that the logits span every token.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from model.kimi_k3.bench.layers import RankOfTP
from model.kimi_k3.checkpoint import RandomSource, checkpoint_tensors
from model.kimi_k3.config import ConfigError, KimiK3Config, preset
from model.kimi_k3.loader import load_model, load_weights
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.parallel import TP
from model.kimi_k3.tokenizer import TOKENIZER_FILE, build_tokenizer, load_tokenizer

from .paths import DecodePath, PathPair, backend_path, perturbed

log = logging.getLogger(__name__)

K3_EVAL_LAYERS = 4  # layers 0-2 KDA (0 dense), 3 MLA: every sublayer kind, ~57 GB of weights


def first_layers(cfg: KimiK3Config, num_layers: int) -> KimiK3Config:
    """The config cut to its first `num_layers` layers, keeping its MLA/KDA pattern on them."""
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ConfigError(f"--layers: {num_layers} outside 1..{cfg.num_hidden_layers}")
    lac = cfg.linear_attn_config
    keep = {f: [i for i in getattr(lac, f) if i <= num_layers] for f in ("full_attn_layers", "kda_layers")}
    body = cfg.model_dump()
    body.update(num_hidden_layers=num_layers, first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers),
                linear_attn_config={**lac.model_dump(), **keep})
    return KimiK3Config.model_validate(body)


def random_model(cfg: KimiK3Config, seed: int, device: torch.device, dtype: torch.dtype,
                 tp: int = 1) -> KimiK3Model:
    """The model with the seeded random weights `k3forge ckpt make` would write, drawn on the device.

    With `tp` > 1: rank 0 of a TP group of that size with every collective the identity (`RankOfTP`), its
    decoder layers (and so its caches) at the rank's shapes, its embedding and lm_head the whole model's. A
    stand-in for what one GPU of the group computes, not the TP model: the other ranks' shares of every
    all-reduce are missing, so it is the same function for the reference and the candidate paths, not K3's."""
    def build(cfg: KimiK3Config, group: TP) -> KimiK3Model:
        with torch.device(device):
            model = KimiK3Model(cfg, group, dtype)
        load_weights(model, RandomSource(checkpoint_tensors(cfg), seed, device),
                     origin=f"random weights (seed {seed})")
        return model

    if tp == 1:
        return build(cfg, TP()).eval()
    model = build(cfg, RankOfTP(size=tp))
    # the whole vocabulary, from a one-layer TP1 model: weights are drawn by name, so its embedding and lm_head are
    # the whole model's, and the rank's layers are never drawn at the whole model's shapes (57 GB at K3's four)
    model.vocab = build(first_layers(cfg, 1), TP()).vocab
    return model.eval()


def load_subject(*, ckpt: str | Path | None = None, preset_name: str = "tiny", layers: int | None = None,
                 seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 tp: int = 1) -> tuple[KimiK3Model, Tokenizer, list[str]]:
    """The model an eval runs on (a checkpoint, or a preset's seeded random weights, cut to `layers`, with its
    layers at one rank's shapes of a TP group of `tp`), its tokenizer, and notes for the report. The same
    arguments give the same weights in any process."""
    device = torch.device(device)
    notes = []
    if ckpt is not None:
        model = load_model(ckpt, act_dtype=dtype, device=device)
        if (Path(ckpt) / TOKENIZER_FILE).is_file():
            tokenizer = load_tokenizer(ckpt, model.cfg)
        else:
            tokenizer = build_tokenizer(model.cfg)
            notes.append(f"{ckpt}: no {TOKENIZER_FILE}; using the built-in byte-level BPE for this config")
            log.warning(notes[-1])
        return model, tokenizer, notes
    cfg = preset(preset_name)
    if preset_name == "k3":
        if device.type != "cuda":
            raise ConfigError("--preset k3: real K3 layer shapes need a GPU (one MoE layer is ~15 GB)")
        cfg = first_layers(cfg, layers or K3_EVAL_LAYERS)
    elif layers is not None:
        cfg = first_layers(cfg, layers)
    cfg.check_tp(tp)
    rank = f", layers at rank 0's shapes of TP{tp} (collectives excluded)" if tp > 1 else ""
    notes.append(f"random {preset_name} weights (seed {seed}), {cfg.num_hidden_layers} layers, {dtype}{rank}")
    return random_model(cfg, seed, device, dtype, tp), build_tokenizer(cfg), notes


def load_pair(candidate: str | Callable[[KimiK3Model], DecodePath], *, perturb: float | None = None,
              yardstick: bool | Callable[[KimiK3Model], DecodePath] = False, kv_cache_dtype: str = "auto",
              **subject) -> PathPair:
    """The reference path and `candidate` (a decode backend name, or a function building the path over the model),
    optionally with scaled logits, over one model (`load_subject`'s arguments); with `yardstick`, the standard path
    beside them (or the path that function builds over the model: gates/evals/exact.py). kv_cache_dtype: the standard's
    MLA cache, and a named candidate's (a function builds its own); the reference keeps the exact cache, so the
    yardstick carries the cache's quantization and the candidate is judged beside it."""
    model, tokenizer, notes = load_subject(**subject)
    cand = candidate(model) if callable(candidate) else backend_path(model, candidate, kv_cache_dtype=kv_cache_dtype)
    if perturb is not None:
        cand = perturbed(cand, perturb)
    standard = (yardstick(model) if callable(yardstick) else
                backend_path(model, "auto", kv_cache_dtype=kv_cache_dtype) if yardstick else None)
    return PathPair(backend_path(model, "reference"), cand, model, tokenizer, tuple(notes), standard)
