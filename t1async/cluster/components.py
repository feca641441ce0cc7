"""What ``cluster up`` starts after NATS, in order: the embedded sampler (unless --sampler-url), the
learner, then the actors. Also the work before them: the task corpus and the optional warm start.

Each child gets its settings as a TOML file, ``<run-dir>/config/{sampler,learner,actors,eval,warm-start}.toml``
(the part of ``UpConfig`` its own settings class declares), read with ``--config FILE``; only what differs
between copies of one child (a sampler's port, an actor's id and seed) is a flag."""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from t1async.cluster.config import UpConfig
from t1async.cluster.cpus import pinned
from t1async.cluster.supervisor import ProcessSpec, python_module
from t1async.config import code_only, to_toml
from t1async.log import get_logger
from t1async.protocol.errors import ConfigError
from t1async.transport.auth import Role, creds_path
from t1async.transport.natsd import free_port

log = get_logger("cluster.components")


def tasks_dir(cfg: UpConfig) -> Path:
    return Path(cfg.tasks) if cfg.tasks is not None else Path(cfg.run_dir) / "tasks"


def ensure_tasks(cfg: UpConfig) -> Path:
    """The actors' task directory; synthesizes the corpus into the run dir the first time. The corpus is
    written beside it and renamed into place when whole, so a Ctrl-C midway never leaves a partial corpus
    that the next run would take as done."""
    d = tasks_dir(cfg)
    if cfg.tasks is None and not any(d.glob("*/task.yaml")):
        from sandbox_agent.synth import generate
        from t1async.cluster.observe.progress import setup_bar

        print(f"tasks: synthesizing {cfg.synth_tasks} into {d}", flush=True)
        partial = d.with_name(d.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # what an interrupted run left
        with setup_bar("synthesizing tasks", cfg.synth_tasks) as bar:
            generate(partial, cfg.synth_tasks, seed=cfg.seed, families=list(cfg.synth_families) or None, progress=bar)
        if d.is_dir():
            try:
                d.rmdir()  # an empty leftover
            except OSError:
                raise ConfigError(f"{d} holds files but no task: move them away, or pass --tasks DIR") from None
        os.replace(partial, d)
        log.info("cluster.tasks_synthesized", dir=str(d), n=cfg.synth_tasks, seed=cfg.seed)
    return d


def warm_start_argv(cfg: UpConfig) -> list[str] | None:
    """The SFT command to run before anything starts, or None (no warm start, or it already ran)."""
    if cfg.warm_start:  # a named recipe: built once into the cache, shared by every run that names it
        from t1async.recipes.warmstart import get_recipe, is_built

        if is_built(get_recipe(cfg.warm_start)):
            return None
        return python_module("t1async.recipes.warmstart", "--recipe", cfg.warm_start)
    out = warm_model_dir(cfg)
    if cfg.warm_start_steps <= 0 or (out / "config.json").is_file():
        return None
    from t1async.learner.settings import SFTConfig

    sft = SFTConfig(tasks=ensure_tasks(cfg), steps=cfg.warm_start_steps, out=out, model=cfg.model)
    toml = {k: v for k, v in asdict(sft).items() if k not in code_only(SFTConfig)}
    return python_module("t1async.learner", "sft", "--config", str(config_file(cfg, "warm-start", toml)))


def warm_model_dir(cfg: UpConfig) -> Path:
    return Path(cfg.run_dir) / "warm-start"


def warm_start_phases(cfg: UpConfig) -> tuple[tuple[str, str, int | None], ...]:
    """The warm start's progress bars: its oracle runs (as many as the corpus's train split: the log says),
    then its SFT steps (``ProcessSpec.progress``)."""
    steps, copy_steps = cfg.warm_start_steps, 0
    if cfg.warm_start:
        from t1async.recipes.warmstart import get_recipe

        steps, copy_steps = get_recipe(cfg.warm_start).sft.steps, get_recipe(cfg.warm_start).sft.copy_steps
    copying = (("copy pretraining", "sft.copy_step", copy_steps),) if copy_steps else ()
    return (("demonstrations", "sft.demo", None), *copying, ("SFT steps", "sft.step", steps))


def warm_start_note(cfg: UpConfig) -> str:
    """What ``cluster up`` says as the warm start begins: what it builds, for how long, and where it goes."""
    if cfg.warm_start:
        return (
            f"building the {cfg.warm_start!r} policy, once (5-10 min on 2 cores: oracle demonstrations, then SFT), "
            f"cached for every later run in {model_dir(cfg)}; --preset none starts the bare model instead"
        )
    return f"fine-tuning on oracle demonstrations for {cfg.warm_start_steps} steps into {warm_model_dir(cfg)}"


def model_dir(cfg: UpConfig) -> Path | None:
    if cfg.warm_start:
        from t1async.recipes.warmstart import cache_dir, get_recipe

        return cache_dir(get_recipe(cfg.warm_start))
    if cfg.warm_start_steps > 0:
        return warm_model_dir(cfg)
    return cfg.model


def trained_prompt(cfg: UpConfig, model: Path | None) -> Path | None:
    """The system prompt the policy in ``model`` was trained with (``system_prompt.txt`` beside its weights), for
    the actors and the in-loop eval: the warm start's (built before they start), or that of a ``--model`` dir
    that has one (a warm start or SFT model handed over by path). None: the agent's default prompt."""
    from t1async.recipes.warmstart import PROMPT_FILE

    if model is None:
        return None
    f = Path(model) / PROMPT_FILE
    return f if cfg.warm_start or f.is_file() else None


def sampler_ready_file(cfg: UpConfig, i: int = 0) -> Path:
    return Path(cfg.run_dir) / ("sampler.url" if i == 0 else f"sampler-{i}.url")


def embedded_sampler_urls(cfg: UpConfig) -> list[str]:
    """The URLs the embedded samplers wrote (``--samplers N``), those that have started."""
    files = [sampler_ready_file(cfg, i) for i in range(cfg.samplers)]
    return [f.read_text().strip() for f in files if f.is_file()]


def _key_file(path: Path, given: str | None) -> str:
    """The key in ``path`` (mode 0600, in a 0700 directory): ``given``, else the one already there (a resumed
    run), else a new random one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if given is None and path.is_file() and path.read_text().strip():
        os.chmod(path, 0o600)
        return path.read_text().strip()
    key = given or secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key + "\n")
    return key


def sampler_key_files(cfg: UpConfig) -> tuple[Path, Path]:
    """Where the embedded samplers' keys live: ``<run-dir>/secrets/sampler.key``, ``sampler-admin.key``."""
    d = Path(cfg.run_dir) / "secrets"
    return d / "sampler.key", d / "sampler-admin.key"


def sampler_keys(cfg: UpConfig) -> tuple[str | None, str | None]:
    """(API key, admin key) the clients send (design §4 "Keys"): with ``--sampler-url``, the user's (flags,
    else ``$T1_SAMPLER_API_KEY``/``$T1_SAMPLER_ADMIN_KEY``); else the embedded samplers', written to
    ``sampler_key_files`` (the flags' keys if given, else random ones made once per run dir)."""
    from t1async.sampler.auth import ADMIN_KEY_ENV, API_KEY_ENV

    if cfg.sampler_url:
        return (
            cfg.sampler_api_key or os.environ.get(API_KEY_ENV) or None,
            cfg.sampler_admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
        )
    api, admin = sampler_key_files(cfg)
    return _key_file(api, cfg.sampler_api_key), _key_file(admin, cfg.sampler_admin_key)


def _key_env(api_key: str | None, admin_key: str | None = None) -> dict[str, str]:
    """Keys for a client child, in its environment (never argv: ``ps`` shows argv to every user)."""
    from t1async.sampler.auth import ADMIN_KEY_ENV, API_KEY_ENV

    return {k: v for k, v in ((API_KEY_ENV, api_key), (ADMIN_KEY_ENV, admin_key)) if v}


def config_file(cfg: UpConfig, name: str, values: dict[str, Any]) -> Path:
    """``values`` as ``<run-dir>/config/<name>.toml``, the settings a child reads with ``--config``."""
    d = Path(cfg.run_dir) / "config"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(to_toml(values, header=f"cluster up's settings for its {name} (read with --config; flags win)"))
    os.replace(tmp, path)
    return path


def nats_creds(cfg: UpConfig, role: Role) -> Path | None:
    """The credentials file a child of ``role`` connects with: --nats-creds with an external NATS, else the
    one ``cluster up`` made for the role (none if it made none)."""
    if cfg.nats is not None:
        return cfg.nats_creds
    path = creds_path(cfg.run_dir, role)
    return path if path.is_file() else None


def _part(cls: type, cfg: UpConfig) -> dict[str, Any]:
    """The fields ``cfg`` shares with a component's settings class (its base class)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cls)}


def push_check_bound(cfg: UpConfig, *, own_samplers: bool) -> float | None:
    """``--push-check-bound``, or where it is unset and the samplers this run starts serve bf16, the bf16 bound
    (their rounding alone passed the fp32 one on learn-choresn, and the run stopped; learner/settings.py)."""
    from t1async.learner.settings import PUSH_CHECK_BOUND_BF16

    if cfg.push_check_bound is not None or not own_samplers:
        return cfg.push_check_bound
    dtype = cfg.vllm_dtype if cfg.engine == "vllm" else cfg.sampler_dtype
    return PUSH_CHECK_BOUND_BF16 if str(dtype) == "bfloat16" else None


def specs(cfg: UpConfig, nats_url: str) -> list[ProcessSpec]:
    """Each child, started with ``--config <run-dir>/config/<child>.toml``, plus the flags that differ
    between copies of one child (a sampler's port, an actor's id and seed)."""
    from actors.settings import EpisodeOptions
    from t1async.learner.settings import LearnerConfig

    out: list[ProcessSpec] = []
    model = model_dir(cfg)
    urls = list(cfg.sampler_url)
    # --samplers N: one of N that dies is restarted on its port; the learner's next push re-syncs it, and the
    # actors' pool keeps it out until then (t1async/sampler/pool.py)
    embedded = []
    api_key, admin_key = sampler_keys(cfg)
    if cfg.engine == "vllm" and not urls:  # one vLLM server on the run's model, stopped with the run
        spec, url = vllm_spec(cfg, model, api_key)
        out.append(spec)
        urls = [url]
    if not urls:  # the embedded samplers, all from one settings file; keys by file, pushes only from these roots
        from t1async.model.weights import default_model_dir
        from t1async.sampler.settings import SamplerSettings

        api_file, admin_file = sampler_key_files(cfg)
        roots = (Path(model if model is not None else default_model_dir()).parent, Path(cfg.run_dir) / "checkpoints")
        roots[1].mkdir(parents=True, exist_ok=True)
        sampler = SamplerSettings(
            model=model,
            seed=cfg.seed,
            dtype=cfg.sampler_dtype,
            max_batch=cfg.sampler_max_batch,
            prefix_cache_tokens=cfg.prefix_cache_tokens,
            api_key_file=api_file,
            admin_api_key_file=admin_file,
            allowed_weight_roots=roots,
        )
        sampler_toml = config_file(cfg, "sampler", asdict(sampler))
        for i in range(cfg.samplers):
            ready = sampler_ready_file(cfg, i)
            ready.unlink(missing_ok=True)
            port = free_port()
            argv = python_module(
                "t1async.sampler",
                "serve",
                "--config",
                str(sampler_toml),
                "--port",
                str(port),
                "--ready-file",
                str(ready),
            )
            name = "sampler" if cfg.samplers == 1 else f"sampler-{i}"
            argv = pinned(argv, cfg.sampler_cpus)
            out.append(ProcessSpec(name, argv, ready_file=ready, restart=cfg.samplers > 1))
            embedded.append(f"http://127.0.0.1:{port}")
    urls = urls or embedded
    learner_toml = config_file(
        cfg,
        "learner",
        {
            **{k: v for k, v in _part(LearnerConfig, cfg).items() if k not in code_only(LearnerConfig)},
            "push_check_bound": push_check_bound(cfg, own_samplers=not cfg.sampler_url),
            "nats": nats_url,
            "nats_creds": nats_creds(cfg, Role.LEARNER),
            "run_dir": cfg.run_dir,
            "model": model,
            "nproc": cfg.learner_procs,
            "sampler_url": urls,
            "engine": cfg.engine,
        },
    )
    learner = pinned(python_module("t1async.learner", "serve", "--config", str(learner_toml)), cfg.learner_cpus)
    learner_env = _key_env(api_key, admin_key)  # the learner pushes weights: the admin key too
    out.append(ProcessSpec("learner", learner, learner_env, finishes=cfg.steps > 0, restart=True))  # resumes
    prompt = trained_prompt(cfg, model)
    actors_toml = config_file(
        cfg,
        "actors",
        {
            **_part(EpisodeOptions, cfg),
            "nats": nats_url,
            "nats_creds": nats_creds(cfg, Role.ACTOR),
            "tasks": tasks_dir(cfg),
            "model": model,
            "system_prompt_file": prompt,
            "sampler_url": urls,
            "engine": cfg.engine,
        },
    )
    for i in range(cfg.actors):
        argv = python_module(
            "actors", "--config", str(actors_toml), "--actor-id", f"actor-{i}", "--seed", str(cfg.seed + i)
        )
        argv += ["--work-dir", str(Path(cfg.run_dir) / "work" / f"actor-{i}")]  # emptied by its restart after a kill
        # the learner abandons a dead actor's open episodes (design §7); actors generate: the API key only
        out.append(ProcessSpec(f"actor-{i}", argv, _key_env(api_key), restart=True))
    if cfg.eval_every > 0:
        out.append(replace(eval_spec(cfg, nats_url, model), env=_key_env(api_key)))
    return out


def vllm_spec(cfg: UpConfig, model: Path | None, api_key: str | None) -> tuple[ProcessSpec, str]:
    """The vLLM server ``cluster up --engine vllm`` starts (t1async.sampler.vllm_launch) on the run's model,
    on a free loopback port, and its URL. Its log is ``<run-dir>/logs/vllm.log``."""
    from t1async.model.weights import default_model_dir
    from t1async.sampler.vllm_launch import ServeSettings, VLLMSettings

    ready = sampler_ready_file(cfg)
    ready.unlink(missing_ok=True)
    port = free_port()
    settings_model = Path(model if model is not None else default_model_dir())
    (Path(cfg.run_dir) / "checkpoints").mkdir(parents=True, exist_ok=True)
    settings = ServeSettings(
        **_part(VLLMSettings, cfg),
        model=settings_model,
        port=port,
        ready_file=ready,
        log_file=Path(cfg.run_dir) / "logs" / "vllm.log",
        allowed_weight_roots=(settings_model.parent, Path(cfg.run_dir) / "checkpoints"),
    )
    argv = python_module("t1async.sampler.vllm_launch", "--config", str(config_file(cfg, "vllm", asdict(settings))))
    env = _key_env(api_key)  # vLLM checks it on /inference (its control endpoints take none: loopback only)
    spec = ProcessSpec(
        "sampler", pinned(argv, cfg.sampler_cpus), env, ready_file=ready, ready_timeout_s=cfg.vllm_start_timeout
    )
    return spec, f"http://127.0.0.1:{port}"


def eval_spec(cfg: UpConfig, nats_url: str, model: Path | None) -> ProcessSpec:
    """The in-loop evaluator (t1async.eval.loop): the eval split, every ``--eval-every`` versions, its own
    sampler on each scored checkpoint, the starting policy first."""
    from t1async.eval.loop import LoopSettings
    from t1async.model.weights import default_model_dir

    start = model if model is not None else default_model_dir()
    settings = LoopSettings(
        nats=nats_url,
        nats_creds=nats_creds(cfg, Role.EVAL),
        tasks=tasks_dir(cfg),
        run_dir=Path(cfg.run_dir),
        every=cfg.eval_every,
        model=Path(start),
        samples=cfg.eval_samples,
        seed=cfg.seed,
        max_turns=cfg.max_turns,
        max_new_tokens=cfg.max_new_tokens,
        max_context=cfg.max_context,
        temperature=cfg.temperature,
        system_prompt_file=trained_prompt(cfg, start),
    )
    return ProcessSpec(
        "eval", python_module("t1async.eval.loop", "--config", str(config_file(cfg, "eval", asdict(settings))))
    )
