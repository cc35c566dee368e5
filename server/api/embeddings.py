"""Embeddings in the protocols embedding clients speak, from the same pass and batcher as every task.

- `POST /v1/embeddings`: OpenAI's embeddings API (the `openai` package's `client.embeddings.create`):
  `input` a string or a list of strings, `model` (an embedding task's name, or the backbone's),
  `encoding_format` float or base64, `dimensions` (refused unless the module declares shortened
  sizes); errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (server/errors.py
  picks every refusal's shape from its path, those raised before the route included).
- `GET /v1/models`, `GET /v1/models/{model}`: OpenAI's model list and lookup (`client.models.list()`):
  the names `model` takes, each embedding task and then the backbone's name (server/api/app.py serves them).
- `POST /embed`: Text Embeddings Inference's route (`huggingface_hub.InferenceClient.feature_extraction`
  pointed at it): `inputs`, `normalize`, `truncate`, `truncation_direction`; answers `[[floats]]`;
  errors in TEI's shape, `{"error", "error_type"}` (as TEI's `/tokenize`).
- `POST /similarity`: TEI's sentence similarity (`InferenceClient.sentence_similarity`): `{"inputs":
  {"source_sentence", "sentences"}, "parameters": {truncate, truncation_direction}}`, answered with the
  cosine similarity of each sentence's embedding to the source sentence's, `[floats]`. TEI's root (`POST
  /`, where the client posts given a server's URL) embeds, or answers similarity where `inputs` is such
  an object, or what /predict answers (a classifier's labels, a token task's entities) where Hugging
  Face's `parameters` come beside a text.
- `POST /score` (`/v1/score`) and `POST /rerank` (`/v1/rerank`, `/v2/rerank`): vLLM's score and rerank
  APIs as vLLM answers them for an embedding model: cosine similarities of the texts' embeddings (1:N or
  N:N pairs; a query's documents best first, `top_n`, `return_documents`); errors in OpenAI's shape.

All go through `Serving.run_inference` (server/api/serving.py: limits, tokenization, the batcher, metrics, timing
headers), so they batch with `/v1/infer` requests and work the same with `--workers N`. Their bodies
are msgspec structs (server/api/schemas.py `decode`), answered by the app's raw ASGI layer, not FastAPI.
"""
from __future__ import annotations

import base64
import secrets
import time
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np
from msgspec import Meta, Struct

from modules_store import TaskType
from server.api.schemas import AnswerControls, OpenAIModel, OpenAIModelList, PromptName, TEIDirection, decode, probe
from server.api.serving import Serving
from server.errors import ApiError, clip
from server.heads.embedding import vector_size
from server.modules import token_limit


# ---- request bodies ---------------------------------------------------------------------------------
class OpenAIEmbeddingRequest(Struct, forbid_unknown_fields=True):
    """OpenAI's embeddings body, e.g. {"input": ["A fine film.", "Peter flew to Brussels."], "model": "embedding"}."""
    input: Annotated[Union[str, list[Union[str, int, list[int]]]], Meta(
        description="a text or a list of texts (token arrays are refused: send text)")]
    model: Annotated[str, Meta(description="an embedding task's name (GET /v1/tasks), or the backbone's name")]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[Union[int, None], Meta(description="refused unless the module declares shortened sizes")] \
        = None
    user: Union[str, None] = None
    truncate: Annotated[bool, Meta(description="tmod extension: cut inputs over the model's token limit instead of "
                                               "413")] = False


class OpenAIEmbedding(Struct):
    object: Literal["embedding"]
    index: int
    embedding: Annotated[Union[list[float], str], Meta(description="floats, or base64 of little-endian float32")]


class OpenAIUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(Struct):
    object: Literal["list"]
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class TEIEmbedRequest(Struct, forbid_unknown_fields=True):
    """Text Embeddings Inference's /embed body, e.g. {"inputs": "A fine film."}."""
    inputs: Union[str, list[str]]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: TEIDirection = "right"
    prompt_name: PromptName = None
    dimensions: Annotated[Union[int, None], Meta(description="refused unless the module declares shortened sizes")] \
        = None


