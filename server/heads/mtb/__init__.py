from server.heads.mtb.config import MTBConfig
from server.heads.mtb.model import MTBHead
from server.heads.registry import register_head

register_head("mtb", MTBHead)

__all__ = ["MTBConfig", "MTBHead"]
