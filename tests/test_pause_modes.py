"""SGLang's /pause_generation modes on the real embedded sampler over HTTP (design §10): ``retract`` keeps
every in-flight request alive and recomputes it with the new weights (no token mixes policies), ``in_place``
freezes requests with their KV (new weights over old KV after an update, as SGLang does), ``abort`` aborts;
an update out of a pause retracts too; the learner's pushes pause with ``retract``."""

from __future__ import annotations

import base64
import json
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
import torch

from t1async.learner.serve_cli import ServeConfig
from t1async.learner.weightpush import DiskPushClient, DistributedPusher, WeightPushConfig
from t1async.model.config import MoEConfig
from t1async.model.weights import default_model_dir, load_pretrained, save_pretrained
from t1async.protocol.errors import ConfigError
from t1async.sampler.server import serve
from t1async.sampler.settings import SamplerSettings

CFG = MoEConfig.load(default_model_dir())
L, K = CFG.n_layers, CFG.top_k
N_REQ, NEW = 4, 48


@pytest.fixture(scope="module")
def old():
    return load_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    m = load_pretrained(default_model_dir())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * (float(p.std()) if p.numel() > 1 else 1.0))
    return save_pretrained(m, tmp_path_factory.mktemp("new") / "w1")


@asynccontextmanager
async def sampler(weights: Path | None = None):
    """An in-process sampler; it loads pushed weights from beside ``weights`` (design §4 "Keys")."""
    roots = (weights.parent,) if weights is not None else ()
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve, SamplerSettings(port=0, max_batch=8, allowed_weight_roots=roots))
        try:
            yield url
        finally:
            tg.cancel_scope.cancel()


async def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as c:
        return await c.post(url + path, json=body or {})


async def stats(url: str) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        return (await c.get(url + "/get_server_info")).json()["internal_states"][0]


def prompt(i: int) -> list[int]:
    return [11 + i, 250, 37, 999, 4, 1200 + i, 77, 3000, 18, 640]


