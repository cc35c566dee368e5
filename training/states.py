"""Feeding a head during training: batches of a split, their targets, and the backbone states.

The backbone is frozen, so its states are a function of the input alone. `CachedStates` runs it
once per split and keeps only the states the head reads, real tokens only, in fp16 (a
`TokenStateCache`, which `training.bridges.pairing.PairedStates` uses too);
`RecomputedStates` runs it again for every batch (no memory cost, a backbone pass per epoch).
`CachedStates(disk=...)` also keeps them on disk, for later runs on the same split.
Either way every input is encoded by `Backbone.encode` and padded by `Backbone.collate`, exactly
as the server does it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Iterator, Sequence

import torch

from modules_store import TaskType
from server.backbone import Backbone, EncodedInput, TokenBatch
from training.data.examples import LabelledData
from training.data.word_tags import IGNORE_INDEX, token_labels
from training.progress import progress_of
from training.runs import write_cache_file

log = logging.getLogger("tmod")


class Split:
    """A labelled split bound to a backbone and a label set: every example encoded once (as the
    server encodes), padded into batches on demand, with its targets."""

    def __init__(self, data: LabelledData, labels: list[str], backbone: Backbone):
        self.data = data
        self.labels = labels
        self.backbone = backbone
        index = {label: i for i, label in enumerate(labels)}
        unknown = sorted(set(data.labels_seen()) - set(index))
        if unknown:
            raise ValueError(f"{data.source}: labels {unknown} are not among the head's labels {labels}")
        self.is_token_task = data.task_type == TaskType.token_classification
        self.is_multi_label = data.task_type == TaskType.multi_label_classification
        self.encoded = backbone.encode(data.texts(), data.text_pairs(), truncate=True)
        self.lengths = [len(e) for e in self.encoded]
        if self.is_token_task:
            self.spans = [ex.spans for ex in data.examples]
            self.label_ids = [
                token_labels(enc, spans, [index[t] for t in ex.tags], labels)
                for enc, spans, ex in zip(self.encoded, self.spans, data.examples)
            ]
        elif self.is_multi_label:
            self.label_ids = [[index[label] for label in ex.label] for ex in data.examples]
        else:
            self.label_ids = [index[ex.label] for ex in data.examples]

    def __len__(self) -> int:
        return len(self.data)

    def token_batch(self, rows: list[int]) -> TokenBatch:
        return self.backbone.collate([self.encoded[r] for r in rows])

    def targets(self, rows: list[int], width: int) -> torch.Tensor:
        """(B,) class ids, (B, labels) 0/1 floats for multi-label data, or (B, width) token ids with
        -100 where the loss should not look."""
        if self.is_multi_label:
            return self.multi_hot(rows)
        if not self.is_token_task:
            return torch.tensor([self.label_ids[r] for r in rows], dtype=torch.long)
        out = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :self.lengths[r]] = torch.tensor(self.label_ids[r], dtype=torch.long)
        return out

    def multi_hot(self, rows: Sequence[int]) -> torch.Tensor:
        """(len(rows), labels) float32: 1 where the row carries the label."""
        out = torch.zeros(len(rows), len(self.labels))
        for i, r in enumerate(rows):
            out[i, self.label_ids[r]] = 1.0
        return out

    def batches(self, batch_size: int, shuffle: bool = False, rng: random.Random | None = None) -> list[list[int]]:
        """Rows grouped by similar length to cut padding (see `length_batches`)."""
        return length_batches(self.lengths, batch_size, shuffle, rng)


def padded_tokens(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Word pieces a batch of `rows` costs padded to its longest: what the progress of a pass in
    length order counts, since its batches grow longer and a count of rows or batches would promise
    the end far too soon."""
    return len(rows) * max(lengths[r] for r in rows)


