"""What the server reads of a text: its word pieces with character offsets, and its windows
(`/v1/tokenize`, and Text Embeddings Inference's `/tokenize` route shape); and back, word piece ids
to text (TEI's `/decode`, vLLM's `/detokenize`)."""
from __future__ import annotations

from server.backbone.tokens import END, IDS, SEGMENT, START, EncodedInput, TextEncoder
from server.errors import ApiError
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
