"""Launch the fused KDA decode kernel a few times on one case, then check output and state against the
reference; exit 1 on a mismatch. Run under compute-sanitizer by test_kda_decode_sanitizer.py."""

import argparse
import sys

import torch

from model.kimi_k3.ops.kda import kda_decode
from model.kimi_k3.specialized.kda_decode.inputs import make_case
from model.kimi_k3.specialized.kda_decode.kernel import kda_decode_cute


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--v-split", type=int, required=True)
    ap.add_argument("--launches", type=int, default=2)
    a = ap.parse_args()
    case = make_case(a.heads, a.batch, device="cuda", seed=1, exact_gemm=True)
    ref_case = case.clone_caches()
    for _ in range(a.launches):
        out = kda_decode_cute(*case.args(), tuning={"v_split": a.v_split})
        ref = kda_decode(*ref_case.args())
    torch.cuda.synchronize()
    errors = rel_l2(out, ref), rel_l2(case.ssm_state, ref_case.ssm_state)
    print(f"heads {a.heads} batch {a.batch} v_split {a.v_split}: out rel {errors[0]:.2e}, state rel {errors[1]:.2e}")
    return 0 if errors[0] < 1e-2 and errors[1] < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
