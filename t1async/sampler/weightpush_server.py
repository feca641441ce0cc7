"""The embedded sampler's side of SGLang's distributed weight update, over a gloo group (design §10).

Endpoints (bodies in weightpush.py): ``/init_weights_update_group``, ``/begin_weight_update``,
``/update_weights_from_distributed``, ``/end_weight_update``, ``/destroy_weights_update_group``,
``/pause_generation``, ``/continue_generation``, and ``/ready`` (200, or 503 while paused, as SGLang's).

- As SGLang 0.5.23 (``sglang/srt/managers/scheduler_components/weight_updater.py``):
  ``/update_weights_from_distributed`` outside a ``/begin_weight_update`` .. ``/end_weight_update`` session
  answers ``success: false`` (400); a second begin, or an end without a begin, fails the same way. The
  session outlives a pause and its expiry (SGLang's has no timeout): a new learner closes a session its
  crashed predecessor left open.
- ``/pause_generation`` takes SGLang's ``mode`` (default ``abort``, as SGLang) and the engine carries it out
  before the reply (``Engine.pause``): ``abort`` ends every in-flight request with finish_reason abort;
  ``in_place`` freezes running requests where they are, KV kept (an update then lands under them: they go on
  with new weights over old KV, as in SGLang, which mixes policies); ``retract`` drops their KV and requeues
  them with their sampled tokens, to be re-prefilled under the weights of ``/continue_generation`` (nothing is
  aborted, nothing mixes). Replies are SGLang's ``{"message": ..., "status": "ok"}``; a bad mode is a
  400 naming the modes.
- While paused, new ``/generate`` requests wait (``gate``) and received buckets are staged; continue applies
  the staged tensors as ONE engine update (the same atomic swap between engine steps as a disk update: no
  token is ever computed with half-old, half-new weights), then resumes the engine and lets the waiting
  requests in. ``/update_weights_from_disk`` inside a pause applies at once (SGLang does the same).
- Not paused, each bucket is applied as it arrives (as SGLang does); the engine retracts running requests
  around each swap, so none mixes policies.
- A pause lasts at most ``pause_timeout_s`` (``--pause-timeout``, default 300 s; a trainer that died mid-push must
  not stall every actor): then the staged tensors are dropped, generation goes on with the old weights, and
  that push's remaining buckets and its continue are refused (success false) until the next pause. A
  broadcast that fails mid-bucket (the trainer went away) ends the pause the same way at once.
- A bucket whose names or shapes do not fit the model is still received (so the learner's broadcast never
  hangs) and then rejected with 400; the model is unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from t1async.log import get_logger
from t1async.model.engine import PAUSE_MODES
from t1async.model.weights import check_state
from t1async.protocol.errors import SamplerRequestError
from t1async.sampler import weightpush as W
from t1async.sampler.app import SamplerApp

log = get_logger("sampler.weightpush")


def _reply(success: bool, message: str, status: int | None = None) -> Response:
    body = json.dumps({"success": success, "message": message})
    return Response(body, status_code=status or (200 if success else 400), media_type="application/json")


def _done(message: str) -> Response:
    """SGLang's reply to /pause_generation and /continue_generation (``sglang/srt/entrypoints/http_server.py``)."""
    body = json.dumps({"message": message, "status": "ok"})
    return Response(body, status_code=200, media_type="application/json")


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SamplerRequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise SamplerRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _need(body: dict, key: str, kind: type, default: Any = ...) -> Any:
    v = body.get(key, default)
    if v is ... or not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise SamplerRequestError(f"{key} must be a {kind.__name__}, got {body.get(key)!r}")
    return v


