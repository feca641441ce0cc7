"""Three hosts on one machine: the learner, the sampler and the actors each on their own network namespace,
each host running one node of one 3-node NATS JetStream cluster; then host C's (the actors') link is cut.

    host A 198.18.0.1: NATS node t1-0, the learner's rank 0, the service  (torchrun node 0: learner serve)
    host B 198.18.0.2: NATS node t1-1, the sampler, the learner's rank 1  (python -m t1async.sampler serve,
                       torchrun node 1: learner serve)
    host C 198.18.0.3: NATS node t1-2, the actors      (python -m actors)

Every process is started with the documented multi-host command (README "Many hosts") through
``t1async.testing.netns``, and told its own address: a listener left on 127.0.0.1 would be unreachable from
the other hosts. Weights go by disk (``--weight-sync disk``): the run dir is on the one filesystem every
namespace shares, so the sampler reads the checkpoint the learner names, and the weight push needs no extra
listener (``--weight-sync distributed`` runs the torch.distributed push across hosts A and B instead). The
learner is two torchruns, one rank each (design §10 "Several hosts"; ``--learner-hosts 1``: one plain
process on A), sharing the run dir and the model dir through that same filesystem.
Training runs until version ``versions_before``; host C is unplugged for ``cut_s``; training goes on
(``versions_after`` more versions, or until ``--minutes`` are up); then the actors stop, the learner takes
what is left, and the run is audited: T1_TRAJ and T1_DEAD read back with a plain nats-py client, the
learner's journal and step log (``learner/steps.jsonl``), its last metrics (turns settled by reason).

    python -m bench.multihost --minutes 3 [--weight-sync distributed] [--learner-hosts 1|2] [--json]

Last JSON line: ``turns_trained``, ``turns_lost`` (in the stream, but neither journaled, trained nor
dead-lettered), ``trained_twice``, ``recover_s`` (link up -> the first step training a turn the learner
had not yet received at link up), the versions, the settled counts, the host of each learner rank and the
addresses it had TCP links to. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench._common import emit_json, print_table
from t1async.testing.netns import Connection, Host, Listener, Network, namespaces, network

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
NATS_PORT, ROUTE_PORT, HTTP_PORT, SAMPLER_PORT = 4222, 6222, 8222, 30000
RDZV_PORT = 29400  # the learner's torchrun rendezvous store, on host A
ACTOR = "hostc"  # actor ids: hostc-0, hostc-1, ...; their episodes are hostc-<i>-<hex>

Key = tuple[str, int]


@dataclass(frozen=True)
class Plan:
    minutes: float = 0.0  # 0: stop once versions_after more versions were trained after the cut (the test)
    cut_s: float = 20.0
    versions_before: int = 2
    versions_after: int = 2
    actors: int = 1
    concurrency: int = 2
    batch_turns: int = 4
    max_turns: int = 5
    max_new_tokens: int = 24
    tasks: int = 12
    seed: int = 3
    weight_sync: str = "disk"  # or "distributed": over a torch.distributed group the learner hosts on host A
    learner_hosts: int = 2  # 2: the learner's rank 0 on host A and rank 1 on host B, one torchrun on each
    wait_s: float = 240.0  # the deadline of each wait


@dataclass
class Outcome:
    """What the run saw, raw, for the test to check and the bench to sum up."""

    hosts: dict[str, str] = field(default_factory=dict)  # role -> address
    commands: dict[str, list[str]] = field(default_factory=dict)  # process -> argv (in its host)
    listeners: dict[str, list[Listener]] = field(default_factory=dict)  # role -> TCP listeners in that host
    pids: dict[str, int] = field(default_factory=dict)
    rank_pids: dict[int, int] = field(default_factory=dict)  # learner rank -> its pid (from its log)
    rank_hosts: dict[int, str] = field(default_factory=dict)  # learner rank -> the host whose namespace holds it
    rank_links: dict[int, list[Connection]] = field(default_factory=dict)  # learner rank -> its TCP connections
    version_at_cut: int = 0
    version_at_end: int = 0
    cut_s: float = 0.0
    recover_s: float | None = None
    turns_before_cut: set[Key] = field(default_factory=set)  # trained before the cut
    stream_turns: list[Key] = field(default_factory=list)  # every turn message in T1_TRAJ, in order
    stream_ids: list[str] = field(default_factory=list)  # their Nats-Msg-Id
    undecodable: int = 0
    replicas: dict[str, int] = field(default_factory=dict)  # stream -> its replica count
    dead: list[tuple[str, str]] = field(default_factory=list)  # T1_DEAD: (reason, subject)
    dead_turns: set[Key] = field(default_factory=set)
    journaled: set[Key] = field(default_factory=set)
    trained: dict[Key, int] = field(default_factory=dict)  # (episode, turn) -> steps that trained it
    metrics: dict[str, Any] = field(default_factory=dict)  # the learner's last metrics record
    events: list[dict] = field(default_factory=list)  # the learner's JSON log lines
    exit_codes: dict[str, int] = field(default_factory=dict)
    namespaces_before: list[str] = field(default_factory=list)
    namespaces_after: list[str] = field(default_factory=list)

    @property
    def lost(self) -> set[Key]:
        return set(self.stream_turns) - self.journaled - set(self.trained) - self.dead_turns

    @property
    def twice(self) -> list[Key]:
        return sorted(k for k, n in self.trained.items() if n > 1)

    def summary(self) -> dict[str, Any]:
        return {
            "turns_in_stream": len(set(self.stream_turns)),
            "turns_trained": len(self.trained),
            "turns_lost": len(self.lost),
            "trained_twice": len(self.twice),
            "dead_letters": len(self.dead),
            "recover_s": None if self.recover_s is None else round(self.recover_s, 2),
            "cut_s": round(self.cut_s, 2),
            "version_at_cut": self.version_at_cut,
            "version_at_end": self.version_at_end,
            "learner_rank_hosts": self.rank_hosts,
            "learner_rank_peers": {r: sorted({x.peer[0] for x in links}) for r, links in self.rank_links.items()},
            "settled": self.metrics.get("settled", {}),
            "untrained_turns": self.metrics.get("untrained_turns"),
            "actors_timed_out": self.metrics.get("actors_timed_out"),
        }


# ---------------------------------------------------------------------------------------------- the commands


def py(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def nats_urls(hosts: list[Host]) -> str:
    return ",".join(f"nats://{h.addr}:{NATS_PORT}" for h in hosts)


def nats_node_argv(i: int, hosts: list[Host], store: Path, ready: Path, keys: Path) -> list[str]:
    h = hosts[i]
    routes = ",".join(f"{o.addr}:{ROUTE_PORT}" for o in hosts if o is not h)
    return py(
        "t1async.transport.natsd",
        "--host",
        h.addr,
        "--server-name",
        f"t1-{i}",
        "--routes",
        routes,
        "--store-dir",
        str(store),
        "--ready-file",
        str(ready),
        "--secrets",  # only our per-role users: the first node makes the files, the others read them
        str(keys),
    )


def torchrun_argv(node: int, nodes: int, master: str, argv: list[str]) -> list[str]:
    """``argv`` (``python -m t1async.learner serve ...``) as node ``node`` of ``nodes`` under torchrun, one rank a
    node, static rendezvous: node 0 is global rank 0 (the service) and hosts the store on ``master``."""
    assert argv[1:3] == ["-m", "t1async.learner"], argv
    return py(
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node),
        "--master-addr",
        master,
        "--master-port",
        str(RDZV_PORT),
        *argv[1:],
    )


def learner_rank_pids(logs: Path) -> dict[int, int]:
    """Each learner rank's pid, as it logged it: rank 0 in ``learner.log`` (``learner.ranks_joined``), rank i
    in ``learner-<i>.log`` (``learner.rank_ready``)."""
    joined = [e["pid"] for e in log_events(logs / "learner.log") if e.get("event") == "learner.ranks_joined"]
    pids = {0: joined[-1]} if joined else {}
    for f in sorted(logs.glob("learner-*.log")):
        pids |= {e["rank"]: e["pid"] for e in log_events(f) if e.get("event") == "learner.rank_ready"}
    return pids


def sampler_keys(keys: Path) -> dict[str, str]:
    """The sampler's API and admin keys, made once into ``keys`` (0600) as an operator would; returned as the
    environment the learner and the actors read them from (never argv)."""
    from t1async.transport.auth import write_private

    out = {}
    for name, var in (("sampler.key", "T1_SAMPLER_API_KEY"), ("sampler-admin.key", "T1_SAMPLER_ADMIN_KEY")):
        f = keys / name
        if not f.is_file():
            write_private(f, secrets.token_urlsafe(32) + "\n")
        out[var] = f.read_text().strip()
    return out


def _connect_options(keys: Path, role: str) -> dict[str, Any]:
    from t1async.transport.auth import load_creds

    return load_creds(keys / f"nats-{role}.json").connect_options()


# ---------------------------------------------------------------------------------------------- waits


def wait_until(what: str, cond: Callable[[], Any], deadline_s: float, watch: dict[str, subprocess.Popen]) -> Any:
    """Poll ``cond`` every 0.2 s until truthy; a watched process that exits, or the deadline, raises."""
    t_end = time.monotonic() + deadline_s
    while True:
        got = cond()
        if got:
            return got
        for name, p in watch.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}")
        if time.monotonic() > t_end:
            raise TimeoutError(f"{what}: not within {deadline_s:.0f}s")
        time.sleep(0.2)


def log_events(path: Path) -> list[dict]:
    out: list[dict] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def steps(run: Path) -> list[dict]:
    """``learner/steps.jsonl``, every line (written before each step trains)."""
    path = run / "learner" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def version(run: Path) -> int:
    from t1async.learner.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run / "checkpoints")
    return ckpt.policy_version if ckpt is not None else 0


def trained_keys(run: Path) -> set[Key]:
    return {(ep, int(t)) for s in steps(run) for ep, t in s["turns"]}


def journal_keys(run: Path) -> set[Key]:
    from t1async.ingest.journal import read_journal
    from t1async.protocol import wire

    d = run / "learner" / "journal"
    if not d.exists():
        return set()
    return {(r.episode, r.turn) for r in read_journal(d) if isinstance(r, wire.TurnRecord)}


# ---------------------------------------------------------------------------------------------- NATS, read back


async def _answered(call: Callable[[], Awaitable[T]], wait_s: float = 60.0, pause_s: float = 0.5) -> T:
    """``call()``, waiting out a JetStream election as the transport does: after a host's link comes back, the
    stream's replicas may elect afresh and the API answers 503 until they have."""
    from t1async.transport.natsio import while_electing

    return await while_electing(call, wait_s, pause_s)


