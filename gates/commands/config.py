"""`k3forge config show`: the config (Hugging Face field names), MLA layer ids and every rank-local weight."""

from __future__ import annotations

import json

import torch
from rich.console import Console
from rich.table import Table

from model.kimi_k3.config import KimiK3Config, preset
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.parallel import TP


def register(sub) -> None:
    p = sub.add_parser("config", help="inspect a K3 config")
    verbs = p.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="print a config and the rank-local shape of every weight")
    src = show.add_mutually_exclusive_group()
    src.add_argument("--preset", default="k3", help="k3 (the real config) or tiny (CPU tests); default k3")
    src.add_argument("--config", help="a config.json or checkpoint directory instead of a preset")
    show.add_argument("--tp", type=int, default=1, help="tensor-parallel size for the rank-local shapes")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=run_show)


def describe(cfg: KimiK3Config, tp: int) -> dict:
    """Config, MLA layer ids and {parameter: {shape, dtype}} of rank 0 at TP size tp."""
    cfg.check_tp(tp)
    with torch.device("meta"):
        model = KimiK3Model(cfg, TP(0, tp))
    weights = {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
               for name, p in model.named_parameters()}
    return {"config": cfg.to_hf_dict(nested=False), "tp": tp, "mla_layer_ids": cfg.mla_layer_ids,
            "kda_layer_ids": [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i)],
            "weights": weights}


def run_show(args) -> int:
    cfg = KimiK3Config.from_file(args.config) if args.config else preset(args.preset)
    info = describe(cfg, args.tp)
    if args.json:
        print(json.dumps(info))
        return 0
    out = Console()
    fields = Table(title="config (text_config)", show_header=False)
    for key, value in info["config"].items():
        if key != "quantization_config":
            fields.add_row(key, json.dumps(value))
    fields.add_row("quantization", "MXFP4 routed experts" if cfg.experts_quantized else "none (dense experts)")
    out.print(fields)
    out.print(f"mla_layer_ids (0-indexed): {info['mla_layer_ids']}")
    weights = Table(title=f"rank-local weights at TP{args.tp}")
    for col in ("parameter", "shape", "dtype"):
        weights.add_column(col)
    for name, w in info["weights"].items():
        weights.add_row(name, str(w["shape"]), w["dtype"])
    out.print(weights)
    return 0
