"""Our client and pusher against SGLang as its own source answers (design §4).

SGLang needs a GPU and its package does not import without its kernels and model zoo (``io_struct`` pulls in
``schedule_batch`` and ``configs``; ``sglang==0.5.23`` also pins torch 2.14.1), so it cannot run here. These
tests instead speak to responses laid out exactly as SGLang 0.5.23 writes them, each citing the file and
function under ``sglang/srt/`` that settles it, and run SGLang's own process-group code
(``sglang/srt/utils/common.py`` ``init_custom_process_group``, copied verbatim below: it needs only torch)
against our learner's rank 0. Each test failed on the code before this file's commit.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
import torch

from t1async.learner.weightpush import DistributedPusher, WeightPushConfig, push_tensors
from t1async.protocol.errors import SamplerError
from t1async.protocol.sampling import SamplingParams
from t1async.sampler import weightpush as W
from t1async.sampler.auth import ADMIN_PATHS
from t1async.sampler.client import SGLangClient
from t1async.sampler.pool import PoolConfig
from t1async.sampler.response import parse_generation

# ``sglang/srt/utils/common.py`` ``init_custom_process_group`` (0.5.23), verbatim but for ``torch_release``,
# which is sglang's ``tuple(map(int, torch.__version__.split(".")[:2]))``.
SGLANG_INIT_CUSTOM_PROCESS_GROUP = """
def init_custom_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name=None,
    pg_options=None,
    device_id=None,
):
    import torch
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )
    torch_release = tuple(map(int, torch.__version__.split("+")[0].split(".")[:2]))

    assert (store is None) or (init_method is None), (
        "Cannot specify both init_method and store."
    )

    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"

    if backend:
        backend = Backend(backend)
    else:
        backend = Backend("undefined")

    if timeout is None:
        timeout = default_pg_timeout

    # backward compatible API
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)

        # Use a PrefixStore to avoid accidental overrides of keys used by
        # different systems (e.g. RPC) in case the store is multi-tenant.
        store = PrefixStore(group_name, store)

    pg_options_param_name = (
        "backend_options" if torch_release >= (2, 6) else "pg_options"
    )
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        **{pg_options_param_name: pg_options},
        timeout=timeout,
        device_id=device_id,
    )

    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}

    return pg
"""
_ns: dict = {}
exec(SGLANG_INIT_CUSTOM_PROCESS_GROUP, _ns)
init_custom_process_group = _ns["init_custom_process_group"]


def test_rank0_meets_a_group_built_by_sglangs_own_code():
    """Our rank 0 and a rank built by SGLang's ``init_custom_process_group`` (through torch's
    ``_new_process_group_helper``, which adds its own store prefixes) meet and broadcast. Seen failing on the
    old code: rank 0 on ``PrefixStore(group_name, store)`` alone never met the other side."""
    import datetime

    store = W.store_master("127.0.0.1", 0, 2, 20.0)
    got: dict = {}

    def sglang_rank() -> None:
        try:
            pg = init_custom_process_group(
                backend="gloo",
                init_method=f"tcp://127.0.0.1:{store.port}",
                world_size=2,
                rank=1,
                group_name="conformance_group",
                timeout=datetime.timedelta(seconds=20),
            )
            t = torch.empty(5)
            torch.distributed.broadcast(t, src=0, group=pg)
            got["t"] = t
            torch.distributed.destroy_process_group(pg)
        except Exception as exc:  # reported to the main thread
            got["error"] = exc

    th = threading.Thread(target=sglang_rank)
    th.start()
    try:
        pg = W.open_group(
            store,
            host="127.0.0.1",
            port=store.port,
            rank=0,
            world_size=2,
            group_name="conformance_group",
            timeout_s=20.0,
        )
        W.broadcast(pg, [torch.arange(5, dtype=torch.float32)])
    finally:
        th.join(60)
    assert "error" not in got, got.get("error")
    assert torch.equal(got["t"], torch.arange(5, dtype=torch.float32))


# ------------------------------------------------------------------------------- a fake SGLang, TP workers real

# one SGLang TP worker (sglang/srt/model_executor/model_runner_components/weight_updater.py): joins at
# rank_offset + tp_rank with init_custom_process_group, then receives each bucket as
# receive_weights_from_distributed does
_WORKER = (
    SGLANG_INIT_CUSTOM_PROCESS_GROUP
    + """