class WeightPushServer:
    """The group, the pause gate and the staged tensors of one embedded sampler (``app.engine``)."""

    def __init__(self, app: SamplerApp, pause_timeout_s: float | None = None) -> None:
        self.app = app
        self.pause_timeout_s = float(pause_timeout_s if pause_timeout_s is not None else app.config.pause_timeout)
        self._paused_at = 0.0
        self.expired = False  # the current push outlived its pause: refuse its buckets until the next pause
        self.groups: dict[str, Any] = {}  # group_name -> ProcessGroup
        self.paused = False
        self._resumed = anyio.Event()
        self._resumed.set()
        self.rejected = ""  # a bucket of the paused push did not fit: the rest of it is refused, nothing applied
        self.staged: dict[str, torch.Tensor] = {}
        self.staged_version: str | None = None
        self.session = False  # a /begin_weight_update without its /end_weight_update yet
        self._lock = anyio.Lock()  # one update at a time (broadcasts must be received in order)

    # ------------------------------------------------------------------ the /generate gate

    def gate(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def gated(request: Request) -> Response:
            while self.paused:
                left = self._paused_at + self.pause_timeout_s - time.monotonic()
                if left <= 0:
                    self._expire(f"paused longer than {self.pause_timeout_s:g} s")
                    break
                with anyio.move_on_after(left):
                    await self._resumed.wait()
            return await handler(request)

        return gated

    def hold(
        self, handler: Callable[[Request], Awaitable[Response]], timeout_s: float
    ) -> Callable[[Request], Awaitable[Response]]:
        """``/health_generate`` as SGLang's: its token waits out a pause like any request, and after
        ``timeout_s`` in all the answer is 503 (``HEALTH_CHECK_TIMEOUT``, 20 s)."""
        gated = self.gate(handler)

        async def held(request: Request) -> Response:
            with anyio.move_on_after(timeout_s):
                return await gated(request)
            return Response(status_code=503)

        return held

    async def ready(self, request: Request) -> Response:
        """SGLang's ``/ready``: 200 when it takes new requests, 503 while paused."""
        return Response(status_code=503 if self.paused else 200)

    async def begin(self, request: Request) -> Response:
        if self.session:
            return _reply(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = True
        return _reply(True, "Success")

    async def end(self, request: Request) -> Response:
        if not self.session:
            return _reply(False, "no weight-update session is open; call begin_weight_update() first")
        self.session = False
        return _reply(True, "Success")

    def _expire(self, why: str) -> None:
        """End a pause without its continue: drop the staged tensors, serve the old weights."""
        if not self.paused:
            return
        log.warning(
            "sampler.pause_expired",
            why=why,
            staged=len(self.staged),
            paused_s=round(time.monotonic() - self._paused_at, 3),
        )
        self.staged, self.staged_version = {}, None
        self.paused, self.expired = False, True
        self.app.engine.resume()
        self._resumed.set()

    # ------------------------------------------------------------------ endpoints

    async def init_group(self, request: Request) -> Response:
        try:
            b = await _body(request)
            host, port = _need(b, "master_address", str), _need(b, "master_port", int)
            offset, world = _need(b, "rank_offset", int), _need(b, "world_size", int)
            name, backend = _need(b, "group_name", str, W.DEFAULT_GROUP), _need(b, "backend", str, "gloo")
            if backend != "gloo":
                raise SamplerRequestError(f"backend {backend!r}: the embedded sampler runs on CPU; use backend 'gloo'")
            if not 0 < offset < world:
                raise SamplerRequestError(
                    f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer), got {offset} of {world}"
                )
            if name in self.groups:
                raise SamplerRequestError(f"group {name!r} exists; /destroy_weights_update_group it first")
        except SamplerRequestError as exc:
            return _reply(False, str(exc))
        t0 = time.perf_counter()
        try:
            pg = await anyio.to_thread.run_sync(
                lambda: W.open_group(
                    None, host=host, port=port, rank=offset, world_size=world, group_name=name, backend=backend
                )
            )
        except Exception as exc:  # rendezvous timed out, the store is unreachable
            log.warning("sampler.weight_group_failed", group=name, error=repr(exc))
            return _reply(False, f"Failed to init group {name}: {exc}", 500)
        self.groups[name] = pg
        log.info(
            "sampler.weight_group",
            group=name,
            rank=offset,
            world_size=world,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return _reply(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: Request) -> Response:
        try:
            name = _need(await _body(request), "group_name", str, W.DEFAULT_GROUP)
        except SamplerRequestError as exc:
            return _reply(False, str(exc))
        if self.groups.pop(name, None) is None:
            return _reply(False, f"no weight update group {name!r}; nothing to destroy")
        log.info("sampler.weight_group_destroyed", group=name)
        return _reply(True, f"Succeeded to destroy group {name}.")

    async def update(self, request: Request) -> Response:
        try:
            b = await _body(request)
            names, dtypes, shapes = _need(b, "names", list), _need(b, "dtypes", list), _need(b, "shapes", list)
            if not (len(names) == len(dtypes) == len(shapes)) or not names:
                raise SamplerRequestError(
                    f"names, dtypes and shapes must be non-empty and of one length, got "
                    f"{len(names)}, {len(dtypes)}, {len(shapes)}"
                )
            tensors = []
            for n, d, s in zip(names, dtypes, shapes):
                if (
                    not isinstance(n, str)
                    or not isinstance(s, list)
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)
                ):
                    raise SamplerRequestError(
                        f"each name must be a string and each shape a list of ints >= 0, got {n!r} {s!r}"
                    )
                tensors.append(torch.empty(s, dtype=W.parse_dtype(d)))
            name = _need(b, "group_name", str, W.DEFAULT_GROUP)
            weight_version = b.get("weight_version")
            if weight_version is not None and (
                not isinstance(weight_version, (str, int)) or isinstance(weight_version, bool)
            ):
                raise SamplerRequestError(f"weight_version must be a string, got {weight_version!r}")
            pg = self.groups.get(name)
            if pg is None:
                raise SamplerRequestError(f"no weight update group {name!r}: call /init_weights_update_group first")
        except (SamplerRequestError, ValueError) as exc:
            return _reply(False, str(exc))
        if not self.session:  # SGLang answers before receiving: the learner's broadcast then fails, not hangs
            return _reply(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        async with self._lock:
            t0 = time.perf_counter()
            try:
                await anyio.to_thread.run_sync(W.broadcast, pg, tensors)
            except Exception as exc:  # the trainer went away mid-bucket: the group is unusable
                self.groups.pop(name, None)
                self._expire(f"receive failed: {exc!r}")
                log.warning("sampler.weight_receive_failed", group=name, error=repr(exc))
                return _reply(False, f"Failed to receive weights over group {name} (group dropped): {exc}", 500)
            bucket = dict(zip(names, tensors))
            if self.expired:
                return _reply(
                    False,
                    f"the pause ended after {self.pause_timeout_s:g} s before this push finished; "
                    "its buckets were dropped: /pause_generation and push again",
                )
            if self.paused and self.rejected:
                return _reply(False, f"an earlier bucket of this push was rejected ({self.rejected}); push again")
            try:  # names and shapes checked now, the model untouched; applied now or at continue
                check_state(self.app.engine.state_shapes(), bucket, where="update_weights_from_distributed")
            except Exception as exc:
                if self.paused:  # the version is all or nothing: what was staged of it goes too
                    self.rejected = str(exc)
                    self.staged, self.staged_version = {}, None
                return _reply(False, f"Failed to update weights: {exc}")
            weight_version = None if weight_version is None else str(weight_version)
            if self.paused:
                self.staged.update(bucket)
                self.staged_version = weight_version if weight_version is not None else self.staged_version
            else:
                try:
                    await self.app.engine.update_weights_from_tensors(bucket, weight_version=weight_version)
                except Exception as exc:  # the engine stopped; the model is unchanged
                    return _reply(False, f"Failed to update weights: {exc}")
        log.info(
            "sampler.weights_received",
            group=name,
            tensors=len(names),
            staged=self.paused,
            mb=round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 2),
            seconds=round(time.perf_counter() - t0, 3),
        )
        return _reply(True, "Succeeded to update parameter online.")

    async def pause(self, request: Request) -> Response:
        try:
            mode = _need(await _body(request), "mode", str, "abort")
            if mode not in PAUSE_MODES:
                raise SamplerRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        except SamplerRequestError as exc:
            return _reply(False, str(exc))
        if not self.paused:
            self.paused, self._resumed, self._paused_at = True, anyio.Event(), time.monotonic()
        self.expired, self.rejected = False, ""
        running = len(self.app.active)
        await self.app.engine.pause(mode)  # carried out by the step loop before we answer
        log.info("sampler.paused", mode=mode, in_flight=running)
        return _done("Generation paused successfully.")

    async def resume(self, request: Request) -> Response:
        if self.expired:
            return _reply(
                False,
                f"the pause ended after {self.pause_timeout_s:g} s before continue; the update "
                "was dropped and the old weights serve: /pause_generation and push again",
            )
        async with self._lock:
            staged, weight_version = self.staged, self.staged_version
            self.staged, self.staged_version = {}, None
            if self.rejected:
                log.warning("sampler.push_dropped", why=self.rejected)
                self.rejected = ""
            error = None
            if staged:
                try:
                    await self.app.engine.update_weights_from_tensors(staged, weight_version=weight_version)
                except Exception as exc:
                    error = exc
            self.app.engine.resume()  # retracted requests are re-prefilled with the weights of now
            self.paused = False
            self._resumed.set()
        if error is not None:
            log.warning("sampler.weights_update_failed", error=repr(error))
            return _reply(False, f"Generation continued on the old weights; the staged update failed: {error}")
        log.info("sampler.continued", applied=len(staged), weight_version=str(self.app.engine.weight_version))
        return _done("Generation continued successfully.")

    def routes(self) -> list[Route]:
        return [
            Route("/init_weights_update_group", self.init_group, methods=["POST"]),
            Route("/begin_weight_update", self.begin, methods=["POST"]),
            Route("/end_weight_update", self.end, methods=["POST"]),
            Route("/update_weights_from_distributed", self.update, methods=["POST"]),
            Route("/destroy_weights_update_group", self.destroy_group, methods=["POST"]),
            Route("/pause_generation", self.pause, methods=["POST"]),
            Route("/continue_generation", self.resume, methods=["POST"]),
            Route("/ready", self.ready, methods=["GET"]),
        ]
