"""``cluster up`` settings: one typed config, from defaults, then a TOML file, then flags.

A TOML file holds the same settings as the flags, top level or under ``[cluster]``, with ``-`` or ``_``:

    max-staleness = 2
    batch-turns = 32
    actors = 2
    sampler-url = ["http://gpu1:30000", "http://gpu2:30000"]
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_agent.context import POLICIES
from t1async.cluster.state import DEFAULT_RUN_DIR
from t1async.learner.options import ADVANTAGES, CRITICS
from t1async.protocol.errors import ConfigError


@dataclass(frozen=True)
class UpConfig:
    run_dir: Path = DEFAULT_RUN_DIR
    # NATS
    nats: str | None = None  # external NATS URL(s); None starts the embedded nats-server
    nats_port: int = 0
    max_payload: int = 8 << 20
    nats_nodes: int = 1  # >1: start an embedded JetStream cluster of this many nodes
    stream_replicas: int = 0  # replicas of T1_TRAJ; 0: min(nats_nodes, 3) embedded, an external stream as it is
    # samplers
    sampler_url: tuple[str, ...] = ()  # real SGLang servers; none starts the embedded sampler
    samplers: int = 1  # embedded samplers to start (without --sampler-url)
    model: Path | None = None
    sampler_dtype: str = "float32"
    sampler_max_batch: int = 64
    prefix_cache_tokens: int = 262_144
    sampler_cpus: str = ""  # taskset CPU list the embedded samplers run on (e.g. "0"); "": any CPU
    warm_start_steps: int = 0  # >0: SFT on oracle demonstrations first
    warm_start: str = ""  # a named warm-start recipe (t1async.recipes.warmstart): its cached model is the policy
    # tasks and actors
    tasks: Path | None = None  # None: a synthetic corpus in <run-dir>/tasks
    synth_tasks: int = 220
    synth_families: tuple[str, ...] = ()  # families of the synthesized corpus (default: the 11 default ones)
    actors: int = 2
    concurrency: int = 4
    max_turns: int = 300
    max_new_tokens: int = 128
    max_context: int = 8192
    context_policy: str = "truncate-observations"  # what an episode does when its history outgrows max_context
    context_keep_turns: int = 8  # turns truncate-observations keeps whole
    temperature: float = 1.0
    verify_every: int = 0
    # learner
    max_staleness: int = 1
    batch_turns: int = 16
    lr: float = 1e-4
    lease: float = 180.0
    actor_timeout: float = 15.0
    no_replay: bool = False
    advantage: str = "gae"  # gae | turn: the learner's advantage estimator (TrainerConfig.advantage)
    value_lr: float | None = None  # the value head's learning rate (None: lr; TrainerConfig.value_lr)
    critic: str = "shared"  # shared | detached: whether the value loss trains the trunk (TrainerConfig.critic)
    weight_sync: str = "disk"  # how versions reach the samplers: disk | distributed (learner/weightpush.py)
    weight_bucket_mb: float = 64.0
    learner_cpus: str = ""  # taskset CPU list the learner runs on (e.g. "1"); "": any CPU
    learner_procs: int = 1  # ranks of the data-parallel learner (learner serve --nproc)
    wandb: bool = False  # the learner's curves to Weights & Biases too (TensorBoard files are always written)
    # the held-out eval inside the loop (t1async.eval.loop): every N policy versions, 0 = off
    eval_every: int = 0
    eval_samples: int = 1
    # lifetime
    duration: float | None = None
    steps: int = 0
    seed: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)

    def check(self) -> UpConfig:
        positive = (
            "actors",
            "concurrency",
            "max_turns",
            "max_new_tokens",
            "max_context",
            "batch_turns",
            "sampler_max_batch",
            "synth_tasks",
            "eval_samples",
            "learner_procs",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.context_policy not in POLICIES:
            raise ConfigError(f"--context-policy {self.context_policy!r} is not one of: {', '.join(POLICIES)}")
        for name in ("max_staleness", "steps", "verify_every", "warm_start_steps", "context_keep_turns", "eval_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.value_lr is not None and not self.value_lr > 0:
            raise ConfigError(f"--value-lr must be > 0, got {self.value_lr}")
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"--advantage must be {' or '.join(ADVANTAGES)}, got {self.advantage!r}")
        if self.critic not in CRITICS:
            raise ConfigError(f"--critic must be {' or '.join(CRITICS)}, got {self.critic!r}")
        if self.weight_sync not in ("disk", "distributed"):
            raise ConfigError(f"--weight-sync must be disk or distributed, got {self.weight_sync!r}")
        if not self.weight_bucket_mb > 0:
            raise ConfigError(f"--weight-bucket-mb must be > 0, got {self.weight_bucket_mb}")
        if not 1 <= self.samplers <= 16:
            raise ConfigError(f"--samplers must be 1..16, got {self.samplers}")
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
        if not self.actor_timeout > 0:
            raise ConfigError(f"--actor-timeout must be > 0 seconds, got {self.actor_timeout}")
        if self.duration is not None and self.duration <= 0:
            raise ConfigError(f"--duration must be > 0 seconds, got {self.duration}")
        for name in ("sampler_cpus", "learner_cpus"):
            if getattr(self, name):
                from t1async.cluster.components import parse_cpus

                parse_cpus(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.sampler_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--sampler-dtype must be float32 or bfloat16, got {self.sampler_dtype!r}")
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
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"--model {self.model}: not a model directory (no config.json)")
        return self


_FIELDS = {f.name: f for f in dataclasses.fields(UpConfig)}
_PATHS = {"run_dir", "model", "tasks"}


def _coerce(name: str, value: Any, source: str) -> Any:
    if name in _PATHS:
        return None if value is None else Path(value)
    if name in ("sampler_url", "synth_families"):
        vals = [value] if isinstance(value, str) else list(value or [])
        if not all(isinstance(v, str) for v in vals):
            raise ConfigError(f"{source}: {name.replace('_', '-')} must be a string or a list of strings")
        if name == "synth_families":
            vals = [f.strip() for v in vals for f in v.split(",") if f.strip()]
        return tuple(vals)
    default = _FIELDS[name].default
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"{source}: {name.replace('_', '-')} must be true or false, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{source}: {name.replace('_', '-')} must be an integer, got {value!r}")
    if isinstance(default, float) or name in ("duration", "value_lr"):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{source}: {name.replace('_', '-')} must be a number, got {value!r}")
        return float(value)
    return value


def load_toml(path: Path) -> dict[str, Any]:
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None
    doc = doc.get("cluster", doc)
    out = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in _FIELDS or name == "extra_env":
            raise ConfigError(
                f"--config {path}: unknown setting {key!r}; known: "
                f"{', '.join(sorted(k.replace('_', '-') for k in _FIELDS if k != 'extra_env'))}"
            )
        out[name] = _coerce(name, value, f"--config {path}")
    return out


def from_args(args: argparse.Namespace) -> UpConfig:
    values: dict[str, Any] = {}
    if getattr(args, "preset", None):
        from t1async.recipes.presets import preset_values

        values.update(preset_values(args.preset))
    if getattr(args, "config", None) is not None:
        values.update(load_toml(args.config))
    for name in _FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = _coerce(name, v, "flag")
    return UpConfig(**values).check()
