"""The proxy's API key: clients send it on /v1/* (like vLLM's own middleware, which guards /v1 and leaves /health
and /metrics open), and the proxy sends its own to the instances. Only the key's digest is kept and compared, in
constant time, as vLLM's check does."""

from __future__ import annotations

import hashlib
import hmac
import json

from aiohttp import web


def _refusal(message: str) -> bytes:
    """A 401's body in OpenAI's shape (what its clients parse), built once."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


NO_KEY = _refusal("missing API key: send the header 'Authorization: Bearer <key>'")
WRONG_KEY = _refusal("incorrect API key provided")


class KeyGuard:
    """`key` None: auth off, and a request pays one attribute test for it."""

    def __init__(self, key: str | None):
        self._digest = hashlib.sha256(key.encode()).digest() if key else None
        # Clients authenticate to the proxy, the proxy to the instances: their header is replaced, not passed on.
        self.upstream_header = f"Bearer {key}" if key else None

    def refusal(self, req: web.Request) -> web.Response | None:
        """The 401 for a request without the key (None: it may pass)."""
        if self._digest is None or self._authorized(req):
            return None
        return web.Response(status=401, body=WRONG_KEY if "Authorization" in req.headers else NO_KEY,
                            content_type="application/json", headers={"WWW-Authenticate": "Bearer"})

    def _authorized(self, req: web.Request) -> bool:
        """The request's `Authorization: Bearer <key>` is the key (parsed as vLLM parses it)."""
        scheme, _, token = req.headers.get("Authorization", "").partition(" ")
        # surrogatepass: whatever the header held encodes (and mismatches) instead of raising.
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        return hmac.compare_digest(digest, self._digest) and scheme.lower() == "bearer"