async def _read_streams(urls: list[str], keys: Path) -> dict[str, Any]:
    """T1_TRAJ and T1_DEAD, every stored message, by sequence (a plain nats-py client, as the admin)."""
    import nats
    import nats.js.errors

    from t1async.protocol import wire
    from t1async.transport.base import HDR_DEAD_REASON, HDR_DEAD_SUBJECT

    nc = await nats.connect(servers=urls, connect_timeout=5, **_connect_options(keys, "admin"))
    out: dict[str, Any] = {"turns": [], "ids": [], "undecodable": 0, "dead": [], "dead_turns": [], "replicas": {}}
    try:
        js = nc.jetstream(timeout=10)
        for stream in ("T1_TRAJ", "T1_DEAD"):
            try:
                info = await _answered(functools.partial(js.stream_info, stream))
            except nats.js.errors.NotFoundError:
                continue
            out["replicas"][stream] = info.config.num_replicas
            for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1) if info.state.messages else ():
                try:
                    m = await _answered(functools.partial(js.get_msg, stream, seq))
                except nats.js.errors.NotFoundError:
                    continue
                headers = m.headers or {}
                try:
                    rec = wire.decode(m.data or b"")
                except Exception:  # noqa: BLE001 - a segment letter or a chunk: not a record
                    rec = None
                if stream == "T1_DEAD":
                    out["dead"].append((headers.get(HDR_DEAD_REASON, ""), headers.get(HDR_DEAD_SUBJECT, "")))
                    if isinstance(rec, wire.TurnRecord):
                        out["dead_turns"].append((rec.episode, rec.turn))
                elif rec is None:
                    out["undecodable"] += 1
                elif isinstance(rec, wire.TurnRecord):
                    out["turns"].append((rec.episode, rec.turn))
                    out["ids"].append(headers.get("Nats-Msg-Id", ""))
    finally:
        await nc.close()
    return out


