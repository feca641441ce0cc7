"""Warm-start SFT on oracle demonstrations, token-in exactly like the agent.

A demonstration is a task's oracle solution rendered as agent turns (``sandbox_agent.agent.runner.oracle_turns``:
``[(assistant_text, observation), ..., ("DONE", "")]``, observations from really running each chunk in the
sandbox). ``demo_tokens`` builds the token sequence the agent would have produced had the model sampled
those replies: the first input is ``render(system + instruction)``; each reply is ``encode(text) + end_of_turn_id``
(the sampler stops on, and keeps, the end-of-turn token); then ``bridge_ids`` + the observation message
encoded on its own + the generation prompt. The loss is on the reply tokens only. So SFT trains the very
token sequences RL later samples: no template mismatch between warm start and RL. Only the train split of the
tasks is demonstrated (the split is by content key: no eval or test task is ever an SFT example).

    python -m t1async.learner sft --synth 64 --steps 300 --out runs/sft     # writes a model directory
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import numpy as np
import torch

from t1async.learner.batch import plan_microbatches
from t1async.learner.settings import SFTConfig
from t1async.log import get_logger
from t1async.protocol.errors import ConfigError

if TYPE_CHECKING:
    from t1async.model.moe import MoETransformer

log = get_logger("t1async.recipes.sft")


@dataclass(frozen=True)
class Demo:
    task: str
    instruction: str
    turns: tuple[tuple[str, str], ...]  # (assistant text, observation); the last observation is unused


@dataclass(frozen=True)
class Example:
    task: str
    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]


def demo_tokens(demo: Demo, tok, system_prompt: str | None = None) -> Example:
    """The agent's token-in sequence for a demonstration, and its loss mask (reply tokens)."""
    from sandbox_agent.agent.loop import initial_messages

    msgs = (
        initial_messages(demo.instruction)
        if system_prompt is None
        else initial_messages(demo.instruction, system_prompt)
    )
    ids: list[int] = list(tok.render(msgs))
    mask: list[bool] = [False] * len(ids)
    if not demo.turns:
        raise ConfigError(f"demonstration for {demo.task} has no turns")
    for k, (reply, obs) in enumerate(demo.turns):
        out = [*tok.encode(reply), tok.end_of_turn_id]
        ids += out
        mask += [True] * len(out)
        if k == len(demo.turns) - 1:
            break
        ctx = [*tok.bridge_ids(out), *tok.message_ids("user", obs), *tok.generation_prompt_ids()]
        ids += ctx
        mask += [False] * len(ctx)
    return Example(demo.task, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))


async def collect_demos(tasks: Sequence, *, concurrency: int = 2, backend=None) -> list[Demo]:
    """Run each task's oracle in a sandbox and keep the demonstrations whose verification resolved."""
    from sandbox_agent.agent.runner import oracle_turns

    demos: list[Demo | None] = [None] * len(tasks)
    limit = anyio.Semaphore(max(1, concurrency))
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        task = tasks[i]
        async with limit:
            try:
                turns, result = await oracle_turns(task, backend=backend)
            except Exception as exc:  # a broken task is skipped, not fatal; say which and why
                log.warning("sft.oracle_failed", task=task.id, error=f"{type(exc).__name__}: {exc}")
                return
            finally:
                done += 1  # the progress (cluster up's warm-start bar): one more oracle run over, kept or not
                log.info("sft.demo", step=done - 1, total=len(tasks))
        if not result.resolved:
            log.warning("sft.oracle_unresolved", task=task.id, passed=result.passed, total=result.total)
            return
        demos[i] = Demo(task.id, task.instruction, tuple(turns))

    async with anyio.create_task_group() as tg:
        for i in range(len(tasks)):
            tg.start_soon(one, i)
    return [d for d in demos if d is not None]


