"""Where a batch's time went (tokenize, backbone, heads): filled by the engine and the runner, read
by the batcher and the runtime for the timing headers and metrics. A small shared type: it lives
below every one of its users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timings:
    tokenize: float = 0.0
    backbone: float = 0.0
    heads: float = 0.0
    extra: dict = field(default_factory=dict)
