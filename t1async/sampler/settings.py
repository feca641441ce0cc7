"""The embedded sampler's settings (``python -m t1async.sampler serve``, and the sampler part of ``cluster up``).

``SamplerSettings`` is the server's one config: the CLI resolves it (defaults < ``--config FILE.toml`` < flags),
reads the keys into it, and hands it to ``server.serve``; ``launch.py`` writes it as the child's TOML file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from t1async.config import setting

Dtype = Literal["float32", "bfloat16"]
Engine = Literal["sglang", "vllm"]


@dataclass(frozen=True)
class SamplerSettings:
    """``sampler serve``'s settings: ``--config FILE.toml`` (what ``cluster up`` and ``launch.py`` write) and/or
    flags; the running server's config (``SamplerApp.config``, ``/server_info`` less the keys)."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(30000, "port to bind; 0 picks a free one", ge=0, le=65535)
    model: Path | None = setting(None, "model directory (default: the shipped tiny model)")
    seed: int = setting(0, "sampling seed")
    dtype: Dtype = setting("float32", "compute dtype of the embedded sampler")
    max_batch: int = setting(64, "most sequences decoded together", ge=1)
    prefix_cache_tokens: int | None = setting(None, "prefix (KV) cache size in tokens", ge=0)
    served_model_name: str = setting("t1async-tiny-moe", "the model id in /v1/models")
    pause_timeout: float = setting(
        300.0, "seconds a /pause_generation lasts at most before generation goes on with the old weights", gt=0
    )
    health_timeout: float = setting(20.0, "seconds /health_generate waits for its one token", gt=0, cli=False)
    ready_file: Path | None = setting(None, "write the URL to this file once the server answers")
    log_level: str | None = setting(None, "debug|info|warning|error (default: T1_LOG_LEVEL or info)")
    api_key: str | None = setting(
        None,
        "require Authorization: Bearer KEY on every endpoint but /health* (as SGLang's --api-key; default: "
        "$T1_SAMPLER_API_KEY; a flag shows in ps, prefer --api-key-file or the variable)",
        metavar="KEY",
        group="access",
        repr=False,
    )
    api_key_file: Path | None = setting(None, "read --api-key from this file's first line", group="access")
    admin_api_key: str | None = setting(
        None,
        "require this key (instead of --api-key) on the admin endpoints: the weight updates, pause/continue, "
        "/flush_cache, /abort_request (as SGLang's --admin-api-key; default: $T1_SAMPLER_ADMIN_KEY)",
        metavar="KEY",
        group="access",
        repr=False,
    )
    admin_api_key_file: Path | None = setting(None, "read --admin-api-key from this file's first line", group="access")
    allowed_weight_roots: tuple[Path, ...] = setting(
        (),
        "/update_weights_from_disk loads only from under these directories, comma-separated (default: the "
        "model directory's parent)",
        metavar="DIR,...",
        sep=",",
        group="access",
    )


@dataclass(frozen=True)
class SamplerKeys:
    """The keys a client of the samplers sends (``learner serve``, ``python -m actors``, eval, benches take
    these via ``like``); a real SGLang started with ``--api-key``/``--admin-api-key`` takes them the same way."""

    sampler_api_key: str | None = setting(
        None,
        "the samplers' API key, sent as Authorization: Bearer (default: $T1_SAMPLER_API_KEY)",
        metavar="KEY",
    )
    sampler_admin_key: str | None = setting(
        None,
        "the key for the samplers' admin endpoints (weight updates, pause) (default: $T1_SAMPLER_ADMIN_KEY, "
        "else the API key)",
        metavar="KEY",
    )


@dataclass(frozen=True)
class EngineSettings:
    """Which protocol the samplers speak (``cluster up``, ``learner serve``, ``python -m actors`` and the
    benches take it via ``like``)."""

    engine: Engine = setting(
        "sglang",
        "the samplers' engine: sglang (SGLang's /generate, or t1async's embedded sampler) or vllm (vLLM's "
        "/inference/v1/generate and RL endpoints; without --sampler-url, cluster up starts a vLLM server)",
    )
