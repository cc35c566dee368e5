"""Per-architecture access to a Hugging Face model's embedding step and its layer list.

Streaming needs three things from a model: embed the tokens, build what the layers need besides
the hidden states (a `BlockContext`: the attention mask, plus rotary position embeddings for a
decoder, the relative position bias for MPNet), and call one layer. Encoders (BERT, RoBERTa,
DistilBERT, MiniLM, ...) share `EncoderAdapter`; MPNet uses `MPNetAdapter` (its layers take a
relative position bias that the model computes once per forward: here once per batch); Llama-style
decoders (SmolLM2) use `DecoderAdapter` with a causal mask. The MTB head rebuilds blocks from a
config alone and runs them through the same `block_context` / `run_block` pair, with the position
module of `positions_for` (rotary embeddings; MPNet's relative position table, copied from the backbone).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

DECODER_TYPES = ("llama",)


def is_decoder(config) -> bool:
    return config.model_type in DECODER_TYPES


class BlockContext:
    """What a block call needs besides the hidden states, built once per batch."""

    def __init__(self, mask, position_embeddings=None, position_ids=None, position_bias=None):
        self.mask, self.position_embeddings, self.position_ids = mask, position_embeddings, position_ids
        self.position_bias = position_bias  # MPNet: (B, heads, T, T) added to the attention scores

    def run(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.position_bias is not None:  # MPNet: (hidden_states, attention_mask, position_bias)
            out = block(hidden, self.mask, self.position_bias)
        elif self.position_embeddings is None:  # encoders: (hidden_states, attention_mask) positionally
            out = block(hidden, self.mask)
        else:
            out = block(hidden, attention_mask=self.mask, position_embeddings=self.position_embeddings,
                        position_ids=self.position_ids)
        return out[0] if isinstance(out, tuple) else out


class RelativePositionBias(nn.Module):
    """MPNet's relative position bias: (T, T) bucket ids of key - query positions (made once per
    length and device: HF makes them per forward and, in some versions, on the CPU, a copy a captured
    CUDA graph cannot hold), looked up in a (buckets, heads) table that the encoder owns, not its
    layers. The backbone's adapter wraps the encoder's own table; an MTB head holds a frozen copy."""

    def __init__(self, table: nn.Embedding, num_buckets: int):
        super().__init__()
        self.table, self.num_buckets = table, num_buckets
        self._buckets: dict[tuple[int, str], torch.Tensor] = {}

    def buckets(self, length: int, device: torch.device) -> torch.Tensor:
        from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

        key = (length, str(device))
        if key not in self._buckets:
            positions = torch.arange(length, dtype=torch.long)
            relative = positions[None, :] - positions[:, None]  # memory - context, as HF
            self._buckets[key] = MPNetEncoder.relative_position_bucket(relative, num_buckets=self.num_buckets).to(device)
        return self._buckets[key]

    def context(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> BlockContext:
        """The bias summed with the additive padding mask, so each layer adds one tensor instead of
        two (exact where a key is real: mask 0; where it is padding both are ~float32 min)."""
        bias = self.table(self.buckets(hidden.shape[1], hidden.device)).permute(2, 0, 1).unsqueeze(0)  # (1, heads, T, T)
        # the additive padding mask of HF's eager attention (MPNet has no SDPA path): 0 / float32 min
        padding = (1.0 - attention_mask[:, None, None, :].to(bias.dtype)) * torch.finfo(bias.dtype).min
        return BlockContext(None, position_bias=bias + padding)


def positions_for(config) -> nn.Module | None:
    """What blocks of this architecture need besides their own weights to run: a decoder's rotary
    embeddings (buffers only), MPNet's relative position table (zeros here: `copy_positions` fills it
    from the backbone, an artifact's weights load it; it never trains), or nothing."""
    if is_decoder(config):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(config=config)
    if config.model_type == "mpnet":
        table = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
        table.weight.requires_grad_(False)
        return RelativePositionBias(table, config.relative_attention_num_buckets)
    return None


def copy_positions(positions: nn.Module | None, adapter) -> None:
    """Fill a head's position module from the backbone's (MPNet's table; rotary has no weights)."""
    if isinstance(positions, RelativePositionBias):
        with torch.no_grad():
            positions.table.weight.copy_(adapter.positions.table.weight)


