"""``cluster up`` settings: one typed config, from defaults, then a preset, then a TOML file, then flags.

``UpConfig`` is the learner's settings (``LearnerConfig``, which include the trainer's ``TrainerConfig``), the
actors' episode settings (``EpisodeOptions``) and the embedded sampler's, plus what only the cluster has (NATS,
how many of each, the corpus, the warm start, lifetime). Each setting and its help is declared once, in its
component; the flags (``cluster/flags.py``) and the TOML keys come from the fields (``t1async/config.py``), and
``cluster up`` hands each child its part as a TOML file (``cluster/components.py``).

A TOML file holds the same settings as the flags, top level or under ``[cluster]``, with ``-`` or ``_``:

    max-staleness = 2
    batch-turns = 32
    actors = 2
    sampler-url = ["http://gpu1:30000", "http://gpu2:30000"]
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from actors.settings import EpisodeOptions
from sandbox_agent.agent.context import POLICIES
from t1async.cluster.cpus import parse_cpus
from t1async.cluster.state import DEFAULT_RUN_DIR
from t1async.config import check_bounds, code_only, like, resolve, setting
from t1async.learner.settings import LearnerConfig
from t1async.protocol.errors import ConfigError
from t1async.sampler.settings import Dtype, Engine, EngineSettings, SamplerKeys, SamplerSettings
from t1async.sampler.vllm_launch import VLLMSettings
from t1async.transport.auth import NatsClientSettings

# the flag groups of `cluster up --help`, in this order
NATS, SAMPLERS, ACTORS, LEARNER = "NATS", "samplers", "actors", "learner"
EVAL, LIFETIME = "eval in the loop", "lifetime"


@dataclass(frozen=True)
class UpConfig(LearnerConfig, EpisodeOptions, VLLMSettings):
    run_dir: Path = setting(DEFAULT_RUN_DIR, "the run's directory", cli=False)
    preset: str = setting("none", "the preset the run's settings started from (--preset)", cli=False)
    # NATS
    nats: str | None = setting(
        None, "use this NATS (e.g. nats://a:4222,nats://b:4222) instead of starting one", metavar="URL", group=NATS
    )
    nats_creds: Path | None = like(
        NatsClientSettings,
        "nats_creds",
        help="with --nats: the credentials file every component connects with (default: the embedded NATS's "
        "per-role ones in <run-dir>/secrets)",
        group=NATS,
    )
    nats_tls: bool = setting(
        False, "the embedded NATS over TLS, with a CA made in <run-dir>/secrets (ca.pem)", group=NATS
    )
    nats_port: int = setting(0, "port of the embedded nats-server (default: a free one)", ge=0, group=NATS)
    max_payload: int = setting(
        8 << 20, "max_payload of the embedded nats-server (default 8 MiB)", metavar="BYTES", ge=1, group=NATS
    )
    nats_nodes: int = setting(
        1,
        "start an embedded JetStream cluster of N nats-server nodes (3 survives losing one node)",
        metavar="N",
        group=NATS,
    )
    stream_replicas: int = setting(
        0,
        "replicas of the T1_TRAJ stream: created with R, or scaled to R (default: min(--nats-nodes, 3); with "
        "--nats, the stream as it is)",
        metavar="R",
        group=NATS,
    )
    # samplers
    engine: Engine = like(EngineSettings, "engine", group=SAMPLERS)
    sampler_url: tuple[str, ...] = setting(
        (),
        "a server to sample from, speaking --engine's protocol (repeatable); none: start the embedded sampler "
        "(--engine vllm: start a vLLM server)",
        metavar="URL",
        group=SAMPLERS,
    )
    samplers: int = setting(
        1,
        "start N embedded samplers; episodes are pinned to one, a dead one is restarted and re-synced",
        metavar="N",
        group=SAMPLERS,
    )
    model: Path | None = setting(None, "model directory (default: the shipped tiny MoE)", group=SAMPLERS)
    sampler_dtype: Dtype = like(SamplerSettings, "dtype", group=SAMPLERS)
    sampler_max_batch: int = like(SamplerSettings, "max_batch", group=SAMPLERS)
    prefix_cache_tokens: int = like(SamplerSettings, "prefix_cache_tokens", 262_144, group=SAMPLERS)
    sampler_api_key: str | None = like(
        SamplerKeys,
        "sampler_api_key",
        group=SAMPLERS,
        help="the --sampler-url servers' API key, sent as Authorization: Bearer (default: $T1_SAMPLER_API_KEY); "
        "the embedded samplers get a random one per run, in <run-dir>/secrets/ (mode 0600)",
    )
    sampler_admin_key: str | None = like(
        SamplerKeys,
        "sampler_admin_key",
        group=SAMPLERS,
        help="the --sampler-url servers' admin key, for the learner's weight pushes (default: "
        "$T1_SAMPLER_ADMIN_KEY); the embedded samplers get a random one per run",
    )
    sampler_cpus: str = setting(
        "",
        "pin the embedded samplers to these CPUs (taskset list, e.g. 0; default: any)",
        metavar="LIST",
        group=SAMPLERS,
    )
    warm_start_steps: int = setting(
        0, "first fine-tune on oracle demonstrations for N steps (default 0: no)", ge=0, group=SAMPLERS
    )
    warm_start: str = setting(
        "",
        "policy = this warm-start recipe's cached model (built first if missing; python -m t1async.recipes.warmstart)",
        metavar="RECIPE",
        group=SAMPLERS,
    )
    # tasks and actors (and EpisodeOptions: how each episode runs)
    tasks: Path | None = setting(
        None, "task directory (default: synthesize a corpus into <run-dir>/tasks)", metavar="DIR", group=ACTORS
    )
    synth_tasks: int = setting(220, "tasks to synthesize when --tasks is not given", ge=1, group=ACTORS)
    synth_families: tuple[str, ...] = setting(
        (), "families to synthesize (default: the 11 default ones)", metavar="A,B", sep=",", group=ACTORS
    )
    actors: int = setting(2, "actor processes", ge=1, group=ACTORS)
    max_new_tokens: int = 128  # cluster up's own default for its actors and eval (declared in EpisodeOptions)
    # learner (and LearnerConfig)
    learner_cpus: str = setting(
        "", "pin the learner to these CPUs (taskset list, e.g. 1; default: any)", metavar="LIST", group=LEARNER
    )
    learner_procs: int = setting(
        1,
        "ranks of the data-parallel learner over torch.distributed, gloo on CPU (learner serve --nproc)",
        metavar="N",
        ge=1,
        group=LEARNER,
    )
    # the held-out eval inside the loop (t1async.eval.loop)
    eval_every: int = setting(
        0,
        "score the held-out split (the tasks' eval split) every N policy versions, and the starting policy first "
        "(default 0: off)",
        metavar="N",
        ge=0,
        group=EVAL,
    )
    eval_samples: int = setting(1, "episodes per held-out task", metavar="K", ge=1, group=EVAL)
    # lifetime
    duration: float | None = setting(None, "stop after this many seconds", metavar="SECONDS", gt=0, group=LIFETIME)
    seed: int = setting(0, "seed for the task corpus and actors", group=LIFETIME)
    max_restarts: int = setting(
        5,
        "restarts of one component (the learner, an actor, one of N samplers) within 10 minutes; "
        "one more death stops the run (0: any death stops it)",
        metavar="N",
        ge=0,
        group=LIFETIME,
    )
    extra_env: dict[str, str] = setting(factory=dict, help="environment for every child", cli=False)

    def check(self) -> UpConfig:
        if self.context_policy not in POLICIES:
            raise ConfigError(f"--context-policy {self.context_policy!r} is not one of: {', '.join(POLICIES)}")
        if not 1 <= self.samplers <= 16:
            raise ConfigError(f"--samplers must be 1..16, got {self.samplers}")
        if self.engine == "vllm" and self.samplers > 1:
            raise ConfigError("--engine vllm starts one vLLM server; to use several, start them and give --sampler-url")
        if self.engine == "vllm" and self.weight_sync == "distributed" and self.device != "cuda":
            raise ConfigError(
                "--engine vllm --weight-sync distributed is vLLM's NCCL weight transfer: it needs --device cuda "
                "(untested: no GPU has run it); on CPU use --weight-sync disk"
            )
        if self.samplers > 1 and self.sampler_url:
            raise ConfigError(
                f"--samplers {self.samplers} starts embedded samplers, --sampler-url uses running ones: "
                "give one of them"
            )
        if not 1 <= self.nats_nodes <= 9:
            raise ConfigError(f"--nats-nodes must be 1..9, got {self.nats_nodes}")
        if self.nats is not None and self.nats_nodes > 1:
            raise ConfigError(
                f"--nats-nodes {self.nats_nodes} starts an embedded cluster, --nats uses an external one: "
                "give one of them"
            )
        if self.nats is not None and self.nats_tls:
            raise ConfigError(
                "--nats-tls makes TLS keys for the embedded NATS; an external one has its own: give tls:// in --nats "
                "and its CA in the --nats-creds file (ca_file)"
            )
        if self.nats_creds is not None and self.nats is None:
            raise ConfigError(
                "--nats-creds is for an external --nats; the embedded NATS gets per-role credentials made for it"
            )
        if self.nats_port and self.nats_nodes > 1:
            raise ConfigError(
                f"--nats-port is the single embedded server's port; with --nats-nodes {self.nats_nodes} "
                "each node takes a free port: drop --nats-port"
            )
        if not 0 <= self.stream_replicas <= 5:
            raise ConfigError(
                f"--stream-replicas must be 1..5 (JetStream's limit), or 0 for the default; got {self.stream_replicas}"
            )
        if self.nats is None and self.stream_replicas > self.nats_nodes:
            raise ConfigError(
                f"--stream-replicas {self.stream_replicas} needs as many NATS servers, but the embedded "
                f"NATS has {self.nats_nodes}: pass --nats-nodes {self.stream_replicas}"
            )
        check_bounds(self)  # each field's own ge/gt/le
        for name in ("sampler_cpus", "learner_cpus"):
            if getattr(self, name):
                parse_cpus(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.tasks is not None and not Path(self.tasks).is_dir():
            raise ConfigError(
                f"--tasks {self.tasks}: no such directory (make one: python -m sandbox_agent synth --out DIR)"
            )
        if self.warm_start:
            from t1async.recipes.warmstart import get_recipe

            get_recipe(self.warm_start)  # an unknown name fails now, in one line
        if self.synth_families:
            from sandbox_agent.synth import ALL_FAMILIES

            bad = [f for f in self.synth_families if f not in ALL_FAMILIES]
            if bad:
                raise ConfigError(f"--synth-families {','.join(bad)}: unknown; known: {', '.join(ALL_FAMILIES)}")
        if self.model is not None:
            from t1async.model.modeldir import check_model_dir

            check_model_dir(Path(self.model), "--model")
        return self


# not keys of cluster up's TOML file: the learner's code-only settings and its own durable consumer name
_NOT_TOML = ("extra_env", "durable", *code_only(LearnerConfig))


def from_args(args: argparse.Namespace) -> UpConfig:
    """Defaults < ``--preset`` < ``--config FILE.toml`` (top level or ``[cluster]``) < flags; then checked. With no
    ``--preset``, the one ``presets.default_preset`` picks for what the flags and the file name."""
    from t1async.recipes.presets import default_preset, preset_values

    name = getattr(args, "preset", None)
    if name is None:
        own: UpConfig = resolve(UpConfig, args, section="cluster", exclude=_NOT_TOML)
        name = default_preset(
            model=own.model,
            sampler_url=own.sampler_url,
            tasks=own.tasks,
            warm_start=own.warm_start,
            warm_start_steps=own.warm_start_steps,
        )
    cfg: UpConfig = resolve(UpConfig, args, preset=preset_values(name), section="cluster", exclude=_NOT_TOML)
    return dataclasses.replace(cfg, preset=name).check()
