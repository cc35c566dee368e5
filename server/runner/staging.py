"""Page-locked host input sets per bucket, made once and reused batch after batch (on cuda)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from server.backbone import TokenBatch
from server.runner.shapes import Bucket

STAGING_SETS = 2  # page-locked input sets per bucket: one batch running, the next one prepared


@dataclass
class StagingSet:
    """One set of host input tensors of a bucket's shape (page-locked on cuda)."""

    bucket: Bucket
    tensors: dict[str, torch.Tensor]  # input_ids, attention_mask, token_type_ids?, class:<name>
    busy: bool = False


class StagingBuffers:
    """Host input tensors per bucket, `sets` of each, made once (`allocate`, at warm-up) and reused:
    a prepared batch is copied into a free set (`take`) and the set is given back once the pass that
    reads it has run (`give_back`). With two batches in flight (one running, the next prepared) two
    sets suffice; when none is free (or the bucket or a class is not held) `take` answers None and
    the batch stays in pageable memory. Thread-safe: `take` runs on a tokenizer thread, `give_back`
    on the compute thread."""

    def __init__(self, pin: bool, sets: int = STAGING_SETS):
        self.pin, self.sets = pin, sets
        self._free: dict[Bucket, list[StagingSet]] = {}
        self._lock = threading.Lock()
        self.misses = 0  # batches left in pageable memory (no free set)

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())

    def allocate(self, buckets: list[Bucket], token_types: bool, classes: set[str]) -> None:
        """Sets for every bucket not held yet, or held without a tensor now needed (a module that
        reads another class was loaded); sets that are fine stay. A replaced set still taken by an
        in-flight batch is only dropped when that batch gives it back."""
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else []) + \
            [f"class:{name}" for name in sorted(classes)]
        for bucket in buckets:
            held = self._free.get(bucket)
            if held and set(names) <= set(held[0].tensors):
                continue
            shape = (bucket.size, bucket.seq_len)
            made = [StagingSet(bucket, {name: torch.zeros(shape, dtype=torch.long, pin_memory=self.pin)
                                        for name in names}) for _ in range(self.sets)]
            with self._lock:
                self._free[bucket] = made

    def take(self, batch: TokenBatch, bucket: Bucket) -> tuple[TokenBatch, StagingSet] | None:
        """`batch` copied into a free set of `bucket` -> (the staged batch, its set), or None."""
        wanted = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                  **({"token_type_ids": batch.token_type_ids} if batch.token_type_ids is not None else {}),
                  **{f"class:{name}": t for name, t in batch.classes.items()}}
        with self._lock:
            sets = self._free.get(bucket, [])
            chosen = next((s for s in sets if not s.busy and set(wanted) <= set(s.tensors)), None)
            if chosen is None:
                self.misses += 1
                return None
            chosen.busy = True
        for name, value in wanted.items():
            chosen.tensors[name].copy_(value)
        t = chosen.tensors
        staged = replace(batch, input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                         token_type_ids=t.get("token_type_ids") if batch.token_type_ids is not None else None,
                         classes={name: t[f"class:{name}"] for name in batch.classes})
        return staged, chosen

    def give_back(self, staging: StagingSet | None) -> None:
        if staging is not None:
            with self._lock:
                staging.busy = False

    def clear(self) -> None:
        with self._lock:
            self._free = {}
