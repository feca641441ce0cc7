"""One client constructor for every engine: ``sampler_client(engine, urls, ...)`` is an ``SGLangClient`` for
SGLang and the embedded sampler, a ``VLLMClient`` for vLLM (design §4 "Engines")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from t1async.protocol.errors import ConfigError
from t1async.sampler.client import SGLangClient

ENGINES = ("sglang", "vllm")


def sampler_client(
    engine: str, urls: Sequence[str] | str, *, model_dir: str | Path | None = None, **kw: Any
) -> SGLangClient:
    """A client of ``urls`` speaking ``engine``'s protocol; ``model_dir`` gives the routing shape (neither vLLM
    nor SGLang says it), ``kw`` are ``SGLangClient``'s options (keys, timeouts, pool; ``pause_mode`` for vLLM)."""
    if engine == "vllm":
        from t1async.model.tokenizer import assets_dir
        from t1async.sampler.vllm_client import VLLMClient

        return VLLMClient(urls, model_dir=model_dir if model_dir is not None else assets_dir(), **kw)
    if engine == "sglang":
        kw.pop("pause_mode", None)
        return SGLangClient(urls, model_dir=model_dir, **kw)
    raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
