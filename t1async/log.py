"""Structured logging for every t1async component.

``configure()`` once per process (the CLIs do it); ``get_logger(name)`` everywhere. Events are names with
fields, never formatted sentences: ``log.info("turn.sampled", episode=ep, turn=k, tokens=n)``.

On a TTY the lines are human-readable; otherwise (pipes, files, CI) they are JSON lines. ``T1_LOG_JSON=1``
or ``=0`` forces either; ``T1_LOG_LEVEL`` sets the level (default ``info``). ``log_file`` additionally writes
JSON lines to a file (the cluster's run dir).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import IO, Any, TextIO, cast

import structlog

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


class _Tee:
    """Writes each rendered line to the console stream and, as JSON, to a file."""

    def __init__(
        self, console: IO[str], file: IO[str] | None, console_renderer: Any, json_renderer: Any, console_level: int = 0
    ):
        self.console, self.file = console, file
        self.console_renderer, self.json_renderer = console_renderer, json_renderer
        self.console_level = console_level

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
        if self.file is not None:
            self.file.write(self.json_renderer(logger, method, dict(event)) + "\n")
            self.file.flush()
        if _LEVELS.get(method, 20) < self.console_level:
            raise structlog.DropEvent
        return self.console_renderer(logger, method, event)


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time (test runners and CLIs swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(
    level: str | None = None,
    *,
    json: bool | None = None,
    stream: TextIO | None = None,
    log_file: str | Path | None = None,
    console_level: str | None = None,
) -> None:
    """Set up structlog for this process. Safe to call more than once (the last call wins).

    ``console_level`` (default: ``level``) lets the console show less than the log file gets."""
    stream = stream or cast(TextIO, _CurrentStderr())  # duck-typed: write/flush/isatty are all used
    level_name = (level or os.environ.get("T1_LOG_LEVEL") or "info").lower()
    if level_name not in _LEVELS:
        raise ValueError(f"log level {level_name!r} is not one of {sorted(_LEVELS)}")
    env_json = os.environ.get("T1_LOG_JSON")
    if json is None:
        json = env_json == "1" if env_json in ("0", "1") else not stream.isatty()
    if console_level is not None and console_level.lower() not in _LEVELS:
        raise ValueError(f"log level {console_level!r} is not one of {sorted(_LEVELS)}")
    json_renderer = structlog.processors.JSONRenderer()
    console = json_renderer if json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    file = open(log_file, "a", encoding="utf-8") if log_file else None  # noqa: SIM115 - lives for the process
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _Tee(stream, file, console, json_renderer, _LEVELS[(console_level or level_name).lower()]),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level_name]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(_LEVELS[level_name], logging.WARNING), stream=stream)


def get_logger(name: str, **fields: Any) -> Any:
    """A structlog logger bound to ``component=name`` and any extra fields.

    Lazy: a logger made at import time still follows a later ``configure()``."""
    return structlog.get_logger(name, component=name, **fields)
