"""Request and response bodies of the HTTP API: one declaration each, from which `/openapi.json` is
generated.

The inference routes' bodies (`/v1/infer`, `/v1/tokenize`, `/tokenize`, and in embeddings.py
OpenAI's and TEI's) are msgspec structs: decoded and validated in one pass over the bytes
(`decode`), strictly typed (JSON `true`, not `"true"`; `1`, not `"1"`), answers encoded once. Their
JSON Schema comes from msgspec (`openapi_components`). The admin and task listing routes, answered
by FastAPI, keep pydantic models."""
from __future__ import annotations

import json
import re
import sys
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct
from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.errors import CLIP, ApiError, did_you_mean

REF_TEMPLATE = "#/components/schemas/{name}"


class TextPair(Struct, forbid_unknown_fields=True):
    text: str
    text_pair: str


Window = Annotated[int, Meta(ge=16, description="word pieces per window for this request (at most the backbone's "
                                                 "limit; default: GET /v1/tasks, `window`)")]
Stride = Annotated[int, Meta(ge=1, description="how far each window starts after the one before, at least window/8 "
                                                "(default: three quarters of the window)")]


class AnswerControls(Struct, forbid_unknown_fields=True):
    """Per-request answer controls (docs/answer-controls.md). Each applies to the task types it
    concerns and is ignored by the others; left out, answers are the defaults. OIP v2 takes the same
    names as request parameters."""

    top_k: Annotated[Union[Annotated[int, Meta(ge=1)], None], Meta(description=(
        "sequence and multi-label tasks: only the k best labels in `scores`, best first (ties in label order); more "
        "than a task has gives all of them"))] = None
    raw_scores: Annotated[bool, Meta(description=(
        "sequence and multi-label tasks: the head's logits in `score` and `scores` instead of probabilities (labels "
        "are chosen as without it)"))] = False
    threshold: Annotated[Union[Annotated[float, Meta(ge=0.0, le=1.0)], None], Meta(description=(
        "multi-label tasks: a label is answered when its probability is at least this (default: the module's "
        "per-label thresholds); single-label tasks: label null (none of these) when the best probability is under "
        "this (default: the module's decoding.threshold, if any)"))] = None
    aggregation: Annotated[Union[Literal["first", "average", "max", "none"], None], Meta(description=(
        "token tasks: a word's label from its first piece's, the mean of its pieces' probabilities (average) or its "
        "most confident piece's (max), as Hugging Face's token-classification pipeline; none: every word piece with "
        "its own label, score and offsets (`tokens`) instead of entities. Default: the module's, else first"))] = None
    truncation_direction: Annotated[Literal["right", "left"], Meta(description=(
        "with truncate: cut the end (right) or the start (left) of an input that is too long"))] = "right"

    def options(self):
        """The controls decoding reads (server.heads.decode.AnswerOptions), or None for the defaults."""
        if (self.top_k is None and not self.raw_scores and self.threshold is None
                and self.aggregation is None):  # the defaults (most requests): no object made and compared
            return None
        from server.heads.decode import AnswerOptions

        options = AnswerOptions(top_k=self.top_k, raw_scores=self.raw_scores, threshold=self.threshold,
                                aggregation=self.aggregation)
        return None if options.is_default() else options


DEFAULT_CONTROLS = AnswerControls()