import json, sys, datetime, torch
host, port, world, rank, group = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
pg = init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}", world_size=world, rank=rank,
                               group_name=group, timeout=datetime.timedelta(seconds=60))
print("joined", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd == "destroy":
        break
    sums = []
    for name, dtype, shape in zip(cmd["names"], cmd["dtypes"], cmd["shapes"]):
        w = torch.empty(shape, dtype=getattr(torch, dtype))
        torch.distributed.broadcast(w, src=0, group=pg)
        sums.append(float(w.double().sum()))
    print(json.dumps(sums), flush=True)
"""
)


class FakeSGLang:
    """One SGLang server's HTTP answers for a weight push, with ``tp`` real worker processes."""

    def __init__(self, url: str, tp: int, running: int = 2) -> None:
        self.url, self.tp, self.running = url, tp, running  # requests in its running batch
        self.workers: list[subprocess.Popen] = []
        self.session = False
        self.paused: str | None = None
        self.calls: list[tuple[str, dict]] = []
        self.received: dict[str, list[float]] = {}  # name -> the sum each TP worker received
        self.version = "0"
        self.init: dict = {}

    def server_info(self) -> dict:  # sglang/srt/entrypoints/http_server.py server_info: ServerArgs, resolved and flat
        return {"tp_size": self.tp, "pp_size": 1, "dp_size": 1, "weight_version": "0", "version": "0.5.23"}

    @staticmethod
    def reply(success: bool, message: str) -> httpx.Response:
        return httpx.Response(200 if success else 400, json={"success": success, "message": message})

    async def handle(self, path: str, body: dict) -> httpx.Response:
        self.calls.append((path, body))
        if path == "/ready":  # tokenizer_manager.is_ready: not paused and healthy
            return httpx.Response(503 if self.paused else 200)
        if path in ("/health", "/health_generate"):  # a token; paused, it waits (here: 503 at once, as at the end)
            return httpx.Response(503 if self.paused else 200)
        if path in ("/server_info", "/get_server_info"):
            return httpx.Response(200, json=self.server_info())
        if path == "/init_weights_update_group":
            self.init = body
            for i in range(self.tp):
                self.workers.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _WORKER, body["master_address"], str(body["master_port"])]
                        + [str(body["world_size"]), str(body["rank_offset"] + i), body["group_name"]],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for w in self.workers:
                line = await anyio.to_thread.run_sync(w.stdout.readline)
                assert line.strip() == "joined", line
            return self.reply(True, "Succeeded to initialize custom process group.")
        if path == "/pause_generation":  # sglang/srt/entrypoints/http_server.py pause_generation
            self.paused = body.get("mode", "abort")
            return httpx.Response(200, json={"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation":
            self.paused = None
            return httpx.Response(200, json={"message": "Generation continued successfully.", "status": "ok"})
        # sglang/srt/managers/scheduler_components/weight_updater.py SchedulerWeightUpdaterManager
        if path == "/begin_weight_update":
            if self.session:
                return self.reply(False, "a weight-update session is already open; call end_weight_update() first")
            self.session = True
            return self.reply(True, "Success")
        if path == "/end_weight_update":
            if not self.session:
                return self.reply(False, "no weight-update session is open; call begin_weight_update() first")
            self.session = False
            return self.reply(True, "Success")
        if path == "/update_weights_from_distributed":
            if not self.session:
                return self.reply(
                    False,
                    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
                )
            cmd = json.dumps({k: body[k] for k in ("names", "dtypes", "shapes")}) + "\n"
            sums = []
            for w in self.workers:
                w.stdin.write(cmd)
                w.stdin.flush()
            for w in self.workers:
                sums.append(json.loads(await anyio.to_thread.run_sync(w.stdout.readline)))
            for i, name in enumerate(body["names"]):
                self.received[name] = [s[i] for s in sums]
            self.version = body.get("weight_version") or self.version
            # flush_cache_after_weight_update: Scheduler.flush_cache refuses while the running batch is not
            # empty (retract and abort empty it; in_place keeps it)
            if body.get("flush_cache", True) and self.running and self.paused == "in_place":
                return self.reply(
                    False,
                    "Weights were updated, but the cache was not flushed because requests are still running or "
                    "queued. Retract or finish them, then call /flush_cache.",
                )
            return self.reply(True, "Succeeded to update parameter online.")
        if path == "/destroy_weights_update_group":
            for w in self.workers:
                w.stdin.write('"destroy"\n')
                w.stdin.flush()
            self.stop()
            return self.reply(True, "Succeeded to destroy custom process group.")
        return httpx.Response(404)

    def stop(self) -> None:
        for w in self.workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self.workers = []


def _fakes_transport(fakes: list[FakeSGLang]) -> httpx.MockTransport:
    by_host = {httpx.URL(f.url).host: f for f in fakes}

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        return await by_host[request.url.host].handle(request.url.path, body)

    return httpx.MockTransport(handler)


async def test_distributed_push_to_sglang_servers_with_tensor_parallel_workers():
    """Two SGLang servers, TP 2 and TP 1: the group is 1 + 3 ranks with cumulative offsets (1, 3), every
    bucket runs inside a begin/end session, ``--pause-mode retract`` becomes ``in_place`` with
    ``flush_cache: false``, and every TP worker receives exactly the learner's tensors. Seen failing on the
    old code (no session: ``success: false``; world 1 + 2 servers; retract sent as is)."""
    fakes = [FakeSGLang("http://sglang-a:30000", tp=2), FakeSGLang("http://sglang-b:30000", tp=1)]
    model = torch.nn.Linear(6, 4)
    try:
        async with SGLangClient([f.url for f in fakes], transport=_fakes_transport(fakes)) as client:
            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=1e-4, timeout_s=60.0))
            try:
                with anyio.fail_after(120):
                    out = await pusher.push(model, policy_version=3)
            finally:
                with anyio.fail_after(60):
                    await pusher.aclose()
    finally:
        for f in fakes:
            f.stop()
    assert out["buckets"] == 2
    assert [f.init["world_size"] for f in fakes] == [4, 4]
    assert [f.init["rank_offset"] for f in fakes] == [1, 3]
    want = {name: float(t.double().sum()) for name, t in push_tensors(model)}
    for f in fakes:
        assert {k: v for k, v in f.received.items()} == {k: [s] * f.tp for k, s in want.items()}
        paths = [p for p, _ in f.calls if p not in ("/ready", "/server_info")]
        assert paths[:3] == ["/init_weights_update_group", "/pause_generation", "/begin_weight_update"]
        assert paths[3:] == [
            "/update_weights_from_distributed",
            "/update_weights_from_distributed",
            "/end_weight_update",
            "/continue_generation",
            "/destroy_weights_update_group",
        ]
        modes = [b["mode"] for p, b in f.calls if p == "/pause_generation"]
        flushes = [b["flush_cache"] for p, b in f.calls if p == "/update_weights_from_distributed"]
        assert modes == ["in_place"] and flushes == [False, False] and f.version == "3"