def copy_examples(
    n: int,
    vocab_size: int,
    special: frozenset[int],
    *,
    seed: int = 0,
    min_len: int = 8,
    max_len: int = 48,
    pool: Sequence[int] | None = None,
) -> list[Example]:
    """``n`` copy-pretraining sequences: random tokens ``s`` then ``s`` again, the loss on the repeat (after
    its first token). A model from random weights learns here what every copy from an instruction needs
    (heads that find where the current token was before and copy what followed it); the demonstrations then
    only teach which instruction slot each command argument comes from. ``pool``: draw from these token ids
    only (e.g. the demonstrations' reply tokens). Measured on the 4.5 M MoE, lr 3e-3, 2048-token steps: from
    the ~90 tokens of the synth WORDS the loss left its guessing plateau (ln 90 = 4.5) after ~60 steps and
    was 3.6 at step 210; from the whole 4096-token vocabulary it had not moved at step 80."""
    rng = np.random.default_rng(seed)
    ids = range(vocab_size) if pool is None else pool
    arr = np.asarray(
        sorted({int(i) for i in ids if int(i) not in special and 0 <= int(i) < vocab_size}), dtype=np.int32
    )
    if arr.size < 2:
        raise ConfigError(f"copy pretraining needs a pool of at least 2 ordinary token ids, got {arr.size}")
    out = []
    for k in range(n):
        s = rng.choice(arr, size=int(rng.integers(min_len, max_len + 1)))
        toks = np.concatenate([s, s])
        mask = np.zeros(toks.size, dtype=bool)
        mask[s.size + 1 :] = True
        out.append(Example(f"copy-{k}", toks, mask))
    return out


def synth_tasks(n: int, seed: int, root: Path) -> list:
    """Generate ``n`` synthetic tasks into ``root`` and load them."""
    from sandbox_agent.synth import generate
    from sandbox_agent.tasks.task import load_task

    return [load_task(p) for p in generate(root, n, seed=seed)]


def _lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _pad(examples: Sequence[Example], idx: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(examples[i].tokens) for i in idx)
    toks = np.full((len(idx), t), pad_id, dtype=np.int64)
    mask = np.zeros((len(idx), t), dtype=bool)
    for row, i in enumerate(idx):
        e = examples[i]
        toks[row, : len(e.tokens)] = e.tokens
        mask[row, : len(e.tokens)] = e.loss_mask
    return torch.from_numpy(toks), torch.from_numpy(mask)


def demo_loss(
    model: MoETransformer, examples: Sequence[Example], *, pad_id: int = 0, batch_tokens: int = 8192
) -> float:
    """Mean next-token cross-entropy over the loss tokens of ``examples`` (no gradient)."""
    total, count = 0.0, 0
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for g in plan_microbatches([len(e.tokens) for e in examples], batch_tokens):
                toks, mask = _pad(examples, g, pad_id)
                nll = _nll(model, toks)
                m = mask[:, 1:]
                total += float(nll[m].sum())
                count += int(m.sum())
    finally:
        model.train(was)
    return total / max(count, 1)


