"""The one-task prediction APIs of KServe's V1 data plane and of Text Embeddings Inference.

KServe V1 (TensorFlow Serving's REST API): `POST /v1/models/<task>:predict`, what the `kserve`
package's REST client sends by default (its protocol "v1"). Request `{"instances": [...]}` (or
`{"inputs": [...]}`, KServe's other name): texts, or `{"text", "text_pair"}` objects for a pair task;
tmod's `truncate` and answer controls as on /v1/infer. Answer `{"predictions": [...]}`: per instance,
the task's answer as /v1/infer gives it (`label` / `score` / `scores`, `labels`, `entities`,
`embedding`). Errors as KServe's servers give them, the message in `error`. Liveness is V1's too
(`GET /`: `{"status": "alive"}`), but not model readiness: `GET /v1/models/<name>` is OpenAI's model
object of an embedding model, and a task there is answered 404 naming V2's `GET
/v2/models/<task>/ready`. `:explain` is refused: tmod has no explainer.

TEI's `POST /predict`: a classifier's labels, best first, `[{"score", "label"}, ...]` for one input
(`"inputs"`: a text, or a `[text, text_pair]` pair) or a list of them for a batch (`[[text],
[text, text_pair], ...]`); `raw_scores` answers logits, `truncate` cuts long inputs (at
`truncation_direction`'s end). TEI serves one
model: here the one classification task that reads such inputs (single-label or multi-label), or the
one `?tasks=<task>` names. Errors in TEI's shape. `huggingface_hub`'s `InferenceClient.text_classification`
posts here (or to TEI's root, given the server's URL) with Hugging Face's `parameters` (`top_k`,
`function_to_apply`), which TEI ignores: here they are read (`"none"` answers logits, the head's own
function its probabilities, the other is refused), and the answer takes Hugging Face's shape, a list of labels per input for one input too, so that the client
returns every label as its documentation says, not only the best one. A token task named in `?tasks=`
(TEI has no such route) is answered in Hugging Face's token-classification shape, what
`InferenceClient.token_classification` reads: per input its entities `{"entity_group", "score", "word",
"start", "end"}` (or, with `aggregation_strategy` "none", its word pieces with `entity`), its
`ignore_labels` (default ["O"]) left out.

One request runs one task: /v1/infer runs several in one pass.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from modules_store import TaskType
from server.api.schemas import AnswerControls, TEIDirection, TextPair, check_one_form, decode
from server.api.serving import Serving
from server.errors import ApiError, clip, did_you_mean, not_loaded
from server.modules import compares_pairs

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
        check_one_form(self.items(), "instances" if self.instances is not None else "inputs")

    def items(self) -> list:
        return self.instances if self.instances is not None else self.inputs


class PredictResponse(Struct):
    predictions: Annotated[list[dict[str, Any]], Meta(description="per instance, in order, the task's answer as "
                                                                  "/v1/infer gives it")]


def predict_route(serving: Serving):
    """handler(body, request, task, verb) -> (answer bytes, headers), for the app's raw ASGI layer. A task is
    looked up as OIP looks up a model (`Serving.module`: one model, one task)."""
    require_ready, module_of, fit_to_inputs, run_inference = (serving.require_ready, serving.module,
                                                              serving.fit_to_inputs, serving.run_inference)

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


class HuggingFaceParameters(Struct, forbid_unknown_fields=True):
    """Hugging Face's text- and token-classification parameters, as `InferenceClient.text_classification`
    and `.token_classification` send them (each kind's own; the other kind's are refused)."""
    top_k: Annotated[Union[Annotated[int, Meta(ge=1)], None], Meta(description="only the k best labels")] = None
    function_to_apply: Annotated[Union[Literal["softmax", "sigmoid", "none"], None], Meta(description=(
        "'none': the head's logits (as raw_scores); the head's own function (softmax for a single-label task, "
        "sigmoid for a multi-label one) its probabilities; the other is refused"))] = None
    aggregation_strategy: Annotated[Union[Literal["none", "simple", "first", "average", "max"], None], Meta(
        description="token tasks: 'none' every word piece with its own tag (`entity`); 'first', 'average', 'max' "
                    "a word's tag from its pieces (tmod's `aggregation`); 'simple' (or none given) the module's own, "
                    "as entities (`entity_group`)")] = None
    ignore_labels: Annotated[Union[list[str], None], Meta(
        description="token tasks: the tags or entity types left out (default ['O'])")] = None
    stride: Annotated[Union[int, None], Meta(description="refused: tmod reads a long text in overlapping windows of "
                                                         "its own (docs/windows.md)")] = None


class TEIPredictRequest(Struct, forbid_unknown_fields=True):
    """TEI's /predict body, e.g. {"inputs": "A fine film."} or {"inputs": [["A fine film."], ["A man sleeps.",
    "Nobody sleeps."]]}."""
    inputs: Annotated[Union[str, list[Union[str, list[str]]]], Meta(
        description='a text; a pair [text, text_pair]; or a batch of both: [[text], [text, text_pair], ...]')]
    truncate: bool = False
    truncation_direction: TEIDirection = "right"
    raw_scores: Annotated[bool, Meta(description="the head's logits instead of probabilities")] = False
    parameters: Annotated[Union[HuggingFaceParameters, None], Meta(
        description="Hugging Face's text- or token-classification parameters (huggingface_hub's InferenceClient)")] \
        = None


CLASSIFIERS = (TaskType.sequence_classification, TaskType.multi_label_classification)


def tei_inputs(inputs) -> tuple[list, bool]:
    """(the sequences, each a text or a (text, text_pair) tuple; whether the request was a batch), read
    as TEI reads them: a string is one text, a list of strings one pair, a list of lists a batch."""
    if isinstance(inputs, str):
        return [inputs], False
    if not inputs:
        raise ApiError(422, "invalid_request", "inputs is empty: send a text, a pair [text, text_pair] or a batch "
                                               "[[text], [text, text_pair], ...]")
    if all(isinstance(item, str) for item in inputs):
        if len(inputs) > 2:
            raise ApiError(422, "invalid_request", f"inputs has {len(inputs)} texts: a list of strings is one "
                                                   "pair [text, text_pair]; a batch is a list of lists, [[text], ...]")
        return [inputs[0] if len(inputs) == 1 else tuple(inputs)], False
    if any(isinstance(item, str) or len(item) not in (1, 2) for item in inputs):
        raise ApiError(422, "invalid_request", "a batch is a list of lists, each [text] or [text, text_pair]")
    return [item[0] if len(item) == 1 else tuple(item) for item in inputs], True


def tei_classifier(runtime, named: tuple[str, ...], pairs: bool):
    """The task TEI's /predict answers: the one named (`?tasks=`: a token task too, on single texts),
    else the one classification task loaded that reads these inputs (single texts or pairs); 400 saying
    which to name otherwise (one not loaded: why, where the runtime refused it or left it out)."""
    modules = runtime.modules
    fits = sorted(t for t, m in modules.items()
                  if m.manifest.task_type in CLASSIFIERS and compares_pairs(m.manifest) == pairs)
    inputs = "text pairs" if pairs else "single texts"
    if named:
        task = ",".join(named)
        taggers = [] if pairs else sorted(t for t, m in modules.items()
                                          if m.manifest.task_type == TaskType.token_classification)
        if task not in fits + taggers:
            why = (f"is not loaded{not_loaded([task], runtime.load_errors, runtime.skipped)}" if task not in modules
                   else f"is no classification task on {inputs}")
            raise ApiError(400, "unknown_task", f"task {clip(task)} {why}{did_you_mean([task], fits + taggers)}; "
                                                f"/predict answers one of {sorted(fits + taggers)}")
        return modules[task]
    if len(fits) != 1:
        raise ApiError(400, "unknown_task", f"/predict answers one classification task on {inputs}, and "
                       + (f"{len(fits)} are loaded ({fits}): name one, /predict?tasks={fits[0]}" if fits else
                          "none is loaded"))
    return modules[fits[0]]


def hugging_face_tokens(answer: dict, pieces: bool, ignored: set[str]) -> list[dict]:
    """A token task's answer for one input as Hugging Face's token classification gives it: its entities
    (`entity_group`), or its word pieces (`entity`, the full tag) where `pieces`; labels in `ignored` left out."""
    if pieces:
        return [{"entity": p["label"], "score": p["score"], "word": p["text"], "start": p["start"], "end": p["end"]}
                for p in answer["tokens"] if p["label"] not in ignored]
    return [{"entity_group": e["label"], "score": e["score"], "word": e["text"], "start": e["start"], "end": e["end"]}
            for e in answer["entities"] if e["label"] not in ignored]


def refuse_token_parameters(parameters: "HuggingFaceParameters | None", module) -> None:
    """422 for Hugging Face's token-classification parameters sent to a classifier."""
    for name in ("aggregation_strategy", "ignore_labels", "stride"):
        if parameters is not None and getattr(parameters, name) is not None:
            raise ApiError(422, "invalid_request", f"parameters.{name} is token classification's: {module.task!r} "
                                                   "classifies whole texts (parameters.top_k, function_to_apply)")