def block_context(config, hidden: torch.Tensor, attention_mask: torch.Tensor,
                  positions: nn.Module | None = None) -> BlockContext:
    """Bidirectional mask for encoders; MPNet's relative position bias with the padding mask folded
    in; causal mask and rotary embeddings for decoders (padding is on the right, so positions are
    0..T-1 for every row). `positions` is the module `positions_for(config)` makes."""
    if config.model_type == "mpnet":
        if not isinstance(positions, RelativePositionBias):
            raise ValueError("MPNet blocks need the encoder's relative position table (positions_for / copy_positions)")
        return positions.context(hidden, attention_mask)
    # imported here, not at the top: transformers.masking_utils imports torch._dynamo (~1/3 of a worker
    # process's start-up), and HTTP workers, which tokenize but never run a block, import this module
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    if not is_decoder(config):
        return BlockContext(create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask))
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    # no cache, given by position: its keyword is past_key_values to transformers 5.23, cache from 5.24
    # (which warns of the old name, removed in 5.40)
    mask = create_causal_mask(config, hidden, attention_mask, None, position_ids=position_ids)
    return BlockContext(mask, positions(hidden, position_ids=position_ids), position_ids)


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
        from transformers.masking_utils import create_bidirectional_mask  # why here: block_context

        return create_bidirectional_mask(config=self.config, inputs_embeds=embedded, attention_mask=attention_mask)

    def run_layer(self, index: int, hidden: torch.Tensor, mask) -> torch.Tensor:
        return run_block(self.layers[index], hidden, mask)


class MPNetAdapter:
    """MPNet (all-mpnet-base-v2): BERT-like post-LN layers whose attention scores get a relative
    position bias. The Hugging Face encoder computes that bias (a bucketed table lookup, the same for
    every layer) once per forward; here `RelativePositionBias` computes it once per batch into the
    `BlockContext`, already summed with the additive padding mask. Positions are counted from the
    left (0..T-1 for every row, padding on the right), as in HF. MPNet has no token types; its
    embeddings number positions from the token ids (pad id 1)."""

    uses_token_types = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.layers = model.encoder.layer
        self.positions = RelativePositionBias(model.encoder.relative_attention_bias,
                                              self.config.relative_attention_num_buckets)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        return self.model.embeddings(input_ids=input_ids)

    def mask(self, embedded: torch.Tensor, attention_mask: torch.Tensor) -> BlockContext:
        return block_context(self.config, embedded, attention_mask, self.positions)

    def run_layer(self, index: int, hidden: torch.Tensor, context: BlockContext) -> torch.Tensor:
        return context.run(self.layers[index], hidden)


class DecoderAdapter:
    """Llama-style causal decoders (SmolLM2): token embeddings, then blocks with a causal mask and
    rotary position embeddings. State L is the last block's raw output (the final RMSNorm, which
    only the language-model head needs, is not applied), like every other state."""

    uses_token_types = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.layers = model.layers
        self.positions = model.rotary_emb

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def mask(self, embedded: torch.Tensor, attention_mask: torch.Tensor) -> BlockContext:
        return block_context(self.config, embedded, attention_mask, self.positions)

    def run_layer(self, index: int, hidden: torch.Tensor, context: BlockContext) -> torch.Tensor:
        return context.run(self.layers[index], hidden)


ADAPTERS: dict[str, Callable[[nn.Module], EncoderAdapter | MPNetAdapter | DecoderAdapter]] = {
    "bert": EncoderAdapter,
    "roberta": EncoderAdapter,
    "xlm-roberta": EncoderAdapter,
    "distilbert": EncoderAdapter,
    "mpnet": MPNetAdapter,
    "llama": DecoderAdapter,
}


def adapter_for(model: nn.Module) -> EncoderAdapter | MPNetAdapter | DecoderAdapter:
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
    "mpnet": ("transformers.models.mpnet.modeling_mpnet", "MPNetLayer"),
    "llama": ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"),
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
    cls = getattr(importlib.import_module(module), name)
    return cls(config, layer_idx=0) if is_decoder(config) else cls(config)


def run_block(block: nn.Module, hidden: torch.Tensor, mask) -> torch.Tensor:
    """One block call; `mask` is a BlockContext, or an encoder's attention mask tensor (the ONNX
    export passes the mask as a graph input)."""
    context = mask if isinstance(mask, BlockContext) else BlockContext(mask)
    return context.run(block, hidden)
