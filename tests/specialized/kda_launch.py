"""Launch the fused KDA decode kernel on one case and check its output, state and conv windows against the
reference; exit 1 on a mismatch. Run under compute-sanitizer by test_kda_decode_sanitizer.py, and under Nsight
Compute by model/kimi_k3/specialized/kda_decode/profile.sh (--repeat: further launches on a fresh case, whose
inputs are still in L2, to profile with warm caches)."""

import argparse
import functools
import sys

import torch

from gates.problems.kda_decode import make_case
from model.kimi_k3.specialized.kda_decode import kda_decode_cute
from model.kimi_k3.specialized.kda_decode.bench import check_against_reference


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--v-split", type=int, required=True)
    ap.add_argument("--repeat", type=int, default=0, help="launches after the checked one, on a fresh case")
    a = ap.parse_args()
    kernel = functools.partial(kda_decode_cute, tuning={"v_split": a.v_split})
    out_rel, state_rel, windows_equal = check_against_reference(kernel, a.heads, a.batch, seed=1)
    print(f"heads {a.heads} batch {a.batch} v_split {a.v_split}: out rel {out_rel:.2e}, state rel {state_rel:.2e}, "
          f"conv windows {'equal' if windows_equal else 'DIFFER'}")
    if a.repeat:
        case = make_case(a.heads, a.batch, device="cuda", seed=2)
        for _ in range(a.repeat):
            kernel(*case.args())
        torch.cuda.synchronize()
    return 0 if out_rel < 1e-3 and state_rel < 1e-5 and windows_equal else 1


if __name__ == "__main__":
    sys.exit(main())