class SimilarityInput(Struct, forbid_unknown_fields=True):
    source_sentence: str
    sentences: Annotated[list[str], Meta(min_length=1, description="compared with source_sentence")]


class SimilarityParameters(Struct, forbid_unknown_fields=True):
    truncate: bool = False
    truncation_direction: TEIDirection = "right"
    prompt_name: PromptName = None


class TEISimilarityRequest(Struct, forbid_unknown_fields=True):
    """Text Embeddings Inference's /similarity body, e.g. {"inputs": {"source_sentence": "A fine film.",
    "sentences": ["A good movie.", "Rain tomorrow."]}}."""
    inputs: SimilarityInput
    parameters: Union[SimilarityParameters, None] = None


ScoreTexts = Annotated[Union[str, Annotated[list[str], Meta(min_length=1)]],
                       Meta(description="a text or a list of texts")]
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoreRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /score body, e.g. {"text_1": "A fine film.", "text_2": ["A good movie.", "Rain tomorrow."]}:
    two sides under one of vLLM's pairs of names, each a text or a list; one text on the first side is
    compared with every text on the second, else text i with text i."""
    model: Annotated[Union[str, None], Meta(description="an embedding task's name, or the backbone's (default: the "
                                                        "backbone's own embedding)")] = None
    text_1: Union[ScoreTexts, None] = None
    text_2: Union[ScoreTexts, None] = None
    queries: Union[ScoreTexts, None] = None
    documents: Union[ScoreTexts, None] = None
    items: Union[ScoreTexts, None] = None
    data_1: Union[ScoreTexts, None] = None
    data_2: Union[ScoreTexts, None] = None
    user: Union[str, None] = None
    truncate: Annotated[bool, Meta(description="tmod extension: cut inputs over the model's token limit instead of "
                                               "413")] = False

    def __post_init__(self):
        given = sorted({name for pair in SCORE_FIELDS for name in pair if getattr(self, name) is not None})
        if given not in [sorted(pair) for pair in SCORE_FIELDS]:
            raise ValueError("send the two sides under one pair of names: " +
                             ", ".join(f"{a} and {b}" for a, b in SCORE_FIELDS) + f" (got {', '.join(given) or 'none'})")
        first, second = self.sides()
        if len(first) not in (1, len(second)):
            raise ValueError(f"{len(first)} texts to compare with {len(second)}: send one, or as many (1:N or N:N)")

    def side_names(self) -> tuple[str, str]:
        """The pair of names the request sent its sides under, e.g. ("text_1", "text_2")."""
        return next(pair for pair in SCORE_FIELDS if getattr(self, pair[0]) is not None and
                    getattr(self, pair[1]) is not None)

    def sides(self) -> tuple[list[str], list[str]]:
        """(first side, second side) as lists of texts."""
        first, second = (getattr(self, name) for name in self.side_names())
        return [first] if isinstance(first, str) else first, [second] if isinstance(second, str) else second


class ScoreData(Struct):
    index: int
    object: Literal["score"]
    score: Annotated[float, Meta(description="the cosine similarity of the two texts' embeddings")]


class PoolingUsage(OpenAIUsage):
    """vLLM's usage of its pooling routes (/classify, /score): OpenAI's, with no completion."""
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class ScoreResponse(Struct):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(Struct, forbid_unknown_fields=True):
    """vLLM's /rerank body (Jina's and Cohere's API), e.g. {"query": "A fine film.", "documents":
    ["A good movie.", "Rain tomorrow."], "top_n": 1}."""
    query: str
    documents: Annotated[list[str], Meta(min_length=1)]
    model: Annotated[Union[str, None], Meta(description="an embedding task's name, or the backbone's (default: the "
                                                        "backbone's own embedding)")] = None
    top_n: Annotated[int, Meta(ge=0, description="the best N documents (0: all)")] = 0
    return_documents: Annotated[bool, Meta(description="each result's document text (Cohere's and Jina's option)")] \
        = True
    user: Union[str, None] = None
    truncate: Annotated[bool, Meta(description="tmod extension: cut inputs over the model's token limit instead of "
                                               "413")] = False


class TEIRerankRequest(Struct, forbid_unknown_fields=True):
    """Text Embeddings Inference's /rerank body (what Haystack's and LlamaIndex's TEI rankers post), e.g.
    {"query": "A fine film.", "texts": ["A good movie.", "Rain tomorrow."]}."""
    query: str
    texts: Annotated[list[str], Meta(min_length=1)]
    raw_scores: Annotated[bool, Meta(description="accepted either way: the score is the cosine similarity of the "
                                                 "embeddings, no classifier's logit to squash")] = False
    return_text: Annotated[bool, Meta(description="each result's text")] = False
    truncate: Union[bool, None] = False
    truncation_direction: TEIDirection = "right"


class TEIRank(Struct, omit_defaults=True):
    index: int
    score: Annotated[float, Meta(description="the cosine similarity of the query's and the text's embeddings")]
    text: Union[str, None] = None


class RerankDocument(Struct):
    text: str


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: Annotated[float, Meta(description="the cosine similarity of the query's and the document's "
                                                       "embeddings")]
    document: Union[RerankDocument, None] = None


class RerankResponse(Struct):
    id: str
    model: str
    usage: OpenAIUsage
    results: Annotated[list[RerankResult], Meta(description="best first")]


# ---- shared ----------------------------------------------------------------------------------------
def embedding_modules(runtime) -> dict:
    return {task: m for task, m in runtime.modules.items() if m.manifest.task_type == TaskType.embedding}


def embedding_model_names(runtime) -> list[str]:
    """The names `model` takes: each embedding task, then the backbone's name (its default embedding)."""
    found = embedding_modules(runtime)
    return sorted(found) + ([runtime.model_info()[0]] if found else [])