def _nll(model: MoETransformer, toks: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Per-position NLL of tokens[:, 1:] given the prefix, [B, T - 1] (right padding needs no mask), on the
    model's device (``bf16``: under bf16 autocast). The lm_head runs in checkpointed chunks
    (``MoETransformer.token_logprobs``): no [B, T, V] logits."""
    device = next(model.parameters()).device
    toks = toks.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(toks, logits=False)
        return -model.token_logprobs(out.hidden, toks)[0][:, 1:].float().cpu()


def sft_train(
    model: MoETransformer,
    examples: Sequence[Example],
    cfg: SFTConfig,
    *,
    pad_id: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    event: str = "sft.step",
) -> list[float]:
    """Train the LM head on the examples' loss tokens; returns the loss of every step. ``on_step(step, loss)``
    after each optimizer step (e.g. to save snapshots). Every 10th step is logged as ``event`` (a progress bar
    follows it: cluster up's warm start)."""
    if not examples:
        raise ConfigError("SFT needs at least one demonstration example")
    exs = [Example(e.task, e.tokens[: cfg.max_len], e.loss_mask[: cfg.max_len]) for e in examples]
    exs = [e for e in exs if e.loss_mask[1:].any()]
    if not exs:
        raise ConfigError(f"no example has a loss token within max_len={cfg.max_len}")
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    model.train()
    losses: list[float] = []
    order: list[int] = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        # draw examples until the padded batch would exceed the budget (at least one)
        batch: list[int] = []
        longest = 0
        while True:
            if not order:
                order = list(range(len(exs)))
                rng.shuffle(order)
            nxt = order[-1]
            n = len(exs[nxt].tokens)
            if batch and (len(batch) + 1) * max(longest, n) > cfg.batch_tokens:
                break
            batch.append(order.pop())
            longest = max(longest, n)
            if len(batch) == len(exs):
                break
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        toks, mask = _pad(exs, batch, pad_id)
        m = mask[:, 1:]
        loss = _nll(model, toks, cfg.train_dtype == "bfloat16")[m].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
        if step % 10 == 0 or step == cfg.steps - 1:
            log.info(
                event,
                step=step,
                loss=round(losses[-1], 4),
                examples=len(batch),
                tokens=int(m.sum()),
                elapsed_s=round(time.perf_counter() - t0, 1),
            )
    opt.zero_grad(set_to_none=True)
    model.eval()
    return losses


def run_sft(cfg: SFTConfig) -> dict:
    """The ``sft`` command: demonstrations (of ``cfg.tasks``, or ``cfg.synth`` synthetic tasks) -> training -> a
    model directory at ``cfg.out``."""
    import json

    from t1async.learner.trainer_config import torch_device
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import default_model_dir, load_pretrained, save_pretrained

    if cfg.out is None:
        raise ConfigError("SFT needs an output directory: --out DIR (SFTConfig.out)")
    out, tasks_dir, synth = cfg.out, cfg.tasks, cfg.synth or 0  # synth: unused with tasks
    src = cfg.model or default_model_dir()
    tok = ChatTokenizer.load(src)
    model = load_pretrained(src, torch.float32).to(torch_device(cfg.device))  # fp32 master weights
    with tempfile.TemporaryDirectory(prefix="t1-sft-tasks-") as tmp:
        if tasks_dir is not None:
            from sandbox_agent.tasks.task import load_tasks

            tasks = load_tasks(tasks_dir)
        else:
            tasks = synth_tasks(synth, cfg.seed, Path(tmp))
        if not tasks:
            raise ConfigError(f"no tasks found ({tasks_dir or f'--synth {synth}'})")
        held = len(tasks)
        tasks = [t for t in tasks if t.split == "train"]  # eval and test content keys are never demonstrated
        if not tasks:
            raise ConfigError(
                f"none of the {held} tasks ({tasks_dir or f'--synth {synth}'}) is in the train split: eval and test "
                "tasks are held out of SFT; give more tasks"
            )
        log.info("sft.tasks", train=len(tasks), held_out=held - len(tasks))
        t0 = time.perf_counter()
        demos = anyio.run(lambda: collect_demos(tasks, concurrency=cfg.concurrency), backend="trio")
        t_demos = time.perf_counter() - t0
    if not demos:
        raise ConfigError(f"none of the {len(tasks)} tasks gave a resolved oracle demonstration (see the log)")
    examples = [demo_tokens(d, tok) for d in demos]
    before = demo_loss(model, examples, pad_id=tok.pad_id)
    losses = sft_train(model, examples, cfg, pad_id=tok.pad_id)
    after = demo_loss(model, examples, pad_id=tok.pad_id)
    save_pretrained(model, out, tok)
    summary = {
        "tasks": len(tasks),
        "demos": len(demos),
        "examples_tokens": int(sum(len(e.tokens) for e in examples)),
        "loss_tokens": int(sum(int(e.loss_mask.sum()) for e in examples)),
        "steps": cfg.steps,
        "loss_before": before,
        "loss_after": after,
        "t_demos_s": t_demos,
        "first_losses": losses[:5],
        "last_losses": losses[-5:],
        "out": str(out),
    }
    (Path(out) / "sft_metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("sft.done", **{k: v for k, v in summary.items() if not isinstance(v, list)})
    return summary
