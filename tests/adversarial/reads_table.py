"""A correct kernel whose output depends on a data file it reads at call time (a tuned table, a .cu source, a
config): no import names it, so the evidence must cover it from what the process opened, or editing it would
leave the bundle fresh."""

import json
from pathlib import Path

from model.kimi_k3.ops.kda_decode import kda_decode as reference

TABLE = Path(__file__).with_name("reads_table.json")


def kda_decode(proj, conv_state, ssm_state, slots, w):
    scale = json.loads(TABLE.read_text())["output_scale"]
    return reference(proj, conv_state, ssm_state, slots, w) * scale
