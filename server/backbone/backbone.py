"""The frozen backbone: tokenize with offsets, then stream hidden states one layer at a time.

`stream(batch, upto)` yields `(index, hidden)` as each state is computed, through the backend the
backbone was given (server/backbone/backends/: torch, the reference, or ONNX Runtime, as TEI's
backend trait); `all_states(batch)` is the Hugging Face forward with every hidden state, the
reference the tests compare against; `fingerprint` identifies weights and tokenizer exactly (every
module manifest records it). Architectures plug in through architectures.py, models come from
sources.py, and tokens.py's `TextEncoder` is the one tokenize-with-offsets / collate path.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from modules_store import BackboneFingerprint
from server.backbone.architectures import adapter_for
from server.backbone.backends.torch_backend import TorchBackend
from server.backbone.sources import folder_problem, resolve_backbone
from server.backbone.tokens import EncodedInput, TextEncoder, TokenBatch


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
    """A Hugging Face encoder or decoder, frozen in eval mode, whose layers run one at a time.

    States are numbered 0..L: 0 is the embedding output, l is the output of layer l.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, name: str = ""):
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
        # RoBERTa and MPNet reserve positions for padding; stay within what the position table covers
        model_max -= 2 if self.config.model_type in ("roberta", "xlm-roberta", "mpnet") else 0
        tok_max = getattr(tokenizer, "model_max_length", model_max) or model_max
        self.max_tokens = min(model_max, tok_max)  # the most tokens one input may have
        self.device = next(self.model.parameters()).device
        self.text = TextEncoder(tokenizer, self.max_tokens, self.adapter.uses_token_types, self.device)
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
    def load(cls, path: str | Path | None = None, device: str = "cpu", name: str | None = None,
             cache_dir: Path | None = None) -> "Backbone":
        """A local Hugging Face folder, or a named offline backbone ('minilm', the default;
        'smollm2', 'mpnet'): see server/backbone/sources.py. Weights are computed in float32."""
        path, default_name = resolve_backbone(path, cache_dir)
        problem = folder_problem(path)
        if problem:
            raise FileNotFoundError(problem)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, config=config, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
        model.to(device)
        return cls(model, tokenizer, name=name or default_name)

    # ---- tokenization (TextEncoder: encode with offsets, collate into padded batches) ---------
    def tokenize(self, texts: Sequence[str], text_pairs: Sequence[str] | None = None,
                 truncate: bool = False, max_tokens: int | None = None) -> TokenBatch:
        return self.text.tokenize(texts, text_pairs, truncate, max_tokens)

    def encode(self, texts: Sequence[str], text_pairs: Sequence[str] | None = None,
               truncate: bool = False, max_tokens: int | None = None) -> list[EncodedInput]:
        return self.text.encode(texts, text_pairs, truncate, max_tokens)

    def collate(self, rows: Sequence[EncodedInput]) -> TokenBatch:
        return self.text.collate(rows)

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
        from server.backbone.architectures import is_decoder

        if name != "torch" and is_decoder(self.config):
            raise ValueError(f"backend {name!r} exports encoders only; {self.name} is a decoder (use backend torch)")
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
