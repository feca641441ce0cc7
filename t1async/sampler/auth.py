"""Keys for the sampler's HTTP API, the way SGLang checks them (design §4).

``--api-key KEY`` guards every endpoint; ``--admin-api-key KEY`` guards the admin ones (``ADMIN_PATHS``: the
weight updates and their session, the pause, the cache flush, the abort). A request carries its key as
``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as SGLang also takes). As SGLang's ``decide_request_auth``:

- ``OPTIONS`` and paths that start with ``/health``, ``/ready`` or ``/metrics`` are never checked (probes
  carry no secret): ``/health`` and ``/health_generate`` stay open;
- a normal endpoint needs the API key when one is set (the admin key does not open it);
- an admin endpoint needs the admin key when one is set (the API key does not open it), else the API key
  when one is set, else nothing;
- a refused request is HTTP 401 with SGLang's body ``{"error": "Unauthorized"}``.

A key comes from the flag, from a file (``--api-key-file``, first line) or from the environment
(``T1_SAMPLER_API_KEY``, ``T1_SAMPLER_ADMIN_KEY``; our clients read the same names). Keys are never logged.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from t1async.log import get_logger
from t1async.protocol.errors import ConfigError

__all__ = [
    "ADMIN_PATHS",
    "API_KEY_ENV",
    "ADMIN_KEY_ENV",
    "exempt",
    "allowed",
    "KeyMiddleware",
    "read_key",
]
log = get_logger("sampler.auth")

API_KEY_ENV = "T1_SAMPLER_API_KEY"
ADMIN_KEY_ENV = "T1_SAMPLER_ADMIN_KEY"
# the endpoints SGLang marks AuthLevel.ADMIN_OPTIONAL that the embedded sampler serves
ADMIN_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/destroy_weights_update_group",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/abort_request",
    }
)
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def exempt(method: str, path: str) -> bool:
    """Requests no key is asked for (SGLang's exemptions)."""
    return method == "OPTIONS" or path.startswith(_OPEN_PREFIXES)


def _matches(authorization: str | None, x_api_key: str | None, key: str) -> bool:
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode()):
            return True
    return bool(x_api_key) and hmac.compare_digest(str(x_api_key).encode(), key.encode())


def allowed(
    method: str,
    path: str,
    authorization: str | None,
    x_api_key: str | None,
    api_key: str | None,
    admin_key: str | None,
) -> bool:
    """Whether a request with these headers may reach ``path`` (the rules in the module doc)."""
    if exempt(method, path):
        return True
    if path in ADMIN_PATHS:
        need = admin_key or api_key
    else:
        need = api_key
    return need is None or _matches(authorization, x_api_key, need)


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def _drain(receive: Receive, limit: int = 1 << 20) -> None:
    """Read a refused request's body (up to ``limit`` bytes), so the connection is in a clean state."""
    seen = 0
    while seen <= limit:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


class KeyMiddleware:
    """ASGI middleware in front of the sampler's routes (a refused request never reaches a handler)."""

    def __init__(self, app: Any, *, api_key: str | None, admin_key: str | None) -> None:
        self.app, self.api_key, self.admin_key = app, api_key, admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if allowed(method, path, headers.get("authorization"), headers.get("x-api-key"), self.api_key, self.admin_key):
            await self.app(scope, receive, send)
            return
        log.info("sampler.unauthorized", path=path, method=method, had_key="authorization" in headers)
        await _drain(receive)
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # the server may drop this connection once it answered a request it did not serve: say so,
                    # so that the client opens a new one rather than reuse it as it closes
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def read_key(value: str | None, file: Path | None, env: str, flag: str) -> str | None:
    """The key from ``flag`` (``value``), else ``flag``-file's first line, else ``$env``; None when none is
    given. Both a value and a file is an error; so is an empty key."""
    if value is not None and file is not None:
        raise ConfigError(f"give {flag} or {flag}-file, not both")
    if file is not None:
        try:
            text = Path(file).read_text()
            mode = Path(file).stat().st_mode
        except OSError as exc:
            raise ConfigError(f"{flag}-file {file}: cannot read it ({exc.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("sampler.key_file_open", file=str(file), mode=oct(mode & 0o777), hint="chmod 600 it")
        value = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not value:
            raise ConfigError(f"{flag}-file {file} is empty: write the key on its first line")
        return value
    if value is None:
        value = os.environ.get(env) or None
    if value is not None and not value.strip():
        raise ConfigError(f"{flag} is empty: pass a key, or leave it out for none")
    return value