def backbone_embedding(found: dict):
    """Among the loaded embedding tasks `found`, the backbone's own: `embedding`, else the first by
    name; None when there is none."""
    if not found:
        return None
    return found["embedding"] if "embedding" in found else found[sorted(found)[0]]


def embedding_module(runtime, model: str | None):
    """An embedding task by name; the backbone's name (or None) means the backbone's own embedding
    (`backbone_embedding`); anything else 404 model_not_found."""
    found = embedding_modules(runtime)
    if model in found:
        return found[model]
    backbone = runtime.model_info()[0]
    if found and (model is None or model == backbone or model.rsplit("/", 1)[-1] == backbone):
        return backbone_embedding(found)
    if not found:  # whatever was asked for: say what would serve it
        raise ApiError(404, "model_not_found", "no embedding task is loaded: serve one (tmod-serve --tasks "
                       "embedding,..., or POST /admin/modules/embedding/load; a store without one gets the "
                       "backbone's from tmod-train embedding --store STORE)", param="model")
    raise ApiError(404, "model_not_found", f"no embedding model {clip(model)}; embedding tasks loaded: {sorted(found)}"
                   f" (or the backbone's name, {backbone!r})", param="model")


def vectors_of(results: list[dict], task: str, normalize: bool | None, dimensions: int | None,
               module) -> np.ndarray:
    """(N, D) float32 vectors from the decoded answers: as the model makes them (`normalize`
    None), or unit length (True) or as pooled before any normalisation (False); cut to `dimensions`
    (a declared shortened size) and then made unit length again where the model normalises."""
    config = module.manifest.config
    vectors = np.array([r[task]["embedding"] for r in results], dtype=np.float32)
    norms = np.array([r[task]["norm"] for r in results], dtype=np.float32)[:, None]
    if normalize is False and config["normalize"]:
        vectors = vectors * norms
    elif normalize and not config["normalize"]:
        vectors = vectors / np.maximum(norms, 1e-12)
    if dimensions is not None and dimensions != vectors.shape[1]:
        vectors = vectors[:, :dimensions]
        if normalize if normalize is not None else config["normalize"]:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors


