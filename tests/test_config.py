"""``t1async.config``: a frozen dataclass's fields give the flags, the TOML keys, their checks and the merge
order (defaults < preset < TOML < flags)."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from t1async.config import add_arguments, check_bounds, from_mapping, like, load_toml, resolve, setting, to_toml
from t1async.protocol.errors import ConfigError


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Base:
    lr: float = setting(1e-4, "learning rate", gt=0, group="train")
    steps: int = setting(0, "steps (default 0: never)", ge=0)


@dataclass(frozen=True)
class Settings(Base):
    color: Color = setting(Color.RED, "a color")
    mode: Literal["a", "b"] = setting("a", "a mode")
    replay: bool = setting(True, "replay")
    out: Path | None = setting(None, "an output dir")
    url: tuple[str, ...] = setting((), "a URL (repeatable)", metavar="URL")
    fams: tuple[str, ...] = setting((), "families", sep=",")
    value_lr: float | None = setting(None, "the head's rate", gt=0)
    steps: int = 5  # a new default; Base's help and bounds stand
    copied: int = like(Base, "steps", 7)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p, Settings)
    return p.parse_args(list(argv))


def test_flags_come_from_the_fields():
    a = parse(
        "--lr", "0.5", "--color", "blue", "--no-replay", "--out", "x", "--url", "u1", "--url", "u2",
        "--fams", "p,q", "--value-lr", "3e-3", "--mode", "b",
    )  # fmt: skip
    c = resolve(Settings, a)
    assert c == Settings(
        lr=0.5, color=Color.BLUE, replay=False, out=Path("x"), url=("u1", "u2"), fams=("p", "q"), value_lr=3e-3,
        mode="b",
    )  # fmt: skip
    assert isinstance(c.color, Color) and resolve(Settings, parse()) == Settings()
    with pytest.raises(SystemExit):
        parse("--color", "green")  # argparse offers the enum's values as choices
    with pytest.raises(SystemExit):
        parse("--mode", "c")


def test_help_has_groups_and_defaults(capsys):
    p = argparse.ArgumentParser()
    add_arguments(p, Settings)
    text = p.format_help()
    assert "train:" in text and "learning rate (default 0.0001)" in text
    assert "{red,blue}" in text and "--replay, --no-replay" in text and "--url URL" in text
    assert "steps (default 0: never)" in text  # a help that says its default is kept as written
    assert Settings().steps == 5 and Settings().copied == 7


def test_toml_keys_are_the_field_names(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('lr = 1\nvalue-lr = 0.25\ncolor = "blue"\nurl = "only"\nout = "d"\n')
    assert load_toml(f, Settings) == {
        "lr": 1.0,
        "value_lr": 0.25,
        "color": Color.BLUE,
        "url": ("only",),
        "out": Path("d"),
    }
    f.write_text("valu_lr = 1\n")
    with pytest.raises(
        ConfigError, match=r"unknown setting 'valu_lr' \(did you mean 'value-lr'\?\); valid settings: .*lr"
    ):
        load_toml(f, Settings)
    f.write_text('lr = "fast"\n')
    with pytest.raises(ConfigError, match="--lr must be a number, got 'fast'"):
        load_toml(f, Settings)
    f.write_text('color = "green"\n')
    with pytest.raises(ConfigError, match="--color must be red or blue, got 'green'"):
        load_toml(f, Settings)
    f.write_text("lr = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(f, Settings)
    with pytest.raises(ConfigError, match="no such file"):
        load_toml(tmp_path / "none.toml", Settings)
    f.write_text("[part]\nsteps = 3\n")
    assert load_toml(f, Settings, section="part") == {"steps": 3}


def test_defaults_then_preset_then_toml_then_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("lr = 0.2\nsteps = 9\n")
    preset = {"lr": 0.1, "steps": 1, "color": "blue"}
    c = resolve(Settings, parse("--config", str(f), "--steps", "4"), preset=preset)
    assert (c.lr, c.steps, c.color, c.mode) == (0.2, 4, Color.BLUE, "a")
    with pytest.raises(ConfigError, match="preset: unknown setting 'nope'"):
        resolve(Settings, parse(), preset={"nope": 1})


def test_bounds(tmp_path):
    with pytest.raises(ConfigError, match="--value-lr must be > 0, got -1"):
        resolve(Settings, parse("--value-lr", "-1"))
    with pytest.raises(ConfigError, match="--steps must be >= 0, got -2"):
        from_mapping(Settings, {"steps": -2})
    with pytest.raises(ConfigError, match="Settings.lr must be > 0, got 0"):
        check_bounds(Settings(lr=0), "Settings")


def test_to_toml_round_trips(tmp_path):
    c = Settings(lr=5e-5, color=Color.BLUE, out=Path("a b"), url=("x", 'y"z'), replay=False)
    f = tmp_path / "c.toml"
    f.write_text(to_toml(c, header="written by a test"))
    assert resolve(Settings, argparse.Namespace(config=f)) == c
    assert "value_lr" not in f.read_text()  # None: the reader's default


def test_cluster_up_hands_children_toml_files(tmp_path):
    """Each child of ``cluster up`` gets ``--config <run-dir>/config/<child>.toml`` and reads back what the
    cluster was given."""
    from actors.__main__ import build_parser, settings
    from t1async.cluster import components
    from t1async.cluster.config import UpConfig
    from t1async.sampler.__main__ import _parser
    from t1async.sampler.settings import SamplerSettings

    cfg = UpConfig(run_dir=tmp_path, max_new_tokens=77, lr=3e-5, value_lr=1e-2, sampler_max_batch=8).check()
    by = {s.name: list(s.argv) for s in components.specs(cfg, "nats://127.0.0.1:1")}
    assert all("--config" in argv for argv in by.values())
    from tests.clusterargs import serve_args

    learner = serve_args(by["learner"])
    assert (learner.lr, learner.value_lr, learner.run_dir, learner.nats) == (3e-5, 1e-2, tmp_path, "nats://127.0.0.1:1")
    p = build_parser()
    actor = settings(p.parse_args(by["actor-1"][by["actor-1"].index("actors") + 1 :]), p)
    assert (actor.max_new_tokens, actor.actor_id, actor.seed, actor.sampler_url) == (
        77,
        "actor-1",
        1,
        learner.sampler_url,
    )
    sampler = resolve(SamplerSettings, _parser().parse_args(by["sampler"][by["sampler"].index("serve") :]))
    assert (sampler.max_batch, sampler.prefix_cache_tokens) == (8, 262_144)


def test_presets_are_partial_up_configs(tmp_path):
    from t1async.cluster.config import UpConfig
    from t1async.config import from_mapping
    from t1async.recipes.presets import PRESETS

    for name, values in PRESETS.items():
        assert UpConfig(run_dir=tmp_path, **from_mapping(UpConfig, values, where=f"preset {name}: "))


def test_cluster_up_hands_the_eval_and_the_warm_start_toml_files(tmp_path):
    """The in-loop eval and the warm-start SFT read their settings from ``--config`` too (no re-spelled flags),
    and a user's flags still work (and win)."""
    from t1async.cluster import components
    from t1async.cluster.config import UpConfig
    from t1async.config import code_only
    from t1async.eval.loop import LoopSettings
    from t1async.learner.settings import SFTConfig

    tasks = tmp_path / "tasks"
    (tasks / "t0").mkdir(parents=True)
    (tasks / "t0" / "task.yaml").write_text("")  # ensure_tasks: a corpus is there, nothing is synthesized
    cfg = UpConfig(run_dir=tmp_path, tasks=tasks, eval_every=3, max_turns=7, warm_start_steps=5, seed=4).check()
    by = {s.name: list(s.argv) for s in components.specs(cfg, "nats://127.0.0.1:1")}
    argv = by["eval"][by["eval"].index("t1async.eval.loop") + 1 :]
    assert argv == ["--config", str(tmp_path / "config" / "eval.toml")]
    p = argparse.ArgumentParser()
    add_arguments(p, LoopSettings)
    ev = resolve(LoopSettings, p.parse_args(argv))
    assert (ev.nats, ev.tasks, ev.run_dir, ev.every, ev.max_turns, ev.seed, ev.system_prompt_file) == (
        "nats://127.0.0.1:1",
        tasks,
        tmp_path,
        3,
        7,
        4,
        None,
    )
    assert resolve(LoopSettings, p.parse_args([*argv, "--every", "9"])).every == 9  # flags win
    with pytest.raises(ConfigError, match="missing required setting.*--run-dir, --tasks, --every"):
        resolve(LoopSettings, p.parse_args(["--nats", "nats://x:1"]))

    warm = components.warm_start_argv(cfg)
    assert warm is not None and warm[warm.index("sft") + 1 :] == [
        "--config",
        str(tmp_path / "config" / "warm-start.toml"),
    ]
    p = argparse.ArgumentParser()
    add_arguments(p, SFTConfig)
    sft = resolve(SFTConfig, p.parse_args(warm[warm.index("sft") + 1 :]), exclude=code_only(SFTConfig))
    assert (sft.tasks, sft.steps, sft.out, sft.model) == (tasks, 5, components.warm_model_dir(cfg), None)


