"""Layer-mix heads of one width k run as one computation (serving only: eval mode, no dropout).

`MixGroup` keeps one stacked running buffer (B, T, K, k) for its K heads: per state one GELU, one
matmul against the heads' concatenated projections (centred, so that the layer norm's mean is
already subtracted), one norm per token and head and one weighted add, whatever K is. At the end
its heads' classifiers run stacked too: heads whose classifiers have the same shape
(`classifier_shape`) form a `SequenceStack` or a `TokenStack`, whose weights carry a leading head
dimension and run as batched matrix products (baddbmm) and one attention call over all of them. Label
counts may differ: classifier rows are padded with zeros (server/heads/stacking.py) and each head's
logits are sliced back. Positional and casing embeddings are stacked with zero rows for heads without them
(adding 0 changes nothing).

Everything that depends only on the heads is built here, once per plan; per batch there are no
host syncs and no tensors made from Python values, so a pass can be captured as a CUDA graph.
"""
from __future__ import annotations

from itertools import groupby

import torch
import torch.nn.functional as F

from modules_store import TaskType
from server.backbone.tokens import CASING_CLASSES, TokenBatch
from server.heads.layermix.layer import MIX_NORM_EPS, pool
from server.heads.layermix.model import LayerMixHead
from server.heads.stacking import batched_linear, linear_stack, padded_classifiers, stack


def classifier_shape(head: LayerMixHead) -> tuple:
    """Heads with equal shapes stack: sequence heads by attention heads; token heads also by
    encoder layers, feed-forward width and layer-norm eps."""
    c = head.config
    if c.task_type == TaskType.token_classification:
        return ("token", c.attention_heads, c.encoder_layers, c.ffn_dim, head.classifier.encoder[0].norm1.eps)
    return ("sequence", c.attention_heads if c.attention else 0, c.pooling)


class StackedAttention:
    """K nn.MultiheadAttention layers (self-attention, key padding mask) as one computation."""

    def __init__(self, layers: list[torch.nn.MultiheadAttention]):
        self.heads = layers[0].num_heads
        self.in_weight = stack([m.in_proj_weight for m in layers])  # (K, 3k, k): q, k, v
        self.in_bias = stack([m.in_proj_bias for m in layers]).unsqueeze(1)
        self.out_weight, self.out_bias = linear_stack([m.out_proj for m in layers])

    def __call__(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """x (K, B, T, k), attend (B, T) bool (True = a real token) -> (K, B*T, k)."""
        K, B, T, k = x.shape
        qkv = batched_linear(x.view(K, B * T, k), self.in_weight, self.in_bias)
        # (K*B, heads, T, d) views
        q, keys, values = qkv.view(K * B, T, 3, self.heads, k // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attention = fused_attention if x.device.type == "cuda" else small_attention
        attended = attention(q, keys, values, attend, K)  # (K*B, heads, T, d)
        return batched_linear(attended.transpose(1, 2).reshape(K, B * T, k), self.out_weight, self.out_bias)


def fused_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor,
                    K: int) -> torch.Tensor:
    """Self-attention on a GPU, (K*B, heads, T, d) -> same: PyTorch's fused kernel (SDPA), the padding
    mask as booleans (True = a real key) shared by the K heads."""
    B, T = attend.shape
    mask = attend.view(1, B, 1, T).expand(K, B, 1, T).reshape(K * B, 1, 1, T)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def small_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor,
                    K: int) -> torch.Tensor:
    """Self-attention for the CPU, (K*B, heads, T, d) -> same, as three batched products (scores with
    the padding mask added, softmax, values), in float32. Heads' attention is tiny (d = 16, T ~ 50):
    there SDPA's fused CPU kernel took 1.7x this, and bfloat16 products 1.8x (scratch measurement,
    8 heads x 32 rows x 47 tokens, one thread)."""
    KB, heads, T, d = q.shape
    with torch.autocast("cpu", enabled=False):
        q, keys, values = (t.float().reshape(KB * heads, T, d) for t in (q, keys, values))
        blocked = torch.zeros(attend.shape, dtype=q.dtype, device=q.device).masked_fill_(~attend, float("-inf"))
        blocked = blocked.view(1, -1, 1, 1, T).expand(K, -1, heads, 1, T).reshape(KB * heads, 1, T)
        scores = torch.baddbmm(blocked, q, keys.transpose(1, 2), alpha=d ** -0.5)
        return torch.bmm(scores.softmax(-1), values).view(KB, heads, T, d)


