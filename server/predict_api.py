"""KServe's V1 data plane (TensorFlow Serving's REST API): `POST /v1/models/<task>:predict`, what the
`kserve` package's REST client sends by default (its protocol "v1"), answered by one tmod task.

Request `{"instances": [...]}` (or `{"inputs": [...]}`, KServe's other name): texts, or
`{"text", "text_pair"}` objects for a pair task; tmod's `truncate` and answer controls as on
/v1/infer. Answer `{"predictions": [...]}`: per instance, the task's answer as /v1/infer gives it
(`label` / `score` / `scores`, `labels`, `entities`, `embedding`). Errors as KServe's servers give
them, the message in `error`. Liveness is V1's too (`GET /`: `{"status": "alive"}`), but not model
readiness: `GET /v1/models/<name>` is OpenAI's model object of an embedding model, and a task there
is answered 404 naming V2's `GET /v2/models/<task>/ready`. `:explain` is refused: tmod has no
explainer. One request runs one task: /v1/infer runs several in one pass.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Union

import msgspec
from msgspec import Meta, Struct

from server.errors import ApiError
from server.schemas import AnswerControls, TextPair, decode

PREDICT = re.compile(r"/v1/models/([^/]+):(predict|explain)")
Instances = Annotated[list[Union[str, TextPair]], Meta(
    min_length=1, description="texts, or {text, text_pair} objects for a pair task; not mixed in one request")]


class PredictRequest(AnswerControls, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/models/<task>:predict`'s body, e.g. {"instances": ["A fine film."]}."""
    instances: Union[Instances, None] = None
    inputs: Annotated[Union[Instances, None], Meta(description="KServe's other name for `instances`")] = None
    truncate: Annotated[bool, Meta(description="cut inputs longer than one window at the window's length instead of "
                                               "reading them whole in overlapping windows")] = False

    def __post_init__(self):
        if (self.instances is None) == (self.inputs is None):
            raise ValueError('send the texts as "instances" (or "inputs"), one of the two: {"instances": ["..."]}')
        items = self.items()
        if any(isinstance(item, str) != isinstance(items[0], str) for item in items):
            raise ValueError("instances must be all texts or all {text, text_pair} objects, not a mix")

    def items(self) -> list:
        return self.instances if self.instances is not None else self.inputs


class PredictResponse(Struct):
    predictions: Annotated[list[dict[str, Any]], Meta(description="per instance, in order, the task's answer as "
                                                                  "/v1/infer gives it")]


def predict_route(require_ready: Callable[[], None], module_of, fit_to_inputs, run_inference):
    """handler(body, request, task, verb) -> (answer bytes, headers), for the app's raw ASGI layer.
    `module_of(task)`: the served module, else 404 naming the loaded ones (OIP's lookup: one model, one task)."""

    async def predict(body: bytes, request, task: str, verb: str) -> tuple[bytes, dict]:
        require_ready()
        module = module_of(task)
        if verb == "explain":
            raise ApiError(501, "not_implemented", f"{task!r} has no explainer: tmod answers "
                           f"POST /v1/models/{task}:predict, not :explain")
        asked = decode(PredictRequest, body, 400)
        items = asked.items()
        pairs = not isinstance(items[0], str)
        fit_to_inputs({task: module}, pairs, named=True)  # a pair task on single texts, an embedding on pairs: 422
        texts = [item.text for item in items] if pairs else items
        results, _, headers = await run_inference(texts, [item.text_pair for item in items] if pairs else None,
                                                  {task: module}, asked.truncate, request, controls=asked)
        return msgspec.json.encode(PredictResponse([r[task] for r in results])), headers

    return predict
