"""A candidate whose import never returns (a stand-in for a kernel launch or a sync that hangs)."""

import time


def _wait_forever() -> None:
    while True:
        time.sleep(1)


_wait_forever()
