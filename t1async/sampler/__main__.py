"""``python -m t1async.sampler serve``: the embedded SGLang-compatible sampler server.

Prints ``t1async sampler ready at http://HOST:PORT`` on stdout once it answers (and writes the URL to
``--ready-file`` if given); stops gracefully on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from t1async.config import add_arguments, resolve
from t1async.sampler.settings import SamplerSettings

READY_PREFIX = "t1async sampler ready at "


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m t1async.sampler",
        description="The embedded SGLang-compatible sampler (POST /generate, token-in/token-out, MoE routing).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="serve the tiny MoE model over SGLang's native HTTP API",
        description="Serve a model over SGLang's native HTTP API (design §4). Settings come from --config "
        "FILE.toml (keys named as the flags; cluster up writes one) and flags, flags winning.",
    )
    add_arguments(s, SamplerSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    from t1async.protocol.errors import ConfigError

    try:
        args: SamplerSettings = resolve(SamplerSettings, _parser().parse_args(argv))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.model is not None and Path(args.model).is_dir():  # what a model dir lacks, in one line
        from t1async.model.modeldir import check_model_dir

        try:
            check_model_dir(Path(args.model), "--model", tokenizer=False)
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
    if args.model is not None and not Path(args.model).is_dir():
        print(f"--model {args.model}: no such directory (pass a model directory holding config.json)", file=sys.stderr)
        return 2
    from t1async.sampler.auth import ADMIN_KEY_ENV, API_KEY_ENV, read_key

    try:
        api_key = read_key(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key")
        admin_key = read_key(args.admin_api_key, args.admin_api_key_file, ADMIN_KEY_ENV, "--admin-api-key")
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2

    import trio

    from t1async.log import configure

    configure(args.log_level)  # before importing modules that bind their loggers at import time
    from t1async.sampler.server import serve
    from t1async.signals import wait_for_stop

    config = replace(args, api_key=api_key, admin_api_key=admin_key)  # the server's config: the keys read

    async def run() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:

            async def signals() -> None:
                await wait_for_stop()
                stop.set()

            nursery.start_soon(signals)
            url = await nursery.start(
                lambda task_status: serve(config, shutdown_trigger=stop.wait, task_status=task_status)
            )
            print(READY_PREFIX + url, flush=True)
            if args.ready_file:
                tmp = Path(str(args.ready_file) + ".tmp")
                tmp.write_text(url + "\n")
                os.replace(tmp, args.ready_file)
            # serve() returns once the HTTP server has shut down; then stop the signal watcher
            await stop.wait()
        # nursery exits when serve() finished its graceful shutdown

    from t1async.protocol.errors import T1Error

    failed: list[T1Error | ExceptionGroup[T1Error]] = []
    try:
        trio.run(run)
    except* T1Error as group:  # a bad model dir, weights that do not load: say what, without a traceback
        failed.extend(group.exceptions)
    if failed:
        for exc in failed:
            print(f"t1async sampler: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print("t1async sampler stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