class Streams:
    """``N_REQ`` streaming /generate requests; ``going`` is set once each has streamed ``at_least`` tokens."""

    def __init__(self, url: str, at_least: int = 4) -> None:
        self.url, self.at_least = url, at_least
        self.last: dict[int, dict] = {}
        self.going = anyio.Event()

    async def one(self, i: int) -> None:
        body = {
            "input_ids": prompt(i),
            "sampling_params": {"max_new_tokens": NEW, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i},
            "return_logprob": True,
            "return_routed_experts": True,
            "stream": True,
            "rid": f"s{i}",
        }
        async with httpx.AsyncClient(timeout=300) as c, c.stream("POST", self.url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    self.last[i] = json.loads(line[6:])
                    if len(self.last) == N_REQ and all(
                        len(d["output_ids"]) >= self.at_least for d in self.last.values()
                    ):
                        self.going.set()

    def seen(self) -> dict[int, tuple[list[int], list[float]]]:
        return {
            i: (list(d["output_ids"]), [x[0] for x in d["meta_info"]["output_token_logprobs"]])
            for i, d in self.last.items()
        }


def forward(model, seq: list[int], rows: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh full forward (fp32): log-probs and routes; with ``rows`` [len(seq) - 1, L, K] the learner's
    replay of those routes."""
    with torch.no_grad():
        if rows is None:
            out = model(torch.tensor([seq]))
        else:
            out = model(torch.tensor([seq[:-1]]), replay=torch.from_numpy(rows[None].astype(np.int64)))
    return torch.log_softmax(out.logits[0].float(), -1), out.routing[0].numpy()


def token_lps(lp: torch.Tensor, p0: int, ids: list[int]) -> np.ndarray:
    return np.array([lp[p0 - 1 + j, t].item() for j, t in enumerate(ids)])


def rows_of(meta: dict) -> np.ndarray:
    assert meta["routed_experts_start_len"] == 0
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, L, K)


def split(meta: dict) -> tuple[list[str], int]:
    """The per-token versions, and where "1" starts (all "0" before it, all "1" after)."""
    v = [sp["version"] for sp in meta["weight_versions"] for _ in range(sp["start"], sp["end"])]  # SGLang's spans
    k = v.index("1") if "1" in v else len(v)
    assert set(v[:k]) <= {"0"} and set(v[k:]) <= {"1"}, v
    return v, k


async def run_with(url: str, between) -> tuple[dict, dict]:
    """Streams going; ``between(seen)`` runs once each has tokens; returns (what was seen, final chunks)."""
    s = Streams(url)
    seen: dict = {}
    async with anyio.create_task_group() as tg:
        for i in range(N_REQ):
            tg.start_soon(s.one, i)
        await s.going.wait()
        await between(seen, s)
    return seen, s.last


async def test_retract_keeps_every_request_and_recomputes_it_with_the_new_weights(old, new_dir):
    new = load_pretrained(new_dir)
    async with sampler(new_dir) as url:

        async def between(seen: dict, s: Streams) -> None:
            r = await post(url, "/pause_generation", {"mode": "retract"})
            assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
            st = await stats(url)
            assert st["running"] == 0 and st["paused"] == "retract" and st["retracted"] == N_REQ
            async with httpx.AsyncClient(timeout=60) as c:  # as SGLang's: not ready while paused
                assert (await c.get(url + "/ready")).status_code == 503
            r = await post(url, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "1"})
            assert r.status_code == 200 and r.json()["success"], r.text
            seen.update(s.seen())  # every token streamed so far was sampled before the pause
            r = await post(url, "/continue_generation")
            assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}

        seen, final = await run_with(url, between)
    for i, d in final.items():
        meta = d["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": NEW}  # none aborted
        ids, lps = d["output_ids"], np.array([x[0] for x in meta["output_token_logprobs"]])
        assert ids[: len(seen[i][0])] == seen[i][0] and lps[: len(seen[i][1])].tolist() == seen[i][1]
        _, k = split(meta)
        assert len(seen[i][0]) <= k < NEW  # the versions split exactly at the update
        seq, p0 = prompt(i) + ids, len(prompt(i))
        rows = rows_of(meta)
        assert rows.shape == (len(seq) - 1, L, K)
        # the context was recomputed with the routes it had used: before the update, the old model's own
        _, routes_old = forward(old, seq)
        assert np.array_equal(rows[: p0 + k - 1], routes_old[: p0 + k - 1])
        # a fresh forward with each token's weights, replaying the returned routes, gives its logprob: the
        # tokens before with the old weights, those after with the new (over KV of the new weights)
        ref_old = token_lps(forward(old, seq, rows)[0], p0, ids)
        ref_new = token_lps(forward(new, seq, rows)[0], p0, ids)
        assert np.abs(ref_old[:k] - lps[:k]).max() < 1e-4
        assert np.abs(ref_new[k:] - lps[k:]).max() < 1e-4
        assert np.abs(ref_old[k:] - lps[k:]).max() > 1e-3  # (the weights did change)


async def test_in_place_freezes_requests_with_their_kv_and_mixes_after_an_update(new_dir):
    """SGLang's in_place: no decode step runs while paused and the KV stays; after an update the requests go
    on with the new weights over the old KV, so a fresh forward with the new weights does not reproduce them."""
    new = load_pretrained(new_dir)
    async with sampler(new_dir) as url:

        async def between(seen: dict, s: Streams) -> None:
            assert (await post(url, "/pause_generation", {"mode": "in_place"})).status_code == 200
            before = await stats(url)
            assert before["running"] == N_REQ and before["paused"] == "in_place"
            r = await post(url, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "1"})
            assert r.json()["success"]
            after = await stats(url)
            assert after["decode_tokens"] == before["decode_tokens"] and after["running"] == N_REQ
            assert after["steps"] > before["steps"]  # the update ran in a step, which decoded nothing
            seen.update(s.seen())
            await post(url, "/continue_generation")

        seen, final = await run_with(url, between)
    mixed = []
    for i, d in final.items():
        meta = d["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        ids, lps = d["output_ids"], np.array([x[0] for x in meta["output_token_logprobs"]])
        assert ids[: len(seen[i][0])] == seen[i][0]
        _, k = split(meta)
        assert len(seen[i][0]) <= k < NEW  # frozen: nothing was sampled between the pause and continue
        seq = prompt(i) + ids
        ref = token_lps(forward(new, seq, rows_of(meta))[0], len(prompt(i)), ids)
        mixed.append(np.abs(ref[k:] - lps[k:]).mean())
    assert np.mean(mixed) > 1e-3


async def test_abort_mode_aborts_every_request_and_new_ones_run_after_continue():
    async with sampler() as url:

        async def between(seen: dict, s: Streams) -> None:
            r = await post(url, "/pause_generation", {"mode": "abort"})
            assert r.json()["message"] == "Generation paused successfully."

        _, final = await run_with(url, between)
        assert all(d["meta_info"]["finish_reason"]["type"] == "abort" for d in final.values())
        assert len(final) == N_REQ
        await post(url, "/continue_generation")
        r = await post(url, "/generate", {"input_ids": prompt(0), "sampling_params": {"max_new_tokens": 3}})
        assert r.json()["meta_info"]["completion_tokens"] == 3


async def test_continue_without_a_pause_is_harmless_and_a_bad_mode_is_a_400():
    async with sampler() as url:
        r = await post(url, "/continue_generation")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        r = await post(url, "/pause_generation", {"mode": "freeze"})
        assert r.status_code == 400 and r.json()["success"] is False
        assert all(m in r.json()["message"] for m in ("abort", "retract", "in_place", "'freeze'"))
        assert (await stats(url))["paused"] is None  # a refused pause pauses nothing
        r = await post(url, "/generate", {"input_ids": prompt(1), "sampling_params": {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["completion_tokens"] == 2


async def test_an_update_out_of_a_pause_retracts_the_running_requests(new_dir):
    """No pause: /update_weights_from_disk itself retracts the running requests around the swap."""
    new = load_pretrained(new_dir)
    async with sampler(new_dir) as url:

        async def between(seen: dict, s: Streams) -> None:
            r = await post(url, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "1"})
            assert r.json()["success"]
            seen["stats"] = await stats(url)

        seen, final = await run_with(url, between)
    for i, d in final.items():
        meta = d["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        ids, lps = d["output_ids"], np.array([x[0] for x in meta["output_token_logprobs"]])
        _, k = split(meta)
        seq = prompt(i) + ids
        ref = token_lps(forward(new, seq, rows_of(meta))[0], len(prompt(i)), ids)
        assert k < NEW and np.abs(ref[k:] - lps[k:]).max() < 1e-4
    assert seen["stats"].get("retracted") == N_REQ


async def test_the_learner_pushes_pause_with_retract(new_dir):
    """Both learner paths, with their defaults, against the real sampler with requests in flight: the disk
    push (pause -> update_weights_from_disk -> continue) and the distributed one both retract, and nothing is
    aborted."""
    assert ServeConfig().pause_mode == "retract" and WeightPushConfig().pause_mode == "retract"
    with pytest.raises(ConfigError, match="retract, in_place, abort"):
        WeightPushConfig(pause_mode="freeze")
    new = load_pretrained(new_dir)
    async with sampler(new_dir) as url:
        async with DiskPushClient([url]) as client:

            async def disk(seen: dict, s: Streams) -> None:
                await client.update_weights_from_disk(str(new_dir), 1)
                st = await stats(url)
                assert st["retracted"] == N_REQ and st["paused"] is None  # paused with retract, continued

            _, final = await run_with(url, disk)
            assert all(d["meta_info"]["finish_reason"]["type"] == "length" for d in final.values())
            assert all(split(d["meta_info"])[1] < NEW for d in final.values())  # "1" reached every request

            pusher = DistributedPusher(client, WeightPushConfig(bucket_mb=0.25))
            try:

                async def dist(seen: dict, s: Streams) -> None:
                    await pusher.push(new, policy_version=2)
                    st = await stats(url)
                    assert st["retracted"] == 2 * N_REQ and st["weight_version"] == "2"

                _, final = await run_with(url, dist)
            finally:
                await pusher.aclose()
            assert all(d["meta_info"]["finish_reason"]["type"] == "length" for d in final.values())


def test_learner_serve_takes_pause_mode(tmp_path):
    """``learner serve --pause-mode`` (default retract) is one of the three modes; anything else is refused."""
    import argparse

    from t1async.learner import serve_cli

    def parse(*flags: str) -> ServeConfig:
        p = argparse.ArgumentParser()
        serve_cli.add_parser(p.add_subparsers())
        args = ["serve", "--run-dir", str(tmp_path), "--nats", "nats://127.0.0.1:1", *flags]
        return serve_cli.config_from_args(p.parse_args(args))

    assert parse().pause_mode == "retract" and parse("--pause-mode", "in_place").pause_mode == "in_place"
    with pytest.raises(SystemExit):
        parse("--pause-mode", "freeze")
    with pytest.raises(ConfigError, match="retract, in_place, abort"):
        DiskPushClient(["http://127.0.0.1:1"], pause_mode="freeze")
