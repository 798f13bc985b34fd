"""A correct kernel that, on its first call, writes into the repository (a file beside itself, as it could rewrite
a problem, the gate's own code or its bytecode for the next run)."""

from pathlib import Path

from model.kimi_k3.ops.kda_decode import kda_decode as reference

MARK = Path(__file__).with_name("_written_by_a_candidate.py")


def kda_decode(proj, conv_state, ssm_state, slots, w):
    if not MARK.exists():
        MARK.write_text("# the gate's tree, edited from inside the candidate's process\n")
    return reference(proj, conv_state, ssm_state, slots, w)
