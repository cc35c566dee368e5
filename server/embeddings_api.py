"""Embeddings in the protocols embedding clients speak, from the same pass and batcher as every task.

- `POST /v1/embeddings`: OpenAI's embeddings API (the `openai` package's `client.embeddings.create`):
  `input` a string or a list of strings, `model` (an embedding task's name, or the backbone's),
  `encoding_format` float or base64, `dimensions` (refused unless the module declares shortened
  sizes); errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (server/errors.py
  picks every refusal's shape from its path, those raised before the route included).
- `POST /embed`: Text Embeddings Inference's route (`huggingface_hub.InferenceClient.feature_extraction`
  pointed at it): `inputs`, `normalize`, `truncate`, `truncation_direction`; answers `[[floats]]`;
  errors in TEI's shape, `{"error", "error_type"}` (as TEI's `/tokenize`).

Both go through the app's `run_inference` (limits, tokenization, the batcher, metrics, timing
headers), so they batch with `/v1/infer` requests and work the same with `--workers N`.
"""
from __future__ import annotations

import base64
import json
from typing import Any, Callable, Literal, Union

import numpy as np
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from modules_store import TaskType
from server.errors import ApiError
from server.heads.embedding import vector_size


# ---- request bodies ---------------------------------------------------------------------------------
class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"input": ["A fine film.", "Peter flew to Brussels."], "model": "embedding"}]})

    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]] = Field(
        description="a text or a list of texts (token arrays are refused: send text)")
    model: StrictStr = Field(description="an embedding task's name (GET /v1/tasks), or the backbone's name")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, description="refused unless the module declares shortened sizes")
    user: StrictStr | None = None
    truncate: bool = Field(False, description="tmod extension: cut inputs over the model's token limit instead of 413")


class TEIEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"inputs": "A fine film."}]})

    inputs: Union[StrictStr, list[StrictStr]]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Literal["left", "right", "Left", "Right"] = "right"
    prompt_name: StrictStr | None = Field(None, description="refused: no prompts are configured")
    dimensions: StrictInt | None = Field(None, description="refused unless the module declares shortened sizes")


# ---- shared ----------------------------------------------------------------------------------------
def embedding_modules(runtime) -> dict:
    return {task: m for task, m in runtime.modules.items() if m.manifest.task_type == TaskType.embedding}


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
        raise ApiError(400, "invalid_request", "token arrays are not accepted: send the text itself", param="input")
    return list(inputs)


def add_embeddings_routes(app: FastAPI, runtime, require_ready: Callable[[], None], run_inference) -> None:
    """The OpenAI and TEI routes on `app`, over its runtime and its shared `run_inference`."""

    def module_for(model: str | None):
        """An embedding task by name; the backbone's name (or None) means the backbone's own embedding."""
        found = embedding_modules(runtime)
        if model in found:
            return found[model]
        backbone = runtime.model_info()[0]
        if found and (model is None or model == backbone or model.rsplit("/", 1)[-1] == backbone):
            return found["embedding"] if "embedding" in found else found[sorted(found)[0]]
        raise ApiError(404, "model_not_found", f"no embedding model {model!r}; embedding tasks loaded: {sorted(found)}"
                       + (f" (or the backbone's name, {backbone!r})" if found else ""), param="model")

    async def embed(texts, module, truncate, request):
        results, job, headers = await run_inference(texts, None, {module.task: module}, truncate, request)
        return results, job.modules[module.task], sum(len(row) for row in job.rows), headers

    async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request) -> Response:
        """OpenAI's embeddings API: `data[i].embedding` as floats or base64 (little-endian float32)."""
        require_ready()
        module = module_for(body.model)
        check_dimensions(body.dimensions, module)
        texts = as_texts(body.input)
        results, module, tokens, headers = await embed(texts, module, body.truncate, request)
        vectors = vectors_of(results, module.task, None, body.dimensions, module)
        if body.encoding_format == "base64":
            encoded: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            encoded = vectors.tolist()
        data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)]
        answer = {"object": "list", "data": data, "model": body.model,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return Response(json.dumps(answer), media_type="application/json", headers=headers)

    async def tei_embed(body: TEIEmbedRequest, request: Request) -> Response:
        """Text Embeddings Inference's /embed: one vector per input, `[[floats]]`."""
        require_ready()
        if body.prompt_name is not None:
            raise ApiError(422, "invalid_request", f"prompt_name {body.prompt_name!r}: no prompts are configured")
        module = module_for(None)
        check_dimensions(body.dimensions, module)
        truncate = body.truncate and body.truncation_direction.lower()  # False, "right" or "left"
        results, module, _, headers = await embed(as_texts(body.inputs), module, truncate, request)
        vectors = vectors_of(results, module.task, body.normalize, body.dimensions, module)
        return Response(json.dumps(vectors.tolist()), media_type="application/json", headers=headers)

    app.router.add_api_route("/v1/embeddings", openai_embeddings, methods=["POST"], tags=["embeddings"],
                              responses={400: {}, 404: {}, 413: {}, 422: {}, 429: {}, 503: {}})
    app.router.add_api_route("/embed", tei_embed, methods=["POST"], tags=["embeddings"],
                              responses={413: {}, 422: {}, 424: {}, 429: {}, 503: {}})