def length_batches(lengths: Sequence[int], batch_size: int, shuffle: bool = False,
                   rng: random.Random | None = None) -> list[list[int]]:
    """Row indices grouped by similar length to cut padding. Not shuffled: sorted by length, cut
    into batches. Shuffled: random pools of 50 batches, each sorted by length, cut into batches,
    then the batches shuffled (new every epoch)."""
    order = list(range(len(lengths)))
    if not shuffle:
        order.sort(key=lengths.__getitem__)
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng = rng or random.Random(0)
    rng.shuffle(order)
    pool = batch_size * 50
    out = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lengths.__getitem__)
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


class RecomputedStates:
    """Run the backbone for every batch (no grad), yielding only the states the head reads."""

    def __init__(self, split: Split, layers: list[int]):
        self.split, self.layers = split, set(layers)
        self.upto = max(layers)

    def states(self, rows: list[int], batch: TokenBatch) -> Iterator[tuple[int, torch.Tensor]]:
        for index, hidden in self.split.backbone.stream(batch, upto=self.upto):
            if index in self.layers:
                # a normal tensor (not an inference-mode one) so autograd may save what it derives
                yield index, hidden.clone()


def free_memory() -> int | None:
    """Bytes of memory this process may still take: the kernel's MemAvailable, or less where a
    container's cgroup limit (v2, else v1) leaves less; None where neither can be read (not Linux)."""
    def read(path: str) -> int | None:
        try:
            text = Path(path).read_text().split()
        except OSError:
            return None
        return int(text[0]) if text and text[0].isdigit() else None

    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = read(limit), read(usage)
        if cap is not None and used is not None:
            free = min(free, max(cap - used, 0))
            break
    return free