def check_dimensions(dimensions: int | None, module) -> None:
    config = module.manifest.config
    full = vector_size(config)
    if dimensions is None or dimensions == full or dimensions in config.get("shortened", []):
        return
    offered = sorted(config.get("shortened", []))
    detail = f"it offers {offered + [full]}" if offered else f"its vectors have {full} dimensions and are not " \
        "trained to be shortened"
    raise ApiError(400, "unsupported_dimensions", f"model {module.task!r} cannot give {dimensions} dimensions: {detail}",
                   param="dimensions")


def as_texts(inputs) -> list[str]:
    if isinstance(inputs, str):
        return [inputs]
    if any(not isinstance(item, str) for item in inputs):
        raise ApiError(400, "invalid_request", "token arrays are not accepted: send the text itself (LangChain's "
                       "OpenAIEmbeddings sends tiktoken ids: give it check_embedding_ctx_length=False)", param="input")
    return list(inputs)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}


def tei_info(runtime, settings, version: str) -> dict:
    """Text Embeddings Inference's /info (huggingface_hub's `get_endpoint_info`), for the TEI routes
    (`/embed`, `/`): the backbone, its precision, the embedding's pooling (null: no embedding task
    loaded), and the limits a TEI client sizes its batches by, each this server's own setting."""
    module = backbone_embedding(embedding_modules(runtime))
    limit = token_limit({module.task: module} if module else {}, settings.max_tokens) or runtime.text.max_tokens
    return {"model_id": runtime.model_info()[0], "model_sha": None,
            "model_dtype": DTYPES.get(settings.precision, settings.precision),
            "model_type": {"embedding": {"pooling": "+".join(module.manifest.config["pooling"]) if module else None}},
            "max_concurrent_requests": settings.max_queue, "max_input_length": limit,
            "max_batch_tokens": settings.max_batch_tokens, "max_batch_requests": settings.max_batch_size,
            "max_client_batch_size": settings.max_inputs, "auto_truncate": False,
            "tokenization_workers": settings.workers, "version": version, "sha": None, "docker_label": None}


