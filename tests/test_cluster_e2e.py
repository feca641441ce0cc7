"""End to end: ``python -m t1async.cluster up`` with every real part (nats-server, the embedded sampler, two
actors in bubblewrap, the learner) for a short bounded run, watched from the wire."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import anyio
import httpx
import pytest

from t1async.cluster.state import ClusterState, is_ours
from t1async.protocol import wire
from t1async.transport import NatsConfig, NatsTransport
from t1async.transport.auth import Role, creds_path
from tests.cluster_watch import check_episode_turns, wait_running
from tests.clusterargs import SMALL, stop_cluster, up_argv

pytestmark = pytest.mark.slow
ETA = 1


def check_keys(run_dir: Path, started: list) -> str:
    """With no flags, ``cluster up`` keys its sampler (design §4 "Keys"): random keys in 0600 files, on no
    component's command line, and the sampler refuses a request without them. Returns the API key."""
    keys = [run_dir / "secrets" / "sampler.key", run_dir / "secrets" / "sampler-admin.key"]
    assert stat.S_IMODE((run_dir / "secrets").stat().st_mode) == 0o700
    for f in keys:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, oct(f.stat().st_mode)
    api, admin = (f.read_text().strip() for f in keys)
    assert len(api) >= 32 and len(admin) >= 32 and api != admin
    for info in started:
        cmdline = Path(f"/proc/{info.pid}/cmdline").read_bytes()
        assert api.encode() not in cmdline and admin.encode() not in cmdline, f"a key on {info.name}'s command line"
    url = (run_dir / "sampler.url").read_text().strip()
    assert httpx.get(f"{url}/get_model_info", timeout=10, trust_env=False).status_code == 401
    assert (
        httpx.get(f"{url}/get_model_info", timeout=10, trust_env=False, headers={"x-api-key": api}).status_code == 200
    )
    return api


async def test_cluster_up_trains_and_stops_cleanly(tmp_path, repo_env):
    run_dir = tmp_path / "run"
    argv = [
        *up_argv(run_dir),
        "--steps",
        "3",
        *SMALL,
        "--max-staleness",
        str(ETA),
        "--duration",
        "240",
    ]
    out = open(tmp_path / "up.out", "w")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=repo_env, start_new_session=True)
    records: list[wire.Record] = []
    started: list = []
    server_versions: list[int] = []
    try:
        st = await wait_running(run_dir, proc)
        started = list(st.components.values())
        sampler_url = (run_dir / "sampler.url").read_text().strip()
        key = check_keys(run_dir, started)
        async with (
            NatsTransport(config=NatsConfig(url=st.nats_url, creds=creds_path(run_dir, Role.READER))) as t,
            t.subscribe("t1.>") as msgs,
            anyio.create_task_group() as tg,
        ):

            async def until_exit() -> None:
                while proc.poll() is None:
                    await anyio.sleep(0.2)
                await anyio.sleep(0.5)  # the last records in flight
                tg.cancel_scope.cancel()

            tg.start_soon(until_exit)
            with anyio.move_on_after(220):
                async for m in msgs:
                    records.append(m.record)
                    if isinstance(m.record, wire.PolicyRecord):
                        try:
                            async with httpx.AsyncClient(
                                trust_env=False, headers={"Authorization": f"Bearer {key}"}
                            ) as c:
                                info = (await c.get(f"{sampler_url}/get_model_info", timeout=5)).json()
                            server_versions.append(int(info["weight_version"]))
                        except httpx.HTTPError:
                            pass  # the last version's update races the shutdown
        proc.wait(timeout=60)
    finally:
        stop_cluster(proc, run_dir, 30)
        out.close()
    log = (tmp_path / "up.out").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "cluster stopped: learner finished" in log

    turns: dict[str, list[wire.TurnRecord]] = {}
    for r in records:
        if isinstance(r, wire.TurnRecord):
            turns.setdefault(r.episode, []).append(r)
    assert len(turns) >= 2
    for ep_turns in turns.values():
        check_episode_turns(ep_turns)

    policies = [r.policy_version for r in records if isinstance(r, wire.PolicyRecord)]
    assert policies[:2] == [1, 2], policies
    assert server_versions and max(server_versions) >= 2, "the sampler serves the pushed versions"
    assert max(t.policy_version for ts in turns.values() for t in ts) >= 1, "turns were sampled by trained weights"

    learner = [r for r in records if isinstance(r, wire.MetricsRecord) and r.component == "learner"]
    last = learner[-1].values
    assert last["max_staleness"] <= ETA and all(int(k) <= ETA for k in last["staleness_hist"])
    assert last["stale_masked_tokens"] == 0 and last["turns_trained"] >= 3 * 6

    st = ClusterState.load(run_dir)
    assert st.status == "stopped"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(m["component"] == "learner" for m in metrics)
    # no stray process: every pid the supervisor started is gone
    logs = run_dir / "logs"
    assert {p.name for p in logs.iterdir()} >= {"sampler.log", "learner.log", "actor-0.log", "actor-1.log"}
    assert {p.name for p in started} >= {"nats", "sampler", "learner", "actor-0", "actor-1"}
    for info in started + [st.supervisor]:
        assert info is None or not is_ours(info), f"{info.name} (pid {info.pid}) outlived the cluster"
    # nor a work dir: a stopped actor's open episodes remove theirs (before, SIGTERM killed the actor outright
    # and left one per open episode in /tmp)
    work = sorted((run_dir / "work").iterdir())
    assert [p.name for p in work] == ["actor-0", "actor-1"] and not [q for p in work for q in p.iterdir()]

    # the run's metrics.jsonl pictures: one page with the learner's steps and their time split
    from t1async.cluster.observe.report import load, report

    png, page, numbers = report(run_dir)
    assert png.stat().st_size > 20_000 and "data:image/png;base64," in page.read_text()
    assert numbers["steps"] >= 3 and len(load(run_dir / "metrics.jsonl").steps) >= 3
