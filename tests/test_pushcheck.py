"""The push check (learner/pushcheck.py) against the real embedded sampler, over SGLang's protocol: the sampler
samples after the probe and the learner recomputes those tokens' log-probs. (vLLM's path, prompt_logprobs, is in
test_vllm_real.py; the retry and the error in test_vllm_client.py.)"""

from __future__ import annotations

import torch

from t1async.learner.pushcheck import SAMPLED, PushCheck, PushCheckConfig, engine_logprobs
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
