"""``t1async``: one console command for everything ``python -m`` runs.

    t1async up [flags]              = python -m t1async.cluster up [flags]      (down, status, tail, report too)
    t1async eval [flags]            = python -m t1async.eval [flags]
    t1async learner ... / sampler ... / vllm ...   = python -m t1async.learner ... / t1async.sampler / ...vllm_launch
    t1async actors ... / sandbox ... = python -m actors ... / python -m sandbox_agent ...
    t1async bench NAME [flags]      = python -m bench.NAME [flags]

Each subcommand runs its module exactly as ``python -m`` would (``runpy``), so its flags, ``--help``, exit
status and signals are that module's own; ``python -m`` keeps working. Installed by ``pip install -e .``
(``[project.scripts]``); ``python -m t1async`` does the same.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

CLUSTER = ("up", "down", "status", "tail", "report")  # t1async.cluster's own subcommands
MODULES = {
    "eval": ("t1async.eval", "evaluate a policy: pass@k and tests passed with CIs"),
    "learner": ("t1async.learner", "the learner alone (serve, sft)"),
    "sampler": ("t1async.sampler", "the embedded sampler alone"),
    "vllm": ("t1async.sampler.vllm_launch", "start vLLM as cluster up --engine vllm does"),
    "actors": ("actors", "actors alone, against a running NATS and sampler"),
    "sandbox": ("sandbox_agent", "tasks and sandboxes: synth, run-task, check, list, images"),
}


def bench_names() -> list[str]:
    """The runnable benches: bench/*.py with a ``__main__`` guard (``_``-prefixed helpers left out)."""
    if find_spec("bench") is None and (Path.cwd() / "bench" / "__init__.py").is_file():
        sys.path.insert(0, str(Path.cwd()))  # a checkout: its bench/ (not installed), as ``python -m`` finds it
    spec = find_spec("bench")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(
        p.stem
        for p in root.glob("*.py")
        if not p.stem.startswith("_") and 'if __name__ == "__main__"' in p.read_text(encoding="utf-8")
    )


def usage() -> str:
    lines = [__doc__.strip().splitlines()[0], "", "usage: t1async COMMAND [flags]   (t1async COMMAND --help)", ""]
    lines.append(f"  {' | '.join(CLUSTER):<34} the cluster on one machine (python -m t1async.cluster)")
    lines += [f"  {name:<34} {what} (python -m {module})" for name, (module, what) in MODULES.items()]
    names = ", ".join(bench_names()) or "from a source checkout (bench/ is not installed)"
    lines.append(f"  {'bench NAME':<34} a benchmark: {names}")
    return "\n".join(lines)


def resolve(argv: Sequence[str]) -> tuple[str, list[str]]:
    """(module to run, its argv after the program name) for ``t1async ARGV``; ValueError names what was wrong."""
    if not argv:
        raise ValueError("no command given")
    cmd, rest = argv[0], list(argv[1:])
    if cmd in CLUSTER:
        return "t1async.cluster", [cmd, *rest]
    if cmd in MODULES:
        return MODULES[cmd][0], rest
    if cmd == "bench":
        names = bench_names()
        if not names:
            raise ValueError(
                "the benches run from a source checkout of t1async (bench/ is not installed): run this in one"
            )
        if not rest or rest[0] not in names:
            got = f"{rest[0]!r} is not one" if rest else "none given"
            raise ValueError(f"bench needs a NAME ({got}); one of: {', '.join(names)}")
        return f"bench.{rest[0]}", rest[1:]
    raise ValueError(f"unknown command {cmd!r}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    try:
        module, rest = resolve(args)
    except ValueError as exc:
        commands = ", ".join([*CLUSTER, *MODULES, "bench NAME"])
        print(f"t1async: {exc} (commands: {commands}; `t1async --help` says what each runs)", file=sys.stderr)
        return 2
    sys.argv = [f"t1async {' '.join(args[: len(args) - len(rest)])}", *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # the module's own exit status
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
