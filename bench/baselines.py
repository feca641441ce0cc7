"""The baselines RL must beat, each scored on the same held-out test tasks as RL, by content key.

    python -m bench.learning --preset learn-choresn --folds 3 --baselines sweep,passk,mask,sft,rft,contentfree

- ``sweep``: the warm start at its best temperature, chosen on the eval split (never on test);
- ``passk``: the warm start at the training temperature, ``--passk`` samples a test task: pass@k for k = 1..K
  (Chen et al.'s unbiased estimator per task, then the mean over keys); pass@1 is its baseline figure, pass@k
  says what sampling alone reaches (what RL's sharpening could at most turn into pass@1);
- ``mask``: the warm start with DONE masked before the oracle's turn count (``DoneMasked``);
- ``sft``: the full-demonstration recipe (``<recipe>-full``, the oracle's demonstrations only), greedy;
- ``rft``: rejection-sampling fine-tuning: the warm start samples the *train* split, the resolved episodes are
  kept, their commands re-run in the sandbox as demonstrations and the warm start fine-tuned on them (``rft``);
- ``contentfree``: RL at RL's budget with a reward of 1 for every turn that does not say DONE (``--reward
  turns``, ``sandbox_agent.agent.types.Reward.TURNS``), whatever the tests say: what "always go on" is worth;
- ``binary``: RL at RL's budget with the outcome reward (``--reward binary``: 1 at the end when every test
  passes, else 0) in place of the dense one, from the same init and with the same ``--cluster-arg``: dense
  against binary where the init seldom succeeds (give an advantage that carries the end's reward back to earlier
  turns, e.g. ``--cluster-arg=--advantage=rloo``: under ``turn`` a binary reward reaches only the last turn).

``contentfree`` and ``binary`` start from RL's init (``--rl-init``), the others from the fold's warm start (``sft``
from nothing: its own build).

How DONE is masked. The sampler is left as it is: a logit mask there would ban DONE's first token, which other
replies may start with, and the embedded and vLLM samplers would each need it. ``DoneMasked`` is agent-side: a
reply that parses as DONE before the task's oracle turn count is re-sampled (another seed, up to ``tries``
times). That is rejection sampling of the policy's own reply distribution conditioned on "not DONE": the
sequence-level mask, the honest one. It needs T > 0 (greedy re-samples the same reply): it runs at the
training temperature, and a reply still DONE after ``tries`` stands (counted in ``masked_kept_done``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.learning_stats import keys_of, per_task
from sandbox_agent.agent.actions import parse_action
from t1async.eval.stats import by_key_ci, pass_at_k, split_errors
from t1async.log import get_logger
from t1async.protocol.sampling import Generation, Sampler, SamplingParams
from t1async.signals import run_until_stop

log = get_logger("bench.baselines")
BASELINES = ("sweep", "passk", "mask", "sft", "rft", "contentfree", "binary")
# the baselines that are RL runs (cluster up --reward R from RL's init), and their reward
RL_BASELINES = {"contentfree": "turns", "binary": "binary"}


def pass_at_ks(rows: Sequence[Mapping], ks: Sequence[int]) -> dict[int, dict]:
    """k -> ``{"mean", "ci95", "keys"}`` of pass@k by content key (errored episodes left out): per task the
    unbiased estimator over its samples, then ``by_key_ci``. A k above a task's sample count is skipped."""
    kept = split_errors(rows)[0]
    by: dict[str, list[bool]] = defaultdict(list)
    for r in kept:
        by[str(r["task"])].append(bool(r["resolved"]))
    key_of = keys_of(kept)
    out: dict[int, dict] = {}
    for k in ks:
        vals = {t: pass_at_k(len(v), sum(v), k) for t, v in by.items() if len(v) >= k}
        if vals:
            out[k] = by_key_ci(vals, key_of)
    return out


def oracle_command_turns(task) -> int:  # noqa: ANN001 - a sandbox_agent Task
    """The oracle's command turns (its DONE is the one after): the task's ``max_turns`` less one when it has
    one, else its solution's chunks."""
    from sandbox_agent.agent.runner import solution_chunks

    mt = task.extra.get("max_turns")
    if isinstance(mt, int) and mt > 1:
        return mt - 1
    return len(solution_chunks(task.solution.read_text())) if task.solution is not None else 0


class DoneMasked:
    """A Sampler that re-samples a DONE reply given before the task's oracle turn count (see the module
    docstring). Episodes are told apart by ``rid`` (``eval-<task>-s<sample>``, t1async.eval.run), their turn by
    the count of requests with that rid."""

    def __init__(self, inner: Sampler, tokenizer, need: Mapping[str, int], *, tries: int = 8) -> None:  # noqa: ANN001
        self.inner, self.tok, self.need, self.tries = inner, tokenizer, dict(need), tries
        self.turn: dict[str, int] = defaultdict(int)
        self.resampled = 0
        self.kept_done = 0

    def _need(self, rid: str | None) -> int:
        for tid, n in self.need.items():
            if rid is not None and rid.startswith(f"eval-{tid}-s"):
                return n
        return 0

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        routed_experts_start_len: int | None = None,
        rid: str | None = None,
    ) -> Generation:
        key = rid or ""
        turn = self.turn[key]
        self.turn[key] += 1
        need = self._need(rid)
        gen = await self.inner.generate(input_ids, params, routed_experts_start_len=routed_experts_start_len, rid=rid)
        for k in range(1, self.tries + 1):
            if turn >= need or not _is_done(self.tok.decode(list(gen.output_ids), skip_special_tokens=True)):
                return gen
            self.resampled += 1
            seed = None if params.seed is None else (params.seed + 7919 * k) & 0x7FFFFFFF
            gen = await self.inner.generate(
                input_ids, replace(params, seed=seed), routed_experts_start_len=routed_experts_start_len, rid=rid
            )
        if turn < need and _is_done(self.tok.decode(list(gen.output_ids), skip_special_tokens=True)):
            self.kept_done += 1
        return gen

    async def aclose(self) -> None:  # the inner sampler is the caller's
        return None