async def test_a_session_left_open_by_a_dead_learner_is_closed_and_the_push_goes_on():
    """A learner that died between begin and end leaves SGLang's session open (it has no timeout): the next
    push ends it and begins again."""
    fakes = [FakeSGLang("http://sglang-a:30000", tp=1, running=0)]
    fakes[0].session, fakes[0].paused = True, "retract"  # what the dead learner left
    model = torch.nn.Linear(3, 2)
    try:
        async with SGLangClient([f.url for f in fakes], transport=_fakes_transport(fakes)) as client:
            assert await W.reachable(client, client.urls) == client.urls  # /ready 503: paused, still there
            pusher = DistributedPusher(client, WeightPushConfig(timeout_s=60.0, pause_mode="abort"))
            try:
                with anyio.fail_after(120):
                    await pusher.push(model, policy_version=1)
            finally:
                with anyio.fail_after(60):
                    await pusher.aclose()
    finally:
        fakes[0].stop()
    f = fakes[0]
    assert f.version == "1" and f.paused is None and not f.session
    paths = [p for p, _ in f.calls]
    assert paths.count("/begin_weight_update") == 2 and paths.count("/end_weight_update") == 2


def test_rank_layout_pause_mode_and_admin_paths():
    assert W.rank_layout([1]) == (2, [1])
    assert W.rank_layout([2, 1, 4]) == (8, [1, 3, 4])
    with pytest.raises(ValueError, match="tp_size"):
        W.rank_layout([0])
    assert W.tp_size({"tp_size": 8}, "u") == 8 and W.tp_size({}, "u") == 1
    with pytest.raises(SamplerError, match="pp_size 2"):
        W.tp_size({"tp_size": 2, "pp_size": 2}, "u")
    assert W.pause_mode_for({"version": "0.5.23"}, "retract") == "in_place"
    assert W.pause_mode_for({"version": "t1async-embedded-0.1"}, "retract") == "retract"
    assert W.pause_mode_for({"version": "0.5.23"}, "abort") == "abort"
    # sglang/srt/entrypoints/http_server.py: both are @auth_level(AuthLevel.ADMIN_OPTIONAL)
    assert {"/begin_weight_update", "/end_weight_update"} <= ADMIN_PATHS


