"""The learner's command line: ``serve`` (the RL learner service) and ``sft`` (the warm start)."""

from __future__ import annotations

import argparse
import json
import sys

from t1async.config import add_arguments, code_only, resolve
from t1async.learner.settings import SFTConfig
from t1async.protocol.errors import ConfigError, T1Error

SFT_HELP = """\
Warm start: supervised fine-tuning on oracle demonstrations. Runs each task's oracle solution in the
sandbox, keeps the demonstrations whose tests pass, trains on them (next-token loss on the agent's reply
tokens) and writes a model directory the sampler and the learner can load.

examples:
  python -m t1async.learner sft --synth 64 --steps 300 --out runs/sft
  python -m t1async.learner sft --tasks path/to/tasks --steps 300 --out runs/sft --model path/to/model
"""


def _sft(cfg: SFTConfig) -> int:
    import torch

    from t1async.recipes.sft import run_sft

    torch.set_num_threads(max(1, cfg.threads))
    summary = run_sft(cfg)
    print(
        f"sft: {summary['demos']} demos of {summary['tasks']} tasks, {summary['loss_tokens']} loss tokens; "
        f"loss {summary['loss_before']:.3f} -> {summary['loss_after']:.3f} in {summary['steps']} steps; "
        f"model dir {summary['out']}"
    )
    if cfg.json:
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
    add_arguments(s, SFTConfig)
    from t1async.learner import serve_cli

    serve_cli.add_parser(sub)
    args = p.parse_args(argv)
    configure()
    if args.cmd == "serve":
        try:
            model = serve_cli.config_from_args(args).model
            if model is not None:  # checked here, not while parsing: cluster up's warm start writes it later
                from t1async.model.modeldir import check_model_dir

                check_model_dir(model, "--model")
            return serve_cli.serve(args)
        except T1Error as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    if args.cmd == "sft":
        try:
            sft: SFTConfig = resolve(SFTConfig, args, exclude=code_only(SFTConfig))
        except ConfigError as exc:
            s.error(str(exc))
        if (sft.tasks is None) == (sft.synth is None):
            s.error("give one of --tasks DIR (a task directory) or --synth N (synthetic tasks)")
        if sft.out is None:
            s.error("the following arguments are required: --out")
        if sft.model is not None:
            from t1async.model.modeldir import check_model_dir

            try:
                check_model_dir(sft.model, "--model")
            except ConfigError as exc:
                s.error(str(exc))
        try:
            return _sft(sft)
        except T1Error as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
