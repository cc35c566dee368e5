from server.heads.embedding.config import EmbeddingConfig, sentence_transformers_settings, vector_size
from server.heads.embedding.model import EmbeddingHead
from server.heads.registry import register_head

register_head("embedding", EmbeddingHead)

__all__ = ["EmbeddingConfig", "EmbeddingHead", "sentence_transformers_settings", "vector_size"]