def embeddings_routes(serving: Serving) -> dict:
    """{path: handler(body, request) -> (answer bytes, headers)}: OpenAI's and TEI's routes over the app's
    runtime and its shared `run_inference` (the app's raw ASGI layer serves them)."""
    runtime, require_ready, run_inference = serving.runtime, serving.require_ready, serving.run_inference

    async def embed(texts, module, truncate, request, direction: str = "right", names=None):
        results, job, headers = await run_inference(texts, None, {module.task: module}, truncate, request,
                                                    controls=AnswerControls(truncation_direction=direction),
                                                    names=names)
        return results, job.modules[module.task], sum(len(row) for row in job.rows), headers

    async def openai_embeddings(body: bytes, request) -> tuple[bytes, dict]:
        """OpenAI's embeddings API: `data[i].embedding` as floats or base64 (little-endian float32)."""
        require_ready()
        asked = decode(OpenAIEmbeddingRequest, body, 400)
        module = embedding_module(runtime, asked.model)
        check_dimensions(asked.dimensions, module)
        texts = as_texts(asked.input)
        results, module, tokens, headers = await embed(texts, module, asked.truncate, request)
        vectors = vectors_of(results, module.task, None, asked.dimensions, module)
        if asked.encoding_format == "base64":
            encoded: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            encoded = vectors.tolist()
        answer = OpenAIEmbeddingResponse("list", [OpenAIEmbedding("embedding", i, e) for i, e in enumerate(encoded)],
                                         asked.model, OpenAIUsage(tokens, tokens))
        return msgspec.json.encode(answer), headers

    async def tei_embed(body: bytes, request) -> tuple[bytes, dict]:
        """Text Embeddings Inference's /embed: one vector per input, `[[floats]]`."""
        require_ready()
        asked = decode(TEIEmbedRequest, body, 422)
        refuse_prompt(asked.prompt_name)
        module = embedding_module(runtime, None)
        check_dimensions(asked.dimensions, module)
        results, module, _, headers = await embed(as_texts(asked.inputs), module, asked.truncate, request,
                                                  asked.truncation_direction.lower())
        vectors = vectors_of(results, module.task, asked.normalize, asked.dimensions, module)
        return msgspec.json.encode(vectors.tolist()), headers

    async def tei_similarity(body: bytes, request) -> tuple[bytes, dict]:
        """Text Embeddings Inference's /similarity: each sentence's cosine similarity to the source sentence,
        from their embeddings, read in one pass."""
        require_ready()
        asked = decode(TEISimilarityRequest, body, 422)
        parameters = asked.parameters or SimilarityParameters()
        refuse_prompt(parameters.prompt_name)
        scores, *_, headers = await scored([asked.inputs.source_sentence], asked.inputs.sentences,
                                           ("inputs.source_sentence", "inputs.sentences"), None, parameters.truncate,
                                           request, parameters.truncation_direction.lower())
        return msgspec.json.encode(scores.tolist()), headers

    async def scored(first: list[str], second: list[str], sides: tuple[str, str], model: str | None, truncate: bool,
                     request, direction: str = "right"):
        """(cosine similarities of first[i] (or first[0]) and second[i], module, tokens, headers): one pass;
        `sides`: the request's names of the two, which a refused text is named by."""
        results, module, tokens, headers = await embed([*first, *second], embedding_module(runtime, model), truncate,
                                                       request, direction, sides_named(*sides, len(first)))
        vectors = vectors_of(results, module.task, True, None, module)
        left, right = vectors[:len(first)], vectors[len(first):]
        return (left * right).sum(axis=1) if len(left) == len(right) else right @ left[0], module, tokens, headers

    async def vllm_score(body: bytes, request) -> tuple[bytes, dict]:
        """vLLM's /score with an embedding model: each pair's cosine similarity."""
        require_ready()
        asked = decode(ScoreRequest, body, 400)
        scores, module, tokens, headers = await scored(*asked.sides(), asked.side_names(), asked.model,
                                                       asked.truncate, request)
        answer = ScoreResponse(f"score-{secrets.token_hex(16)}", "list", int(time.time()), asked.model or module.task,
                               [ScoreData(i, "score", s) for i, s in enumerate(scores.tolist())],
                               PoolingUsage(tokens, tokens))
        return msgspec.json.encode(answer), headers

    async def vllm_rerank(body: bytes, request) -> tuple[bytes, dict]:
        """vLLM's /rerank with an embedding model: the documents by their cosine similarity to the query,
        best first, the best `top_n`."""
        require_ready()
        asked = decode(RerankRequest, body, 400)
        scores, module, tokens, headers = await scored([asked.query], asked.documents, ("query", "documents"),
                                                       asked.model, asked.truncate, request)
        order = best_first(scores)[:asked.top_n or None]
        results = [RerankResult(i, float(scores[i]), RerankDocument(asked.documents[i]) if asked.return_documents
                                else None) for i in order]
        answer = RerankResponse(f"rerank-{secrets.token_hex(16)}", asked.model or module.task,
                                OpenAIUsage(tokens, tokens), results)
        return msgspec.json.encode(answer), headers

    async def tei_rerank(body: bytes, request) -> tuple[bytes, dict]:
        """Text Embeddings Inference's /rerank with an embedding model: `[{index, score, text}]`, the texts by
        their cosine similarity to the query, best first."""
        require_ready()
        asked = decode(TEIRerankRequest, body, 422)
        scores, *_, headers = await scored([asked.query], asked.texts, ("query", "texts"), None, bool(asked.truncate),
                                           request, asked.truncation_direction.lower())
        order = best_first(scores)
        ranks = [TEIRank(i, float(scores[i]), asked.texts[i] if asked.return_text else None) for i in order]
        return msgspec.json.encode(ranks), headers

    async def rerank(body: bytes, request) -> tuple[bytes, dict]:
        """/rerank, where vLLM and TEI both serve theirs: a body with `texts` and no `documents` is TEI's,
        answered (and refused) in TEI's shape; any other, vLLM's."""
        sent = probe(body)
        if not sent.has("texts") or sent.has("documents"):
            return await vllm_rerank(body, request)
        try:
            return await tei_rerank(body, request)
        except ApiError as exc:
            exc.protocol = "/embed"
            raise

    return {"/v1/embeddings": openai_embeddings, "/embed": tei_embed, "/similarity": tei_similarity,
            "/score": vllm_score, "/v1/score": vllm_score,
            "/rerank": rerank, "/v1/rerank": vllm_rerank, "/v2/rerank": vllm_rerank}


