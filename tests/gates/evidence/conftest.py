import json

import pytest

from tests.gates.fixtures.helpers import REAL_BUNDLE


@pytest.fixture
def bundle():
    """The KDA kernel's committed H200 bundle, parsed afresh for each test (tests edit it)."""
    return json.loads(REAL_BUNDLE.read_text())
