"""PyTorch eager: the model's own modules, one layer call per state."""
from __future__ import annotations

from typing import Iterator

import torch

from server.backbone.architectures import EncoderAdapter
from server.backbone.tokens import TokenBatch


class TorchBackend:
    name = "torch"
    precision = "fp32"

    def __init__(self, adapter: EncoderAdapter):
        self.adapter = adapter

    @torch.inference_mode()
    def stream(self, batch: TokenBatch, upto: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Only the state being handed out (and the next one while it is computed) is alive: the
        generator keeps no list, so each state is freed as soon as the consumer drops it."""
        hidden = self.adapter.embed(batch.input_ids, batch.token_type_ids)
        mask = self.adapter.mask(hidden, batch.attention_mask)
        yield 0, hidden
        for index in range(upto):
            hidden = self.adapter.run_layer(index, hidden, mask)
            yield index + 1, hidden

    def describe(self) -> dict:
        return {"backend": self.name, "precision": self.precision, "torch_threads": torch.get_num_threads()}
