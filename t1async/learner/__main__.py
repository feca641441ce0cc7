"""The learner's command line: ``serve`` (the RL learner service) and ``sft`` (the warm start)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from t1async.protocol.errors import T1Error

SFT_HELP = """\
Warm start: supervised fine-tuning on oracle demonstrations. Runs each task's oracle solution in the
sandbox, keeps the demonstrations whose tests pass, trains on them (next-token loss on the agent's reply
tokens) and writes a model directory the sampler and the learner can load.

examples:
  python -m t1async.learner sft --synth 64 --steps 300 --out runs/sft
  python -m t1async.learner sft --tasks path/to/tasks --steps 300 --out runs/sft --model path/to/model
"""


def _sft(args: argparse.Namespace) -> int:
    import torch

    from t1async.recipes.sft import SFTConfig, run_sft

    torch.set_num_threads(max(1, args.threads))
    cfg = SFTConfig(steps=args.steps, lr=args.lr, batch_tokens=args.batch_tokens, max_len=args.max_len, seed=args.seed)
    summary = run_sft(
        out=Path(args.out),
        tasks_dir=Path(args.tasks) if args.tasks else None,
        synth=args.synth,
        cfg=cfg,
        model_dir=Path(args.model) if args.model else None,
        concurrency=args.concurrency,
    )
    print(
        f"sft: {summary['demos']} demos of {summary['tasks']} tasks, {summary['loss_tokens']} loss tokens; "
        f"loss {summary['loss_before']:.3f} -> {summary['loss_after']:.3f} in {summary['steps']} steps; "
        f"model dir {summary['out']}"
    )
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    from t1async.log import configure

    p = argparse.ArgumentParser(prog="python -m t1async.learner", description="t1async learner commands")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "sft",
        help="warm-start SFT on oracle demonstrations; writes a model directory",
        description=SFT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--tasks", help="a directory of task directories (Terminal-Bench 1 or 2 format)")
    src.add_argument("--synth", type=int, help="generate this many synthetic tasks (sandbox_agent.synth)")
    s.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    s.add_argument("--out", required=True, help="output model directory (loadable by the sampler)")
    s.add_argument("--model", default=None, help="starting model directory (default: the shipped embedded model)")
    s.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    s.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per step")
    s.add_argument("--max-len", type=int, default=4096, help="truncate demonstrations to this many tokens")
    s.add_argument("--concurrency", type=int, default=2, help="oracle runs in parallel")
    s.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    s.add_argument(
        "--seed", type=int, default=0, help="seed for the synthetic tasks (--synth) and the batch order (default 0)"
    )
    s.add_argument("--json", action="store_true", help="print the summary as JSON on the last stdout line")
    from t1async.learner import serve_cli

    serve_cli.add_parser(sub)
    args = p.parse_args(argv)
    configure()
    if args.cmd == "serve":
        try:
            return serve_cli.serve(args)
        except T1Error as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    if args.cmd == "sft":
        if args.synth is not None and args.synth < 1:
            p.error("--synth must be >= 1")
        try:
            return _sft(args)
        except T1Error as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
