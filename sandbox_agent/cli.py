"""``python -m sandbox_agent``: synthesize tasks, check a corpus for benchmark overlap, run one task.

    python -m sandbox_agent synth --out DIR --n N --seed S [--families a,b]
    python -m sandbox_agent decontam --corpus DIR --against DIR [--ngram 8] [--threshold 0.5] [--json]
    python -m sandbox_agent run-task TASK_DIR [--oracle | --agent null|oracle] [--backend B] [--json]
    python -m sandbox_agent check TASKS_DIR [--sample K] [--seed S] [--backend B] [--json]
    python -m sandbox_agent list TASKS_DIR [--backend B] [--json]
    python -m sandbox_agent images build-base [--force]

``--backend auto|bwrap|container`` (default auto): bwrap when it reproduces the task exactly (no
Dockerfile, or only FROM/WORKDIR/COPY/ENV), else the container backend (podman).

Exit status: 0 done (whatever the tests said), 1 the task could not be run (TaskNeedsImageError, a broken
task, a sandbox failure), 2 bad usage, 3 the task's image did not build (its Dockerfile failed, e.g. a host
it needs is unreachable: not the policy's fault). With ``--json`` the last line of stdout is one JSON object,
whatever the outcome; ``"status": "image_build_failed"`` names the failing ``step`` and unreachable ``host``.
``check`` exits 1 if a task is bad, else 3 if some task's image did not build.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

from sandbox_agent.images.buildfail import IMAGE_BUILD_FAILED
from sandbox_agent.sandbox.backend import BackendName
from t1async.log import configure
from t1async.protocol.errors import T1Error

EXIT_NOT_RUN = 1
EXIT_IMAGE_BUILD_FAILED = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandbox_agent", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "synth",
        help="write synthetic tasks (Terminal-Bench 1 format)",
        description="Write N synthetic tasks into DIR, cycling through the task families.",
    )
    s.add_argument("--out", required=True, type=Path, help="output directory (created if missing)")
    s.add_argument("--n", required=True, type=int, help="number of tasks")
    s.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    s.add_argument("--families", default="", help="comma-separated family names (default: all)")
    s.add_argument("--json", action="store_true", help="print a JSON summary as the last line")

    d = sub.add_parser(
        "decontam",
        help="report overlap between a corpus and a benchmark",
        description="Near-duplicate instructions (n-gram Jaccard/containment) and identical test files.",
    )
    d.add_argument("--corpus", required=True, type=Path, help="the training corpus (task dirs)")
    d.add_argument("--against", required=True, type=Path, help="the benchmark to check against (task dirs)")
    d.add_argument("--ngram", type=int, default=8, help="shingle size in words (default 8)")
    d.add_argument("--threshold", type=float, default=0.5, help="flag at Jaccard or containment >= this (default 0.5)")
    d.add_argument("--json", action="store_true", help="print the report as JSON (last line)")

    r = sub.add_parser(
        "run-task",
        help="run one task in the bwrap sandbox with a scripted agent",
        description="Run TASK_DIR with its oracle solution or a do-nothing agent; print per-test "
        "results, the dense reward (tests passed) and whether it resolved.",
    )
    r.add_argument("task_dir", type=Path, metavar="TASK_DIR")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--oracle", action="store_true", help="run the task's solution (same as --agent oracle)")
    g.add_argument("--agent", choices=("null", "oracle"), help="scripted agent (default: null)")
    _environment_flags(r)
    r.add_argument("--json", action="store_true", help="print the result as JSON (last line)")

    c = sub.add_parser(
        "check",
        help="oracle must resolve and do-nothing must not, on (a sample of) tasks",
        description="Run every task's oracle and a do-nothing agent in the bwrap sandbox; exit 1 "
        "if any oracle fails to resolve or any do-nothing run resolves.",
    )
    c.add_argument("tasks_dir", type=Path, metavar="TASKS_DIR")
    c.add_argument("--sample", type=int, default=0, help="check a random sample of K tasks (default: all)")
    c.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    c.add_argument("--concurrency", type=int, default=2, help="tasks run at once (default 2)")
    _environment_flags(c)
    c.add_argument("--json", action="store_true", help="print a JSON summary (last line)")

    ls = sub.add_parser("list", help="list the tasks under a directory", description="Load and list tasks.")
    ls.add_argument("tasks_dir", type=Path, metavar="TASKS_DIR")
    ls.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    ls.add_argument("--json", action="store_true", help="print JSON (last line)")

    im = sub.add_parser(
        "images",
        help="container images: build the base image",
        description="Build the container backend's base image from Debian packages (mmdebstrap + "
        "podman import + uv/pytest from PyPI); cached, so a second run takes seconds.",
    )
    im.add_argument("action", choices=("build-base",), help="what to do")
    im.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    return p


BACKENDS = tuple(b.value for b in BackendName)
NETWORK_HELP = (
    "containers only: give the verifier the network, so a test script that fetches uv/pytest runs as "
    "written (default: no network; such scripts are replaced by their test files under pytest -rA)"
)
AGENT_NETWORK_HELP = (
    "containers only: the agent's container gets the network (podman's bridge, the host's CA bundle), for "
    "tasks whose solution installs packages as it goes (default: --network=none while the agent acts)"
)
BACKEND_HELP = (
    "sandbox backend (default auto: bwrap for tasks without a Dockerfile or image, containers with podman "
    "for the rest; bwrap runs the Dockerfile subset it can reproduce only when podman is missing)"
)


def _environment_flags(p: argparse.ArgumentParser) -> None:
    """``--backend``, ``--verifier-network``, ``--agent-network``: where a task runs (run-task, check)."""
    p.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    p.add_argument("--verifier-network", action="store_true", help=NETWORK_HELP)
    p.add_argument("--agent-network", action="store_true", help=AGENT_NETWORK_HELP)


def _cmd_synth(a: argparse.Namespace) -> int:
    from sandbox_agent.synth import generate

    fams = [f.strip() for f in a.families.split(",") if f.strip()] or None
    paths = generate(a.out, a.n, a.seed, fams)
    print(f"wrote {len(paths)} tasks to {a.out}")
    if a.json:
        print(json.dumps({"out": str(a.out), "tasks": len(paths), "seed": a.seed}))
    return 0


def _cmd_decontam(a: argparse.Namespace) -> int:
    from sandbox_agent.tasks.decontam import decontaminate

    if a.ngram < 1 or not 0 < a.threshold <= 1:
        raise _Usage(f"--ngram must be >= 1 and --threshold in (0, 1]; got {a.ngram} and {a.threshold}")
    rep = decontaminate(a.corpus, a.against, n=a.ngram, threshold=a.threshold)
    print(
        f"corpus {a.corpus}: {rep.corpus_tasks} tasks; against {a.against}: {rep.against_tasks} tasks; "
        f"{a.ngram}-grams, threshold {a.threshold}"
    )
    print(f"{'corpus task':<36} {'against task':<36} {'kind':<12} {'jaccard':>8} {'contain':>8} {'shared':>7}")
    for o in rep.overlaps:
        print(
            f"{o.corpus_task:<36} {o.against_task:<36} {o.kind:<12} "
            f"{o.jaccard:>8.3f} {o.containment:>8.3f} {o.shared:>7}"
        )
    print(f"flagged {len(rep.flagged)} of {rep.corpus_tasks} corpus tasks")
    for u in rep.unreadable:
        print(f"unreadable: {u}", file=sys.stderr)
    if a.json:
        print(json.dumps(rep.to_json()))
    return 0


def _cmd_run_task(a: argparse.Namespace) -> int:
    from sandbox_agent.agent.runner import NullAgent, OracleAgent, run_policy
    from sandbox_agent.sandbox.backend import pick_backend
    from sandbox_agent.tasks.task import load_task

    task = load_task(a.task_dir)
    policy = OracleAgent() if (a.oracle or a.agent == "oracle") else NullAgent()
    backend = pick_backend(a.backend, [task], agent_network=a.agent_network)
    from sandbox_agent.tasks.verifier import VerifierConfig

    verifier = VerifierConfig(allow_network=a.verifier_network)
    head = {"task": task.id, "format": task.format, "agent": policy.name, "backend": backend.name}
    try:
        run = trio.run(lambda: run_policy(task, policy, backend=backend, verifier=verifier))
    except Exception as exc:
        return _run_task_failed(a, head, exc)
    v = run.verify
    print(f"task {task.id} ({task.format}) agent={policy.name} backend={backend.name} verifier={v.path}")
    if run.act is not None:
        print(f"  solution exit code {run.act.exit_code}{' (timed out)' if run.act.timed_out else ''}")
    for name, ok in sorted(v.tests.items()):
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(
        f"status={v.status} reward={v.passed} passed={v.passed}/{v.total} resolved={v.resolved} "
        f"verify_s={v.duration_s:.2f}"
    )
    if v.status != "ok":
        print(f"  detail: {v.detail.strip()[:2000]}")
    if a.json:
        print(
            json.dumps(
                {
                    "task": task.id,
                    "format": task.format,
                    "agent": policy.name,
                    "status": v.status,
                    "reward": v.passed,
                    "passed": v.passed,
                    "total": v.total,
                    "resolved": v.resolved,
                    "tests": v.tests,
                    "detail": v.detail[:2000],
                    "wall_s": round(run.wall_s, 3),
                    "backend": backend.name,
                    "verifier_path": v.path,
                }
            )
        )
    return 0


def _run_task_failed(a: argparse.Namespace, head: dict, exc: Exception) -> int:
    """run-task could not run the task: say why in one line (and, with --json, as its JSON line)."""
    from sandbox_agent.images.build import image_build_error

    built = image_build_error(exc)
    if built is None:
        leaves = list(exc.exceptions) if isinstance(exc, ExceptionGroup) else [exc]
        err = next((e for e in leaves if isinstance(e, T1Error)), None)
        if err is None:
            raise exc
        if a.json:
            print(json.dumps({**head, "status": "error", "resolved": False, "detail": str(err)[:2000]}))
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NOT_RUN
    if a.json:
        fields = {"status": IMAGE_BUILD_FAILED, "resolved": False, "reward": 0, "passed": 0, "total": 0, "tests": {}}
        detail = {"step": built.step, "host": built.host, "detail": built.cause}
        print(json.dumps({**head, **fields, **detail}))
    print(f"error: {built}", file=sys.stderr)
    return EXIT_IMAGE_BUILD_FAILED


def _cmd_check(a: argparse.Namespace) -> int:
    import random

    from sandbox_agent.agent.runner import check_tasks
    from sandbox_agent.sandbox.backend import SandboxBackend, pick_backend
    from sandbox_agent.tasks.task import load_tasks
    from sandbox_agent.tasks.verifier import VerifierConfig

    if a.sample < 0 or a.concurrency < 1:
        raise _Usage(f"--sample must be >= 0 and --concurrency >= 1; got {a.sample} and {a.concurrency}")
    tasks = load_tasks(a.tasks_dir)
    if a.sample and a.sample < len(tasks):
        tasks = random.Random(a.seed).sample(tasks, a.sample)
    groups: dict[str, tuple[SandboxBackend, list]] = {}  # auto: each task on its backend (backend.bwrap_first)
    skipped = []
    for t in tasks:
        backend = pick_backend(a.backend, [t], agent_network=a.agent_network)
        if backend.supports(t):
            groups.setdefault(backend.name, (backend, []))[1].append(t)
        else:
            skipped.append(t)
            why = backend.refusal(t) or f"needs image {t.docker_image}"
            print(f"skip {t.id:<40} {why}")

    async def run_all() -> list:
        out = []
        for backend, group in groups.values():
            out += await check_tasks(
                group,
                backend=backend,
                concurrency=a.concurrency,
                verifier=VerifierConfig(allow_network=a.verifier_network),
            )
        return out

    rows = trio.run(run_all)
    for r in rows:
        if r.unbuilt is not None:
            at = f" at `{r.unbuilt.step}`" if r.unbuilt.step else ""
            print(f"IMG {r.task_id:<40} image build failed{at}: {r.unbuilt.cause}")
            continue
        print(
            f"{'ok ' if r.ok else 'BAD'} {r.task_id:<40} oracle {r.oracle.status} {r.oracle.passed}/{r.oracle.total}"
            f"  null {r.null.status} {r.null.passed}/{r.null.total}"
        )
    unbuilt = [r for r in rows if r.unbuilt is not None]
    bad = [r.task_id for r in rows if not r.ok and r.unbuilt is None]
    checked = len(rows) - len(unbuilt)
    print(
        f"{checked - len(bad)} of {checked} tasks ok"
        + (f"; {len(unbuilt)} more could not build their image (not counted)" if unbuilt else "")
    )
    if a.json:
        print(
            json.dumps(
                {
                    "tasks": len(rows),
                    "ok": checked - len(bad),
                    "bad": bad,
                    "skipped": [t.id for t in skipped],
                    IMAGE_BUILD_FAILED: len(unbuilt),
                    "unbuilt": [
                        {"task": r.task_id, "step": r.unbuilt.step, "host": r.unbuilt.host, "detail": r.unbuilt.cause}
                        for r in unbuilt
                        if r.unbuilt is not None
                    ],
                    "oracle_resolved": sum(r.oracle.resolved for r in rows),
                    "null_resolved": sum(r.null.resolved for r in rows),
                }
            )
        )
    return EXIT_NOT_RUN if bad else EXIT_IMAGE_BUILD_FAILED if unbuilt else 0


def _cmd_list(a: argparse.Namespace) -> int:
    from sandbox_agent.sandbox.backend import task_backend
    from sandbox_agent.tasks.task import load_tasks

    tasks = load_tasks(a.tasks_dir)
    rows = []
    for t in tasks:
        img = t.docker_image or "-"
        backend, status = task_backend(t, a.backend)
        rows.append((t, backend, status))
        print(
            f"{t.id:<40} {t.format} {t.split:<5} {t.family:<14} tests={len(t.test_files)} backend={backend} "
            f"image={status} ({img})"
        )
    if a.json:
        print(
            json.dumps(
                [
                    {
                        "id": t.id,
                        "format": t.format,
                        "split": t.split,
                        "family": t.family,
                        "path": str(t.path),
                        "docker_image": t.docker_image,
                        "backend": b,
                        "image_status": st,
                    }
                    for t, b, st in rows
                ]
            )
        )
    return 0


def _cmd_images(a: argparse.Namespace) -> int:
    import time

    from sandbox_agent.images.build import build_base

    t0 = time.monotonic()
    name = build_base(force=a.force)
    print(f"base image {name} ready ({time.monotonic() - t0:.1f} s)")
    return 0


class _Usage(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    configure(level="warning")  # events go to stderr; stdout carries the report (and --json's last line)
    if getattr(a, "agent_network", False) and a.backend == BackendName.BWRAP:
        p.error("--agent-network needs a container (--backend container or auto): bwrap gives the agent no network")
    handlers = {
        "synth": _cmd_synth,
        "decontam": _cmd_decontam,
        "run-task": _cmd_run_task,
        "check": _cmd_check,
        "list": _cmd_list,
        "images": _cmd_images,
    }
    try:
        return handlers[a.cmd](a)
    except _Usage as exc:
        p.error(str(exc))
    except T1Error as exc:
        if a.cmd == "run-task" and a.json:  # e.g. a task dir it cannot read: still one JSON line
            print(json.dumps({"task": str(a.task_dir), "status": "error", "resolved": False, "detail": str(exc)}))
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NOT_RUN
    return 0
