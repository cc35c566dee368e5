from server.backbone.backbone import Backbone
from server.backbone.sources import default_backbone_path
from server.backbone.tokens import EncodedInput, InputTooLong, TokenBatch

__all__ = ["Backbone", "InputTooLong", "EncodedInput", "TokenBatch", "default_backbone_path"]
