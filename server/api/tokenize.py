"""What the server reads of a text: its word pieces with character offsets, and its windows
(`/v1/tokenize`, and Text Embeddings Inference's `/tokenize` route shape); and back, word piece ids
to text (TEI's `/decode`, vLLM's `/detokenize`). The routes: `tokenize_routes`."""
from __future__ import annotations

import asyncio

import msgspec
from fastapi import Request, Response

from server.api.embeddings import refuse_prompt
from server.api.schemas import (TeiDecodeRequest, TeiTokenizeRequest, TokenizeRequest, VllmDetokenizeRequest,
                                VllmDetokenizeResponse, VllmTokenizeRequest, VllmTokenizeResponse, decode, probe,
                                request_body)
from server.api.serving import Serving, check_query, require_json
from server.backbone.tokens import END, IDS, SEGMENT, START, EncodedInput, TextEncoder
from server.errors import ApiError, clip, protocol_of
from server.windows import TextWindows


def pieces(encoder: TextEncoder, row: EncodedInput, add_special_tokens: bool) -> list[dict]:
    """Each word piece: id, the piece as the vocabulary spells it (`token`), whether it is a special
    token, and for the others `segment` (0 text, 1 text pair) and `start`/`end`, character offsets
    into that text (`text[start:end]` is what the piece covers)."""
    names = encoder.tokenizer.convert_ids_to_tokens(list(row.ids))
    out = []
    for token_id, name, (start, end), segment in zip(row.ids, names, row.offsets, row.sequence_ids):
        if segment is None:
            if add_special_tokens:
                out.append({"id": int(token_id), "token": name, "special": True})
            continue
        source = row.text if segment == 0 else row.text_pair
        out.append({"id": int(token_id), "token": name, "special": False, "segment": segment, "start": start,
                    "end": end, "text": source[start:end]})
    return out


def describe(encoder: TextEncoder, text: TextWindows, add_special_tokens: bool) -> dict:
    """One input for /v1/tokenize: its word pieces, and the windows it is read in, each as the
    stretch of the text it holds (`start`/`end` characters, `tokens`: word pieces of the row,
    special tokens and text pair included)."""
    whole = text.whole
    spans = []
    for (first, last), row in zip(text.spans, text.rows):
        # the window's first and last token, read from the token array (not the per-token offsets list)
        start, end = (int(whole.tokens[text.first + first, START]), int(whole.tokens[text.first + last - 1, END])) \
            if last > first else (0, 0)
        spans.append({"start": start, "end": end, "tokens": len(row)})
    return {"tokens": pieces(encoder, whole, add_special_tokens), "length": len(whole), "windows": spans}


def tei_tokens(encoder: TextEncoder, row: EncodedInput, add_special_tokens: bool) -> list[dict]:
    """Text Embeddings Inference's SimpleToken list: id, text, special, start, stop (character
    offsets; null for special tokens, whose text is the token itself)."""
    return [{"id": p["id"], "text": p["token"] if p["special"] else p["text"], "special": p["special"],
             "start": p.get("start"), "stop": p.get("end")} for p in pieces(encoder, row, add_special_tokens)]


def text_ids(row: EncodedInput, add_special_tokens: bool) -> list[int]:
    """A row's word piece ids, its special tokens left out unless asked for."""
    ids = row.tokens[:, IDS] if add_special_tokens else row.tokens[row.tokens[:, SEGMENT] >= 0, IDS]
    return ids.tolist()


def decoded(encoder: TextEncoder, ids: list[list[int]], skip_special_tokens: bool, field: str, limit: int,
            malformed_status: int = 422) -> list[str]:
    """Each list of word piece ids as text; `malformed_status` naming the first id the vocabulary does not
    hold (`field`: what the request calls the lists), 413 past `limit` ids in all."""
    total = sum(map(len, ids))
    if total > limit:
        raise ApiError(413, "too_many_tokens", f"{total} ids; at most {limit} per request (send fewer)")
    size = len(encoder.tokenizer)
    for i, row in enumerate(ids):
        bad = next((token for token in row if not 0 <= token < size), None)
        if bad is not None:
            where = f"{field}[{i}]" if len(ids) > 1 else field
            raise ApiError(malformed_status, "invalid_request",
                           f"{where}: id {bad} is not in the vocabulary (ids 0 to {size - 1})")
    return encoder.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)


