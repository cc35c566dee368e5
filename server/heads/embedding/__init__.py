"""Embedding heads: the backbone's own sentence vector (mean, CLS or max pooling over one state,
server/heads/pooling.py), normalised as the model's sentence-transformers configuration says; no
weights. Output (B, D + 1): the vector and its norm before normalisation. Served by /v1/infer,
server/api/embeddings.py (OpenAI /v1/embeddings, TEI /embed) and OIP (docs/EMBEDDINGS.md).
"""
from server.heads.embedding.config import EmbeddingConfig, sentence_transformers_settings, vector_size
from server.heads.embedding.model import EmbeddingHead
from server.heads.registry import register_head

register_head("embedding", EmbeddingHead)

__all__ = ["EmbeddingConfig", "EmbeddingHead", "sentence_transformers_settings", "vector_size"]