async def _next_metrics(urls: list[str], timeout_s: float, keys: Path) -> dict[str, Any]:
    """The learner's next metrics record (``t1.metrics.learner``), its values."""
    import nats

    from t1async.protocol import wire

    nc = await nats.connect(servers=urls, connect_timeout=5, **_connect_options(keys, "reader"))
    try:
        sub = await nc.subscribe("t1.metrics.learner")
        msg = await sub.next_msg(timeout=timeout_s)
        rec = wire.decode(msg.data)
        assert isinstance(rec, wire.MetricsRecord)
        return dict(rec.values)
    finally:
        await nc.close()


# ---------------------------------------------------------------------------------------------- the run


def run(plan: Plan, work: Path, say: Callable[[str], None] = lambda s: None) -> Outcome:
    from sandbox_agent.synth import generate

    out = Outcome(namespaces_before=namespaces())
    tasks, run_dir, logs = work / "tasks", work / "learner-run", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    generate(tasks, plan.tasks, seed=plan.seed)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "T1_LOG_JSON": "1",
        "NO_PROXY": "*",
    }
    try:
        with network(3) as net:
            _run(plan, net, out, tasks, run_dir, logs, env, say)
    finally:
        out.namespaces_after = namespaces()
        out.events = log_events(logs / "learner.log")
    return out