class TokenStateCache:
    """Backbone states of every real token of a list of encoded inputs, computed once (no grad)
    and kept flat: one (total tokens + 1, H) tensor per state, row `starts[r] + t` holding token t
    of input r; the last row is all zeros and is what padded positions gather.

    Memory: total tokens x len(layers) x hidden size x 2 bytes in fp16 (SST-2 train, all 7 states
    of MiniLM: about 0.87M tokens -> 4.7 GB; one state -> 0.7 GB).

    `tensors` ({state: (total + 1, H)}) fills the cache from elsewhere (a file) instead of running
    `backbone`, which may then be None.
    """

    def __init__(self, backbone: Backbone | None, encoded: Sequence[EncodedInput], layers: Sequence[int],
                 batch_size: int = 128, dtype=torch.float16, device: torch.device | str = "cpu",
                 progress: bool = True, desc: str = "caching states",
                 tensors: dict[int, torch.Tensor] | None = None):
        self.layers, self.device = list(dict.fromkeys(layers)), torch.device(device)
        self.lengths = [len(e) for e in encoded]
        self.starts, total = [], 0
        for n in self.lengths:
            self.starts.append(total)
            total += n
        self.total = total
        self.padding_row = total  # an all-zero row that padded positions gather
        if tensors is not None:
            self.cache = {}
            for i in self.layers:
                if i not in tensors:
                    raise ValueError(f"state {i} is missing from the given tensors")
                if tensors[i].shape[0] != total + 1:
                    raise ValueError(f"state {i} has {tensors[i].shape[0]} rows, {total + 1} expected")
                self.cache[i] = tensors[i].to(self.device, dtype)
            return
        if backbone is None:
            raise ValueError("a backbone (or the tensors) is needed to fill the cache")
        self.cache = {i: torch.zeros(total + 1, backbone.hidden_size, dtype=dtype, device=self.device)
                      for i in self.layers}
        upto = max(self.layers)
        batches = length_batches(self.lengths, batch_size)
        total = sum(padded_tokens(self.lengths, rows) for rows in batches)
        with progress_of(total=total, bars=progress, desc=desc, unit="tok") as bar:
            for rows in batches:
                batch = backbone.collate([encoded[r] for r in rows])
                for index, hidden in backbone.stream(batch, upto=upto):
                    if index not in self.cache:
                        continue
                    hidden = hidden.to(self.device, dtype)
                    for i, r in enumerate(rows):
                        start, n = self.starts[r], self.lengths[r]
                        self.cache[index][start:start + n] = hidden[i, :n]
                bar.update(padded_tokens(self.lengths, rows))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache.values())

    def flat(self, index: int) -> torch.Tensor:
        """State `index` of every real token, (total tokens, H), in the cache's dtype (a view)."""
        return self.cache[index][:self.total]

    def gather_index(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """(B, width) flat row numbers of the tokens of `rows`, padded with the zero row."""
        gather = torch.full((len(rows), width), self.padding_row, dtype=torch.long)
        for i, r in enumerate(rows):
            n = self.lengths[r]
            gather[i, :n] = torch.arange(self.starts[r], self.starts[r] + n)
        return gather.to(self.device)

    def states(self, rows: Sequence[int], batch: TokenBatch,
               layers: Sequence[int] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """(state, (B, T, H) float32 on the batch's device) for `rows` padded as `batch` is."""
        gather = self.gather_index(rows, batch.seq_len)
        for index in (self.layers if layers is None else layers):
            yield index, self.cache[index][gather].to(batch.input_ids.device, torch.float32)


class CachedStates(TokenStateCache):
    """Every state the head reads, for every real token of the split, computed once in fp16.

    With `disk` (a folder), each state is also kept on disk as `<key>.state<i>.safetensors`, the key
    being the sha256 of the backbone's identity, its backend precision and the split's token ids:
    a later run on the same split (another head, the last-layer baseline) loads the states it needs
    and runs the backbone only for states not stored yet (up to the deepest missing one)."""

    def __init__(self, split: Split, layers: list[int], batch_size: int = 128, dtype=torch.float16,
                 device: torch.device | str = "cpu", progress: bool = True, desc: str = "caching states",
                 disk: Path | None = None):
        self.split = split
        layers = list(dict.fromkeys(layers))
        if disk is None:
            super().__init__(split.backbone, split.encoded, layers, batch_size, dtype, device, progress, desc)
            return
        prefix = Path(disk) / split_states_key(split)
        stored = {i: load_state_file(prefix, i) for i in layers}
        missing = [i for i in layers if stored[i] is None]
        if missing:
            computed = TokenStateCache(split.backbone, split.encoded, missing, batch_size, dtype, "cpu", progress, desc)
            for i in missing:
                stored[i] = computed.cache[i]
                save_state_file(prefix, i, computed.cache[i])
        super().__init__(None, split.encoded, layers, dtype=dtype, device=device, tensors=stored)


STATES_FORMAT = 1


def split_states_key(split: Split) -> str:
    """sha256 of what a split's states depend on: backbone identity, backend precision, token ids."""
    backbone = split.backbone
    digest = hashlib.sha256(json.dumps({
        "format": STATES_FORMAT, "backbone": list(backbone.fingerprint.identity()),
        "backend": backbone.backend.name, "precision": backbone.backend.precision,
    }).encode())
    for row in split.encoded:
        digest.update(json.dumps(row.ids).encode())
    return digest.hexdigest()


def load_state_file(prefix: Path, index: int) -> torch.Tensor | None:
    from safetensors.torch import load_file

    path = Path(f"{prefix}.state{index}.safetensors")
    if not path.is_file():
        return None
    try:
        return load_file(str(path))["state"]
    except Exception as exc:  # a damaged file is recomputed, whatever the damage
        log.warning("ignoring the state cache %s: %s (recomputing)", path, exc)
        return None


def save_state_file(prefix: Path, index: int, tensor: torch.Tensor) -> None:
    from safetensors.torch import save_file

    path = Path(f"{prefix}.state{index}.safetensors")
    write_cache_file(path, lambda tmp: save_file({"state": tensor.contiguous()}, tmp))

