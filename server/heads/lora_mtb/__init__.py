from server.heads.lora_mtb.config import DEFAULT_TARGETS, LoraMTBConfig
from server.heads.lora_mtb.model import LoraMTBHead
from server.heads.registry import register_head

register_head("lora-mtb", LoraMTBHead)

__all__ = ["DEFAULT_TARGETS", "LoraMTBConfig", "LoraMTBHead"]
