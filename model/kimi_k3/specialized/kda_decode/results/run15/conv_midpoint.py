"""Run 15: the v channel whose bf16 rounding the gate's reference (on the H200) and the kernel disagreed on.

Draws the gate's input again from its seed (batch 64, 96 heads, large-magnitude) and sums that channel's conv
window in float64 and in three fp32 orders: the exact value lies 1.7e-6 below a bf16 midpoint, so the fp32 order
decides the rounding. `python -m model.kimi_k3.specialized.kda_decode.results.run15.conv_midpoint` (CPU).
"""

import torch
import torch.nn.functional as F

import gates.problems.kda_decode as problem

SEED = 7983838191423593534  # the input seed in gate_report.md
ROW, HEAD, V_ROW = 7, 65, 20  # batch row of slot 17; the failing state element is [17, 65, 20, 17]

case = problem.make_case(96, 64, num_slots=66, seed=SEED, dist="large", head_dim=128, rank=128)
proj, conv_state, _, slots, w = case.args()
channel = 2 * case.cols.p + HEAD * 128 + V_ROW  # v's channel in the conv (and in proj's q|k|v columns)
window = torch.cat([conv_state[slots[ROW], channel, 1:].float(), proj[ROW, case.cols.qkv][channel].float().view(1)])
taps = w.conv_weight[channel].float()
exact = (window.double() * taps.double()).sum()
print(f"window {window.tolist()}  taps {taps.tolist()}")
print(f"float64: {exact.item():.9f}, bf16 of SiLU {F.silu(exact).to(torch.bfloat16).item()}")
for order in ([0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3]):
    acc = torch.zeros(())
    for i in order:
        acc = acc + window[i] * taps[i]
    print(f"fp32 order {order}: {acc.item():.9f}, bf16 of SiLU {F.silu(acc).to(torch.bfloat16).item()}")
