"""A test-only head kind, "device_failure": a layer-mix head whose finish raises the RuntimeError
torch raises after a sticky CUDA error when a batch holds a text with the word TRIGGER, and never
returns (a hung kernel: it sleeps STUCK_S) when it holds STUCK; otherwise it answers as a layer-mix head. Registered on import (the test's process and a tmod-serve subprocess
that imports this module first), so a real server meets the error where a real pass would."""
from __future__ import annotations

import time

from server.heads.layermix import LayerMixHead
from server.heads.registry import HEAD_KINDS, register_head

TRIGGER = "kaboom"
STUCK, STUCK_S = "standstill", 600.0
# torch's text for cudaErrorIllegalAddress (c10/cuda/CUDAException.cpp)
MESSAGE = ("CUDA error: an illegal memory access was encountered\n"
           "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
           "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")


class DeviceFailureHead(LayerMixHead):
    def finish(self, state, batch):
        if any(TRIGGER in text for text in batch.texts):
            raise RuntimeError(MESSAGE)
        if any(STUCK in text for text in batch.texts):
            time.sleep(STUCK_S)
        return super().finish(state, batch)


if "device_failure" not in HEAD_KINDS:
    register_head("device_failure", DeviceFailureHead)