# ------------------------------------------------------------------------------- /generate as SGLang answers it

# sglang/srt/managers/tokenizer_manager.py (_handle_batch_output) and sglang/srt/utils/weight_versions.py
# (add_weight_versions_to_meta_info): a request an update landed in, 5 output tokens, 2 under "3", 3 under "4"
SGLANG_META = {
    "id": "ep/0",
    "finish_reason": {"type": "length", "length": 5},
    "prompt_tokens": 4,
    "weight_version": "4",
    "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}],
    "completion_tokens": 5,
    "cached_tokens": 0,
    "e2e_latency": 0.1,
    "output_token_logprobs": [[-0.5, 10, None], [-0.6, 11, None], [-0.7, 12, None], [-0.8, 13, None], [-0.9, 14, None]],
}


def _sglang_out(routes: bool = True, layers: int = 3, topk: int = 2) -> dict:
    meta = dict(SGLANG_META)
    if (
        routes
    ):  # sglang/srt/state_capturer/routed_experts.py: int32 [seqlen - 1 - start, num_hidden_layers, topk], base64
        rows = 4 + 5 - 1 - 1
        meta["routed_experts"] = base64.b64encode(
            (np.arange(rows * layers * topk, dtype=np.int32) % 8).tobytes()
        ).decode()
    return {"text": "abcde", "output_ids": [10, 11, 12, 13, 14], "meta_info": meta}


