"""``SGLangClient``: the Sampler protocol over SGLang's native HTTP API (httpx), for a real SGLang server
or the embedded one, interchangeably.

Errors (all from t1async.protocol.errors)::

    SamplerError                 no URL answered usably after the retries (names the URL and the cause),
    │                            the client was used after ``aclose()`` (SamplerClosedError), or a sampler
    │                            reports a weight_version that is not an integer (SamplerVersionError)
    └── SamplerRequestError      the server rejected the request (HTTP 400): our fault, never retried

Connection errors, timeouts and HTTP 502/503/504/429 are retried with exponential backoff and jitter,
moving to the least-loaded other URL where there is one. Requests go to the URL with the fewest
outstanding requests (ties rotate), under a load cap; an episode's turns stay on one sampler, and a client
running ``monitor()`` takes dead samplers out and brings them back (t1async/sampler/pool.py).

Decoding the answers (pure functions) is response.py. Routing needs the model's (layers, topk, experts),
from its ``config.json`` as SGLang sizes its trace: ``routing_shape`` if given, else ``model_dir``'s
``config.json``, else the ``config.json`` under the ``model_path`` a URL's ``/model_info`` names, when that is
a directory here (SGLang's ``/model_info`` has no layer count). Routes asked for and not returned (SGLang
without ``--enable-return-routed-experts``) raise SamplerError.

Logprobs: t1async trains on the model's own logprob (temperature 1). SGLang returns ``log_softmax(logits /
T)`` unless started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``sglang/srt/layers/sampler.py``), and says so only in
``/server_info``'s ``internal_states[].env_vars`` when also started with ``SGLANG_EXPOSE_OWN_ENV_VARS=1``;
the first request at a temperature other than 0 and 1 checks every URL and raises SamplerError naming both
settings where that is not shown (the embedded sampler shows it). ``train_logprobs=False`` (eval) skips it.

Keys (auth.py): ``api_key`` goes on every request as ``Authorization: Bearer``, ``admin_key`` (else
``api_key``) on the admin endpoints; each defaults to ``$T1_SAMPLER_API_KEY`` / ``$T1_SAMPLER_ADMIN_KEY``
(``""``: send none). A 401 raises SamplerError saying which key to give.
"""

from __future__ import annotations

import enum
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import anyio
import httpx

from t1async.protocol.errors import SamplerError, SamplerRequestError, SamplerVersionError
from t1async.protocol.sampling import Generation, SamplingParams
from t1async.sampler.auth import ADMIN_KEY_ENV, ADMIN_PATHS, API_KEY_ENV
from t1async.sampler.pool import PoolConfig, SamplerPool
from t1async.sampler.response import (
    error_message,
    parse_generation,
    parse_weight_version,
    shape_from_config,
)

try:
    from t1async.log import get_logger
except ImportError:  # pragma: no cover
    import structlog

    def get_logger(name: str, **fields: Any) -> Any:
        return structlog.get_logger(name).bind(component=name, **fields)


__all__ = [
    "SGLangClient",
    "SamplerClosedError",
    "SamplerUnreachableError",
]
log = get_logger("sampler.client")
_RETRY_STATUS = {429, 502, 503, 504}
_TRUE = ("1", "true", "yes", "on")


