"""API keys: where they come from (--api-key, repeatable; --api-key-file; PAGEDSERVE_API_KEY) and the
middleware that checks them.

Each presented token is compared with every configured key through SHA-256 digests and
hmac.compare_digest, without stopping at the first match: the time taken tells an attacker
neither which key nor how many leading bytes matched, nor a key's length. Keys are never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fastapi.responses import JSONResponse

from pagedserve.server.protocol import error_body
from pagedserve.server.web import is_public_request

# Paths that stay reachable without the API key (load balancers and Prometheus scrape them).
OPEN_PATHS = ("/health", "/metrics", "/version", "/ping", "/load")


def load_api_keys(keys=None, key_file: str | None = None) -> list[str]:
    """--api-key values (a string or a list), the non-empty lines of --api-key-file, and
    PAGEDSERVE_API_KEY when neither flag gave one. ValueError names what is wrong."""
    if isinstance(keys, str):
        keys = [keys]
    out = [k for k in (keys or []) if k]
    if key_file:
        try:
            lines = Path(key_file).expanduser().read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {e.strerror or e}") from None
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file: {key_file} holds no key (one key per line)")
        out += file_keys
    if not out and os.environ.get("PAGEDSERVE_API_KEY"):
        out = [os.environ["PAGEDSERVE_API_KEY"]]
    return list(dict.fromkeys(out))


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


class APIKeyMiddleware:
    """Pure ASGI middleware (keeps streaming and disconnect detection intact)."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self._digests = [_digest(k.encode()) for k in api_keys]

    def _matches(self, token: bytes) -> bool:
        d = _digest(token)
        ok = False
        for ref in self._digests:  # no early exit: the same work whichever key matches
            ok |= hmac.compare_digest(d, ref)
        return ok

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or path in OPEN_PATHS \
                or is_public_request(scope.get("method"), path):
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers") or ():
            if k == b"authorization":
                auth = v
                break
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and self._matches(token.strip()):
            return await self.app(scope, receive, send)
        msg = "Missing API key." if not auth else "Incorrect API key provided."
        resp = JSONResponse(error_body(msg, 401, param=None, code="invalid_api_key"), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)