def _is_done(text: str) -> bool:
    return parse_action(text).done


def eval_masked(model: Path, tasks: list, *, samples: int, out: Path, ev: Mapping, temperature: float) -> list[dict]:
    """``bench.learning_runs.eval_policy`` with ``DoneMasked`` around the embedded sampler."""
    from t1async.eval.run import EvalConfig, progress_stream, run_eval
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import launch_sampler

    tok = ChatTokenizer.load(model)
    cfg = EvalConfig(
        samples=samples,
        concurrency=ev["concurrency"],
        seed=ev["seed"],
        max_turns=ev["max_turns"],
        max_new_tokens=ev["max_new_tokens"],
        max_context=ev["max_context"],
        temperature=temperature,
    )
    agent = cfg.agent()
    if ev.get("system_prompt") is not None:
        agent = replace(agent, system_prompt=ev["system_prompt"])
    need = {t.id: oracle_command_turns(t) for t in tasks}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")

    async def go() -> list[dict]:
        async with launch_sampler(model, seed=ev["seed"], prefix_cache_tokens=0) as url, SGLangClient([url]) as c:
            masked = DoneMasked(c, tok, need)
            rows = await run_eval(tasks, masked, tok, cfg, jsonl=out, progress=progress_stream(), agent=agent)
            log.info("baseline.mask", resampled=masked.resampled, kept_done=masked.kept_done)
            for r in rows:
                r["masked_kept_done"] = masked.kept_done
            return rows

    return run_until_stop(go)  # SIGTERM: the episodes' sandboxes and work dirs are removed first


def rft_demos(rows: Sequence[Mapping], tasks: Mapping[str, object], *, concurrency: int = 2) -> list:
    """The resolved episodes of ``rows`` (the warm start sampled on train) as SFT demonstrations: each kept
    episode's commands, written as the task's solution in a copy of its dir and re-run in the sandbox
    (``sft.collect_demos``: the real observations, and only what still resolves is kept). One demonstration per
    distinct (task, commands)."""
    from sandbox_agent.tasks.task import load_task
    from t1async.recipes.sft import collect_demos

    seen: set[tuple[str, tuple[str, ...]]] = set()
    picked: list[tuple[object, tuple[str, ...]]] = []
    for r in split_errors(rows)[0]:
        if not r["resolved"] or str(r["task"]) not in tasks:
            continue
        cmds = tuple(s["command"] for s in r.get("steps", ()) if s.get("action") == "bash" and s.get("command"))
        if cmds and (str(r["task"]), cmds) not in seen:
            seen.add((str(r["task"]), cmds))
            picked.append((tasks[str(r["task"])], cmds))
    if not picked:
        return []
    with tempfile.TemporaryDirectory(prefix="t1-rft-") as tmp:
        copies = []
        for i, (task, cmds) in enumerate(picked):
            d = Path(tmp) / f"{i:05d}"
            shutil.copytree(task.path, d)  # type: ignore[attr-defined]
            (d / "solution.sh").write_text("#!/bin/bash\n" + "\n\n".join(cmds) + "\n")
            copies.append(load_task(d))
        return run_until_stop(lambda: collect_demos(copies, concurrency=concurrency))


def rft_model(warm: Path, demos: list, out: Path, *, steps: int, system_prompt: str | None) -> Path:
    """The warm start fine-tuned on ``demos`` (its recipe's SFT settings, ``steps`` steps) into ``out``."""
    import torch

    from t1async.learner.settings import SFTConfig
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import load_pretrained, save_pretrained
    from t1async.recipes.sft import demo_tokens, sft_train
    from t1async.recipes.warmstart import PROMPT_FILE

    tok = ChatTokenizer.load(warm)
    model = load_pretrained(warm)
    examples = [demo_tokens(d, tok, system_prompt) for d in demos]
    torch.manual_seed(0)
    sft_train(model, examples, SFTConfig(steps=steps, lr=5e-4, warmup_steps=min(10, steps), batch_tokens=2048))
    if out.exists():
        shutil.rmtree(out)
    save_pretrained(model, out, tok)
    if system_prompt is not None:
        (out / PROMPT_FILE).write_text(system_prompt)
    return out


def best_of(figures: Mapping[str, float]) -> tuple[str, float]:
    """(name, pass@1) of the best baseline; a NaN (nothing scored) never wins, a tie goes to the first name."""
    ok = {n: v for n, v in figures.items() if np.isfinite(v)}
    if not ok:
        return ("none", float("nan"))
    name = max(ok, key=lambda n: (ok[n], -list(figures).index(n)))
    return name, ok[name]


def pass1_by_key(rows: Sequence[Mapping]) -> dict:
    """pass@1 of eval rows by content key, with its cluster bootstrap CI."""
    kept = split_errors(rows)[0]
    scores = per_task(kept)
    return by_key_ci({t: s[0] for t, s in scores.items()}, keys_of(kept))


__all__ = [
    "BASELINES",
    "RL_BASELINES",
    "DoneMasked",
    "best_of",
    "eval_masked",
    "oracle_command_turns",
    "pass1_by_key",
    "pass_at_ks",
    "rft_demos",
    "rft_model",
]