def tei_root(routes: dict):
    """TEI's root, where huggingface_hub's InferenceClient posts given a server's URL as its model: TEI
    serves one model there, tmod several tasks, so the body chooses: /similarity where `inputs` is an
    object, /predict where Hugging Face's `parameters` come beside a text, else /embed (each names what
    is malformed). `routes`: the app's handlers by path."""

    async def root(body: bytes, request) -> tuple[bytes, dict]:
        sent = probe(body)
        if bytes(sent.inputs)[:1] == b"{":
            path = "/similarity"
        else:
            path = "/predict" if sent.has("parameters") else "/embed"
        if path != "/predict" and request.query("tasks"):  # ?tasks= would be ignored: an embedding answered
            raise ApiError(400, "invalid_request", f"?tasks= names the task of a body of /predict's (Hugging Face's "
                           f"`parameters` beside a text); this body is {path}'s, which reads no tasks")
        return await routes[path](body, request)

    return root


def best_first(scores) -> list[int]:
    """The indices of `scores`, highest score first (equal scores in request order)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def sides_named(first: str, second: str, count: int):
    """Text i's name in a request of two sides, `count` texts under `first` then the rest under `second`:
    "query", "documents[0]", ... (a side of one text is named by itself, as a request sends it)."""
    def name(i: int) -> str:
        if i < count:
            return first if count == 1 else f"{first}[{i}]"
        return f"{second}[{i - count}]"
    return name


def refuse_prompt(prompt_name: str | None) -> None:
    if prompt_name is not None:
        raise ApiError(422, "invalid_request", f"prompt_name {prompt_name!r}: no prompts are configured")


def model_list_routes(app, serving: Serving) -> None:
    """Adds OpenAI's model list (the names /v1/embeddings takes) to the FastAPI `app`."""
    runtime, require_ready = serving.runtime, serving.require_ready
    started_s = int(time.time())

    @app.get("/v1/models", response_model=OpenAIModelList, tags=["embeddings"], responses={503: {}})
    async def openai_models():
        """OpenAI's model list (`client.models.list()`): each embedding task, then the backbone's name."""
        require_ready()
        return OpenAIModelList(data=[OpenAIModel(id=name, created=started_s) for name in embedding_model_names(runtime)])

    @app.get("/v1/models/{model:path}", response_model=OpenAIModel, tags=["embeddings"], responses={404: {}, 503: {}})
    async def openai_model(model: str):
        """One name of the list (`client.models.retrieve(name)`); 404 in OpenAI's shape for any other. The
        path is KServe V1's model readiness too: OpenAI's answer is kept (a task is no embedding model),
        and the 404 of a served task says where KServe's readiness is."""
        require_ready()
        try:
            embedding_module(runtime, model)
        except ApiError as exc:
            if model not in runtime.modules:
                raise
            raise ApiError(404, exc.type, f"{exc.message}; {model!r} is a task: KServe V1 clients predict at POST "
                           f"/v1/models/{model}:predict and ask its readiness at GET /v2/models/{model}/ready",
                           **exc.details) from None
        return OpenAIModel(id=model, created=started_s)
