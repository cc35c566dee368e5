"""vLLM's classification API, `POST /classify` (and `POST /v1/classify`, where SGLang serves it): what
a client of vLLM's or SGLang's pooling server sends a classifier, answered by one tmod task.

Request `{"model": <task>, "input": "text" | ["text", ...]}` (`user` accepted and unused; tmod's
`truncate` as on /v1/embeddings); `model` may be left out when one such task is loaded. Answer
`{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs", "num_classes"}],
"usage"}`: `probs` in the order of the task's labels (GET /v1/tasks/<task>), `label` tmod's answer
(null where the module's "none of these" threshold says so). Single-label tasks on single texts
only, as vLLM's classifiers: a multi-label, token, embedding or pair task is refused with the route
that answers it. Errors in OpenAI's shape, as vLLM's. One request runs one task: /v1/infer runs
several in one pass.
"""
from __future__ import annotations

import secrets
import time
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

from modules_store import TaskType
from server.api.embeddings import PoolingUsage, as_texts
from server.api.schemas import decode
from server.api.serving import Serving
from server.errors import ApiError, clip, not_loaded
from server.modules import compares_pairs


class ClassifyRequest(Struct, forbid_unknown_fields=True):
    """vLLM's /classify body, e.g. {"model": "acceptability", "input": ["The cat sat.", "Cat the sat."]}."""
    input: Annotated[Union[str, list[Union[str, int, list[int]]]], Meta(
        description="a text or a list of texts (token arrays are refused: send text)")]
    model: Annotated[Union[str, None], Meta(
        description="a single-label task's name (GET /v1/tasks); optional when one is loaded")] = None
    user: Union[str, None] = None
    truncate: Annotated[bool, Meta(description="tmod extension: cut inputs over the model's token limit instead of "
                                               "413")] = False


class ClassifyData(Struct):
    index: int
    label: Annotated[Union[str, None], Meta(description="the answer; null: none of the labels reaches the module's "
                                                        "threshold")]
    probs: Annotated[list[float], Meta(description="each label's probability, in the order of the task's labels")]
    num_classes: int


class ClassifyResponse(Struct):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage


KINDS = {TaskType.multi_label_classification: "a multi-label", TaskType.token_classification: "a token",
         TaskType.embedding: "an embedding", TaskType.regression: "a regression"}


def classifiers(modules: dict) -> list[str]:
    """The tasks /classify answers: single-label classification of single texts."""
    return sorted(task for task, m in modules.items()
                  if m.manifest.task_type == TaskType.sequence_classification and not compares_pairs(m.manifest))


def classify_module(modules: dict, model: str | None, runtime=None):
    """The task `model` names (or the only classifier loaded); 404 model_not_found for a name not
    loaded (saying why, where `runtime` refused it or left it out), 400 for a task /classify does not
    answer, saying which route does."""
    choices = classifiers(modules)
    if model is None:
        if len(choices) == 1:
            return modules[choices[0]]
        raise ApiError(400, "invalid_request", f"name the task in 'model': one of {choices}", param="model")
    module = modules.get(model)
    if module is None:
        why = not_loaded([model], runtime.load_errors, runtime.skipped) if runtime is not None else ""
        raise ApiError(404, "model_not_found", f"no model {clip(model)}{why}; /classify answers {choices}", param="model")
    if model not in choices:
        kind = "compares a text with a text pair" if compares_pairs(module.manifest) else \
            f"is {KINDS.get(module.manifest.task_type, 'another kind of')} task"
        raise ApiError(400, "unsupported_model", f"model {model!r} {kind}: /classify answers single-label tasks on "
                       f"single texts ({choices}); ask it through /v1/infer?tasks={model}", param="model")
    return module


def classify_routes(serving: Serving) -> dict:
    """{path: handler(body, request) -> (answer bytes, headers)} for the app's raw ASGI layer."""
    runtime, require_ready, run_inference = serving.runtime, serving.require_ready, serving.run_inference

    async def classify(body: bytes, request) -> tuple[bytes, dict]:
        require_ready()
        asked = decode(ClassifyRequest, body, 400)
        module = classify_module(runtime.modules, asked.model, runtime)
        texts = as_texts(asked.input)
        results, job, headers = await run_inference(texts, None, {module.task: module}, asked.truncate, request)
        module = job.modules[module.task]  # the version that answered
        labels = module.manifest.labels
        data = [ClassifyData(i, r[module.task]["label"], [r[module.task]["scores"][label] for label in labels],
                             len(labels)) for i, r in enumerate(results)]
        tokens = sum(len(row) for row in job.rows)
        answer = ClassifyResponse(f"classify-{secrets.token_hex(16)}", "list", int(time.time()), module.task, data,
                                  PoolingUsage(tokens, tokens))
        return msgspec.json.encode(answer), headers

    return {"/classify": classify, "/v1/classify": classify}
