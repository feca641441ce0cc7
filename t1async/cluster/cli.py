"""``python -m t1async.cluster up|down|status|tail|report``: run the t1async cluster on one machine and watch it.

Every subcommand takes ``--run-dir`` (default ``runs/latest``, relative to the current directory): ``up``
writes ``<run-dir>/cluster.json`` (PIDs, NATS URL) and ``<run-dir>/logs/``; ``down``, ``status`` and ``tail``
read it. ``T1_BACKEND=asyncio`` runs on asyncio instead of trio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from t1async.cluster.state import (
    DEFAULT_RUN_DIR,
    ClusterState,
    ProcStatus,
    RunStatus,
    is_ours,
    reap_stale,
    stop_recorded,
)
from t1async.log import configure
from t1async.protocol.errors import ConfigError, T1Error
from t1async.signals import cancel_on_stop

EXIT_NOT_RUNNING = 3


def _run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    backend = os.environ.get("T1_BACKEND", "trio")
    if backend not in ("trio", "asyncio"):
        raise ConfigError(f"T1_BACKEND={backend!r} is not one of 'trio', 'asyncio'")
    try:
        return anyio.run(fn, *args, backend=backend)
    except ExceptionGroup as group:  # a task group wrapped our one error: show it plainly
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], (T1Error, BrokenPipeError)):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


# ---------------------------------------------------------------------------------------- up


def cmd_up(args: argparse.Namespace) -> int:
    from t1async.cluster.config import from_args

    cfg = from_args(args)
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # the terminal shows the dashboard and one closing line (why it stopped); the supervisor's log goes to its
    # file, and to the terminal too only when --log-level asks for it
    configure(
        args.log_level, log_file=run_dir / "logs" / "supervisor.jsonl", console_level=args.log_level or "critical"
    )
    from t1async.cluster import components, preflight
    from t1async.cluster.observe.progress import show_progress
    from t1async.cluster.supervisor import ClusterConfig, ProcessSpec, Supervisor

    if cfg.preset != "none" and args.preset is None:
        print(
            f"preset: {cfg.preset} (the default for a run that names no model or tasks; --preset none: the bare model)"
        )
    # every outside dependency first: a wrong URL or a missing tool fails now, in one line, not minutes later
    if cfg.nats is not None:
        preflight.check_nats(cfg.nats)
    preflight.check_samplers(cfg.sampler_url)
    if cfg.engine == "vllm":
        preflight.check_vllm(cfg.sampler_url, cfg.vllm_python)
    preflight.check_sandbox()
    components.ensure_tasks(cfg)
    preflight.check_tasks(components.tasks_dir(cfg))
    warm = components.warm_start_argv(cfg)
    before: tuple[ProcessSpec, ...] = (
        ()
        if warm is None
        else (
            ProcessSpec(
                "warm-start",
                warm,
                progress=components.warm_start_phases(cfg),
                note=components.warm_start_note(cfg),
            ),
        )
    )

    async def progress(nats_url: str, run_dir: Path) -> None:
        urls = list(cfg.sampler_url) or components.embedded_sampler_urls(cfg)
        key = components.sampler_keys(cfg)[0]
        creds = components.nats_creds(cfg, Role.READER)
        await show_progress(
            nats_url, run_dir, sampler_urls=urls, sampler_api_key=key, plain=args.plain, nats_creds=creds
        )

    from t1async.transport.auth import Role
    from t1async.transport.natscluster import default_replicas

    sup = ClusterConfig(
        run_dir=run_dir,
        nats_url=cfg.nats,
        nats_port=cfg.nats_port,
        max_payload=cfg.max_payload,
        nats_nodes=cfg.nats_nodes,
        stream_replicas=default_replicas(cfg.nats_nodes, cfg.stream_replicas, external=cfg.nats is not None),
        nats_auth=cfg.nats is None,  # the embedded NATS takes only the users it makes (transport/auth.py)
        nats_tls=cfg.nats_tls,
        nats_creds=cfg.nats_creds,
        duration_s=cfg.duration,
        max_restarts=cfg.max_restarts,
        build=lambda url: components.specs(cfg, url),
        before=before if warm else (),
        progress=progress,
    )
    return _run(Supervisor(sup).run)


# ---------------------------------------------------------------------------------------- down


def cmd_down(args: argparse.Namespace) -> int:
    state = ClusterState.load(args.run_dir)
    lines = []
    if state.supervisor is not None:  # the supervisor stops its components itself, NATS last
        lines.append(stop_recorded(state.supervisor, args.timeout))
    # whatever outlived it (it was SIGKILLed, or had to be): by PID, only if still the recorded process
    lines += [f"{line} (reaped: its supervisor was gone)" for line in reap_stale(args.run_dir, args.timeout)]
    state = ClusterState.load(args.run_dir)
    if state.status != RunStatus.STOPPED:
        state.status, state.components = RunStatus.STOPPED, {}
        state.save()
    print("\n".join(lines) if lines else "nothing was running", flush=True)
    return 0


# ---------------------------------------------------------------------------------------- status


def _healthz(monitor_url: str) -> str:
    if not monitor_url:
        return "unknown (external NATS)"
    try:
        resp = httpx.get(f"{monitor_url}/healthz?js-enabled-only=true", timeout=1.0, trust_env=False)
    except httpx.HTTPError as exc:
        return f"unreachable ({type(exc).__name__})"
    return "ok" if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text.strip()[:100]}"


def cmd_status(args: argparse.Namespace) -> int:
    state = ClusterState.load(args.run_dir)
    procs = ([state.supervisor] if state.supervisor else []) + list(state.components.values())
    alive = {p.name: is_ours(p) for p in procs}
    running = state.status == RunStatus.RUNNING and all(alive.values()) and bool(alive)
    health = _healthz(state.monitor_url) if state.status != RunStatus.STOPPED else "-"
    if args.json:
        print(
            json.dumps(
                {
                    "run_dir": state.run_dir,
                    "status": state.status,
                    "running": running,
                    "nats_url": state.nats_url,
                    "healthz": health,
                    "processes": {p.name: {"pid": p.pid, "alive": alive[p.name], "log": p.log} for p in procs},
                }
            )
        )
    else:
        print(
            f"run dir:  {state.run_dir}\nstatus:   {state.status}\nnats:     {state.nats_url or '-'}\n"
            f"healthz:  {health}"
        )
        for p in procs:
            print(f"  {p.name:<12} pid {p.pid:<8} {ProcStatus.ALIVE if alive[p.name] else ProcStatus.GONE}  {p.log}")
    return 0 if running else EXIT_NOT_RUNNING


# ---------------------------------------------------------------------------------------- tail


def cmd_tail(args: argparse.Namespace) -> int:
    from t1async.transport.auth import Role, creds_path

    url, creds = args.nats, args.nats_creds
    if url is None:
        try:
            state = ClusterState.load(args.run_dir)
        except ConfigError as exc:
            raise ConfigError(f"no --nats given and {exc}; or pass --nats nats://HOST:PORT") from None
        if state.status == RunStatus.STOPPED or not state.nats_url:
            raise ConfigError(
                f"the cluster in {args.run_dir} is not running (status {state.status}): start it with "
                f"`python -m t1async.cluster up --run-dir {args.run_dir}`, or pass --nats URL"
            )
        url = state.nats_url
        if creds is None and creds_path(args.run_dir, Role.READER).is_file():  # the read-only user cluster up made
            creds = creds_path(args.run_dir, Role.READER)
    # stdout carries records only; the tail's own logs go to stderr, and only warnings and worse
    configure(args.log_level, console_level=args.log_level or "warning")
    from t1async.cluster.glossary import TURN_FIELDS
    from t1async.cluster.observe.tail import TailConfig, tail

    fields = tuple(f.strip() for f in (args.fields or "").split(",") if f.strip())
    unknown = [f for f in fields if f not in TURN_FIELDS] if not args.json else []
    if unknown:
        raise ConfigError(f"--fields: unknown field(s) {', '.join(unknown)}; known: {','.join(TURN_FIELDS)}")
    if args.max_text < 0:
        raise ConfigError(f"--max-text must be >= 0 (0: no limit), got {args.max_text}")
    cfg = TailConfig(
        nats_url=url,
        subject=args.subject,
        json=args.json,
        episode=args.episode,
        text=not args.no_text,
        fields=fields,
        max_text=args.max_text,
        nats_creds=Path(creds) if creds else None,
    )

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(cancel_on_stop, tg.cancel_scope)
            await tail(cfg, sys.stdout, sys.stderr)
            tg.cancel_scope.cancel()

    _run(main)
    return 0


# ---------------------------------------------------------------------------------------- report


def cmd_report(args: argparse.Namespace) -> int:
    from t1async.cluster.observe.report import report

    png, page, numbers = report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {png} and {page}")
    print("  ".join(f"{k} {v}" for k, v in numbers.items()))
    return 0


# ---------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m t1async.cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{up,down,status,tail,report}")

    def add(name: str, help: str, description: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(
            name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sp.add_argument(
            "--run-dir",
            default=str(DEFAULT_RUN_DIR),
            help=f"the cluster's run directory (default: {DEFAULT_RUN_DIR}, relative to the cwd)",
        )
        sp.add_argument(
            "--log-level",
            default=None,
            choices=["debug", "info", "warning", "error"],
            help="log level (default: $T1_LOG_LEVEL or info)",
        )
        return sp

    up = add(
        "up",
        "start the cluster in the foreground",
        "Start a whole T1 training loop in the foreground, with embedded defaults:\n"
        "  0. by default the `quickstart` preset: a weak warm-started policy that RL visibly improves on\n"
        "     `touch4` tasks, its warm start built on first use (5-10 min on 2 cores) and cached;\n"
        "     --preset none: the bare model (random weights);\n"
        "  1. a synthetic task corpus in <run-dir>/tasks (unless --tasks), and an optional warm start (SFT);\n"
        "  2. nats-server with JetStream (free loopback port, store in <run-dir>/nats) unless --nats;\n"
        "  3. the embedded SGLang-compatible sampler with the tiny MoE model, unless --sampler-url;\n"
        "  4. the learner (checkpoints in <run-dir>/checkpoints), then --actors actor processes.\n"
        "Checks --nats, --sampler-url, bubblewrap and the tasks first, and stops with a one-line error if\n"
        "one is missing. Shows a live dashboard (--plain: one line every 10 s); the supervisor's own log\n"
        "goes to <run-dir>/logs/supervisor.jsonl, and to the terminal only with --log-level.\n"
        "Writes <run-dir>/cluster.json (PIDs), <run-dir>/logs/, <run-dir>/metrics.jsonl.\n"
        "Runs until Ctrl-C, SIGTERM, `down`, --duration or --steps; then stops every component\n"
        "(SIGTERM, then SIGKILL), NATS last. Run it again on the same --run-dir to resume training.",
    )
    from t1async.cluster.flags import add_up_arguments

    add_up_arguments(up)
    up.add_argument(
        "--plain",
        action="store_true",
        help="one compact status line every 10 s instead of the live dashboard (the default off a terminal)",
    )
    up.set_defaults(func=cmd_up)

    down = add(
        "down",
        "stop a running cluster",
        "Stop the cluster recorded in <run-dir>/cluster.json: SIGTERM to its supervisor (which stops its\n"
        "components), then SIGTERM/SIGKILL to any component still alive. Only processes whose PID still\n"
        "shows the recorded command line and start time are signalled.",
    )
    down.add_argument(
        "--timeout", type=float, default=20.0, metavar="SECONDS", help="wait this long before SIGKILL (default 20)"
    )
    down.set_defaults(func=cmd_down)

    st = add(
        "status",
        "show what runs",
        "Show the cluster in <run-dir>: its status, each process (pid, alive), the NATS URL and its /healthz.\n"
        f"Exit status 0 when everything runs, {EXIT_NOT_RUNNING} otherwise.",
    )
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=cmd_status)

    from t1async.cluster.glossary import LEGEND, TURN_FIELDS

    tl = add(
        "tail",
        "print records as they are published",
        "Subscribe to SUBJECT (default t1.traj.>, every episode's records; also t1.policy, t1.metrics.>,\n"
        "t1.dead.>) and print each record decoded: turns show episode, turn, policy version, token counts,\n"
        "reward, tests, drift (keep vs the previous sequence length) and routing start/rows, action,\n"
        "observation and output text (when the tokenizer loads). --json prints one object per record\n"
        "(token ids and logprobs as lists, routing as {start, dtype, shape}, bytes as hex). Malformed\n"
        "messages print one line starting with '!'. Live only: nothing published before it started.\n"
        "Records go to stdout (plain text, colours on a terminal only), the header and logs to stderr.\n\n" + LEGEND,
    )
    tl.add_argument(
        "subject", nargs="?", default="t1.traj.>", help="NATS subject, wildcards allowed (default t1.traj.>)"
    )
    tl.add_argument(
        "--nats", default=None, metavar="URL", help="NATS URL (default: the running cluster's, from --run-dir)"
    )
    tl.add_argument(
        "--nats-creds",
        default=None,
        metavar="FILE",
        help="NATS credentials file (default: the run's read-only one, <run-dir>/secrets/nats-reader.json)",
    )
    tl.add_argument("--json", action="store_true", help="one JSON object per record")
    tl.add_argument("--episode", default=None, metavar="ID", help="only this episode's records")
    tl.add_argument("--no-text", action="store_true", help="do not decode output ids to text")
    tl.add_argument(
        "--fields",
        default=None,
        metavar="A,B,...",
        help=f"show only these parts of a turn ({','.join(TURN_FIELDS)}); with --json, only these keys",
    )
    tl.add_argument(
        "--max-text",
        type=int,
        default=160,
        metavar="N",
        help="clip action, observation and text to N characters (default 160; 0: no limit)",
    )
    tl.set_defaults(func=cmd_tail)

    rp = add(
        "report",
        "picture a run: one page from its metrics.jsonl",
        "Read <run-dir>/metrics.jsonl (a running or a stopped cluster) and write one page: reward and\n"
        "resolved rate, throughput, the staleness histogram, TITO drift counts, mismatch and policy shift,\n"
        "and the learner's step time (forward, backward, checkpoint, push). Writes <run-dir>/report.png and\n"
        "report.html (the PNG embedded, with the headline numbers), and prints those numbers.",
    )
    rp.add_argument(
        "--out", default=None, metavar="PATH", help="write PATH.png and PATH.html instead (default <run-dir>/report)"
    )
    rp.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except T1Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `status | head`: the reader left; say nothing more, and let exit not flush again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell tool killed by the broken pipe
