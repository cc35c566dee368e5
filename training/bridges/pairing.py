"""Paired states: the same texts run through two backbones, for training or fitting bridges.

A bridge is served on one backbone (the *source*) and stands in for another (the *target*, the
one the foreign modules were trained on). Fitting one needs both backbones' states on the same
inputs. `PairedStates.build` encodes every text with each backbone's own tokenizer, runs each
backbone once (no grad) and keeps the listed states of every real token in fp16, flat per state
(`training.states.TokenStateCache`, as `CachedStates` does), then saves both to a disk cache
keyed by the texts, both backbones' identities and the layers, so the next run loads them.

The tokenizers differ, so token i of one side is not token i of the other. `source_batch` /
`target_batch` give each side's padded batch with its own ids and offsets, and `token_pairs`
lines the two sides up by character offsets: one row per target token (or per whitespace word),
its source row the mean of the source tokens that overlap it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from modules_store import BackboneFingerprint
from server.backbone import Backbone, EncodedInput, TokenBatch
from server.backbone.sources import default_cache_dir
from server.backbone.tokens import TextEncoder
from training.progress import progress_of
from training.runs import write_cache_file
from training.states import TokenStateCache, length_batches

log = logging.getLogger("tmod")

CACHE_FORMAT = 1
POOLS = ("token", "word")


def texts_sha256(texts: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode()).hexdigest()


def paired_key(texts: Sequence[str], source: BackboneFingerprint, target: BackboneFingerprint,
               source_layers: Sequence[int], target_layers: Sequence[int]) -> str:
    """sha256 of (texts, both fingerprints' identity, layers): the paired cache's file name."""
    record = {"format": CACHE_FORMAT, "texts": texts_sha256(texts), "source": list(source.identity()),
              "target": list(target.identity()), "source_layers": list(source_layers),
              "target_layers": list(target_layers)}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _trimmed_spans(encoded: EncodedInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, sequence ids) of every token, spans trimmed of whitespace (byte-level BPE
    offsets include a token's leading space); special tokens and empty spans get sequence id -1."""
    n = len(encoded)
    starts, ends, seqs = np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64)
    for t, ((a, b), seq) in enumerate(zip(encoded.offsets, encoded.sequence_ids)):
        if seq is None:
            continue
        text = encoded.text if seq == 0 else (encoded.text_pair or "")
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if b > a:
            starts[t], ends[t], seqs[t] = a, b, seq
    return starts, ends, seqs


def _overlaps(a_start, a_end, a_seq, b_start, b_end, b_seq) -> np.ndarray:
    """(len a, len b) bool: same sequence, both real, character spans overlap."""
    return ((a_start[:, None] < b_end[None, :]) & (b_start[None, :] < a_end[:, None])
            & (a_seq[:, None] == b_seq[None, :]) & (a_seq[:, None] >= 0) & (b_seq[None, :] >= 0))


def _words(encoded: EncodedInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, sequence ids) of the whitespace-separated words of an input's text(s)."""
    found = [(m.start(), m.end(), 0) for m in re.finditer(r"\S+", encoded.text)]
    if encoded.text_pair is not None:
        found += [(m.start(), m.end(), 1) for m in re.finditer(r"\S+", encoded.text_pair)]
    arr = np.array(found, dtype=np.int64).reshape(-1, 3)
    return arr[:, 0], arr[:, 1], arr[:, 2]


def _without_names(meta: dict) -> dict:
    """Cache metadata less the backbones' display names (informational, not part of the key)."""
    out = dict(meta)
    for side in ("source", "target"):
        if isinstance(out.get(side), dict):
            out[side] = {k: v for k, v in out[side].items() if k != "name"}
    return out


class Pooling:
    """How flat token rows of each side pool into aligned rows: row g of the output is the mean
    of source rows `source_index[source_group == g]` (likewise for the target)."""

    def __init__(self, source_group, source_index, target_group, target_index, rows: int):
        self.rows = rows
        self.source_group, self.source_index = torch.as_tensor(source_group), torch.as_tensor(source_index)
        self.target_group, self.target_index = torch.as_tensor(target_group), torch.as_tensor(target_index)

    @staticmethod
    def pool(flat: torch.Tensor, group: torch.Tensor, index: torch.Tensor, rows: int,
             chunk: int = 1 << 17) -> torch.Tensor:
        out = torch.zeros(rows, flat.shape[1], dtype=torch.float32)
        for s in range(0, len(index), chunk):
            out.index_add_(0, group[s:s + chunk], flat[index[s:s + chunk]].float())
        counts = torch.bincount(group, minlength=rows).clamp(min=1).to(torch.float32)
        return out / counts[:, None]


