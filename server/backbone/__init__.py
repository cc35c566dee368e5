from server.backbone.backbone import Backbone, InputTooLong, default_backbone_path
from server.backbone.tokens import TokenBatch

__all__ = ["Backbone", "InputTooLong", "TokenBatch", "default_backbone_path"]
