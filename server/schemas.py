"""Request and response bodies of the HTTP API (the OpenAPI schema is generated from these)."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator


class TextPair(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: StrictStr
    text_pair: StrictStr


class AnswerControls(BaseModel):
    """Per-request answer controls (docs/answer-controls.md). Each applies to the task types it
    concerns and is ignored by the others; left out, answers are the defaults. OIP v2 takes the same
    names as request parameters."""

    model_config = ConfigDict(extra="forbid")
    top_k: int | None = Field(None, ge=1, strict=True, description="sequence and multi-label tasks: only the k best labels "
                              "in `scores`, best first (ties in label order); more than a task has gives all of them")
    raw_scores: StrictBool = Field(False, description="sequence and multi-label tasks: the head's logits in `score` "
                                   "and `scores` instead of probabilities (labels are chosen as without it)")
    threshold: float | None = Field(None, ge=0.0, le=1.0, description="multi-label tasks: a label is answered when its "
                                    "probability is at least this (default: the module's per-label thresholds); "
                                    "single-label tasks: label null (none of these) when the best probability is under "
                                    "this (default: the module's decoding.threshold, if any)")
    aggregation: Literal["first", "average", "max", "none"] | None = Field(
        None, description="token tasks: a word's label from its first piece's, the mean of its pieces' probabilities "
        "(average) or its most confident piece's (max), as Hugging Face's token-classification pipeline; none: every "
        "word piece with its own label, score and offsets (`tokens`) instead of entities. Default: the module's, else first")
    truncation_direction: Literal["right", "left"] = Field(
        "right", description="with truncate: cut the end (right) or the start (left) of an input that is too long")

    def options(self):
        """The controls decoding reads (server.heads.decode.AnswerOptions), or None for the defaults."""
        from server.heads.decode import AnswerOptions

        options = AnswerOptions(top_k=self.top_k, raw_scores=self.raw_scores, threshold=self.threshold,
                                aggregation=self.aggregation)
        return None if options.is_default() else options


class InferRequest(AnswerControls):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"inputs": ["Peter Blackburn flew to Brussels. A fine film."]}]},
    )
    inputs: list[Union[StrictStr, TextPair]] = Field(
        min_length=1, description="texts, or {text, text_pair} objects; not mixed in one request"
    )
    truncate: bool = Field(
        False, description="cut inputs longer than one window at the window's length (the first window) instead of "
                           "reading them whole in overlapping windows"
    )
    window: int | None = Field(None, ge=16, description="word pieces per window for this request (at most the "
                                                        "backbone's limit; default: GET /v1/tasks, `window`)")
    stride: int | None = Field(None, ge=1, description="how far each window starts after the one before, at least "
                                                       "window/8 (default: three quarters of the window)")

    @field_validator("inputs")
    @classmethod
    def _check_inputs(cls, inputs: list) -> list:
        if len({isinstance(item, str) for item in inputs}) > 1:
            raise ValueError("inputs must be all texts or all {text, text_pair} objects, not a mix")
        return inputs  # empty texts and limits are checked where every protocol shares them (app.py)


class ModelInfo(BaseModel):
    backbone: str
    fingerprint: str = Field(description="first 12 hex digits of the backbone weights hash")


class InferResponse(BaseModel):
    results: list[dict[str, dict[str, Any]]] = Field(description="one object per input, in input order, keyed by task")
    model: ModelInfo
    tasks: dict[str, str] = Field(description="task -> module version that answered")
    truncated: list[int] = Field(default_factory=list, description="indices of inputs that were cut to fit")
    windows: list[int] = Field(default_factory=list, description="per input, how many windows it was read in "
                                                                 "(1: read whole)")


class TaskInfo(BaseModel):
    task: str
    version: str
    kind: str
    task_type: str
    labels: list[str]
    layers: list[int]
    parameters: int
    metrics: dict[str, Any]
    backbone: dict[str, Any]
    description: str = ""
    inputs: str = Field("text", description="'text_pair': the task compares a text with a text pair (send "
                                            "{text, text_pair} objects); 'text': either form")
    served_through: dict[str, Any] | None = None  # a foreign module: the bridge and the chain of backbones
    windows: str | None = Field(None, description="how the windows of a long text become one answer "
                                                  "(server/windows.py RULES); null: such texts are refused")


class TaskDetail(TaskInfo):
    manifest: dict[str, Any]


class TaskList(BaseModel):
    tasks: list[TaskInfo]
    backbone: ModelInfo
    windows: dict[str, Any] = Field(default_factory=dict, description="how long texts are read: window and stride "
                                    "in word pieces, the overlap, the longest window a request may ask for, the "
                                    "rule combining windows per task type, and the default window of a request for each "
                                    "loaded task type (window_by_task_type: measured where docs/windows.md says)")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: Union[StrictStr, list[Union[StrictStr, TextPair]]] = Field(
        description="a text, a list of texts, or {text, text_pair} objects")
    add_special_tokens: bool = True
    window: int | None = Field(None, ge=16, description="as in /v1/infer")
    stride: int | None = Field(None, ge=1, description="as in /v1/infer")


class TeiTokenizeRequest(BaseModel):
    """Text Embeddings Inference's /tokenize body."""
    inputs: Union[StrictStr, list[StrictStr]]
    add_special_tokens: bool = True


class ModuleAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9_\-]{0,63}$",
                                description="store version; default: latest (load) or the loaded one (reload)")


class ModuleActionResult(BaseModel):
    task: str
    action: str
    version: str
    previous_version: str | None = None