class PairedStates:
    """Both backbones' states on the same texts. Build with `PairedStates.build`."""

    def __init__(self, texts: list[str], source_text: TextEncoder, target_text: TextEncoder,
                 source_encoded: list[EncodedInput], target_encoded: list[EncodedInput],
                 source_cache: TokenStateCache, target_cache: TokenStateCache,
                 source_fingerprint: BackboneFingerprint, target_fingerprint: BackboneFingerprint,
                 path: Path | None = None):
        self.texts = texts
        self.source_text, self.target_text = source_text, target_text
        self.source_encoded, self.target_encoded = source_encoded, target_encoded
        self.source_cache, self.target_cache = source_cache, target_cache
        self.source_fingerprint, self.target_fingerprint = source_fingerprint, target_fingerprint
        self.source_layers, self.target_layers = list(source_cache.layers), list(target_cache.layers)
        self.source_hidden, self.target_hidden = source_fingerprint.hidden_size, target_fingerprint.hidden_size
        self.source_lengths, self.target_lengths = source_cache.lengths, target_cache.lengths
        self.path = path  # the disk cache it came from / went to, if any
        self._poolings: dict[str, Pooling] = {}

    def __len__(self) -> int:
        return len(self.texts)

    # ---- building and the disk cache ---------------------------------------------------------
    @classmethod
    def build(cls, texts: list[str], source: Backbone, target: Backbone, source_layers: list[int],
              target_layers: list[int], cache_dir: Path | None = None, batch_size: int = 64,
              progress: bool = True, cache: bool = True) -> "PairedStates":
        """Encode `texts` with each backbone (truncating to its limit), run each once and keep the
        listed states of real tokens in fp16. With `cache`, load from / save to
        `<cache_dir>/paired/<key>.safetensors` (+ `<key>.json`); cache_dir defaults to
        server.backbone.sources.default_cache_dir()."""
        texts = list(texts)
        source_layers, target_layers = sorted(set(source_layers)), sorted(set(target_layers))
        for name, backbone, layers in (("source", source, source_layers), ("target", target, target_layers)):
            if not layers or layers[0] < 0 or layers[-1] > backbone.num_layers:
                raise ValueError(f"{name} layers {layers} outside 0..{backbone.num_layers} of {backbone.name}")
        source_encoded = source.encode(texts, truncate=True)
        target_encoded = target.encode(texts, truncate=True)
        key = paired_key(texts, source.fingerprint, target.fingerprint, source_layers, target_layers)
        folder = Path(cache_dir or default_cache_dir()) / "paired"
        path, meta_path = folder / f"{key}.safetensors", folder / f"{key}.json"
        meta = {
            "format": CACHE_FORMAT, "texts_sha256": texts_sha256(texts), "count": len(texts),
            "source": {"identity": list(source.fingerprint.identity()), "name": source.name,
                       "layers": source_layers, "lengths": [len(e) for e in source_encoded]},
            "target": {"identity": list(target.fingerprint.identity()), "name": target.name,
                       "layers": target_layers, "lengths": [len(e) for e in target_encoded]},
        }
        if cache and path.is_file() and meta_path.is_file():
            loaded = cls._load(path, meta_path, meta, source_encoded, target_encoded, source_layers, target_layers)
            if loaded is not None:
                log.info("paired states loaded from %s", path)
                src_cache, tgt_cache = loaded
                return cls(texts, source.text, target.text, source_encoded, target_encoded, src_cache, tgt_cache,
                           source.fingerprint, target.fingerprint, path)
        src_cache = TokenStateCache(source, source_encoded, source_layers, batch_size, progress=progress,
                                    desc=f"source states ({source.name})")
        tgt_cache = TokenStateCache(target, target_encoded, target_layers, batch_size, progress=progress,
                                    desc=f"target states ({target.name})")
        saved = cache and cls._save(path, meta_path, meta, src_cache, tgt_cache)
        return cls(texts, source.text, target.text, source_encoded, target_encoded, src_cache, tgt_cache,
                   source.fingerprint, target.fingerprint, path if saved else None)

    @staticmethod
    def _save(path: Path, meta_path: Path, meta: dict, src: TokenStateCache, tgt: TokenStateCache) -> bool:
        from safetensors.torch import save_file

        tensors = {f"source.{i}": t.contiguous() for i, t in src.cache.items()}
        tensors.update({f"target.{i}": t.contiguous() for i, t in tgt.cache.items()})
        saved = write_cache_file(path, lambda tmp: save_file(tensors, tmp, metadata={"format": str(CACHE_FORMAT)})) \
            and write_cache_file(meta_path, lambda tmp: Path(tmp).write_text(json.dumps(meta) + "\n"))
        if saved:
            log.info("paired states saved to %s", path)
        return saved

    @staticmethod
    def _load(path, meta_path, meta, source_encoded, target_encoded, source_layers, target_layers):
        """The two caches from disk, or None (logged) when the files do not match this request."""
        from safetensors.torch import load_file

        try:
            stored = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring the paired cache %s: unreadable metadata (%s)", meta_path, exc)
            return None
        if _without_names(stored) != _without_names(meta):
            log.warning("ignoring the paired cache %s: its metadata does not match (recomputing)", meta_path)
            return None
        try:
            tensors = load_file(str(path))
            src = TokenStateCache(None, source_encoded, source_layers,
                                  tensors={i: tensors[f"source.{i}"] for i in source_layers})
            tgt = TokenStateCache(None, target_encoded, target_layers,
                                  tensors={i: tensors[f"target.{i}"] for i in target_layers})
        except Exception as exc:  # a damaged cache is recomputed, whatever the damage
            log.warning("ignoring the paired cache %s: %s (recomputing)", path, exc)
            return None
        return src, tgt

    # ---- batches -----------------------------------------------------------------------------
    def source_batch(self, rows: Sequence[int]) -> tuple[TokenBatch, dict[int, torch.Tensor]]:
        """The source backbone's padded batch of `rows` and its cached states {state: (B, T_s, H_s)}
        (float32, zeros at padding)."""
        batch = self.source_text.collate([self.source_encoded[r] for r in rows])
        return batch, dict(self.source_cache.states(rows, batch))

    def target_batch(self, rows: Sequence[int]) -> tuple[TokenBatch, dict[int, torch.Tensor]]:
        """The target backbone's padded batch of `rows` (target ids and offsets) and its states."""
        batch = self.target_text.collate([self.target_encoded[r] for r in rows])
        return batch, dict(self.target_cache.states(rows, batch))

    def batches(self, batch_size: int, shuffle: bool = False, rng: random.Random | None = None) -> list[list[int]]:
        """Rows grouped by similar length (the longer side of each pair), like Split.batches."""
        lengths = [max(a, b) for a, b in zip(self.source_lengths, self.target_lengths)]
        return length_batches(lengths, batch_size, shuffle, rng)

    # ---- rows aligned by characters ----------------------------------------------------------
    def pooling(self, pool: str = "token", progress: bool = False) -> Pooling:
        """Which flat source/target rows make each aligned row (computed once per `pool`).

        token: one row per real target token with a non-empty span; its source side is the mean
        of the source tokens of the same sequence whose spans overlap it (targets no source token
        overlaps are dropped). word: one row per whitespace-separated word that tokens of both
        sides overlap; each side the mean of its tokens overlapping the word.
        """
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, not {pool!r}")
        if pool in self._poolings:
            return self._poolings[pool]
        sg, si, tg, ti = [], [], [], []
        rows = 0
        for r in progress_of(range(len(self)), bars=progress, desc=f"aligning {pool}s", unit="ex"):
            s_enc, t_enc = self.source_encoded[r], self.target_encoded[r]
            s_start, s_end, s_seq = _trimmed_spans(s_enc)
            t_start, t_end, t_seq = _trimmed_spans(t_enc)
            s_base, t_base = self.source_cache.starts[r], self.target_cache.starts[r]
            if pool == "token":
                ov = _overlaps(t_start, t_end, t_seq, s_start, s_end, s_seq)  # (T_t, T_s)
                kept = np.flatnonzero(ov.any(axis=1))
                group = np.full(len(t_start), -1, np.int64)
                group[kept] = rows + np.arange(len(kept))
                t_rows, s_cols = np.nonzero(ov)
                sg.append(group[t_rows])
                si.append(s_base + s_cols)
                tg.append(group[kept])
                ti.append(t_base + kept)
            else:
                w_start, w_end, w_seq = _words(s_enc)
                ov_s = _overlaps(w_start, w_end, w_seq, s_start, s_end, s_seq)  # (W, T_s)
                ov_t = _overlaps(w_start, w_end, w_seq, t_start, t_end, t_seq)  # (W, T_t)
                kept = np.flatnonzero(ov_s.any(axis=1) & ov_t.any(axis=1))
                group = np.full(len(w_start), -1, np.int64)
                group[kept] = rows + np.arange(len(kept))
                ov_s, ov_t = ov_s[kept], ov_t[kept]
                w, c = np.nonzero(ov_s)
                sg.append(group[kept][w])
                si.append(s_base + c)
                w, c = np.nonzero(ov_t)
                tg.append(group[kept][w])
                ti.append(t_base + c)
            rows += len(kept)
        cat = (lambda parts: torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long))
        self._poolings[pool] = Pooling(cat(sg), cat(si), cat(tg), cat(ti), rows)
        return self._poolings[pool]

    def token_pairs(self, source_layers: int | list[int], target_layer: int,
                    pool: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
        """(X (N, H_s), Y (N, H_t)) float32, row n of both describing the same characters (see
        `pooling`). A list of source layers is averaged (AVG mapping)."""
        layers = [source_layers] if isinstance(source_layers, int) else list(source_layers)
        missing = [i for i in layers if i not in self.source_cache.cache]
        if missing or target_layer not in self.target_cache.cache:
            raise ValueError(f"states not paired: source {missing or ''} target "
                             f"{'' if target_layer in self.target_cache.cache else target_layer}; "
                             f"paired are source {self.source_layers}, target {self.target_layers}")
        p = self.pooling(pool)
        x = None
        for i in layers:
            pooled = Pooling.pool(self.source_cache.flat(i), p.source_group, p.source_index, p.rows)
            x = pooled if x is None else x.add_(pooled)
        x /= len(layers)
        y = Pooling.pool(self.target_cache.flat(target_layer), p.target_group, p.target_index, p.rows)
        return x, y
