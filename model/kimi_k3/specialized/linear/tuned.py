"""Configs chosen by measurement on the H200, where they beat `LinearConfig.for_shape`'s heuristic.

Keyed by (M, N, K) for the SM count they were measured at; every other problem takes the heuristic. Source: the
sweep of 2026-12-01 (`results/sweep1/`: the heuristic and six one-knob variants, M = 1-3, in-pipeline timing,
cold L2) and NOTES.md's table. An entry is kept only where it won by more than the sweep's run-to-run spread
(about 2 %) and, for M = 2, where the heuristic falls off a cliff (the latent projections: 18.7 µs against 14.3-15.5).
"""

from __future__ import annotations

from .kernel import LinearConfig

MEASURED_SMS = 132  # NVIDIA H200

# (M, N, K): (warps, rows_per_warp, split_k, stages) of the gemv path; µs heuristic -> tuned in the comment
TUNED: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (1, 7168, 3584): (4, 8, 4, 4),  # moe_latent_up: 14.11 -> 13.77
    (1, 2112, 7168): (4, 4, 4, 4),  # mla_qkv_a: 9.85 -> 9.32
    (1, 1536, 7168): (4, 4, 8, 4),  # mla_g_proj / shared_gate_up TP8: 8.07 -> 7.90
    (2, 3584, 7168): (4, 8, 4, 6),  # moe_latent_down: 18.67 -> 15.49
    (2, 7168, 3584): (4, 8, 4, 4),  # moe_latent_up: 18.65 -> 14.27
    (2, 2112, 7168): (4, 4, 4, 4),  # mla_qkv_a: 11.48 -> 10.82
    (2, 1536, 7168): (4, 4, 8, 4),  # mla_g_proj / shared_gate_up TP8: 8.55 -> 8.21
}


def tuned_config(m: int, n: int, k: int, num_sms: int, out_dtype: str) -> LinearConfig | None:
    """The measured config for this problem on this GPU, or None where the heuristic stands."""
    entry = TUNED.get((m, n, k)) if num_sms == MEASURED_SMS else None
    if entry is None:
        return None
    warps, rows_per_warp, split_k, stages = entry
    return LinearConfig(path="gemv", warps=warps, rows_per_warp=rows_per_warp, split_k=split_k, stages=stages,
                        out_dtype=out_dtype)