def tokenize_routes(app, serving: Serving) -> None:
    """Adds /v1/tokenize, TEI's /tokenize and /decode and vLLM's /detokenize (and its tokenize, at
    TEI's path) to the FastAPI `app`.

    An answer is ~25 bytes of JSON per character read: its size is capped (max_tokenize_chars) and it
    is built and serialised in a tokenizer thread, so the event loop (and /healthz) never waits on it."""
    settings, runtime, require_ready = serving.settings, serving.runtime, serving.require_ready

    def check_tokenize_size(texts: list[str], text_pairs: list[str] | None) -> None:
        characters = sum(map(len, texts)) + sum(map(len, text_pairs or ()))
        if characters > settings.max_tokenize_chars:
            raise ApiError(413, "too_many_characters",
                           f"the request is {characters} characters; at most {settings.max_tokenize_chars} per "
                           "tokenize request (send fewer or shorter texts)",
                           characters=characters, limit=settings.max_tokenize_chars)

    async def json_answer(build) -> Response:
        """`build()`'s answer as JSON bytes, built and serialised in a tokenizer thread."""
        content = await asyncio.get_running_loop().run_in_executor(
            runtime.tokenize_executor, lambda: msgspec.json.encode(build()))
        return Response(content=content, media_type="application/json")

    async def json_body(request: Request) -> bytes:
        require_json(request.scope)
        check_query(request.scope)  # `?add_special_tokens=false` was ignored, the special tokens counted
        return await request.body()

    async def body_of(kind: type, request: Request):
        return decode(kind, await json_body(request), protocol_of(request.url.path)[1])

    @app.post("/v1/tokenize", tags=["tokenize"], responses={413: {}, 422: {}, 503: {}},
              openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request):
        """The word pieces of each input with their character offsets, and the windows the server would
        read it in (with this request's `window` / `stride`, or the defaults). At most `max_tokenize_chars`
        characters per request (413 above)."""
        require_ready()
        body = await body_of(TokenizeRequest, request)
        items = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if items and len({isinstance(item, str) for item in items}) > 1:
            raise ApiError(422, "invalid_request", "inputs must be all texts or all {text, text_pair} objects")
        pairs = bool(items) and not isinstance(items[0], str)
        texts = [item.text if pairs else item for item in items]
        text_pairs = [item.text_pair for item in items] if pairs else None
        check_tokenize_size(texts, text_pairs)
        reading = await serving.read_inputs(texts, text_pairs, False, body.window, body.stride)
        chosen = {k: v for k, v in serving.window_settings(body.window, body.stride).describe().items() if k != "rules"}
        return await json_answer(lambda: {
            "results": [describe(runtime.text, text, body.add_special_tokens) for text in reading.texts], **chosen})

    @app.post("/tokenize", tags=["tokenize"], responses={400: {}, 404: {}, 413: {}, 422: {}, 503: {}},
              openapi_extra=request_body(TeiTokenizeRequest))
    async def tei_tokenize(request: Request):
        """Text Embeddings Inference's route: `[[{id, text, special, start, stop}]]` per input (character
        offsets; special tokens have no offsets). At most `max_tokenize_chars` characters per request.
        A body with `prompt` (VllmTokenizeRequest) is vLLM's tokenize, answered VllmTokenizeResponse,
        its errors in OpenAI's shape."""
        require_ready()
        raw = await json_body(request)
        sent = probe(raw)
        if sent.has("prompt") or sent.has("messages"):  # vLLM's body
            try:
                return await vllm_tokenize(decode(VllmTokenizeRequest, raw, 400))
            except ApiError as exc:
                exc.protocol = "/detokenize"  # vLLM's
                raise
        body = decode(TeiTokenizeRequest, raw, protocol_of(request.url.path)[1])
        refuse_prompt(body.prompt_name)
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        check_tokenize_size(texts, None)
        reading = await serving.read_inputs(texts, None, False, None, None)
        return await json_answer(lambda: [tei_tokens(runtime.text, text.whole, body.add_special_tokens)
                                          for text in reading.texts])

    def served_model(model: str | None) -> None:
        """vLLM's `model`: the backbone's name or a loaded task's (one tokenizer reads for all), else 404."""
        if model is not None and model != runtime.model_info()[0] and model not in runtime.modules:
            raise ApiError(404, "model_not_found", f"no model {clip(model)}: this server's tokenizer is the "
                           f"backbone's, {runtime.model_info()[0]!r} (or name a loaded task)", param="model")

    async def vllm_tokenize(asked: VllmTokenizeRequest) -> Response:
        served_model(asked.model)
        if not asked.prompt.strip():  # vLLM answers no word pieces (or only the special ones)
            ids = [] if not asked.add_special_tokens else text_ids(runtime.text.encode([""])[0], True)
        else:
            check_tokenize_size([asked.prompt], None)
            reading = await serving.read_inputs([asked.prompt], None, False, None, None, names=lambda i: "prompt")
            ids = text_ids(reading.texts[0].whole, asked.add_special_tokens)
        strs = runtime.text.tokenizer.convert_ids_to_tokens(ids) if asked.return_token_strs else None
        return Response(msgspec.json.encode(VllmTokenizeResponse(len(ids), runtime.text.max_tokens, ids, strs)),
                        media_type="application/json")

    @app.post("/detokenize", tags=["tokenize"], responses={400: {}, 404: {}, 413: {}, 503: {}},
              openapi_extra=request_body(VllmDetokenizeRequest), response_model=None)
    async def vllm_detokenize(request: Request):
        """vLLM's route: word piece ids back to text (special tokens kept, as vLLM decodes), `{"prompt"}`;
        errors in OpenAI's shape."""
        require_ready()
        asked = await body_of(VllmDetokenizeRequest, request)
        served_model(asked.model)
        text, = decoded(runtime.text, [asked.tokens], False, "tokens", settings.max_tokenize_chars, 400)
        return Response(msgspec.json.encode(VllmDetokenizeResponse(text)), media_type="application/json")

    @app.post("/decode", tags=["tokenize"], responses={413: {}, 422: {}, 503: {}},
              openapi_extra=request_body(TeiDecodeRequest), response_model=None)
    async def tei_decode(request: Request):
        """Text Embeddings Inference's route: word piece ids back to text, one string per list of ids
        (`ids` one list, or a list of lists); special tokens left out unless `skip_special_tokens` is false."""
        require_ready()
        asked = await body_of(TeiDecodeRequest, request)
        lists = {isinstance(item, list) for item in asked.ids}
        if len(lists) > 1:
            raise ApiError(422, "invalid_request", "ids: send one list of ids, or a list of lists, not both mixed")
        ids = asked.ids if lists == {True} else [asked.ids]
        return decoded(runtime.text, ids, asked.skip_special_tokens, "ids", settings.max_tokenize_chars)
