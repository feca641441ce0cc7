"""``python -m bench.chaos``: a seeded schedule of faults over a real cluster, then its history checked.

It runs ``python -m t1async.cluster up`` with 3 NATS nodes, 2 samplers and 2 actor processes for
``--minutes`` (default 15), and every 30–90 s (seeded) injects one fault, each kind once per round in a
seeded order:

- ``kill_actor`` / ``kill_learner`` / ``kill_sampler`` / ``kill_nats``: SIGKILL of that process (for NATS,
  half the time the ``T1_TRAJ`` stream leader); the supervisor restarts it;
- ``stop_sampler``: SIGSTOP of a sampler for 20 s, then SIGCONT (a hang, not a crash);
- ``kill_shell``: SIGKILL of a sandboxed shell mid-command;
- ``disk_full``: the learner's journal directory (a 256 MiB tmpfs the bench mounts) filled for 30 s (root);
- ``poison``: a plain nats-py client publishes 20 malformed payloads and re-publishes 10 valid turn records
  already in the stream, without their message ids (JetStream stores them twice);
- ``kill_supervisor``: SIGKILL of ``cluster up`` itself: no process of the run may be left 10 s later (those
  left count as leaks), then ``cluster up`` is started again on the run dir and resumes.

After each fault it waits for the learner's next step (a new line in ``learner/steps.jsonl`` for a newer
version): that is the fault's recovery time. At the end it reads every turn record in ``T1_TRAJ`` with a
plain nats-py client, waits for the learner to journal them, stops the cluster and checks the history from
the stream and the run dir, not from the components' counters:

- ``turns_lost``: turns acked by JetStream that are neither in the learner's journal nor dead-lettered
  (poisoned episodes, ``learner/poisoned.jsonl``);
- ``trained_twice``: turns in two counted steps of ``steps.jsonl`` (a crashed step's line is superseded by
  the resumed learner's); ``turns_settled_once``: turns trained exactly once;
- the staleness of every counted step ≤ η, the learner's policy version never going back (metrics.jsonl),
  its peak RSS, and ``leaks``: processes whose command line names the run dir after ``cluster up`` exited.

Targets: ``turns_lost = 0``, ``trained_twice = 0``, ``leaks = 0``, every fault recovered, ``recover_s_max
≤ 60``. ``tests/test_chaos.py`` runs a short version (4 faults, fixed seed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
import psutil

from bench._common import emit_json, print_grid
from t1async.cluster.state import ClusterState, RunStatus
from t1async.credits.settle import read_step_log
from t1async.ingest.journal import read_journal
from t1async.procs import pid_alive, popen
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError
from t1async.transport.auth import Role, creds_path, load_creds

KINDS = (
    "kill_actor",
    "kill_learner",
    "kill_sampler",
    "kill_nats",
    "stop_sampler",
    "kill_shell",
    "disk_full",
    "poison",
    "kill_supervisor",
)
RECOVER_LIMIT_S = 240.0  # how long a fault's recovery is waited for before it counts as not recovered


@dataclass
class Fault:
    kind: str
    target: str = ""
    at_s: float = 0.0  # since the run started
    ended_s: float = 0.0
    recover_s: float | None = None  # the fault's end to the learner's next step; None: not recovered
    note: str = ""


@dataclass
class Run:
    run_dir: Path
    argv: list[str]  # cluster up's
    log: Any  # its output file
    t0: float
    journal_fs: Path | None
    pids_seen: set[int] = field(default_factory=set)
    proc: Any = None  # cluster up (subprocess.Popen), started by ``start``
    orphans: list[str] = field(default_factory=list)  # what a SIGKILLed cluster up left alive after 10 s

    def start(self) -> None:
        """cluster up (again: a resume on the same run dir). A parent-death SIGTERM: it stops its run in order
        when this bench dies however it dies (a test's timeout kills it)."""
        self.proc = popen(
            self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, pdeathsig=signal.SIGTERM
        )

    def components(self) -> dict[str, int]:
        try:
            st = ClusterState.load(self.run_dir)
        except ConfigError:  # not written yet
            return {}
        pids = {name: p.pid for name, p in st.components.items() if p.pid}
        self.pids_seen |= set(pids.values())
        return pids

    def version(self) -> int:
        """The newest counted step's version (-1 before the first)."""
        steps = read_step_log(self.run_dir / "learner" / "steps.jsonl")
        return max(steps, default=-1)


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _ancestors(pid: int) -> set[int]:
    try:
        return {pid, *(p.pid for p in psutil.Process(pid).parents())}
    except psutil.Error:
        return {pid}


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def leaked(run_dir: Path, pids: set[int]) -> list[str]:
    """Processes still alive that name the run dir or were components of it."""
    mine = _ancestors(os.getpid())  # this bench and whatever started it may name the run dir too
    out = []
    for pid in psutil.pids():
        if pid not in mine:
            cmd = _cmdline(pid)
            if str(run_dir) in cmd or (pid in pids and cmd):
                out.append(f"{pid}: {cmd[:120]}")
    return out


async def _nats(url: str, fn: Callable[[Any], Any], creds: Path | None) -> Any:
    """``fn(nc)`` on a plain nats-py connection, as the run's admin (the operator's key: it may do anything)."""
    opts = load_creds(creds).connect_options() if creds is not None else {}
    nc = await nats.connect(servers=url.split(","), connect_timeout=5, max_reconnect_attempts=3, **opts)
    try:
        return await fn(nc)
    finally:
        await nc.close()


def admin_creds(run_dir: Path) -> Path | None:
    """The admin's credentials ``cluster up`` made in the run dir (none: an open NATS)."""
    path = creds_path(run_dir, Role.ADMIN)
    return path if path.is_file() else None


def stream_leader(url: str, creds: Path | None = None) -> str:
    async def ask(nc: Any) -> str:
        info = await nc.jetstream().stream_info("T1_TRAJ")
        return info.cluster.leader if info.cluster else ""

    try:
        return asyncio.run(_nats(url, ask, creds))
    except Exception:  # noqa: BLE001 - no leader right now: pick any node
        return ""


def poison_burst(url: str, rng: random.Random, creds: Path | None = None) -> str:
    async def burst(nc: Any) -> str:
        js = nc.jetstream()
        for i in range(20):
            junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
            await js.publish(f"t1.traj.chaos-{rng.getrandbits(32):08x}-{i}", junk)
        info = await js.stream_info("T1_TRAJ")
        last, dup = info.state.last_seq, 0
        for seq in range(last, max(last - 200, 0), -1):
            if dup >= 10:
                break
            try:
                msg = await js.get_msg("T1_TRAJ", seq)
            except Exception:  # noqa: BLE001 - deleted or not there
                continue
            if msg.data and isinstance(_decode(msg.data), wire.TurnRecord):
                await js.publish(msg.subject, msg.data)  # no Nats-Msg-Id: stored a second time
                dup += 1
        return f"20 malformed, {dup} duplicate turns"

    return asyncio.run(_nats(url, burst, creds))


def _decode(data: bytes) -> wire.Record | None:
    try:
        return wire.decode(data)
    except Exception:  # noqa: BLE001 - malformed: not a turn
        return None


def stream_turns(url: str, creds: Path | None = None, deadline_s: float = 300.0) -> set[tuple[str, int]]:
    """Every valid turn record in T1_TRAJ, read by an ephemeral consumer from the start up to the stream's last
    sequence at the time of asking (``read_turns``)."""
    return asyncio.run(_nats(url, lambda nc: read_turns(nc.jetstream(), deadline_s), creds))


async def read_turns(js: Any, deadline_s: float, pause_s: float = 0.5) -> set[tuple[str, int]]:
    """``stream_turns`` on a JetStream context. A fetch that times out is retried (on a loaded machine a fetch may
    come back empty long before the end). A 503 (a node that just came back after ``kill_nats``, a consumer whose
    leader moved) drops the consumer and makes a new one from the next sequence not yet read. Only reaching the
    last sequence (or nothing left pending) ends the read; ``deadline_s`` without it is an error, never a short
    history."""
    from nats.js import api
    from nats.js.errors import ServiceUnavailableError

    from t1async.transport.natsio import while_electing

    give_up = time.monotonic() + deadline_s
    unavailable: BaseException | None = None

    def check_deadline(seen: int, last: int) -> None:
        if time.monotonic() > give_up:
            why = f" (last error: {unavailable!r})" if unavailable is not None else ""
            raise TimeoutError(f"T1_TRAJ: read to sequence {seen} of {last} in {deadline_s:.0f} s{why}")

    # a 503 or no answer while JetStream elects: asked again until the deadline, as the transport does
    last = (await while_electing(lambda: js.stream_info("T1_TRAJ"), deadline_s, pause_s)).state.last_seq
    got: set[tuple[str, int]] = set()
    seen, sub = 0, None
    while seen < last:
        check_deadline(seen, last)
        try:
            if sub is None:
                start = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seen + 1)
                sub = await js.pull_subscribe("t1.traj.>", durable=None, stream="T1_TRAJ", config=start)
            msgs = await sub.fetch(512, timeout=3)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        except ServiceUnavailableError as exc:
            unavailable = exc
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            sub = None
            await asyncio.sleep(pause_s)
            continue
        for m in msgs:
            seen = max(seen, m.metadata.sequence.stream)
            rec = _decode(m.data)
            if isinstance(rec, wire.TurnRecord):
                got.add((rec.episode, rec.turn))
            await m.ack()
        if msgs and msgs[-1].metadata.num_pending == 0:  # caught up (the last sequence may be one it filters out)
            break
    return got