def test_the_eval_loop_command_line_takes_flags_or_a_file(tmp_path, capsys):
    from t1async.eval.loop import main

    assert main(["--run-dir", str(tmp_path), "--tasks", str(tmp_path), "--every", "0", "--nats", "nats://x:1"]) == 2
    assert "--every must be >= 1, got 0" in capsys.readouterr().err
    assert main(["--run-dir", str(tmp_path), "--tasks", str(tmp_path), "--every", "1"]) == 2
    assert "no --nats URL" in capsys.readouterr().err
    f = tmp_path / "eval.toml"
    f.write_text('every = 2\nnats = "nats://x:1"\n')
    assert main(["--config", str(f)]) == 2
    assert "missing required setting(s) --run-dir, --tasks" in capsys.readouterr().err


def test_each_command_keeps_its_episode_defaults(tmp_path):
    """Each episode setting is declared once (``actors.settings.EpisodeOptions``) and each command keeps its own
    default: the actors and ``python -m t1async.eval`` ask for 256 new tokens a turn, ``cluster up`` and its eval
    loop 128. What a command resolves is what its code runs with: the eval loop's settings are an ``EvalConfig``."""
    from actors.settings import ActorSettings
    from t1async.cluster.config import UpConfig
    from t1async.eval.__main__ import EvalSettings
    from t1async.eval.loop import LoopSettings
    from t1async.eval.run import EvalConfig

    loop = LoopSettings(run_dir=tmp_path, tasks=tmp_path, every=1)
    got = {
        name: (c.max_new_tokens, c.concurrency, c.max_turns)
        for name, c in [
            ("actors", ActorSettings()),
            ("eval", EvalSettings()),
            ("eval loop", loop),
            ("cluster up", UpConfig(run_dir=tmp_path)),
        ]
    }
    assert got == {
        "actors": (256, 4, 300),
        "eval": (256, 4, 20),
        "eval loop": (128, 2, 20),
        "cluster up": (128, 4, 300),
    }
    assert isinstance(loop, EvalConfig) and loop.agent().sampling.max_new_tokens == 128
    assert EvalConfig().agent().sampling.max_new_tokens == 256 and not EvalConfig().agent().request_routing
    with pytest.raises(ConfigError, match="--samples must be >= 1, got 0"):
        EvalConfig(samples=0)  # checked when built in code too, not only when resolved from flags