class StackedLayerNorm:
    def __init__(self, norms: list[torch.nn.LayerNorm]):
        self.eps = norms[0].eps
        self.weight = stack([m.weight for m in norms]).unsqueeze(1)  # (K, 1, k)
        self.bias = stack([m.bias for m in norms]).unsqueeze(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.bias, F.layer_norm(x, x.shape[-1:], eps=self.eps), self.weight)


class ClassifierStack:
    """What sequence and token stacks share: their heads, and the mix turned into the classifier's
    input (GELU, then positional and casing embeddings)."""

    def __init__(self, tasks: list[str], heads: list[LayerMixHead], start: int):
        self.tasks, self.start, self.stop = tasks, start, start + len(heads)
        self.num_labels = [head.config.num_labels for head in heads]
        k = heads[0].config.project_dim
        self.positions = None
        if any(head.positions is not None for head in heads):
            # heads clamp positions at their own max_positions - 1: repeat each table's last row up
            # to the longest table, and clamp at that one
            longest = max(head.config.max_positions for head in heads if head.positions is not None)
            tables = []
            for head in heads:
                table = (head.positions.weight.detach() if head.positions is not None
                         else heads[0].projections.new_zeros(1, k))
                tail = table[-1:] if head.positions is not None else table
                tables.append(torch.cat([table, tail.expand(longest - len(table), k)]))
            self.positions = torch.stack(tables)  # (K, P, k)
        self.casing = None
        if any(head.casing is not None for head in heads):
            self.casing = stack([head.casing.weight if head.casing is not None
                                 else heads[0].projections.new_zeros(CASING_CLASSES, k) for head in heads])

    def inputs(self, mix: torch.Tensor, casing: torch.Tensor | None) -> torch.Tensor:
        """mix (K, B, T, k) -> GELU(mix) + positional + casing embeddings."""
        mixed = F.gelu(mix)
        if self.positions is not None:
            T = mixed.shape[2]
            positions = torch.arange(T, device=mixed.device).clamp(max=self.positions.shape[1] - 1)
            mixed = mixed + self.positions[:, positions].unsqueeze(1)
        if self.casing is not None:
            mixed = mixed + self.casing[:, casing]
        return mixed

    def split(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """(K, B[, T], C_max) -> each head's (B[, T], C) logits."""
        return {task: logits[j, ..., :labels] for j, (task, labels) in enumerate(zip(self.tasks, self.num_labels))}


class SequenceStack(ClassifierStack):
    """K `SequenceClassifier`s of one shape: self-attention and GELU (unless off), masked mean (or
    pair pooling), linear."""

    def __init__(self, tasks: list[str], heads: list[LayerMixHead], start: int):
        super().__init__(tasks, heads, start)
        attention = heads[0].classifier.attention is not None
        self.attention = StackedAttention([head.classifier.attention for head in heads]) if attention else None
        self.weight, self.bias = padded_classifiers([head.classifier.classifier for head in heads])
        self.pair = heads[0].config.pooling == "pair"

    def __call__(self, mix: torch.Tensor, batch: TokenBatch, casing: torch.Tensor | None) -> dict:
        K, B, T, k = mix.shape
        mask = batch.attention_mask
        attended = self.inputs(mix, casing)
        if self.attention is not None:
            attended = F.gelu(self.attention(attended, mask.bool())).view(K, B, T, k)
        pooled = pool(attended, mask, batch.token_classes("segment") if self.pair else None)  # (K, B, k or 4k)
        return self.split(batched_linear(pooled, self.weight, self.bias))


class TokenStack(ClassifierStack):
    """K `TokenClassifier`s: pre-LN encoder layer(s), then a linear per token."""

    def __init__(self, tasks: list[str], heads: list[LayerMixHead], start: int):
        super().__init__(tasks, heads, start)
        self.layers = []
        for depth in range(heads[0].config.encoder_layers):
            layers = [head.classifier.encoder[depth] for head in heads]
            self.layers.append((
                StackedLayerNorm([m.norm1 for m in layers]), StackedAttention([m.self_attn for m in layers]),
                StackedLayerNorm([m.norm2 for m in layers]), linear_stack([m.linear1 for m in layers]),
                linear_stack([m.linear2 for m in layers]),
            ))
        self.weight, self.bias = padded_classifiers([head.classifier.classifier for head in heads])

    def __call__(self, mix: torch.Tensor, batch: TokenBatch, casing: torch.Tensor | None) -> dict:
        K, B, T, k = mix.shape
        attend = batch.attention_mask.bool()
        x = self.inputs(mix, casing)
        for norm1, attention, norm2, (w1, b1), (w2, b2) in self.layers:
            x = x.view(K, B * T, k)
            x = x + attention(norm1(x).view(K, B, T, k), attend)
            x = x + batched_linear(F.gelu(batched_linear(norm2(x), w1, b1)), w2, b2)
        return self.split(batched_linear(x, self.weight, self.bias).view(K, B, T, -1))


def centred(projection: torch.Tensor) -> torch.Tensor:
    """W (k, H) minus the mean of its k rows."""
    return projection - projection.mean(0, keepdim=True)


# Weights are quantised to [-64, 64], not [-127, 127]: on an x86 CPU without VNNI (AVX2, and AVX-512
# before Cascade Lake) oneDNN's int8 product shifts the int8 activations to uint8 [0, 255] and sums each
# pair of uint8 x int8 products into int16 with saturation (vpmaddubsw). 2 * 255 * 64 = 32,640 fits
# int16, so no pair saturates and the int32 product is exact on every x86 CPU, as it is with VNNI.
WEIGHT_LEVELS = 64


class Int8Projection:
    """x @ W^T as an int8 x int8 -> int32 product (`head_precision int8`). On this CPU (AVX-512
    VNNI, one thread) the product ran 8x the fp32 one at 1504 tokens x 384 -> 1024 (1.3 vs 12.2 ms,
    scratch measurement).

    W is quantised once, one symmetric scale per row, onto [-64, 64] (`WEIGHT_LEVELS`: the product
    is then exact on CPUs without VNNI too). x is quantised per token onto its own [min, max] range
    (256 levels), with a zero point: GELU's outputs lie in [-0.17, max], where a symmetric range
    would leave most negative codes unused. With x ~ s (q + 128) + lo,

        x W^T ~ s * (q W_q^T * row scales + (128 + lo / s) * W's row sums),

    an int8 product plus one rank-1 correction. The token's scale s is returned, not applied: the
    layer norm that follows divides per-token scalars out, so `MixGroup.consume` folds s into the
    norm's eps. Tried on the shipped MiniLM modules' validation sets (docs/gpu.md, int8 heads): these
    7-bit weights keep every module within the accuracy rule; 7-bit activations (129 levels, the
    other way to avoid the saturation) lost one RTE example beside a bf16 backbone (0.36 points,
    outside it), as a symmetric activation range did before.
    """

    def __init__(self, weight: torch.Tensor):
        scale = weight.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / WEIGHT_LEVELS
        quantised = torch.round(weight / scale[:, None]).to(torch.int8)
        self.weight = quantised.T  # (H, N): a view, as fast as a copy
        self.scale = scale.float()
        # integer sums (exact) times the scale: the correction for a constant token cancels exactly
        self.row_sums = quantised.sum(1, dtype=torch.int32).float() * self.scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., H) -> (x W^T / s (..., N), the token scales s (..., 1))."""
        shape, x = x.shape[:-1], x.float().flatten(0, -2)  # (tokens, H): _int_mm takes 2-D operands
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # (torch.aminmax ran 9x slower)
        token_scale = ((high - low) / 255).clamp_(min=1e-12)  # a constant token: q = -128, all in the correction
        quantised = (x - low).div_(token_scale).round_().sub_(128).to(torch.int8)
        product = torch._int_mm(quantised, self.weight) * self.scale  # (tokens, N)
        product.addr_((low / token_scale).add_(128).squeeze(-1), self.row_sums)
        return product.view(*shape, -1), token_scale.view(*shape, 1)


class MixGroup:
    """Layer-mix heads sharing k, run as one: the mix, then their classifiers stacked."""

    def __init__(self, tasks: list[str], heads: list[LayerMixHead], int8: bool = False):
        # order the heads so that each classifier stack is a contiguous range of the buffer
        order = sorted(range(len(heads)), key=lambda j: classifier_shape(heads[j]))
        self.tasks, self.heads = [tasks[j] for j in order], [heads[j] for j in order]
        heads = self.heads
        self.k = heads[0].config.project_dim
        self.steps: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = {}
        weights = [head.mix_weights().detach() for head in heads]
        for index in sorted({i for head in heads for i in head.layers_read()}):
            members = [j for j, head in enumerate(heads) if index in head.layers_read()]
            # each head's rows centred: x W^T minus its mean over k is x (W - mean_rows W)^T, so the
            # layer norm's mean is folded into the weights and only its scale is left per batch
            projection = torch.cat([centred(heads[j].projection(index).detach()) for j in members], dim=0)
            layer_weight = torch.stack([weights[j][heads[j]._slot[index]] for j in members])
            rows = None if len(members) == len(heads) else torch.tensor(members, device=projection.device)
            if int8:
                projection = Int8Projection(projection)
            self.steps[index] = (rows, projection, layer_weight.view(-1, 1))
        self.layers = sorted(self.steps)
        self.stacks: list[ClassifierStack] = []
        for shape, members in groupby(range(len(heads)), key=lambda j: classifier_shape(heads[j])):
            members = list(members)
            kind = TokenStack if shape[0] == "token" else SequenceStack
            self.stacks.append(kind([self.tasks[j] for j in members], [heads[j] for j in members], members[0]))
        self.reads_casing = any(s.casing is not None for s in self.stacks)

    def start(self, batch: TokenBatch) -> None:
        return None  # the buffer is made on the first state, with its shape

    def consume(self, buffer: torch.Tensor | None, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Add this state's weighted terms to the (B, T, K, k) buffer (made on the first state)."""
        rows, projection, layer_weight = self.steps[index]
        if isinstance(projection, Int8Projection):
            # LN(s * x) = x / sqrt(mean(x^2) + eps / s^2) for the token's scale s
            projected, token_scale = projection(F.gelu(hidden))
            eps = MIX_NORM_EPS / token_scale.square().unsqueeze(-1)  # (B, T, 1, 1)
        else:
            projected = (F.gelu(hidden) @ projection.T).float()  # a 16-bit product (autocast) cast once
            eps = MIX_NORM_EPS
        projected = projected.unflatten(-1, (-1, self.k))  # (B, T, K_index, k), centred
        # LN of a centred vector is x / sqrt(mean(x^2) + eps): one norm per (token, head), then one
        # multiply-add into the buffer, instead of F.layer_norm's passes over the whole tensor
        # (layer norm at width 64 cost more than the GELU, the norm and the add together on the CPU)
        norm = torch.linalg.vector_norm(projected, dim=-1, keepdim=True)
        scale = torch.rsqrt(norm.square_().div_(self.k).add_(eps)).mul_(layer_weight)
        if buffer is None:
            buffer = hidden.new_zeros(*hidden.shape[:2], len(self.heads), self.k)
        if rows is None:
            buffer.addcmul_(projected, scale)  # buffer += w * LN(projected)
        else:
            buffer.index_add_(2, rows, projected * scale)
        return buffer

    def finish(self, buffer: torch.Tensor, batch: TokenBatch) -> dict[str, torch.Tensor]:
        casing = batch.token_classes("casing") if self.reads_casing else None
        stacked = buffer.permute(2, 0, 1, 3).contiguous()  # (K, B, T, k): one head after another
        out = {}
        for s in self.stacks:
            out.update(s(stacked[s.start:s.stop], batch, casing))
        return out