def _run(
    plan: Plan,
    net: Network,
    out: Outcome,
    tasks: Path,
    run_dir: Path,
    logs: Path,
    env: dict[str, str],
    say: Callable[[str], None],
) -> None:
    a, b, c = net.hosts
    out.hosts = {"A": a.addr, "B": b.addr, "C": c.addr}
    urls = nats_urls(net.hosts)
    url_list = urls.split(",")
    sampler_url = f"http://{b.addr}:{SAMPLER_PORT}"
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, host: Host, argv: list[str]) -> subprocess.Popen:
        out.commands[name] = argv
        p = net.run_in(host, argv, output=logs / f"{name}.log", env=env)
        procs[name] = p
        out.pids[name] = p.pid
        return p

    # each host: its NATS node first (a node waits for its peers to form the cluster). The first one makes the
    # per-role NATS users in keys/ (README: copy keys/ to the other hosts; here they share the disk)
    keys = run_dir.parent / "keys"
    ready = [run_dir.parent / f"nats-{i}.url" for i in range(3)]
    start("nats-0", a, nats_node_argv(0, net.hosts, run_dir.parent / "nats-0", ready[0], keys))
    wait_until("the NATS keys", (keys / "nats-route.password").exists, plan.wait_s, procs)
    for i in (1, 2):
        start(f"nats-{i}", net.hosts[i], nats_node_argv(i, net.hosts, run_dir.parent / f"nats-{i}", ready[i], keys))
    wait_until("the 3-node NATS cluster", lambda: all(f.exists() for f in ready), plan.wait_s, procs)
    env.update(sampler_keys(keys))  # the learner reads both from its environment, the actors the API key
    say(f"NATS cluster up: {urls}")
    sampler_ready = run_dir.parent / "sampler.url"
    start(
        "sampler",
        b,
        py(
            "t1async.sampler",
            "serve",
            "--host",
            b.addr,
            "--port",
            str(SAMPLER_PORT),
            "--ready-file",
            str(sampler_ready),
            "--allowed-weight-roots",
            str(run_dir / "checkpoints"),  # the learner's pushes
            "--api-key-file",
            str(keys / "sampler.key"),
            "--admin-api-key-file",
            str(keys / "sampler-admin.key"),
        ),
    )
    learner_argv = py(
        "t1async.learner",
        "serve",
        "--nats",
        urls,
        "--sampler-url",
        sampler_url,
        "--run-dir",
        str(run_dir),
        "--nats-creds",
        str(keys / "nats-learner.json"),
        "--stream-replicas",
        "3",
        "--batch-turns",
        str(plan.batch_turns),
        "--max-staleness",
        "1",
        *(["--weight-sync", "distributed", "--weight-sync-host", a.addr] if plan.weight_sync == "distributed" else []),
    )
    if plan.learner_hosts == 1:
        start("learner", a, learner_argv)
    else:  # rank 0 (the service) on A, rank 1 on B: the same command under one torchrun per host
        start("learner", a, torchrun_argv(0, plan.learner_hosts, a.addr, learner_argv))
        start("learner-1", b, torchrun_argv(1, plan.learner_hosts, a.addr, learner_argv))
    wait_until("the sampler", sampler_ready.exists, plan.wait_s, procs)
    wait_until(
        "the learner",
        lambda: any(e.get("event") == "learner.ready" for e in log_events(logs / "learner.log")),
        plan.wait_s,
        procs,
    )
    if plan.learner_hosts > 1:
        out.rank_pids = learner_rank_pids(logs)
    say(f"sampler at {sampler_url}, learner ready")
    for i in range(plan.actors):
        start(
            f"actor-{i}",
            c,
            py(
                "actors",
                "--nats",
                urls,
                "--nats-creds",
                str(keys / "nats-actor.json"),
                "--sampler-url",
                sampler_url,
                "--tasks",
                str(tasks),
                "--split",
                "all",
                "--concurrency",
                str(plan.concurrency),
                "--max-turns",
                str(plan.max_turns),
                "--max-new-tokens",
                str(plan.max_new_tokens),
                "--actor-id",
                f"{ACTOR}-{i}",
                "--seed",
                str(plan.seed + i),
            ),
        )
    t0 = time.monotonic()
    wait_until(f"version {plan.versions_before}", lambda: version(run_dir) >= plan.versions_before, plan.wait_s, procs)
    out.version_at_cut = version(run_dir)
    out.turns_before_cut = trained_keys(run_dir)
    out.listeners = {role: net.listeners(h) for role, h in zip("ABC", net.hosts)}
    for rank, pid in out.rank_pids.items():  # the host each learner rank runs in, and the addresses it talks to
        for role, h in zip("ABC", net.hosts):
            if pid in net.pids(h):
                out.rank_hosts[rank] = role
                out.rank_links[rank] = [x for x in net.connections(h) if pid in x.pids]
    say(
        f"version {out.version_at_cut}, {len(out.turns_before_cut)} turns trained: cutting host C for {plan.cut_s:.0f}s"
    )

    t_cut = time.monotonic()
    net.link_down(c, plan.cut_s)
    t_up = time.monotonic()
    out.cut_s = t_up - t_cut
    known = journal_keys(run_dir) | trained_keys(run_dir)
    say("host C back: waiting for training to go on")

    def recovered() -> bool:
        if out.recover_s is None and trained_keys(run_dir) - known:
            out.recover_s = time.monotonic() - t_up
        return out.recover_s is not None

    wait_until("a turn received after the cut, trained", recovered, plan.wait_s, procs)
    target = out.version_at_cut + plan.versions_after
    wait_until(f"version {target}", lambda: version(run_dir) >= target, plan.wait_s, procs)
    if plan.minutes > 0:
        left = plan.minutes * 60 - (time.monotonic() - t0)
        wait_until("the end of the run", lambda: time.monotonic() - t0 >= plan.minutes * 60, left + 60, procs)

    # drain: the actors stop (their open episodes end), the learner takes what is on the stream
    for i in range(plan.actors):
        out.exit_codes[f"actor-{i}"] = net.stop(procs.pop(f"actor-{i}"))

    def read_back() -> set[Key]:
        streams = net.call_in(a, lambda: asyncio.run(_read_streams(url_list, keys)))
        out.stream_turns, out.stream_ids = streams["turns"], streams["ids"]
        out.undecodable, out.dead = streams["undecodable"], streams["dead"]
        out.dead_turns = set(streams["dead_turns"])
        out.replicas = streams["replicas"]
        return set(out.stream_turns)

    stream_keys = read_back()
    wait_until(
        "the learner taking every turn on the stream",
        lambda: stream_keys <= journal_keys(run_dir) | trained_keys(run_dir) | out.dead_turns,
        60,
        procs,
    )

    def accounted() -> bool:  # every turn taken is settled once by some reason, or still open
        out.metrics = net.call_in(a, lambda: asyncio.run(_next_metrics(url_list, 10, keys)))
        return sum(out.metrics["settled"].values()) + out.metrics["untrained_turns"] >= len(stream_keys)

    try:
        wait_until("the learner's metrics counting every turn", accounted, 60, procs)
    except TimeoutError:
        pass  # the test reports the counts
    read_back()  # again: a publish the stopped actors had in flight may have landed since
    if plan.learner_hosts == 1:
        out.exit_codes["learner"] = net.stop(procs.pop("learner"))
    else:  # SIGTERM to rank 0 (the service, by PID): it checkpoints, stops rank 1, and both torchruns exit 0
        if out.rank_pids[0] in net.pids(a):
            os.kill(out.rank_pids[0], signal.SIGTERM)
        for name in ["learner", *(f"learner-{i}" for i in range(1, plan.learner_hosts))]:
            p = procs.pop(name)
            try:
                out.exit_codes[name] = p.wait(timeout=plan.wait_s)
            except subprocess.TimeoutExpired:
                out.exit_codes[name] = net.stop(p)
    out.version_at_end = version(run_dir)
    out.journaled = journal_keys(run_dir)
    from t1async.credits.settle import trained_counts
    from t1async.learner.state import LearnerState

    state = LearnerState.load(run_dir / "checkpoints")
    _, out.trained = trained_counts(run_dir, state.policy_version)
    for name in ["sampler", "nats-2", "nats-1", "nats-0"]:
        out.exit_codes[name] = net.stop(procs.pop(name), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="run this long in all (default 3)")
    p.add_argument("--cut", type=float, default=20.0, help="seconds host C is unplugged (default 20)")
    p.add_argument("--actors", type=int, default=1, help="actor processes on host C (default 1)")
    p.add_argument("--concurrency", type=int, default=2, help="episodes per actor (default 2)")
    p.add_argument(
        "--weight-sync", choices=["disk", "distributed"], default="disk", help="how weights reach the sampler"
    )
    p.add_argument(
        "--learner-hosts",
        type=int,
        choices=[1, 2],
        default=2,
        help="1: the learner on host A; 2 (default): rank 0 on A and rank 1 on B, one torchrun each",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep the run here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    from t1async.log import configure
    from t1async.testing.netns import unavailable

    configure(stream=sys.stderr)  # stdout: the table and the JSON line
    why = unavailable()
    if why:
        print(f"bench.multihost: {why}", file=sys.stderr)
        return 2
    plan = Plan(
        minutes=args.minutes,
        cut_s=args.cut,
        actors=args.actors,
        concurrency=args.concurrency,
        weight_sync=args.weight_sync,
        learner_hosts=args.learner_hosts,
    )

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the namespaces and processes are removed on the way out

    signal.signal(signal.SIGTERM, interrupted)

    with tempfile.TemporaryDirectory(prefix="t1-multihost-") as tmp:
        work = args.keep or Path(tmp)
        out = run(plan, work, say)
    summary = out.summary()
    print_table("three hosts, host C cut", list(summary.items()))
    if args.json:
        emit_json(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
