"""CORS: which browser origins may call the API (`--cors-origins`), as TEI's `--cors-allow-origin`
and vLLM's `--allowed-origins` do. Off by default: no CORS header is sent and a browser page on
another origin cannot read an answer.

Handled in the raw ASGI layer (server/api/app.py `TmodApp.__call__`), because the inference routes are
answered there and never reach a Starlette middleware. A preflight (OPTIONS with
Access-Control-Request-Method) from an allowed origin is answered before the API key is checked (a
browser sends no credentials with it); every answer to an allowed origin names it in
Access-Control-Allow-Origin and exposes tmod's own headers."""
from __future__ import annotations

import re

# request headers a preflight may ask for: a list of header-name tokens (RFC 9110 5.6.2), echoed back
HEADER_LIST = re.compile(rb"\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*\s*")
EXPOSED = "x-request-id, retry-after, inference-header-content-length"
PREFLIGHT_MAX_AGE_S = 600


class Cors:
    """The allowed origins, and the headers each answer to one of them carries."""

    def __init__(self, origins: str):
        listed = [o.strip() for o in origins.split(",") if o.strip()]
        self.any = "*" in listed
        self.origins = frozenset(o.lower().encode() for o in listed if o != "*")  # scheme and host: any case

    def allowed_origin(self, headers) -> bytes | None:
        """The request's Origin when it may call the API, else None (no Origin: not a cross-origin call)."""
        for name, value in headers:
            if name == b"origin":
                return value if self.any or value.lower() in self.origins else None
        return None

    def answer_headers(self, origin: bytes) -> dict[str, str]:
        """What every answer to `origin` carries."""
        if self.any:
            return {"access-control-allow-origin": "*", "access-control-expose-headers": EXPOSED}
        # the value is one of the configured origins but for case (checked above): safe to send back as it is
        return {"access-control-allow-origin": origin.decode("latin-1"), "access-control-expose-headers": EXPOSED,
                "vary": "origin"}

    @staticmethod
    def preflight_headers(headers) -> dict[str, str] | None:
        """The answer to a preflight (OPTIONS with Access-Control-Request-Method), or None when the
        request is not one: the methods tmod has, and the request headers it asked for."""
        method = asked = None
        for name, value in headers:
            if name == b"access-control-request-method":
                method = value
            elif name == b"access-control-request-headers":
                asked = value
        if method is None:
            return None
        out = {"access-control-allow-methods": "GET, POST", "access-control-max-age": str(PREFLIGHT_MAX_AGE_S),
               "content-type": "text/plain; charset=utf-8"}
        if asked is not None and HEADER_LIST.fullmatch(asked):
            out["access-control-allow-headers"] = asked.decode("latin-1").strip()
        return out
