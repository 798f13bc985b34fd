"""The sandbox's side of a misbehaving candidate: a hang is an error that says where the candidate was stuck."""

import pytest

from gates.core.sandbox import Sandbox, SandboxError


def test_a_hung_candidate_is_reported_with_its_stack():
    with Sandbox() as box:
        assert box.request("probe", entries=["model.kimi_k3.ops.kda:kda_decode"])  # started: torch imported
        with pytest.raises(SandboxError) as err:
            box.request("probe", entries=["tests.adversarial.hangs:anything"], timeout_s=5)
    message = str(err.value)
    assert message.startswith("probe: no reply from the candidate's process within 5 s; it was at:")
    assert "hangs.py" in message and "_wait_forever" in message