def test_weight_versions_spans_become_per_token_versions():
    g = parse_generation(_sglang_out(routes=False), 4, None, None, url="http://s")
    assert g.policy_version == 4 and g.output_versions.tolist() == [3, 3, 4, 4, 4]
    bad = _sglang_out(routes=False)
    bad["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 2}]
    with pytest.raises(SamplerError, match="cover 2 of the 5"):
        parse_generation(bad, 4, None, None, url="http://s")


def test_routes_asked_for_and_not_returned_raise():
    """SGLang without --enable-return-routed-experts leaves ``routed_experts`` out
    (sglang/srt/managers/scheduler_components/batch_result_processor.py: no capturer, nothing collected)."""
    with pytest.raises(SamplerError, match="--enable-return-routed-experts"):
        parse_generation(_sglang_out(routes=False), 4, 1, (3, 2, 8), url="http://s")


# sglang/srt/entrypoints/http_server.py model_info: these keys and no others (no layer count, no vocab size)
SGLANG_MODEL_INFO_KEYS = {
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "load_format",
    "reasoning_parser",
    "tool_call_parser",
    "disaggregation_mode",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
}


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir(parents=True)
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts_per_tok": 2, "num_experts": 8}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _sglang(env_vars: dict | None = None, model_path: str = "Qwen/Qwen3-30B-A3B", live: str = "4"):
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/generate":
            return httpx.Response(200, json=_sglang_out())
        if path in ("/model_info", "/get_model_info"):
            info = dict.fromkeys(SGLANG_MODEL_INFO_KEYS)
            info.update(model_path=model_path, weight_version=live, is_generation=True)
            return httpx.Response(200, json=info)
        if path in ("/server_info", "/get_server_info"):
            state = {"#running-req": 0} if env_vars is None else {"#running-req": 0, "env_vars": env_vars}
            return httpx.Response(200, json={"tp_size": 1, "weight_version": "0", "internal_states": [state]})
        if path in ("/ready", "/health_generate"):
            return httpx.Response(200)
        return httpx.Response(404)

    return httpx.MockTransport(handler)


async def test_the_routing_shape_comes_from_the_models_config(tmp_path):
    """SGLang's /model_info says no layer count; the shape is the model's config.json. Seen failing on the
    old code (no ``model_dir``; it asked /get_model_info for the shape)."""
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    async with SGLangClient("http://s", transport=_sglang(), model_dir=_model_dir(tmp_path)) as c:
        g = await c.generate([1, 2, 3, 4], params, routed_experts_start_len=1)
    assert g.routing.shape == (7, 3, 2) and g.routing_start == 1
    # no model_dir: the model_path /model_info names, when it is a directory here (the embedded sampler)
    local = str(_model_dir(tmp_path / "x"))
    async with SGLangClient("http://s", transport=_sglang(model_path=local)) as c:
        assert (await c.generate([1, 2, 3, 4], params, routed_experts_start_len=1)).routing.shape == (7, 3, 2)
    async with SGLangClient("http://s", transport=_sglang()) as c:  # a hub id: nothing to read here
        with pytest.raises(SamplerError, match="model_dir"):
            await c.generate([1, 2, 3, 4], params, routed_experts_start_len=1)


async def test_logprobs_at_a_temperature_need_sglangs_original_logprob_setting(tmp_path):
    """sglang/srt/layers/sampler.py: without SGLANG_RETURN_ORIGINAL_LOGPROB, logprobs are
    log_softmax(logits / T); the setting shows in /server_info only with SGLANG_EXPOSE_OWN_ENV_VARS
    (sglang/srt/managers/scheduler_components/internal_state.py _add_env_vars)."""
    warm = SamplingParams(max_new_tokens=5, temperature=0.7)
    for env in (None, {"SGLANG_EXPOSE_OWN_ENV_VARS": "1"}):
        async with SGLangClient("http://s", transport=_sglang(env_vars=env)) as c:
            with pytest.raises(SamplerError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
                await c.generate([1, 2, 3, 4], warm)
            await c.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=5, temperature=1.0))  # T = 1: the same
        async with SGLangClient("http://s", transport=_sglang(env_vars=env), train_logprobs=False) as c:
            await c.generate([1, 2, 3, 4], warm)  # eval trains on no logprob
    env = {"SGLANG_EXPOSE_OWN_ENV_VARS": "1", "SGLANG_RETURN_ORIGINAL_LOGPROB": "true"}
    async with SGLangClient("http://s", transport=_sglang(env_vars=env)) as c:
        assert (await c.generate([1, 2, 3, 4], warm)).logprobs.tolist() == pytest.approx([-0.5, -0.6, -0.7, -0.8, -0.9])


async def test_the_probe_reads_the_live_version_from_model_info():
    """sglang/srt/entrypoints/http_server.py server_info: a weight version set after start-up is
    /model_info's, not /server_info's (which keeps the start-up "0" here). Seen failing on the old code (it
    read /get_server_info)."""
    async with SGLangClient("http://s", transport=_sglang(live="7")) as c:
        assert await c._probe("http://s") == (True, 7)


