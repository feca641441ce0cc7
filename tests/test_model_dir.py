"""``--model DIR`` on every command line: a dir that is not a supported model dir is one line naming what it
lacks (``t1async.model.modeldir.check_model_dir``), before anything starts."""

from __future__ import annotations

import json
import shutil

import pytest

from t1async.model.modeldir import check_model_dir
from t1async.model.weights import default_model_dir
from t1async.protocol.errors import ConfigError


@pytest.fixture
def model_copy(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d)
    return d


def test_a_whole_model_dir_passes(model_copy):
    assert check_model_dir(model_copy) == model_copy


@pytest.mark.parametrize("gone", ["config.json", "tokenizer.json", "model.safetensors"])
def test_each_missing_part_is_named(model_copy, gone):
    (model_copy / gone).unlink()
    with pytest.raises(ConfigError) as info:
        check_model_dir(model_copy, "--model")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"--model {model_copy}") and gone in msg


def test_what_a_component_does_not_read_is_not_asked_for(model_copy):
    (model_copy / "model.safetensors").unlink()
    assert check_model_dir(model_copy, weights=False) == model_copy  # the actors read the tokenizer only
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="lacks tokenizer.json, model.safetensors"):
        check_model_dir(model_copy)
    shutil.copytree(default_model_dir(), model_copy, dirs_exist_ok=True)
    (model_copy / "tokenizer.json").unlink()
    assert check_model_dir(model_copy, tokenizer=False) == model_copy  # the sampler: token-in


def test_a_missing_dir_and_an_unsupported_architecture_are_one_line(model_copy, tmp_path):
    with pytest.raises(ConfigError, match=r"no such directory"):
        check_model_dir(tmp_path / "nope")
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"unsupported model architecture \['LlamaForCausalLM'\]") as info:
        check_model_dir(model_copy, "--model")
    assert "\n" not in str(info.value)


def test_learner_serve_refuses_a_bad_model_dir(tmp_path, capsys):
    from t1async.learner.__main__ import main

    argv = ["serve", "--run-dir", str(tmp_path / "run"), "--nats", "nats://127.0.0.1:1", "--model", str(tmp_path)]
    assert main(argv) == 2
    assert f"error: --model {tmp_path} is not a model dir: it lacks config.json" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.parametrize(
    "argv",
    [
        ["python -m t1async.learner", "sft", "--synth", "2", "--out", "{tmp}/out"],
        ["python -m t1async.eval", "--tasks", "{tmp}"],
        ["python -m actors", "--nats", "nats://127.0.0.1:1", "--sampler-url", "http://127.0.0.1:1", "--tasks", "{tmp}"],
    ],
    ids=["learner-sft", "eval", "actors"],
)
def test_clis_exit_with_a_usage_error_naming_what_is_missing(argv, tmp_path, capsys):
    from actors.__main__ import main as actors_main
    from t1async.eval.__main__ import main as eval_main
    from t1async.learner.__main__ import main as learner_main

    main = {"python -m t1async.learner": learner_main, "python -m t1async.eval": eval_main}.get(argv[0], actors_main)
    rest = [a.replace("{tmp}", str(tmp_path)) for a in argv[1:]] + ["--model", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        main(rest)
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--model {tmp_path} is not a model dir: it lacks config.json" in err
    assert not (tmp_path / "out").exists()


def test_sampler_serve_refuses_a_bad_model_dir(tmp_path, capsys):
    from t1async.sampler.__main__ import main

    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    assert "lacks config.json, model.safetensors" in capsys.readouterr().err  # token-in: no tokenizer needed


def test_cluster_up_refuses_a_bad_model_dir(tmp_path):
    from t1async.cluster.config import UpConfig

    with pytest.raises(ConfigError, match="lacks config.json"):
        UpConfig(run_dir=tmp_path, model=tmp_path).check()


def test_bench_r3flush_refuses_a_bad_model_dir(tmp_path, capsys):
    from bench.r3flush import main

    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path)])
    assert info.value.code == 2 and "lacks config.json" in capsys.readouterr().err
