"""Layer-mix heads (Dremov): `F = GELU(sum_i w_i LN(GELU(Z_i) W_i^T))`, `w = cutoff(softmax(alpha p))`.

The head keeps one (B, T, k) running buffer; states whose weight the cutoff zeroed are not in
`layers_read()` and are never projected. Sequence tasks: one self-attention layer, masked mean,
linear; pair tasks (`pooling: pair`) pool the text's and the pair's tokens apart (u, v) and classify
[u, v, |u - v|, u * v]. Token tasks: pre-LN encoder layer(s), linear. Optional learned positional
embeddings and a casing embedding read from the raw text through token offsets. grouped.py runs the
layer-mix heads of one plan as one `MixGroup`.
"""
from server.heads.layermix.config import LayerMixConfig
from server.heads.layermix.model import LayerMixHead
from server.heads.registry import register_head

register_head("layermix", LayerMixHead)

__all__ = ["LayerMixConfig", "LayerMixHead"]
