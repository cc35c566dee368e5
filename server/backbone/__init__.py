from server.backbone.backbone import Backbone, InputTooLong, default_backbone_path
from server.backbone.tokens import EncodedInput, TokenBatch

__all__ = ["Backbone", "InputTooLong", "EncodedInput", "TokenBatch", "default_backbone_path"]
