"""The learner's settings and ``learner sft``'s, each declared once (light to import: no torch).

``LearnerConfig`` is what ``learner.service.Learner`` runs with, and the flags and TOML keys of ``learner serve``
(``serve_cli.ServeConfig`` adds the process's wiring) and of ``cluster up`` (``cluster.config.UpConfig`` includes
it). ``SFTConfig`` is what ``recipes.sft`` trains with, and ``learner sft``'s flags and TOML keys; ``cluster up``
writes it as ``<run-dir>/config/warm-start.toml`` for the warm start it runs. Fields with ``cli=False`` are set
by code only (tests, benches, recipes): neither flags nor TOML keys (``code_only``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from t1async.config import check_bounds, setting
from t1async.learner.trainer_config import Device, TrainDtype, TrainerConfig
from t1async.protocol.errors import ConfigError

if TYPE_CHECKING:
    from t1async.learner.pushcheck import PushCheckConfig

WeightSync = Literal["disk", "distributed"]


# the push check's bound on mean |Δlogp| over its probe. fp32 engines agree with the learner to ~1e-6; a sampler
# in bf16 differs by its rounding alone, 0.0003-0.011 a push on learn-choresn's 2 M MoE before the check's mean
# was trimmed (one probe token can be 8 nats off: pushcheck.py), and a push that went wrong read 0.043 (vLLM's
# own reload; docs/results.md, 2026-12-05)
PUSH_CHECK_BOUND = 0.01
PUSH_CHECK_BOUND_BF16 = 0.03


@dataclass(frozen=True)
class LearnerConfig(TrainerConfig):
    """The learner's settings (``learner.service.Learner``): the trainer's, then the learner's own. ``learner
    serve`` (``ServeConfig``) adds the process's wiring; ``cluster up``'s ``UpConfig`` includes them."""

    max_staleness: int = setting(
        1, "η: max policy versions between sampling and training a token (0 = synchronous)", ge=0, group="learner"
    )
    batch_turns: int = setting(16, "B: turns per training step", ge=1, group="learner")
    steps: int = setting(0, "stop after the learner trained this many steps (default 0: never)", ge=0, group="lifetime")
    checkpoint_every: int = setting(
        10,  # a restart trains the steps since again, up to the version last pushed (learner/stepinputs.py)
        "write a full checkpoint (model and AdamW state, what a restart resumes from) every N steps, at the last "
        "step and at a stop; the other steps write only the model dir the samplers load, plus the step's "
        "segments, so a crash resumes at the last version pushed: the last checkpoint, then those steps trained "
        "again",
        ge=1,
        group="learner",
    )
    lease: float = setting(180.0, "seconds an unused credit is held", gt=0, group="learner")
    actor_timeout: float = setting(
        15.0,
        "seconds an actor may go without a heartbeat before the learner releases its credits and ends its open "
        "episodes as aborted",
        gt=0,
        group="learner",
    )
    wandb: bool = setting(
        False,
        "also log the per-step curves to Weights & Biases (needs wandb; WANDB_MODE=offline works); TensorBoard "
        "files are always in <run-dir>/tensorboard/learner",
        group="learner",
    )
    weight_sync: WeightSync = setting(
        "disk",
        "how each version reaches the samplers: disk (/update_weights_from_disk of the checkpoint) or "
        "distributed (SGLang's /update_weights_from_distributed over a torch.distributed group this learner "
        "hosts, in buckets between /pause_generation and /continue_generation)",
        group="learner",
    )
    weight_bucket_mb: float = setting(
        64.0,
        "MiB of tensors per /update_weights_from_distributed call with --weight-sync distributed",
        gt=0,
        group="learner",
    )
    push_check_every: int = setting(
        1,
        "after every N-th weight push, score a fixed 64-token probe on each sampler and on the learner, and record "
        "the mean |Δlogp| as push_check_dlogp (0: never; learner/pushcheck.py)",
        ge=0,
        group="learner",
    )
    push_check_bound: float | None = setting(
        None,
        "the mean |Δlogp| past which a push failed: it is sent once more, then the learner stops naming the "
        f"sampler (default {PUSH_CHECK_BOUND:g}; {PUSH_CHECK_BOUND_BF16:g} when the samplers cluster up starts serve "
        "bfloat16; raise it for a --sampler-url that serves bf16)",
        gt=0,
        group="learner",
    )
    require_routes: bool = setting(
        False,
        "refuse turns whose sampler returned no MoE routes (vLLM-CPU never does) instead of training them on the "
        "learner's own routing (counted as r3_missing_tokens)",
        group="learner",
    )
    run_dir: Path | None = setting(
        None, "where checkpoints, journal and state live (required)", group="learner service"
    )
    model: Path | None = setting(None, "initial model dir (default: the shipped tiny model)", group="learner service")
    durable: str = setting("learner", "JetStream durable consumer name", group="learner service")
    # set by code only (cli=False): neither flags nor TOML keys
    metrics_every_s: float = setting(2.0, "seconds between t1.metrics.learner reports", gt=0, cli=False)
    keep_checkpoints: int = setting(3, "full checkpoints kept", ge=1, cli=False)
    journal_file_bytes: int = setting(
        32 << 20, "the journal rolls over to a new journal file past this size", ge=1, cli=False
    )
    tensorboard: bool = setting(True, "per-step curves in <run_dir>/tensorboard/learner (t1async.curves)", cli=False)
    hf_format: str = setting(
        "", "write an in-house model's checkpoints as this architecture (vLLM serves only those)", cli=False
    )

    @property
    def checkpoints(self) -> Path:
        assert self.run_dir is not None, "LearnerConfig.run_dir is required"
        return self.run_dir / "checkpoints"

    @property
    def push_check(self) -> PushCheckConfig:
        from t1async.learner.pushcheck import PushCheckConfig

        bound = PUSH_CHECK_BOUND if self.push_check_bound is None else self.push_check_bound
        return PushCheckConfig(every=self.push_check_every, bound=bound)


@dataclass(frozen=True)
class SFTConfig:
    """``learner sft``'s settings (``--config FILE.toml`` and/or flags, flags win), and what
    ``recipes.sft.run_sft`` and ``sft_train`` run with; checked when built."""

    tasks: Path | None = setting(
        None, "a directory of task directories (Terminal-Bench 1 or 2 format); or --synth", metavar="DIR"
    )
    synth: int | None = setting(None, "generate this many synthetic tasks (sandbox_agent.synth); or --tasks", ge=1)
    steps: int = setting(200, "optimizer steps", ge=1)
    out: Path | None = setting(None, "output model directory, loadable by the sampler (required)", metavar="DIR")
    model: Path | None = setting(None, "starting model directory (default: the shipped embedded model)")
    lr: float = setting(1e-3, "peak learning rate", gt=0)
    batch_tokens: int = setting(8192, "padded tokens per step", ge=2)  # segments packed longest-first
    max_len: int = setting(4096, "truncate demonstrations to this many tokens", ge=2)
    concurrency: int = setting(2, "oracle runs in parallel", ge=1)
    threads: int = setting(2, "torch CPU threads", ge=1)
    seed: int = setting(0, "seed for the synthetic tasks (--synth) and the batch order")
    json: bool = setting(False, "print the summary as JSON on the last stdout line")
    device: Device = setting(Device.CPU, "where to train: cpu, or cuda (untested, no GPU ran in our tests)")
    train_dtype: TrainDtype = setting(
        TrainDtype.FLOAT32, "float32, or bfloat16: bf16 autocast over fp32 master weights (as the learner's)"
    )
    # set by code only (cli=False): neither flags nor TOML keys
    warmup_steps: int = setting(10, "steps of linear learning-rate warmup", ge=0, cli=False)
    weight_decay: float = setting(0.0, "AdamW weight decay", ge=0, cli=False)
    grad_clip: float = setting(1.0, "max global grad norm", ge=0, cli=False)
    copy_steps: int = setting(
        0, "steps of copy pretraining before the demonstrations (recipes.sft.copy_examples); 0: none", ge=0, cli=False
    )

    def __post_init__(self) -> None:
        for name, kind in (("device", Device), ("train_dtype", TrainDtype)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise ConfigError(
                    f"SFTConfig.{name} must be {' or '.join(repr(k.value) for k in kind)}, got {getattr(self, name)!r}"
                ) from None
        check_bounds(self, "SFTConfig")
