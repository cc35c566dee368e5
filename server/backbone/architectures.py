"""Per-architecture access to a Hugging Face model's embedding step and its layer list.

Streaming needs three things from a model: embed the tokens, build the attention mask the layers
expect, and call one layer. Encoders (BERT, RoBERTa, DistilBERT, MiniLM, ...) all fit the same
adapter; a decoder (Llama/GPT-2 style) would add one here with a causal mask and rotary/position
arguments, and register it in ADAPTERS.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask


class EncoderAdapter:
    """Bidirectional encoders whose layers take (hidden_states, attention_mask)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        if hasattr(model, "encoder") and hasattr(model.encoder, "layer"):  # BERT, RoBERTa, ...
            self.layers = model.encoder.layer
            self._takes_token_types = True
        elif hasattr(model, "transformer") and hasattr(model.transformer, "layer"):  # DistilBERT
            self.layers = model.transformer.layer
            self._takes_token_types = False
        else:
            raise ValueError(f"unsupported encoder layout: {type(model).__name__}")
        self.uses_token_types = self._takes_token_types and getattr(self.config, "type_vocab_size", 0) > 0

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        if self._takes_token_types:
            return self.model.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return self.model.embeddings(input_ids)

    def mask(self, embedded: torch.Tensor, attention_mask: torch.Tensor):
        return create_bidirectional_mask(config=self.config, inputs_embeds=embedded, attention_mask=attention_mask)

    def run_layer(self, index: int, hidden: torch.Tensor, mask) -> torch.Tensor:
        return run_block(self.layers[index], hidden, mask)


ADAPTERS: dict[str, Callable[[nn.Module], EncoderAdapter]] = {
    "bert": EncoderAdapter,
    "roberta": EncoderAdapter,
    "xlm-roberta": EncoderAdapter,
    "distilbert": EncoderAdapter,
}


def adapter_for(model: nn.Module) -> EncoderAdapter:
    model_type = model.config.model_type
    if model_type not in ADAPTERS:
        raise ValueError(f"backbone model_type {model_type!r} is not supported; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type](model)


# The class of one layer per model type, so a head can rebuild backbone blocks (MTB) from the
# backbone's config alone, as recorded in its manifest.
LAYER_CLASSES = {
    "bert": ("transformers.models.bert.modeling_bert", "BertLayer"),
    "roberta": ("transformers.models.roberta.modeling_roberta", "RobertaLayer"),
    "xlm-roberta": ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaLayer"),
    "distilbert": ("transformers.models.distilbert.modeling_distilbert", "TransformerBlock"),
}


def block_config(hf_config: dict):
    """A transformers config object from a manifest's dict, with the attention kernel we serve."""
    from transformers import AutoConfig

    values = dict(hf_config)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    return config


def build_block(config) -> nn.Module:
    import importlib

    if config.model_type not in LAYER_CLASSES:
        raise ValueError(f"no transformer block class for model_type {config.model_type!r}")
    module, name = LAYER_CLASSES[config.model_type]
    return getattr(importlib.import_module(module), name)(config)


def run_block(block: nn.Module, hidden: torch.Tensor, mask) -> torch.Tensor:
    out = block(hidden, mask)
    return out[0] if isinstance(out, tuple) else out
