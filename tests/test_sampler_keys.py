"""Keys on the embedded sampler (design §4 "Keys"): a real ``python -m t1async.sampler serve`` started with
an API key and an admin key (from its environment, as ``launch_sampler`` and ``cluster up`` hand them), and
``--allowed-weight-roots``; driven over HTTP by hand and by our client."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from t1async.learner.weightpush import DiskPushClient
from t1async.model.weights import default_model_dir
from t1async.protocol.errors import ConfigError, SamplerError
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.auth import ADMIN_KEY_ENV, ADMIN_PATHS, API_KEY_ENV, allowed, read_key
from t1async.sampler.client import SGLangClient

API, ADMIN = "api-key-for-tests-0123", "admin-key-for-tests-4567"
PROMPT = [5, 17, 99, 230, 7, 64, 301, 12]
UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's body


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """(url, weight root, a dir outside it, pid) of a sampler with both keys, loading only from the root."""
    from t1async.sampler.launch import SamplerProcess

    base = tmp_path_factory.mktemp("keys")
    root, outside = base / "weights", base / "elsewhere"
    root.mkdir()
    shutil.copytree(default_model_dir(), root / "v1")
    shutil.copytree(default_model_dir(), outside / "v9")
    proc = SamplerProcess(max_batch=8, allowed_weight_roots=(root,), env={API_KEY_ENV: API, ADMIN_KEY_ENV: ADMIN})
    try:
        url = proc.start()
        assert proc.proc is not None
        yield url, root, outside, proc.proc.pid
    finally:
        proc.stop()


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def test_normal_endpoints_need_the_api_key(keyed):
    url, *_ = keyed
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        for key in (None, "wrong", ADMIN):  # the admin key does not open a normal endpoint
            r = await c.post(url + "/generate", json=body, headers=_bearer(key))
            assert r.status_code == 401 and r.json() == UNAUTHORIZED, (key, r.text)
            r = await c.get(url + "/get_model_info", headers=_bearer(key))
            assert r.status_code == 401 and r.json() == UNAUTHORIZED
        assert (await c.post(url + "/generate", json=body, headers=_bearer(API))).status_code == 200
        assert (await c.post(url + "/generate", json=body, headers={"x-api-key": API})).status_code == 200
        info = await c.get(url + "/get_server_info", headers=_bearer(API))
        assert info.status_code == 200 and API not in info.text and ADMIN not in info.text, "keys are never shown"
        # SGLang leaves the probes open: no secret in a liveness check
        assert (await c.get(url + "/health")).status_code == 200
        assert (await c.get(url + "/health_generate")).status_code == 200


async def test_admin_endpoints_need_the_admin_key(keyed):
    url, root, *_ = keyed
    update = {"model_path": str(root / "v1"), "weight_version": "3"}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        for key in (None, "wrong", API):  # the API key does not open an admin endpoint
            for path, body in (
                ("/pause_generation", {"mode": "retract"}),
                ("/update_weights_from_disk", update),
                ("/flush_cache", {}),
                ("/init_weights_update_group", {}),
            ):
                r = await c.post(url + path, json=body, headers=_bearer(key))
                assert r.status_code == 401 and r.json() == UNAUTHORIZED, (path, key, r.text)
                # a refused request's connection is not reused (reusing it raced its close: a flaky disconnect)
                assert r.headers.get("connection") == "close", r.headers
        info = (await c.get(url + "/get_model_info", headers=_bearer(API))).json()
        assert info["weight_version"] == "0", "a refused update changed nothing"
        r = await c.post(url + "/pause_generation", json={"mode": "retract"}, headers=_bearer(ADMIN))
        assert r.status_code == 200, r.text
        r = await c.post(url + "/continue_generation", json={}, headers=_bearer(ADMIN))
        assert r.status_code == 200, r.text


async def test_disk_update_loads_only_from_the_allowed_roots(keyed, tmp_path):
    url, root, outside, _ = keyed
    escape = root / "escape"
    if not escape.exists():
        escape.symlink_to(outside / "v9")  # inside the root by name, outside once resolved
    tries = [outside / "v9", escape, root / ".." / "elsewhere" / "v9", Path("/etc")]
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        for path in tries:
            r = await c.post(url + "/update_weights_from_disk", json={"model_path": str(path)}, headers=_bearer(ADMIN))
            assert r.status_code == 400, (path, r.text)
            msg = r.json()["error"]["message"]
            assert "outside the allowed weight roots" in msg and str(root.resolve()) in msg, msg
        info = (await c.get(url + "/get_model_info", headers=_bearer(API))).json()
        assert info["weight_version"] == "0"


async def test_our_client_with_the_keys_generates_and_pushes(keyed):
    url, root, *_ = keyed
    async with SGLangClient([url], api_key=API, admin_key=ADMIN) as c:
        g = await c.generate(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0))
        assert len(g.output_ids) == 3
    # the learner's disk push: pause -> update -> continue, all admin endpoints
    async with DiskPushClient([url], api_key=API, admin_key=ADMIN) as pusher:
        out = await pusher.update_weights_from_disk(str(root / "v1"), 7)
        assert out[0]["success"] is True
        assert (await pusher.model_info(url))["weight_version"] == "7"
    # an actor holds only the API key: it generates, but cannot push
    async with SGLangClient([url], api_key=API, admin_key="") as c:
        await c.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0))
        with pytest.raises(SamplerError, match="admin key"):
            await c.update_weights_from_disk(str(root / "v1"), 8)


async def test_our_client_reads_the_keys_from_the_environment(keyed, monkeypatch):
    url, *_ = keyed
    async with SGLangClient([url], api_key="") as c:
        with pytest.raises(SamplerError, match="401.*API key"):
            await c.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0))
    monkeypatch.setenv(API_KEY_ENV, API)
    async with SGLangClient([url]) as c:
        assert len((await c.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0))).output_ids) == 1


def test_the_keys_are_not_on_the_command_line(keyed):
    *_, pid = keyed
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"t1async.sampler" in cmdline
    assert API.encode() not in cmdline and ADMIN.encode() not in cmdline


def test_decision_matches_sglangs_rules():
    for path in ADMIN_PATHS:
        assert allowed("POST", path, None, None, None, None), "no keys: open"
        assert allowed("POST", path, f"Bearer {API}", None, API, None), "only an API key: it opens admin"
        assert not allowed("POST", path, f"Bearer {API}", None, API, ADMIN), "an admin key: only it opens admin"
        assert allowed("POST", path, f"bearer {ADMIN}", None, API, ADMIN)
    assert allowed("GET", "/get_model_info", None, None, None, ADMIN), "only an admin key: normal ones stay open"
    assert not allowed("GET", "/get_model_info", f"Bearer {API}x", None, API, None)
    assert not allowed("GET", "/get_model_info", f"Basic {API}", None, API, None)
    assert allowed("OPTIONS", "/generate", None, None, API, ADMIN)
    assert allowed("GET", "/health_generate", None, None, API, ADMIN)


def test_read_key_takes_a_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "k"
    f.write_text("from-file\n")
    os.chmod(f, 0o600)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert read_key("from-flag", None, API_KEY_ENV, "--api-key") == "from-flag"
    assert read_key(None, f, API_KEY_ENV, "--api-key") == "from-file"
    assert read_key(None, None, API_KEY_ENV, "--api-key") == "from-env"
    monkeypatch.delenv(API_KEY_ENV)
    assert read_key(None, None, API_KEY_ENV, "--api-key") is None
    with pytest.raises(ConfigError, match="not both"):
        read_key("x", f, API_KEY_ENV, "--api-key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_key(None, tmp_path / "empty", API_KEY_ENV, "--api-key")
    with pytest.raises(ConfigError, match="cannot read"):
        read_key(None, tmp_path / "missing", API_KEY_ENV, "--api-key")
