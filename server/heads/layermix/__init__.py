from server.heads.layermix.config import LayerMixConfig
from server.heads.layermix.model import LayerMixHead
from server.heads.registry import register_head

register_head("layermix", LayerMixHead)

__all__ = ["LayerMixConfig", "LayerMixHead"]
