"""K3's rank-local projection shapes (N = out_features, K = in_features) at TP8 and TP16, and the bytes a call
must move."""

from __future__ import annotations

from typing import NamedTuple


class Projection(NamedTuple):
    name: str
    tp: int
    n: int
    k: int


PROJECTIONS = (
    Projection("kda_in_proj", 8, 6288, 7168),
    Projection("kda_in_proj", 16, 3216, 7168),
    Projection("o_proj", 8, 7168, 1536),
    Projection("o_proj", 16, 7168, 768),
    Projection("mla_qkv_a", 8, 2112, 7168),  # replicated: the same at TP16
    Projection("mla_q_b", 8, 2304, 1536),
    Projection("mla_q_b", 16, 1152, 1536),
    Projection("mla_g_proj", 8, 1536, 7168),
    Projection("mla_g_proj", 16, 768, 7168),
    Projection("moe_latent_down", 8, 3584, 7168),  # replicated
    Projection("moe_latent_up", 8, 7168, 3584),  # replicated
    Projection("shared_gate_up", 8, 1536, 7168),
    Projection("shared_gate_up", 16, 768, 7168),
    Projection("shared_down", 8, 7168, 768),
    Projection("shared_down", 16, 7168, 384),
    Projection("dense_gate_up", 8, 8448, 7168),
    Projection("dense_down", 8, 7168, 4224),
    Projection("lm_head", 8, 20480, 7168),
)

# Distinct (N, K): several projections share a shape.
SHAPES = tuple(sorted({(p.n, p.k) for p in PROJECTIONS}, key=lambda s: -s[0] * s[1]))


def names(n: int, k: int) -> str:
    """The projections of shape (N, K), e.g. 'mla_g_proj/shared_gate_up TP8'."""
    hits = [p for p in PROJECTIONS if (p.n, p.k) == (n, k)]
    return "/".join(sorted({p.name for p in hits})) + " TP" + "/".join(str(t) for t in sorted({p.tp for p in hits}))


def bytes_moved(m: int, n: int, k: int, out_bytes: int = 2) -> int:
    """The least a call can move: W and x read once (bf16), y written once."""
    return 2 * n * k + 2 * m * k + out_bytes * m * n