class Chaos:
    def __init__(self, run: Run, rng: random.Random, eta_hint: int) -> None:
        self.run, self.rng = run, rng
        self.eta = eta_hint

    def _now(self) -> float:
        return time.monotonic() - self.run.t0

    def inject(self, kind: str) -> Fault:
        f = Fault(kind, at_s=self._now())
        pids = self.run.components()
        pick = lambda prefix: sorted(n for n in pids if n.startswith(prefix))  # noqa: E731
        if kind in ("kill_actor", "kill_learner", "kill_sampler", "kill_nats"):
            names = pick(
                {"kill_actor": "actor-", "kill_learner": "learner", "kill_sampler": "sampler"}.get(kind, "nats-")
            )
            if kind == "kill_nats" and self.rng.random() < 0.5:
                leader = stream_leader(ClusterState.load(self.run.run_dir).nats_url, admin_creds(self.run.run_dir))
                if leader.startswith("t1-"):
                    names = [f"nats-{leader.removeprefix('t1-')}"]
                    f.note = "stream leader"
            f.target = self.rng.choice(names)
            os.kill(pids[f.target], signal.SIGKILL)
        elif kind == "stop_sampler":
            f.target = self.rng.choice(pick("sampler"))
            os.kill(pids[f.target], signal.SIGSTOP)
            try:
                time.sleep(20)
            finally:
                os.kill(pids[f.target], signal.SIGCONT)
        elif kind == "kill_shell":
            shells = [
                p
                for a in pick("actor-")
                for p in _descendants(pids[a])
                if _comm(p) in ("bash", "sh") and _comm_parent_is_sandbox(p)
            ]
            if shells:
                victim = self.rng.choice(shells)
                f.target = f"shell pid {victim}"
                os.kill(victim, signal.SIGKILL)
            else:
                f.note = "no shell was running a command"
        elif kind == "disk_full":
            fs = self.run.journal_fs
            if fs is None:
                f.note = "skipped: the journal tmpfs needs root"
            else:
                f.target = str(fs)
                filler = fs / "chaos-filler"
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    while True:
                        os.write(fd, b"\0" * (1 << 20))
                except OSError:
                    pass
                finally:
                    os.close(fd)
                try:
                    time.sleep(30)
                finally:
                    filler.unlink(missing_ok=True)
        elif kind == "kill_supervisor":  # cluster up itself: nothing of the run may survive it, then resume
            f.target = "cluster up"
            self.run.proc.kill()
            self.run.proc.wait()
            deadline = time.monotonic() + 10.0
            while (left := leaked(self.run.run_dir, set(pids.values()))) and time.monotonic() < deadline:
                time.sleep(0.2)
            if left:
                f.note = f"{len(left)} processes left after 10 s"
                self.run.orphans += left
                for line in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(line.split(":")[0]), signal.SIGKILL)
            else:
                f.note = "nothing left after 10 s; cluster up restarted"
            self.run.start()
        elif kind == "poison":
            f.target = "t1.traj.*"
            f.note = poison_burst(ClusterState.load(self.run.run_dir).nats_url, self.rng, admin_creds(self.run.run_dir))
        f.ended_s = self._now()
        return f

    def wait_recovered(self, f: Fault, before: int) -> None:
        deadline = time.monotonic() + RECOVER_LIMIT_S
        while time.monotonic() < deadline:
            if self.run.proc.poll() is not None:
                f.note += " (cluster up exited)"
                return
            if self.run.version() > before:
                f.recover_s = round(self._now() - f.ended_s, 1)
                return
            self.run.components()
            time.sleep(0.5)


