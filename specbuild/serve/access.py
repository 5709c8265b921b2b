"""Who may use the server: API keys (`--api-key`, SPECBUILD_API_KEY, `--api-key-file`) checked as
`Authorization: Bearer KEY` on every route but the open ones (/health always, /metrics unless `--protect-metrics`).

The check is an ASGI middleware in front of every route, unknown ones included, so nothing answers before it. Each
key is compared through its SHA-256 digest with a constant-time comparison against every configured key, so the time
taken says nothing about how much of a key was right or which key matched. A refusal is 401 with an OpenAI-style
error and `WWW-Authenticate: Bearer`, counted in /metrics like any other error.

An allowed request carries its key's tenant (scope state "tenant": a hash of the key, never the key): what drafters
that learn from traffic learn from one key's requests serves that key's alone (runtime Request.tenant), unless the
server shares one pool (`--shared-draft-pool`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.serve.errors import APIError

HEALTH, METRICS = "/health", "/metrics"


def load_keys(keys: Iterable[str], key_file: Path | None) -> tuple[str, ...]:
    """The keys given on the command line (or SPECBUILD_API_KEY) and in key_file (one per line; blank lines and
    lines starting with # are skipped); one-line errors for a key a client could not send."""
    found = [(key, "--api-key") for key in keys]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecbuildError(f"--api-key-file {key_file}: cannot read it: {exc}") from None
        entries = [(n, line.strip()) for n, line in enumerate(lines, 1) if line.strip()]
        file_keys = [(key, f"{key_file}:{n}") for n, key in entries if not key.startswith("#")]
        if not file_keys:
            raise SpecbuildError(f"--api-key-file {key_file}: no key in it (one key per line)")
        found += file_keys
    for key, where in found:
        if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            raise SpecbuildError(f"{where}: an API key must be printable ASCII without spaces (an HTTP header value)")
    return tuple(dict.fromkeys(key for key, _ in found))


class APIKeyMiddleware:
    """Refuses (401) every HTTP request to a closed path that does not carry one of the keys as a bearer token."""

    def __init__(
        self, app, keys: Iterable[str], protect_metrics: bool, on_refusal: Callable[[int], None], tenants: bool = True
    ):
        self.app = app
        self.tenants = tenants
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self.open_paths = {HEALTH} if protect_metrics else {HEALTH, METRICS}
        self.on_refusal = on_refusal

    def allows(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        matches = [hmac.compare_digest(digest, known) for known in self.digests]  # every key, no early exit
        return scheme.lower() == b"bearer" and any(matches)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.digests or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if self.allows(authorization):
            if self.tenants:
                scope.setdefault("state", {})["tenant"] = tenant(authorization.partition(b" ")[2].strip())
            await self.app(scope, receive, send)
            return
        self.on_refusal(401)
        message = "a valid API key is required: send it as 'Authorization: Bearer KEY'"
        if authorization:
            message = "the API key is not valid (send it as 'Authorization: Bearer KEY')"
        response = APIError(401, message).response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def tenant(key: bytes) -> str:
    """The tenant of an API key: 16 hex digits of a hash of it (a pool's file name under --draft-pool)."""
    return hashlib.sha256(b"specbuild tenant " + key).hexdigest()[:16]