def shape_of_model(model_dir: str | Path) -> tuple[int, int, int]:
    """(layers, topk, experts) from ``model_dir/config.json`` (``response.shape_from_config``)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SamplerError(f"cannot read the routing shape from {path}: {exc}") from exc
    return shape_from_config(cfg if isinstance(cfg, dict) else {}, str(path))


def original_logprobs(server_info: dict) -> bool | None:
    """Whether ``/server_info`` shows ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set on every DP rank (None: it shows
    no ``env_vars``, SGLang started without ``SGLANG_EXPOSE_OWN_ENV_VARS=1``)."""
    states = server_info.get("internal_states")
    envs = [st.get("env_vars") for st in states if isinstance(st, dict)] if isinstance(states, list) else []
    shown = [e for e in envs if isinstance(e, dict)]
    if not shown or len(shown) != len(envs):
        return None
    return all(str(e.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")).strip().lower() in _TRUE for e in shown)


class SamplerClosedError(SamplerError):
    """The client was used after ``aclose()``: your code closed it."""


class SamplerUnreachableError(SamplerError):
    """Every attempt failed to reach the sampler (refused, reset, timed out): it is down, not wrong."""


class _Keys(httpx.Auth):
    """``Authorization: Bearer`` with the admin key on the admin endpoints, the API key elsewhere."""

    def __init__(self, api_key: str | None, admin_key: str | None) -> None:
        self.api_key, self.admin_key = api_key, admin_key

    def auth_flow(self, request: httpx.Request) -> Any:
        key = (self.admin_key or self.api_key) if request.url.path in ADMIN_PATHS else self.api_key
        if key:
            request.headers["Authorization"] = f"Bearer {key}"
        yield request


def _key(given: str | None, env: str) -> str | None:
    return (os.environ.get(env) if given is None else given) or None


class _State(enum.Enum):
    UNOPENED = 1
    OPENED = 2
    CLOSED = 3


class SGLangClient:
    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        http2: bool = False,
        routing_shape: tuple[int, int, int] | None = None,  # (layers, topk, experts)
        model_dir: str | Path | None = None,  # its config.json gives routing_shape
        train_logprobs: bool = True,  # False: logprobs are not trained on (eval), any temperature goes
        transport: httpx.AsyncBaseTransport | None = None,
        pool: PoolConfig | None = None,  # pinning, load cap, health (t1async/sampler/pool.py)
        api_key: str | None = None,  # None: $T1_SAMPLER_API_KEY; "": none
        admin_key: str | None = None,  # None: $T1_SAMPLER_ADMIN_KEY; "": none (the API key goes instead)
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one sampler URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_retries = max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.routing_shape = routing_shape
        self.model_dir = model_dir  # read when the first routes come back (a dense model never asks)
        self._logprobs_checked = not train_logprobs
        self.flush_on_update = True  # /update_weights_from_disk's flush_cache (False: left running, in_place)
        self.outstanding = {u: 0 for u in self.urls}
        self.requests_sent = {u: 0 for u in self.urls}
        self.pool = SamplerPool(self.urls, self.outstanding, pool)
        self._monitored = False  # only a client running monitor() takes failed samplers out (and back)
        self._info: dict[str, dict] = {}
        self._state = _State.UNOPENED
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            http2=http2,
            transport=transport,
            auth=_Keys(_key(api_key, API_KEY_ENV), _key(admin_key, ADMIN_KEY_ENV)),
        )

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        if self._state is _State.CLOSED:
            raise SamplerClosedError("this SGLangClient was closed; create a new one")
        self._state = _State.OPENED
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            await self._http.aclose()

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise SamplerClosedError(f"this SGLangClient (for {', '.join(self.urls)}) was closed; create a new one")

    # ---------------------------------------------------------------- HTTP with retries

    def _pick(self, avoid: str | None = None, key: str | None = None) -> str:
        return self.pool.pick(key, avoid)

    async def monitor(self) -> None:
        """Probe every sampler's ``/health_generate`` forever; take failed ones out, bring them back healthy and
        at the current policy version (SamplerPool). Run it in the owner's task group."""
        self._monitored = True
        try:
            await self.pool.monitor(self._probe)
        finally:
            self._monitored = False

    async def _probe(self, url: str) -> tuple[bool | None, int | None]:
        """(healthy, live weight_version): True after a ``/health_generate`` token, False when that fails;
        None (held: left in or out as it is) when ``/ready`` says 503 and the token waits, as it does
        while a weight push pauses the sampler (SGLang's ``/health_generate`` waits out a pause)."""
        wait = max(0.5, self.pool.config.probe_timeout_s / 2)
        try:
            ready = (await self._http.get(url + "/ready", timeout=wait)).status_code
            try:
                ok: bool | None = (await self._http.get(url + "/health_generate", timeout=wait)).status_code == 200
            except httpx.TimeoutException:
                if ready != 503:  # not paused: a token that does not come is a sick sampler
                    return False, None
                ok = None
            return ok, await self._live_version(url) if ok is not False else None
        except (httpx.HTTPError, ValueError, SamplerVersionError):
            return False, None

    async def _live_version(self, url: str) -> int | None:
        """``/model_info``'s ``weight_version`` (else ``/get_model_info``'s): the live one. ``/server_info``'s
        is the start-up value (SGLang's ``server_info`` docstring)."""
        for path in ("/model_info", "/get_model_info"):
            resp = await self._http.get(url + path)
            if resp.status_code != 404:
                info = resp.json() if resp.status_code == 200 else {}
                raw = info.get("weight_version") if isinstance(info, dict) else None
                return None if raw is None else parse_weight_version(raw, url)
        return None

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        url: str | None = None,
        rid_attempts: bool = False,
        pin: str | None = None,
    ) -> tuple[str, httpx.Response]:
        """Send with retries; returns (url, response) for a 2xx. ``url`` pins one server (no balancing)."""
        self._check_open()
        last: str | None = None
        cause = ""
        for attempt in range(self.max_retries + 1):
            target = url or self._pick(avoid=last, key=pin)
            body = json
            if rid_attempts and attempt and isinstance(json, dict) and json.get("rid"):
                body = {**json, "rid": f"{json['rid']}-retry{attempt}"}  # the first try may still run there
            self.outstanding[target] += 1
            self.requests_sent[target] += 1
            try:
                resp = await self._http.request(method, target + path, json=body)
            except httpx.TransportError as exc:
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                resp = None
                if self._monitored and url is None:  # unreachable: out until the monitor sees it healthy
                    self.pool.mark_down(target, cause)
            finally:
                self.outstanding[target] -= 1
            if resp is not None:
                if resp.status_code < 300:
                    return target, resp
                if resp.status_code == 400:
                    raise SamplerRequestError(f"{target}{path} rejected the request: {error_message(resp)}")
                cause = f"HTTP {resp.status_code}: {error_message(resp)}"
                if resp.status_code == 401:
                    which = "admin key" if path in ADMIN_PATHS else "API key"
                    cause += (
                        f" (the sampler wants its {which}: pass --sampler-api-key/--sampler-admin-key or set "
                        f"{API_KEY_ENV}/{ADMIN_KEY_ENV})"
                    )
                if resp.status_code not in _RETRY_STATUS:
                    raise SamplerError(f"{target}{path} failed with {cause}")
            last = target
            if attempt < self.max_retries:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random())
                log.warning(
                    "sampler.retry", url=target, path=path, attempt=attempt + 1, cause=cause, delay_s=round(delay, 3)
                )
                await anyio.sleep(delay)
        raise (SamplerUnreachableError if resp is None else SamplerError)(
            f"{last}{path} failed after {self.max_retries + 1} attempts (urls: {', '.join(self.urls)}); "
            f"last cause: {cause}"
        )

    # ---------------------------------------------------------------- the Sampler protocol

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        ids = [int(t) for t in input_ids]
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": params.to_sglang(),
            "return_logprob": True,
            "logprob_start_len": max(len(ids) - 1, 0),
            "stream": False,
        }
        if routed_experts_start_len is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = int(routed_experts_start_len)
        if rid is not None:
            body["rid"] = rid
        if 0.0 < params.temperature and abs(params.temperature - 1.0) > 1e-6 and not self._logprobs_checked:
            await self._check_logprobs(params.temperature)
        t0 = time.perf_counter()
        pin = rid.rsplit("/", 1)[0] if rid and "/" in rid else None  # the agent's rid: "<episode>/<turn>"
        url, resp = await self._request("POST", "/generate", json=body, rid_attempts=True, pin=pin)
        latency = time.perf_counter() - t0
        try:
            out = resp.json()
        except ValueError as exc:
            raise SamplerError(f"{url}/generate answered with non-JSON: {resp.text[:200]!r}") from exc
        shape = None
        if routed_experts_start_len is not None:
            shape = self.routing_shape or await self._shape_from(url)
        return parse_generation(out, len(ids), routed_experts_start_len, shape, latency=latency, url=url)

    async def _shape_from(self, url: str) -> tuple[int, int, int]:
        """The routing shape from ``model_dir``'s ``config.json``, else from the one under ``url``'s
        ``/model_info`` ``model_path`` when that is a directory on this machine (the embedded sampler, a local
        SGLang); remembered."""
        if self.model_dir is not None:
            self.routing_shape = shape_of_model(self.model_dir)
            return self.routing_shape
        path = (await self.model_info(url)).get("model_path")
        if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
            raise SamplerError(
                f"{url} serves {path!r}, which has no config.json here, and SGLang does not say the MoE shape: "
                "pass SGLangClient(model_dir=<the model dir>) or routing_shape=(num_hidden_layers, "
                "num_experts_per_tok, num_experts)"
            )
        self.routing_shape = shape_of_model(path)
        return self.routing_shape

    async def _check_logprobs(self, temperature: float) -> None:
        """Every URL must return the model's own logprobs at this temperature (module doc)."""
        from t1async.sampler.weightpush import server_info  # weightpush imports torch: only when needed

        bad: list[str] = []

        async def one(u: str) -> None:
            if original_logprobs(await server_info(self, u)) is not True:
                bad.append(u)

        async with anyio.create_task_group() as tg:
            for u in self.urls:
                tg.start_soon(one, u)
        if bad:
            raise SamplerError(
                f"{', '.join(bad)} may return log_softmax(logits / {temperature:g}), not the model's own logprobs "
                "(SGLang's default at a temperature other than 0 and 1): start SGLang with "
                "SGLANG_RETURN_ORIGINAL_LOGPROB=1 and SGLANG_EXPOSE_OWN_ENV_VARS=1 (so /server_info shows it)"
            )
        self._logprobs_checked = True

    # ---------------------------------------------------------------- control

    async def model_info(self, url: str | None = None) -> dict:
        """``/get_model_info`` of ``url`` (default: any), cached per URL. SGLang's keys only: no MoE shape
        (``model_dir``), and its ``weight_version`` is the one of when it was read."""
        if url is not None and url in self._info:
            return self._info[url]
        got, resp = await self._request("GET", "/get_model_info", url=url)
        self._info[got] = resp.json()
        return self._info[got]

    async def health(self) -> dict[str, bool]:
        """``/health`` of every URL (no retries): {url: healthy}."""
        self._check_open()
        result: dict[str, bool] = {}

        async def one(u: str) -> None:
            try:
                result[u] = (await self._http.get(u + "/health")).status_code == 200
            except httpx.TransportError:
                result[u] = False

        async with anyio.create_task_group() as tg:
            for u in self.urls:
                tg.start_soon(one, u)
        return result

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None) -> list[dict]:
        """POST ``/update_weights_from_disk`` to every URL (concurrently); raises if any fails, except samplers
        that cannot be reached while another took the weights (logged ``sampler.push_skipped``): a restarted
        sampler is re-synced by the next push, and a monitoring client keeps it out until then."""
        body: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not self.flush_on_update:  # SGLang's flush fails the update while requests run (in_place)
            body["flush_cache"] = False
        results: dict[str, dict] = {}
        errors: dict[str, str] = {}
        unreachable: dict[str, str] = {}  # down (refused, timed out): tolerated if another sampler took the weights

        async def one(u: str) -> None:
            try:
                _, resp = await self._request("POST", "/update_weights_from_disk", json=body, url=u)
                results[u] = resp.json()
            except SamplerUnreachableError as exc:
                unreachable[u] = str(exc)
            except SamplerError as exc:
                errors[u] = str(exc)

        async with anyio.create_task_group() as tg:
            for u in self.urls:
                tg.start_soon(one, u)
        if unreachable and (errors or not results or len(self.urls) == 1):
            errors.update(unreachable)
        elif unreachable:  # a dead sampler gets the next push when it is back (and stays out of use until then)
            log.warning(
                "sampler.push_skipped", urls=list(unreachable), model_path=model_path, weight_version=weight_version
            )
        if errors:
            raise SamplerError(
                f"update_weights_from_disk({model_path}) failed on {len(errors)} of "
                f"{len(self.urls)} samplers: " + "; ".join(f"{u}: {e}" for u, e in errors.items())
            )
        self._info.clear()  # weight_version changed
        return [results[u] for u in self.urls if u in results]

    async def post_once(self, url: str, path: str, body: dict) -> httpx.Response:
        """POST ``body`` to ``url + path`` once: no retries, no balancing, any status returned (for a call a
        resend would repeat, e.g. a weight-update broadcast). Raises ``httpx.TransportError`` as is."""
        self._check_open()
        return await self._http.post(url + path, json=body)

    async def get_once(self, url: str, path: str, *, timeout_s: float | None = None) -> httpx.Response:
        """GET ``url + path`` once (no retries; ``timeout_s``: else the client's). Raises ``httpx.HTTPError``."""
        self._check_open()
        if timeout_s is None:
            return await self._http.get(url + path)
        return await self._http.get(url + path, timeout=timeout_s)

    async def flush_cache(self) -> None:
        for u in self.urls:
            await self._request("POST", "/flush_cache", url=u)

    async def abort(self, rid: str) -> None:
        for u in self.urls:
            await self._request("POST", "/abort_request", json={"rid": rid}, url=u)
