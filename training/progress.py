"""Progress of long work: a tqdm bar on a terminal; in a log (stderr not a terminal, or --no-progress) a
plain line at most every LOG_EVERY_S seconds, so that a step of minutes (a large file's backbone
states, an epoch that recomputes them, a teacher's logits) is not silent there, and a short one adds
nothing."""
from __future__ import annotations

import sys
import time
from typing import Iterable

from tqdm.auto import tqdm

LOG_EVERY_S = 30.0


def progress_of(iterable: Iterable | None = None, *, bars: bool, desc: str, unit: str = "it",
                total: int | None = None):
    """`iterable` (or, without one, `update(n)` calls up to `total`) shown as a bar where `bars`,
    else as log lines; both take `update` and `set_postfix` and are context managers."""
    if bars:
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)
    return LogLines(iterable, total=total, desc=desc, unit=unit)


class LogLines:
    """A line such as `caching states: 412000/2260000 tok (18%) in 31 s, ~143 s left` every LOG_EVERY_S."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, unit: str):
        self.iterable, self.desc, self.unit = iterable, desc, unit
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self.postfix = 0, ""
        self.started = self.said = time.monotonic()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.said >= LOG_EVERY_S:
            self.said = now
            print(self.line(now - self.started), file=sys.stderr, flush=True)

    def line(self, elapsed: float) -> str:
        if not self.total:
            return f"{self.desc}: {self.n} {self.unit} in {elapsed:.0f} s{self.postfix}"
        left = (self.total - self.n) * elapsed / self.n if self.n else 0.0
        return (f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%) in {elapsed:.0f} s, "
                f"~{left:.0f} s left{self.postfix}")

    def set_postfix(self, **values) -> None:
        self.postfix = "  " + "  ".join(f"{name} {value}" for name, value in values.items())

    def __enter__(self) -> "LogLines":
        return self

    def __exit__(self, *exc) -> None:
        return None
