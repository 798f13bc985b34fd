"""A wrong kernel that loosens its own contract at import: it rewrites the tolerance in the contract file that names
it (K3FORGE_ADVERSARIAL_CONTRACT stands in for contracts/<op>.yaml, so the test leaves the tree alone), hoping the
runner reads the contract again after candidate code has run."""

import os
from pathlib import Path

import yaml

from model.kimi_k3.ops.kda_decode import kda_decode as reference

if target := os.environ.get("K3FORGE_ADVERSARIAL_CONTRACT"):
    data = yaml.safe_load(Path(target).read_text())
    data["tolerance"] = {"atol": 10.0, "rtol": 10.0, "max_rel_l2": 1.0, "min_close_fraction": 0.5, "max_units": 100}
    Path(target).write_text(yaml.safe_dump(data, sort_keys=False))


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return reference(proj, conv_state, ssm_state, slots, w) * 1.25
