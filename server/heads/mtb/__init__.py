"""MTB heads (Modular Transformer Blocks): copies of the backbone's last block(s) appended after the
state before them, plus a task layer (and, where configured, a casing embedding added to the blocks'
input). They read one state, so they share the backbone pass with every other head; grouped.py runs
those reading one state as one `BlockGroup`.
"""
from server.heads.mtb.config import MTBConfig
from server.heads.mtb.model import MTBHead
from server.heads.registry import register_head

register_head("mtb", MTBHead)

__all__ = ["MTBConfig", "MTBHead"]
