"""A kernel tuned only where its contract says it is timed: at the benchmark points' batches it is the op itself,
at any other batch the contract admits it does the work four times over (a config table with entries at the
listed batches alone, and a slow default). Right everywhere, as fast as its yardstick at the listed points, a
quarter of it between them: in serving most batches are between them. The benchmarks gate times points it
draws between the contract's too, and holds the candidate there to the standard's speed."""

import torch

from model.kimi_k3.ops.kda_decode import kda_decode as reference

TUNED_BATCHES = (1, 8)  # the benchmark points of the contract in test_adversarial.py
REPEATS = 4


def kda_decode(proj, conv_state, ssm_state, slots, w):
    if slots.shape[0] not in TUNED_BATCHES:
        # the same work again on copies of the batch's own state rows: the answer stays right, only the time grows
        # (copies of the whole caches would write far more than the op, slowing the standard's next replay too:
        # the gate's yardstick check, not the drawn points, would then reject it; session 24 on the H200)
        rows = torch.arange(slots.shape[0], dtype=slots.dtype, device=slots.device)
        for _ in range(REPEATS - 1):
            reference(proj, conv_state[slots], ssm_state[slots], rows, w)
    return reference(proj, conv_state, ssm_state, slots, w)
