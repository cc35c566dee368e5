"""Batch shapes: rows (sorted by length) cut into passes, each with its bucket on a GPU (the one
place where a CPU and a GPU differ; see the package docstring)."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from server.config import Settings, parse_sizes


def length_runs(lengths: list[int], max_padding_ratio: float) -> list[slice]:
    """Cut ascending `lengths` into consecutive runs with rows x longest <= ratio x real tokens."""
    runs, start, real = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (i - start + 1) * length > max_padding_ratio * (real + length):
            runs.append(slice(start, i))
            start, real = i, 0
        real += length
    if lengths:
        runs.append(slice(start, len(lengths)))
    return runs


@dataclass(frozen=True, order=True)
class Bucket:
    size: int  # rows
    seq_len: int  # tokens per row

    def __str__(self) -> str:
        return f"{self.size}x{self.seq_len}"


def bounded(sizes: list[int], limit: int, hard: bool = False) -> list[int]:
    """The sizes under `limit`, then the smallest one covering it (or the limit itself; always the
    limit itself when it is `hard`: no row is longer than the backbone's token limit, and its
    position table ends there)."""
    under = [s for s in sizes if s < limit]
    return under + [limit if hard else next((s for s in sizes if s >= limit), limit)]


class BatchShapes:
    """Rows (sorted by length) -> passes: [(rows slice, bucket or None)]. "length_runs": runs within
    `max_padding_ratio`, no bucket; "buckets": one pass per `batch_sizes[-1]` rows, each padded to
    the smallest bucket covering it (None if its longest row is over every bucket length);
    "bucket_runs": as "buckets", each pass then cut into the runs of rows whose buckets cost least
    by `cost` (`cheapest_runs`)."""

    def __init__(self, mode: str, batch_sizes: list[int], seq_lens: list[int], max_padding_ratio: float = 1.25):
        if mode not in ("length_runs", "buckets", "bucket_runs"):
            raise ValueError(f"unknown batch shape mode {mode!r}")
        self.mode = mode
        self.batch_sizes, self.seq_lens = sorted(batch_sizes), sorted(seq_lens)
        self.max_padding_ratio = max_padding_ratio

    @classmethod
    def for_settings(cls, settings: Settings, device: torch.device, max_tokens: int) -> "BatchShapes":
        mode = settings.batch_shapes
        if mode == "auto":
            mode = "buckets" if device.type == "cuda" else "length_runs"
        return cls(mode, bounded(parse_sizes(settings.graph_batch_sizes), settings.max_batch_size),
                   bounded(parse_sizes(settings.graph_seq_lens), max_tokens, hard=True), settings.max_padding_ratio)

    def bucket(self, rows: int, longest: int) -> Bucket | None:
        size = next((s for s in self.batch_sizes if s >= rows), None)
        seq_len = next((n for n in self.seq_lens if n >= longest), None)
        return None if size is None or seq_len is None else Bucket(size, seq_len)

    @property
    def bucketed(self) -> bool:
        """Passes padded to buckets (captured graphs, staging sets): the GPU's modes."""
        return self.mode != "length_runs"

    def passes(self, lengths: list[int], cost: Callable[[Bucket], float | None] | None = None
               ) -> list[tuple[slice, Bucket | None]]:
        """`cost`: with "bucket_runs", a pass's time at a bucket (None: not known, the pass is not cut)."""
        if self.mode == "length_runs":
            return [(run, None) for run in length_runs(lengths, self.max_padding_ratio)]
        out, step = [], self.batch_sizes[-1]
        for start in range(0, len(lengths), step):
            run = slice(start, min(start + step, len(lengths)))
            runs = self.cheapest_runs(lengths, run, cost) if self.mode == "bucket_runs" and cost else None
            out.extend(runs or [(run, self.bucket(run.stop - run.start, max(lengths[run])))])
        return out

    def cheapest_runs(self, lengths: list[int], rows: slice, cost: Callable[[Bucket], float | None]
                      ) -> list[tuple[slice, Bucket]] | None:
        """`rows` (sorted by length) cut where a row's bucket length changes, into the runs whose
        buckets' summed `cost` is least (the whole, one run, on a tie); None where the whole's cost is
        not known. The cuts are few (one per bucket length), so every way of grouping them is tried
        (a shortest path over the cut points)."""
        whole = self.bucket(rows.stop - rows.start, lengths[rows.stop - 1])
        if whole is None or cost(whole) is None:
            return None
        cuts = [rows.start]
        for seq_len in self.seq_lens:  # the first row over each bucket length starts a group
            at = bisect.bisect_right(lengths, seq_len, rows.start, rows.stop)
            if cuts[-1] < at < rows.stop:
                cuts.append(at)
        cuts.append(rows.stop)
        best = [0.0] + [math.inf] * (len(cuts) - 1)  # best[j]: the least cost of the rows before cuts[j]
        came_from = [0] * len(cuts)
        for j in range(1, len(cuts)):
            for i in range(j):  # i = 0 first: on a tie, fewer passes
                bucket = self.bucket(cuts[j] - cuts[i], lengths[cuts[j] - 1])
                c = cost(bucket) if bucket is not None else None
                if c is not None and best[i] + c < best[j]:
                    best[j], came_from[j] = best[i] + c, i
        runs, j = [], len(cuts) - 1
        while j > 0:
            i = came_from[j]
            runs.append((slice(cuts[i], cuts[j]), self.bucket(cuts[j] - cuts[i], lengths[cuts[j] - 1])))
            j = i
        return runs[::-1]

    def reachable(self, max_batch_tokens: int, max_request_rows: int, max_row_tokens: int) -> list[Bucket]:
        """Every bucket a pass can land in, largest first (captured at start). The batcher adds a
        request to a batch while rows x longest stays within `max_batch_tokens`, but a batch's first
        request is taken whatever its size (up to `max_request_rows` rows), and no row is longer than
        `max_row_tokens`. A bucket is reachable when the smallest pass that lands in it (one row more
        than the next smaller size, one token more than the next shorter length) can be formed."""
        out, smaller_size = [], 0
        for size in self.batch_sizes:
            shorter = 0
            for seq_len in self.seq_lens:
                rows, longest = smaller_size + 1, shorter + 1
                if longest <= max_row_tokens and (rows * longest <= max_batch_tokens or rows <= max_request_rows):
                    out.append(Bucket(size, seq_len))
                shorter = seq_len
            smaller_size = size
        return sorted(out, reverse=True)
