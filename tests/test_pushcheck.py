"""The push check (learner/pushcheck.py) against the real embedded sampler, over SGLang's protocol: the sampler
samples after the probe and the learner recomputes those tokens' log-probs. (vLLM's path, prompt_logprobs, is in
test_vllm_real.py; the retry and the error in test_vllm_client.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from t1async.learner.pushcheck import (
    SAMPLED,
    PushCheck,
    PushCheckConfig,
    engine_logprobs,
    learner_logprobs,
    probe_ids,
    trimmed_mean,
)
from t1async.model.weights import default_model_dir, load_pretrained
from t1async.sampler.client import SGLangClient
from t1async.sampler.launch import launch_sampler


async def test_the_check_sees_the_embedded_sampler_agree_and_then_differ():
    model = load_pretrained(default_model_dir())
    async with launch_sampler(default_model_dir(), dtype="float32") as url, SGLangClient([url]) as client:
        check = PushCheck(client, PushCheckConfig(), model.cfg.vocab_size)
        seq, theirs = await engine_logprobs(client, check.ids, url)
        assert seq[: len(check.ids)] == check.ids and len(theirs) == SAMPLED == len(seq) - len(check.ids)
        same = await check.measure(model)
        assert set(same) == {url} and same[url] < 1e-4, same  # fp32 on both sides
        with torch.no_grad():  # the learner now holds other weights than the sampler serves
            for name, p in model.named_parameters():
                if ".moe." in name:
                    p.mul_(1.3)
        other = await check.measure(model)
        assert other[url] > PushCheckConfig().bound, other


def test_cluster_up_gives_its_own_bf16_samplers_the_bf16_bound(tmp_path):
    """bf16 rounding alone read 0.0114 on the probe (untrimmed) at v18 of a learn-choresn run, past the fp32
    bound 0.01, and the run stopped. Samplers cluster up starts in bf16 now get PUSH_CHECK_BOUND_BF16, unless
    the flag is given; fp32 ones, and --sampler-url servers whose dtype cluster up does not know, keep the fp32
    bound."""
    from t1async.learner.settings import PUSH_CHECK_BOUND, PUSH_CHECK_BOUND_BF16
    from tests.clusterargs import learner_argv, serve_args

    def bound(name: str, *flags: str) -> float:
        return serve_args(learner_argv(tmp_path / name, *flags)).push_check.bound

    assert PUSH_CHECK_BOUND < 0.0114 < PUSH_CHECK_BOUND_BF16 < 0.043  # a bf16 stop; vLLM's broken reload
    assert bound("fp32") == PUSH_CHECK_BOUND
    assert bound("bf16", "--sampler-dtype", "bfloat16") == PUSH_CHECK_BOUND_BF16
    assert bound("vllm", "--engine", "vllm", "--vllm-dtype", "bfloat16") == PUSH_CHECK_BOUND_BF16
    assert bound("vllm32", "--engine", "vllm") == PUSH_CHECK_BOUND
    assert bound("flag", "--sampler-dtype", "bfloat16", "--push-check-bound", "0.02") == 0.02
    assert bound("url", "--sampler-dtype", "bfloat16", "--sampler-url", "http://127.0.0.1:1") == PUSH_CHECK_BOUND


async def test_one_token_far_off_does_not_fail_a_push_and_every_token_a_little_off_does():
    """What a bf16 sampler did at v9 of a learn-choresn run: one sampled token of 32 at -0.02 where the learner
    said -8.2, the rest within 0.02, mean 0.27: the plain mean failed a push of the right weights."""
    model = load_pretrained(default_model_dir())
    ids = probe_ids(model.cfg.vocab_size, 64)
    exact = learner_logprobs(model, ids)

    class Engine:  # scores the probe as vLLM does (prompt_logprobs): the learner's own, perturbed
        urls = ["http://engine"]

        def __init__(self, off: np.ndarray) -> None:
            self.off = off

        async def score(self, ids: list[int], *, url: str) -> np.ndarray:
            return exact + self.off

    one = np.zeros(len(exact))
    one[0] = 8.2
    check = PushCheck(Engine(one), PushCheckConfig(), model.cfg.vocab_size)
    got = await check.measure(model)
    assert got["http://engine"] < 1e-6 and check.largest["http://engine"] == pytest.approx(8.2)
    assert float(np.abs(one).mean()) > PushCheckConfig().bound  # the old statistic failed this push
    spread = np.full(len(exact), 0.03)  # every token a little off: other weights
    got = await PushCheck(Engine(spread), PushCheckConfig(), model.cfg.vocab_size).measure(model)
    assert got["http://engine"] == pytest.approx(0.03) and got["http://engine"] > PushCheckConfig().bound
    assert trimmed_mean(np.arange(10.0)) == pytest.approx(4.0)  # 9 of 10 kept
