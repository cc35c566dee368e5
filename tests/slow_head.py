"""A test-only head kind, "slow": a layer-mix head whose finish takes SECONDS longer per pass, so a
real server's passes take a known least time. Registered on import (the test's process and a
tmod-serve subprocess that imports this module first)."""
from __future__ import annotations

import time

from server.heads.layermix import LayerMixHead
from server.heads.registry import HEAD_KINDS, register_head

SECONDS = 0.4


class SlowHead(LayerMixHead):
    def finish(self, state, batch):
        time.sleep(SECONDS)
        return super().finish(state, batch)


if "slow" not in HEAD_KINDS:
    register_head("slow", SlowHead)