def _comm(pid: int) -> str:
    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return ""


def _comm_parent_is_sandbox(pid: int) -> bool:
    try:
        ppid = psutil.Process(pid).ppid()
    except psutil.Error:
        return False
    return _comm(ppid) in ("bwrap", "bash", "sh", "conmon", "runc")


def mount_journal_fs(run_dir: Path, size_mb: int) -> Path | None:
    """A size-limited tmpfs for the learner's journal (root only). Named by this bench's PID: the mounts of
    a bench that was SIGKILLed (its cleanup never ran) are unmounted here, by the next one."""
    if os.geteuid() != 0:
        return None
    for old in Path(tempfile.gettempdir()).glob("t1-chaos-journal-*-*"):
        pid = old.name.split("-")[3]
        if pid.isdigit() and not pid_alive(int(pid)):
            subprocess.run(["umount", "-l", str(old)], check=False, capture_output=True)
            old.rmdir()
    fs = Path(tempfile.mkdtemp(prefix=f"t1-chaos-journal-{os.getpid()}-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(fs)], check=True)
    (run_dir / "learner").mkdir(parents=True, exist_ok=True)
    (run_dir / "learner" / "journal").symlink_to(fs)
    return fs


def history(run_dir: Path, acked: set[tuple[str, int]]) -> dict[str, Any]:
    journal = run_dir / "learner" / "journal"
    journaled = {(r.episode, r.turn) for r in read_journal(journal) if isinstance(r, wire.TurnRecord)}
    poisoned: dict[str, int] = {}
    book = run_dir / "learner" / "poisoned.jsonl"
    if book.exists():
        for line in book.read_text().splitlines():
            if line.strip():
                p = json.loads(line)
                poisoned[p["episode"]] = min(int(p["turn"]), poisoned.get(p["episode"], 1 << 30))
    dead = {(ep, t) for ep, t in acked if ep in poisoned and t >= poisoned[ep]}
    steps = read_step_log(run_dir / "learner" / "steps.jsonl")
    counts: dict[tuple[str, int], int] = {}
    for r in steps.values():
        for ep, t in r["turns"]:
            counts[(ep, int(t))] = counts.get((ep, int(t)), 0) + 1
    versions = []
    rss = []
    mpath = run_dir / "metrics.jsonl"
    for line in mpath.read_text().splitlines() if mpath.exists() else []:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m.get("component") == "learner":
            versions.append(int(m.get("policy_version", 0)))
            if isinstance(m.get("rss_gb"), (int, float)):
                rss.append(float(m["rss_gb"]))
    went_back = sum(1 for a, b in zip(versions, versions[1:]) if b < a)
    return {
        "turns_acked": len(acked),
        "turns_journaled": len(acked & journaled),
        "turns_dead_lettered": len(dead - journaled),
        "turns_lost": len(acked - journaled - dead),
        "lost_examples": sorted(acked - journaled - dead)[:5],
        "turns_settled_once": sum(1 for k in acked if counts.get(k) == 1),
        "turns_pending": len({k for k in acked & journaled if k not in counts}),
        "trained_twice": sum(1 for c in counts.values() if c > 1),
        "max_staleness": max((int(r.get("max_staleness", 0)) for r in steps.values()), default=0),
        "steps": len(steps),
        "version_went_back": went_back,
        "learner_rss_gb_max": round(max(rss, default=0.0), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="faults are injected for this long (default 15)")
    ap.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")
    ap.add_argument("--faults", type=int, default=0, help="stop after this many faults (default 0: no limit)")
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help=f"fault kinds to draw from (default all: {','.join(KINDS)})"
    )
    ap.add_argument("--gap", default="30,90", help="seconds between faults, drawn uniformly (default 30,90)")
    ap.add_argument("--run-dir", type=Path, default=None, help="run dir (default: a new temp dir)")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the first step (default 900)")
    ap.add_argument("--eta", type=int, default=1, help="--max-staleness for the learner (default 1)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("up_args", nargs="*", help="extra `cluster up` flags, after --")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := sorted(set(kinds) - set(KINDS)):
        ap.error(f"unknown --kinds {bad}; the kinds are {list(KINDS)}")
    lo, hi = (float(x) for x in args.gap.split(","))
    rng = random.Random(args.seed)
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="t1-chaos-"))).resolve()
    journal_fs = mount_journal_fs(run_dir, 256)
    argv_up = [
        sys.executable, "-m", "t1async.cluster", "up", "--run-dir", str(run_dir), "--plain", "--preset", "none",
        "--nats-nodes", "3", "--samplers", "2", "--actors", "2", "--max-staleness", str(args.eta),
        "--synth-tasks", "60", "--max-turns", "8", "--max-new-tokens", "32", "--concurrency", "2",
        "--batch-turns", "8", *args.up_args,
    ]  # fmt: skip
    log = open(run_dir / "chaos-cluster.log", "a")  # noqa: SIM115 - closed below
    run = Run(run_dir, argv_up, log, time.monotonic(), journal_fs)
    run.start()
    faults: list[Fault] = []
    acked: set[tuple[str, int]] = set()
    leaks: list[str] = []
    try:
        deadline = time.monotonic() + args.startup_timeout
        while run.version() < 0:
            if run.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the cluster never trained a step; see {run_dir}/chaos-cluster.log and logs/")
            run.components()
            time.sleep(1)
        print(f"chaos: cluster training in {run_dir}, faults for {args.minutes} min (seed {args.seed})", flush=True)
        end = time.monotonic() + 60 * args.minutes
        bag: list[str] = []
        while time.monotonic() < end and (not args.faults or len(faults) < args.faults):
            gap = rng.uniform(lo, hi)
            time.sleep(min(gap, max(end - time.monotonic(), 0)))
            if time.monotonic() >= end or run.proc.poll() is not None:
                break
            chaos = Chaos(run, rng, args.eta)
            before = run.version()
            if not bag:  # every kind once per round, in a seeded order
                bag = rng.sample(kinds, len(kinds))
            f = chaos.inject(bag.pop())
            chaos.wait_recovered(f, max(before, run.version() if f.kind == "poison" else before))
            faults.append(f)
            outcome = "NOT RECOVERED" if f.recover_s is None else f"recovered in {f.recover_s:.1f}s"
            print(
                f"fault {len(faults)}: {f.kind:<13} {f.target:<14} at {f.at_s:6.0f}s  {outcome}  {f.note}", flush=True
            )
        url = ClusterState.load(run_dir).nats_url
        acked = stream_turns(url, admin_creds(run_dir))
        wait_until = time.monotonic() + 180  # the running learner takes what is left on the stream
        while time.monotonic() < wait_until:
            h = history(run_dir, acked)
            if h["turns_lost"] == 0:
                break
            time.sleep(2)
    finally:
        proc = run.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        time.sleep(1)
        leaks = leaked(run_dir, run.pids_seen)
        for line in leaks:
            pid = int(line.split(":")[0])
            try:
                os.kill(pid, signal.SIGKILL)  # ours (it names our run dir): cleaned up, and counted
            except ProcessLookupError:
                pass
        try:
            stopped = ClusterState.load(run_dir).status == RunStatus.STOPPED
        except ConfigError:
            stopped = False
        try:  # the journal lives on the tmpfs: read the history before it goes
            h = history(run_dir, acked) if acked else {"turns_acked": 0, "turns_lost": 0, "trained_twice": 0}
        finally:
            if journal_fs is not None:
                subprocess.run(["umount", "-l", str(journal_fs)], check=False)
                journal_fs.rmdir()
    rec = [f.recover_s for f in faults if f.recover_s is not None]
    rows = [
        (i + 1, f.kind, f.target, round(f.at_s), "-" if f.recover_s is None else f.recover_s, f.note)
        for i, f in enumerate(faults)
    ]
    print_grid(["#", "fault", "target", "at_s", "recover_s", "note"], rows, title="faults")
    result = {
        "faults": len(faults),
        "recovered": len(rec),
        "recover_s_p50": sorted(rec)[len(rec) // 2] if rec else None,
        "recover_s_max": max(rec) if rec else None,
        "leaks": len(leaks) + len(run.orphans),  # at the end, and what a SIGKILLed cluster up left
        "leaked": (run.orphans + leaks)[:5],
        "stopped_clean": stopped,
        "eta": args.eta,
        "run_dir": str(run_dir),
        "fault_log": [asdict(f) for f in faults],
        **h,
    }
    ok = (
        result["turns_lost"] == 0
        and result["trained_twice"] == 0
        and result["leaks"] == 0
        and len(rec) == len(faults)
        and (not rec or max(rec) <= 60)
        and h.get("max_staleness", 0) <= args.eta
    )
    result["targets_met"] = ok
    print(
        f"turns acked {h.get('turns_acked')}, lost {h.get('turns_lost')}, trained twice {h.get('trained_twice')}, "
        f"leaks {result['leaks']}, recovered {len(rec)}/{len(faults)}, targets {'met' if ok else 'MISSED'}",
        flush=True,
    )
    (run_dir / "chaos.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")  # for a post-mortem
    if args.json:
        emit_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