async def test_a_paused_sampler_is_held_not_marked_down():
    """SGLang's /health_generate waits out a pause (its token waits in generate_request) and /ready says 503
    (tokenizer_manager.is_ready); the embedded sampler now does the same, and the pool's probe leaves a
    paused sampler as it is instead of taking it out. Seen failing on the old code: the embedded sampler
    answered /health_generate 200 while paused, and a real SGLang was marked down."""
    from t1async.sampler.server import serve
    from t1async.sampler.settings import SamplerSettings

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            url = await tg.start(serve, SamplerSettings(port=0, max_batch=4, health_timeout=30.0))
            async with SGLangClient([url], pool=PoolConfig(probe_timeout_s=2.0)) as c:
                assert await c._probe(url) == (True, 0)
                await W.pause_generation(c, mode="retract")
                async with httpx.AsyncClient() as http:
                    assert (await http.get(url + "/ready")).status_code == 503
                    with pytest.raises(httpx.ReadTimeout):
                        await http.get(url + "/health_generate", timeout=1.0)
                assert await c._probe(url) == (None, 0)
                await c.pool.probe_all(c._probe)
                assert url in c.pool.live
                await W.continue_generation(c)
                assert await c._probe(url) == (True, 0)
            tg.cancel_scope.cancel()


async def test_the_embedded_sampler_answers_as_sglang(sampler_url):
    """/get_model_info has SGLang's keys only; per-token versions come as SGLang's ``weight_versions``
    spans, not under a key of our own; /server_info says the start-up version, /model_info the live one."""
    async with httpx.AsyncClient() as http:
        info = (await http.get(sampler_url + "/get_model_info")).json()
        assert set(info) == SGLANG_MODEL_INFO_KEYS
        assert (await http.get(sampler_url + "/model_info")).json() == info
        server = (await http.get(sampler_url + "/server_info")).json()
        assert server["tp_size"] == 1 and server["internal_states"][0]["env_vars"]["SGLANG_RETURN_ORIGINAL_LOGPROB"]
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
        meta = (await http.post(sampler_url + "/generate", json=body)).json()["meta_info"]
    assert "output_token_weight_versions" not in meta
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 3}]


async def test_the_disk_push_in_place_does_not_ask_sglang_to_flush_under_running_requests():
    """sglang/srt/managers/scheduler_components/weight_updater.py flush_cache_after_weight_update: with
    ``flush_cache`` (its default) an update while requests run fails (400) after loading the weights; an
    ``in_place`` pause keeps them running. Seen failing on the old code (every in_place disk push failed)."""
    from t1async.learner.weightpush import DiskPushClient

    state: dict = {"paused": None, "bodies": [], "modes": []}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        if request.url.path == "/ready":
            return httpx.Response(503 if state["paused"] else 200)
        if request.url.path == "/server_info":  # a real SGLang's version (the embedded one's starts t1async-)
            return httpx.Response(200, json={"version": "0.5.23", "tp_size": 1})
        if request.url.path == "/pause_generation":
            state["paused"] = body["mode"]
            state["modes"].append(body["mode"])
            return httpx.Response(200, json={"message": "Generation paused successfully.", "status": "ok"})
        if request.url.path == "/continue_generation":
            state["paused"] = None
            return httpx.Response(200, json={"message": "Generation continued successfully.", "status": "ok"})
        if request.url.path == "/update_weights_from_disk":
            state["bodies"].append(body)
            if body.get("flush_cache", True) and state["paused"] == "in_place":  # its running batch stays
                msg = "Weights were updated, but the cache was not flushed because requests are still running"
                return httpx.Response(400, json={"success": False, "message": msg, "num_paused_requests": 0})
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        return httpx.Response(404)

    # retract goes to a real SGLang as in_place, as the distributed push sends it (its retract re-prefills with
    # the new weights' routes beside the old logprobs, unreported): seen failing on the old code (sent retract)
    for mode, sent, flush in (
        ("in_place", "in_place", False),
        ("abort", "abort", None),
        ("retract", "in_place", False),
    ):
        async with DiskPushClient("http://s", pause_mode=mode, transport=httpx.MockTransport(handler)) as c:
            await c.update_weights_from_disk("/ckpt/v1", 1)
        assert state["modes"][-1] == sent, (mode, state["modes"])
        assert state["bodies"][-1].get("flush_cache") is flush and state["paused"] is None