class InferRequest(AnswerControls, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/infer`'s body, e.g. {"inputs": ["Peter Blackburn flew to Brussels. A fine film."]}."""
    inputs: Annotated[list[Union[str, TextPair]], Meta(
        min_length=1, description="texts, or {text, text_pair} objects; not mixed in one request")]
    truncate: Annotated[bool, Meta(description="cut inputs longer than one window at the window's length (the first "
                                               "window) instead of reading them whole in overlapping windows")] = False
    window: Union[Window, None] = None
    stride: Union[Stride, None] = None

    def __post_init__(self):
        check_one_form(self.inputs, "inputs")
        # empty texts and limits are checked where every protocol shares them (server/api/serving.py)


def check_one_form(items: list, field: str) -> None:
    """A request's texts are all texts or all {text, text_pair} pairs: pairs and single texts are read by
    different tasks (ValueError, msgspec's refusal of the body naming `field`)."""
    first = isinstance(items[0], str)
    if any(isinstance(item, str) != first for item in items):
        raise ValueError(f"{field} must be all texts or all {{text, text_pair}} objects, not a mix")


class ModelInfo(Struct):
    backbone: str
    fingerprint: Annotated[str, Meta(description="first 12 hex digits of the backbone weights hash")]


class InferResponse(Struct):
    results: Annotated[list[dict[str, dict[str, Any]]], Meta(description="one object per input, in input order, "
                                                                         "keyed by task")]
    model: ModelInfo
    tasks: Annotated[dict[str, str], Meta(description="task -> module version that answered")]
    truncated: Annotated[list[int], Meta(description="indices of inputs that were cut to fit")]
    windows: Annotated[list[int], Meta(description="per input, how many windows it was read in (1: read whole)")]


class TokenizeRequest(Struct, forbid_unknown_fields=True):
    inputs: Annotated[Union[str, list[Union[str, TextPair]]], Meta(
        description="a text, a list of texts, or {text, text_pair} objects")]
    add_special_tokens: bool = True
    window: Union[Window, None] = None
    stride: Union[Stride, None] = None


# Text Embeddings Inference's request fields, as its routes read them
TEIDirection = Annotated[Literal["left", "right", "Left", "Right"], Meta(
    description="with truncate: cut the end (right) or the start (left) of an input that is too long")]
PromptName = Annotated[Union[str, None], Meta(description="refused: no prompts are configured")]


class TeiTokenizeRequest(Struct, forbid_unknown_fields=True):
    """Text Embeddings Inference's /tokenize body."""
    inputs: Union[str, list[str]]
    add_special_tokens: bool = True
    prompt_name: PromptName = None


class TeiDecodeRequest(Struct, forbid_unknown_fields=True):
    """Text Embeddings Inference's /decode body: word piece ids, one list or a list per text."""
    ids: Annotated[list[Union[int, list[int]]], Meta(description="ids of one text, or a list of them per text")]
    skip_special_tokens: bool = True


class VllmTokenizeRequest(Struct, forbid_unknown_fields=True):
    """vLLM's /tokenize body (its completion form), e.g. {"prompt": "A fine film."}."""
    prompt: Union[str, None] = None
    model: Union[str, None] = None
    add_special_tokens: bool = True
    return_token_strs: Annotated[bool, Meta(description="each id's word piece as the vocabulary spells it")] = False
    messages: Annotated[Union[list, None], Meta(description="refused: no chat template (send prompt)")] = None

    def __post_init__(self):
        if self.messages is not None:
            raise ValueError("chat messages are not tokenized here (an encoder has no chat template): send `prompt`")
        if self.prompt is None:
            raise ValueError("Object missing required field `prompt`")


class VllmTokenizeResponse(Struct):
    count: int
    max_model_len: Annotated[int, Meta(description="the most word pieces the backbone reads in one row (a longer "
                                                   "text is read in windows)")]
    tokens: list[int]
    token_strs: Union[list[str], None] = None


class BodyProbe(Struct):
    """The fields a route serving two protocols' bodies reads to choose one (`probe`), undecoded: TEI's
    root (`inputs` an object: similarity; Hugging Face's `parameters` beside a text: classification),
    /rerank (TEI's `texts` or vLLM's `documents`), /tokenize (vLLM's `prompt` or chat `messages`, or
    TEI's `inputs`)."""
    inputs: msgspec.Raw = msgspec.Raw(b"")
    parameters: msgspec.Raw = msgspec.Raw(b"")
    texts: msgspec.Raw = msgspec.Raw(b"")
    documents: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    messages: msgspec.Raw = msgspec.Raw(b"")

    def has(self, field: str) -> bool:
        return bool(bytes(getattr(self, field)))


def probe(body: bytes) -> BodyProbe:
    """`body`'s choosing fields (none where it is no JSON object: the route's default protocol refuses it)."""
    try:
        return msgspec.json.decode(body, type=BodyProbe)
    except msgspec.DecodeError:
        return BodyProbe()


class VllmDetokenizeRequest(Struct, forbid_unknown_fields=True):
    """vLLM's /detokenize body, e.g. {"tokens": [101, 1037, 2986, 2143, 1012, 102]}."""
    tokens: list[int]
    model: Union[str, None] = None


class VllmDetokenizeResponse(Struct):
    prompt: str


class RepositoryIndexRequest(Struct):
    """Triton's repository index body (`{}` or none: every model; other fields, as Triton's own, ignored)."""
    ready: bool = False


class RepositoryChangeRequest(Struct):
    """Triton's repository load / unload body (`{}` or none; `parameters` as tritonclient sends them)."""
    parameters: dict[str, Any] = {}


# ---- decoding: one pass, and the messages a client reads ------------------------------------------------
_DECODERS: dict[type, msgspec.json.Decoder] = {}
_HUGE_INTEGER = re.compile(rb"[0-9]{%d}" % (sys.get_int_max_str_digits() + 1))


def decode(kind: type, body: bytes, malformed_status: int = 422):
    """`body` as a `kind` (a msgspec struct), or ApiError: `malformed_status` naming the field and what
    was wrong with it (413 for JSON nested too deeply). Only a refused body is read a second time, by
    Python's own parser, so that what is not JSON at all is called what it is."""
    decoder = _DECODERS.get(kind) or _DECODERS.setdefault(kind, msgspec.json.Decoder(kind))
    try:
        decoded = decoder.decode(body)
        if kind.__struct_config__.forbid_unknown_fields or not _HUGE_INTEGER.search(body):
            return decoded
        refused = None  # a field it ignores holds an integer Python's parser refuses: refused as before
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        refused = exc
    if not body.strip():
        raise ApiError(malformed_status, "invalid_request", "request is malformed: body: no body (send a JSON object)",
                       problems=[{"location": "body", "message": "no body"}])
    try:
        parsed = json.loads(body)
    except RecursionError:
        raise ApiError(413, "payload_too_large", "request body is JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise ApiError(malformed_status, "invalid_request", "request body is not valid UTF-8 encoded JSON") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            raise ApiError(malformed_status, "invalid_request", "request body has an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits") from None
        raise malformed(malformed_status, "body", f"not valid JSON: {exc}") from None
    if refused is None:  # the digits were inside a string: nothing refused
        return decoded
    if isinstance(refused, msgspec.DecodeError):  # JSON msgspec does not read (a lone surrogate escape): Python's reading
        try:
            return msgspec.convert(parsed, kind, strict=True)
        except msgspec.ValidationError as exc:
            refused = exc
    text, _, where = str(refused).partition(" - at `")
    where = where.rstrip("`").removeprefix("$").removeprefix(".").replace("][", ".").replace("[", ".").replace("]", "")
    where = where.lstrip(".") or "body"
    hint = HINTS.get((kind.__name__, re.sub(r"\.[0-9]+", ".*", where), text))
    if hint is None and text.startswith("Invalid enum value") and (choices := literal_values(kind, where)):
        hint = "expected one of " + ", ".join(map(repr, choices))
    said = f" ({hint})" if hint else ""
    if not hint and (unknown := UNKNOWN_FIELD.fullmatch(text)):  # `topk` for `top_k`: the likely one
        said = did_you_mean([unknown[1]], field_names(kind, where))
    raise malformed(malformed_status, where, text + said)


UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.*)`")


def field_names(kind: type, where: str) -> list[str]:
    """The field names of the object at `where` (a dotted location; "body" the body itself)."""
    info = type_at(kind, where)
    return [] if info is None else [f.encode_name for option in _options(info)
                                    if isinstance(option, msgspec.inspect.StructType) for f in option.fields]


def literal_values(kind: type, where: str) -> list | None:
    """The values the field at `where` (a dotted location: `aggregation`, `inputs.0.datatype`) takes
    when its type is a Literal, so that "Invalid enum value 'simple'" can say what is valid."""
    info = type_at(kind, where)
    values = [v for option in _options(info) if isinstance(option, msgspec.inspect.LiteralType) for v in option.values]
    return values or None


def type_at(kind: type, where: str):
    """msgspec's type info of the value at `where` in a `kind` body ("body": the body itself, as
    `decode` names that location), or None."""
    info: Any = msgspec.inspect.type_info(kind)
    for part in where.split(".") if where != "body" else ():
        for option in _options(info):
            if isinstance(option, msgspec.inspect.StructType):
                info = next((f.type for f in option.fields if f.encode_name == part), None)
            elif isinstance(option, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)) and part.isdigit():
                info = option.item_type
            elif isinstance(option, msgspec.inspect.DictType):
                info = option.value_type
            else:
                continue
            break
        else:
            return None
    return info


def _options(info) -> list:
    """A type's alternatives (a Union's members, else itself), without Annotated's metadata."""
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    members = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return [m.type if isinstance(m, msgspec.inspect.Metadata) else m for m in members]


# the first mistakes of a newcomer, and what to send instead: (body kind's name, location with any list
# index as *, msgspec's message)
SEND_INPUTS = 'send {"inputs": ["...", ...]}'


def _a_list(field: str) -> str:
    return f'send a list, even of one text: {{"{field}": ["..."]}}'


def _a_pair(field: str) -> str:
    return f'a text alone is a string, "{field}": ["..."]; an object is a pair: {{"text": "...", "text_pair": "..."}}'


PAIR_MISSING = "Object missing required field `text_pair`"
HINTS = {
    ("InferRequest", "body", "Object contains unknown field `tasks`"):
        "tasks are named in the query string: /v1/infer?tasks=ner,emotion",
    ("InferRequest", "inputs", "Expected `array`, got `str`"): _a_list("inputs"),
    ("InferRequest", "body", "Object contains unknown field `input`"):
        f"/v1/infer reads `inputs`, not `input` (that is /v1/embeddings'): {SEND_INPUTS}",
    ("InferRequest", "body", "Object contains unknown field `text`"): SEND_INPUTS,
    ("InferRequest", "body", "Object missing required field `inputs`"): SEND_INPUTS,
    ("InferRequest", "body", "Expected `object`, got `array`"): f"the list goes under `inputs`: {SEND_INPUTS}",
    ("InferRequest", "inputs.*", PAIR_MISSING): _a_pair("inputs"),
    ("PredictRequest", "instances.*", PAIR_MISSING): _a_pair("instances"),
    ("PredictRequest", "inputs.*", PAIR_MISSING): _a_pair("inputs"),
    ("PredictRequest", "instances", "Expected `array | null`, got `str`"): _a_list("instances"),
    ("PredictRequest", "inputs", "Expected `array | null`, got `str`"): _a_list("inputs"),
    # the two embedding APIs' one-letter difference
    ("OpenAIEmbeddingRequest", "body", "Object contains unknown field `inputs`"):
        "OpenAI's /v1/embeddings reads `input`; `inputs` is TEI's /embed",
    ("TEIEmbedRequest", "body", "Object contains unknown field `input`"):
        "TEI's /embed reads `inputs`; `input` is OpenAI's /v1/embeddings",
}


def malformed(status: int, location: str, message: str) -> ApiError:
    location, message = location[:CLIP], message[:200]
    return ApiError(status, "invalid_request", f"request is malformed: {location}: {message}",
                    problems=[{"location": location, "message": message}])


def openapi_components(*kinds: type) -> tuple[dict[type, dict], dict[str, dict]]:
    """({kind: its schema, a $ref where it is a struct}, the components they refer to) for /openapi.json."""
    schemas, components = msgspec.json.schema_components(kinds, ref_template=REF_TEMPLATE)
    return dict(zip(kinds, schemas)), components


def request_body(kind: type) -> dict:
    """A FastAPI route's `openapi_extra`: its JSON body is `kind` (a msgspec struct, in the components)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}}}}


# ---- the routes FastAPI answers --------------------------------------------------------------------------
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
    manifest: dict[str, Any] = Field(description="the module's manifest without its `training` record (the command, "
                                     "files, store and machine it was trained with: the store's manifest.json keeps it)")


class TaskList(BaseModel):
    tasks: list[TaskInfo]
    backbone: dict[str, str] = Field(description="the backbone's name and fingerprint, as `model` in /v1/infer's answer")
    windows: dict[str, Any] = Field(default_factory=dict, description="how long texts are read: window and stride "
                                    "in word pieces, the overlap, the longest window a request may ask for, the "
                                    "rule combining windows per task type, and the default window of a request for each "
                                    "loaded task type (window_by_task_type: measured where docs/windows.md says)")


class OpenAIModel(BaseModel):
    id: str = Field(description="what /v1/embeddings takes as `model`")
    object: Literal["model"] = "model"
    created: int = Field(description="when this server started (Unix seconds): the modules carry no date of their own")
    owned_by: str = "tmod"


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


def numbered_version(value):
    """A version sent as a JSON number (`2`, how a person writes a numbered one) as the store names it
    ("2"); anything else as it came (true is no version: refused as such)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else value


class ModuleAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9_\-]{0,63}$",
                                description="store version (a numbered one also as a JSON number: 2 is \"2\"); "
                                            "default: latest (load) or the loaded one (reload)")

    @field_validator("version", mode="before")
    @classmethod
    def _numbered(cls, value):
        return numbered_version(value)


class ModuleActionResult(BaseModel):
    task: str
    action: str
    version: str
    previous_version: str | None = None


class AdminModules(BaseModel):
    store: str = Field(description="the module store this server loads from, as an absolute path on its machine")
    backbone: dict[str, str] = Field(description="the backbone's name and fingerprint: a module loads only if "
                                     "trained on the same")
    tasks: dict[str, str] = Field(description="each served task's version")
    modules_of: dict[str, str] = Field(description="the backbones whose modules this server can load: its own and "
                                       "those a loaded bridge leads to, each fingerprint with the backbone's name")
    api_key: bool = Field(False, description="whether inference routes need `Authorization: Bearer <key>` "
                          "(--api-key / TMOD_API_KEY): the request `tmod-train --load-into` prints sends it")
    not_served: dict[str, str] = Field(default_factory=dict, description="tasks of the store that start-up left "
                                       "out, each with why (an opt-in module, or none for this backbone) and how to "
                                       "serve it; /readyz's `refused` lists those whose artifact failed its checks")