def answers_logits(asked: TEIPredictRequest, module) -> bool:
    """Whether /predict answers the head's logits: `raw_scores`, or Hugging Face's `function_to_apply: "none"`;
    422 for the function the head does not apply, or for the two fields saying different things."""
    function = asked.parameters.function_to_apply if asked.parameters else None
    if function is None or function == "none":
        return asked.raw_scores or function == "none"
    multi_label = module.manifest.task_type == TaskType.multi_label_classification
    own = "sigmoid" if multi_label else "softmax"
    if function != own:
        kind = "a multi-label task" if multi_label else "a single-label task"
        raise ApiError(422, "invalid_request", f"function_to_apply {function!r}: {module.task!r} is {kind} and "
                                               f"answers {own} probabilities; 'none' gives its logits")
    if asked.raw_scores:
        raise ApiError(422, "invalid_request", f"raw_scores asks for logits and function_to_apply for {own} "
                                               "probabilities: send one of the two")
    return False


def tei_predict_route(serving: Serving):
    """{path: handler(body, request) -> (answer bytes, headers)} for the app's raw ASGI layer."""
    runtime, require_ready, run_inference = serving.runtime, serving.require_ready, serving.run_inference

    async def tei_predict(body: bytes, request) -> tuple[bytes, dict]:
        require_ready()
        asked = decode(TEIPredictRequest, body, 422)
        sequences, batch = tei_inputs(asked.inputs)
        pairs = {isinstance(s, tuple) for s in sequences}
        if len(pairs) > 1:
            raise ApiError(422, "invalid_request", "a batch of texts and text pairs: each is a different task here; "
                                                   "send the texts and the pairs in two requests")
        pairs = pairs.pop()
        module = tei_classifier(runtime, request.query("tasks"), pairs)
        texts = [s[0] for s in sequences] if pairs else sequences
        if module.manifest.task_type == TaskType.token_classification:
            return await tagged(texts, batch, module, asked, request)
        refuse_token_parameters(asked.parameters, module)
        # the answer's scores best first (decode's top_k; every label unless Hugging Face's top_k says fewer)
        top_k = (asked.parameters.top_k if asked.parameters else None) or len(module.manifest.labels)
        controls = AnswerControls(raw_scores=answers_logits(asked, module), top_k=top_k,
                                  truncation_direction=asked.truncation_direction.lower())
        results, _, headers = await run_inference(texts, [s[1] for s in sequences] if pairs else None,
                                                  {module.task: module}, asked.truncate, request, controls=controls)
        ranked = [[{"score": score, "label": label} for label, score in r[module.task]["scores"].items()]
                  for r in results]
        # with Hugging Face's parameters, Hugging Face's shape: a list per input, one input too (the client reads [0])
        return msgspec.json.encode(ranked if batch or asked.parameters else ranked[0]), headers

    async def tagged(texts: list[str], batch: bool, module, asked: TEIPredictRequest, request):
        """A token task in Hugging Face's token-classification shape (InferenceClient.token_classification):
        per input, its entities `{"entity_group", "score", "word", "start", "end"}`, or with aggregation
        'none' its word pieces `{"entity", ...}`; one input's list alone, a batch's a list of them."""
        parameters = asked.parameters or HuggingFaceParameters()
        for given, name in ((asked.raw_scores, "raw_scores"), (parameters.top_k, "parameters.top_k"),
                            (parameters.function_to_apply, "parameters.function_to_apply")):
            if given:
                raise ApiError(422, "invalid_request", f"{name} is text classification's: {module.task!r} is a "
                                                       "token task (parameters.aggregation_strategy, ignore_labels)")
        if parameters.stride is not None:
            raise ApiError(422, "invalid_request", "parameters.stride: tmod reads a long text in overlapping windows "
                                                   "of its own (docs/windows.md); leave stride out")
        strategy = parameters.aggregation_strategy
        controls = AnswerControls(aggregation=None if strategy in (None, "simple") else strategy,
                                  truncation_direction=asked.truncation_direction.lower())
        results, _, headers = await run_inference(texts, None, {module.task: module}, asked.truncate, request,
                                                  controls=controls)
        ignored = set(["O"] if parameters.ignore_labels is None else parameters.ignore_labels)
        found = [hugging_face_tokens(r[module.task], strategy == "none", ignored) for r in results]
        return msgspec.json.encode(found if batch else found[0]), headers

    return {"/predict": tei_predict}
