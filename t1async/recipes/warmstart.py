"""The warm start as a reproducible build step: a named recipe -> a cached model directory.

A ``Recipe`` says everything the warm-started weights depend on: the model shape (``MoEConfig``, whose
``seed`` fixes the random init), the synthetic task families, how many tasks and from which corpus seed (only
their ``train`` split gives demonstrations: the split is by content key, so no eval or test key of any corpus
is demonstrated; the split's version is part of the recipe's hash), and the SFT
settings (steps, lr, batch, seed of the batch order). ``build(recipe)`` generates the tasks, runs each
oracle in the real sandbox (``sft.collect_demos``), trains from the seeded init and writes the model
directory into ``<cache>/warm-start/<recipe hash>/`` atomically (temp dir + rename); a second call finds it
and returns at once. ``recipe.json`` and ``sft_metrics.json`` sit beside the weights. No weights in git.

    python -m t1async.recipes.warmstart --recipe learn            # builds (or finds) it; prints the dir
    python -m t1async.recipes.warmstart --recipe learn --print-dir   # where it is/would be; builds nothing

The cache root is ``$T1ASYNC_CACHE`` or ``$XDG_CACHE_HOME/t1async`` or ``~/.cache/t1async``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_agent.tasks.task import SPLIT_VERSION
from t1async.learner.settings import SFTConfig
from t1async.log import get_logger
from t1async.model.config import MoEConfig
from t1async.model.weights import default_config
from t1async.protocol.errors import ConfigError, T1Error

log = get_logger("t1async.recipes.warmstart")

RECIPE_VERSION = "warmstart-v1"  # bump when the build itself changes (demo rendering, training loop)
PROMPT_FILE = "system_prompt.txt"  # in the model dir: the system prompt the policy was trained with
# The default agent prompt is 327 tokens, 60% of a demonstration of the easy families: every SFT step, every
# sampled turn and every RL step pays for it. This one states the same contract in 53 tokens.
SHORT_PROMPT = (
    "You are in a bash shell. Reply with one command in a ```bash block; "
    "you will see its output. When the task is done, reply DONE."
)


# SFTConfig's fields that are the `learner sft` command's, not the training's: left out of a recipe's hash
_SFT_COMMAND = ("tasks", "synth", "out", "model", "concurrency", "threads", "json")


@dataclass(frozen=True)
class Recipe:
    name: str
    model: MoEConfig = field(default_factory=MoEConfig)
    families: tuple[str, ...] = ("mkfile", "copy")
    tasks: int = 400  # generated; the train split of them gives the demonstrations
    task_seed: int = 1000  # a corpus seed of its own: the bench's eval tasks (seed 0) are other tasks
    sft: SFTConfig = field(default_factory=SFTConfig)
    system_prompt: str = SHORT_PROMPT  # the agent's system prompt in the demos; written beside the weights
    data_version: int = 1  # the families' version (e.g. synth.basics.VERSION): new task text, new demos
    # the split the demonstrations come from: fold ``fold`` of ``folds`` (sandbox_agent.synth.split.split_of,
    # bench.learning --folds), so a fold's warm start never saw its held-out keys; None: the default split
    fold: int | None = None
    folds: int = 0

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "version": RECIPE_VERSION,
            "name": self.name,
            "model": self.model.to_dict(),
            "families": list(self.families),
            "tasks": self.tasks,
            "task_seed": self.task_seed,
            # the training settings: a recipe names its own tasks and model, and where the build goes
            "sft": {k: v for k, v in dataclasses.asdict(self.sft).items() if k not in _SFT_COMMAND},
            "system_prompt": self.system_prompt,
            "split": SPLIT_VERSION,  # which tasks are train (the demonstrations) is part of the recipe
        }
        if not self.sft.copy_steps:  # added later: left out when off, so the recipes built before keep their hash
            d["sft"].pop("copy_steps")
        for k, default in (("device", "cpu"), ("train_dtype", "float32")):  # the same, added later still
            if d["sft"][k] == default:
                d["sft"].pop(k)
        if self.data_version != 1:  # only when set, so the recipes built before it keep their hash
            d["data_version"] = self.data_version
        if self.fold is not None:  # the same
            d["fold"], d["folds"] = self.fold, self.folds
        return d

    def digest(self) -> str:
        d = self.to_dict()
        d.pop("name")  # the name is a label: two names for the same recipe share one build
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# the chores warm starts' SFT: ``learn`` runs it as it is, the ``credit`` ones for more steps
_CHORES_SFT = SFTConfig(steps=300, lr=2e-3, warmup_steps=10, batch_tokens=2048, seed=0)

# ``learn`` on the cdchores tasks (a `cd` that earns nothing, then the chores; sandbox_agent/synth/cdchores.py)
# by ``cdchoresome``'s weaker demonstrator, which does the `cd` and then the first k of the four chores: the
# policy bench.reward_modes trains on cdchores with a dense and with a binary reward. On the full oracle it
# resolved none of the held-out tasks (docs/results.md), so a binary reward was 0 on every episode; on this
# one after 300 SFT steps (loss 0.10) it still resolved none and passed 0.76 tests of 4, after 600 21% and 2.34
_CREDIT = Recipe(
    name="credit",
    model=default_config(),  # the shipped tiny Qwen3-MoE, from its seeded init
    families=("cdchoresome",),
    tasks=400,
    task_seed=1000,
    sft=dataclasses.replace(_CHORES_SFT, steps=600),
)

# the content-dependent family: ``choresnsome``'s demonstrator stops after k of the ceil(n / 2) replies whatever
# n is, so its imitator knows every chore's command and RL on ``choresn`` (every chore tested, max_turns exactly
# the oracle's) has to learn when to stop from what was asked (sandbox_agent/synth/choresn.py). data_version 2:
# decontaminated by key and whole test instructions (sandbox_agent/synth/contam.py), 247 demonstrations of 400
# tasks where the 8-gram check in the train -> test direction left 108
_CHORESN = Recipe(
    name="choresn",
    model=default_config(),
    families=("choresnsome",),
    tasks=400,
    task_seed=1000,
    sft=_CHORES_SFT,
    data_version=2,
)
RECIPES: dict[str, Recipe] = {
    # the chores menu (no copying; sandbox_agent/synth/chores.py) by ``choresome``'s weaker demonstrator, which
    # does only the first k of the four chores: the warm start knows every chore's command but stops early as
    # it did, and RL on ``chores`` teaches it to go on. On the full oracle (``chores``) this shape resolved every
    # held-out chore set before any RL (docs/results.md, "Learning", has that and the earlier tries)
    "learn": Recipe(
        name="learn",
        model=default_config(),  # the shipped tiny Qwen3-MoE, from its seeded init
        families=("choresome",),
        tasks=400,
        task_seed=1000,
        sft=_CHORES_SFT,
    ),
    "credit": _CREDIT,
    # the content-dependent family (_CHORESN, above)
    "choresn": _CHORESN,
    # the baseline "SFT on the full demonstrations only" (bench.learning --baselines sft): the same, on the oracle
    "choresn-full": dataclasses.replace(_CHORESN, name="choresn-full", families=("choresn",)),
    # ``credit`` stopped at 450 SFT steps: a policy that does the `cd` and some chores but seldom all four (held
    # out, at T 1: 14.7% resolved, 1.64 tests of 4), so a binary end-of-episode reward is mostly 0 while a dense
    # one pays for each chore done (bench.reward_modes --warm-start credit-early)
    "credit-early": dataclasses.replace(_CREDIT, name="credit-early", sft=dataclasses.replace(_CHORES_SFT, steps=450)),
    # stopped at 330 steps: the T1 setting, where an episode seldom succeeds whole (held out, at T 1: 4.4% resolved,
    # 1.88 tests of 4), so a binary end-of-episode reward is 0 in most task groups and a dense one still pays for
    # each chore done (bench.reward_modes --warm-start credit-sparse). Not monotone in the steps: the cosine
    # schedule spans each recipe's own steps, and 375 resolved 16.9%, more than 450 did
    "credit-sparse": dataclasses.replace(
        _CREDIT, name="credit-sparse", sft=dataclasses.replace(_CHORES_SFT, steps=330)
    ),
    # ``credit`` on ``cdchoresfew``, a demonstrator that never does all four chores: no demonstration resolves
    # its cdchores task, so a binary end-of-episode reward is 0 unless the policy goes beyond its demonstrations,
    # and a dense one pays for each chore (bench.reward_modes --warm-start credit-rare). Stopping the SFT sooner
    # did not give that: 315 steps resolved 9.6%, more than 330 (docs/results.md, "Reward")
    "credit-rare": dataclasses.replace(_CREDIT, name="credit-rare", families=("cdchoresfew",)),
    # the CI learning test's policy (tests/test_learning_ci.py): it imitates ``touchsome``, a demonstrator that
    # names only the first k of touch4's four files (k uniform 1-4), so on touch4 it names 1-4 of them, every
    # name right (2.51 of 4, pass@1 26%, 300 tasks x 4 samples) and RL has one decision per file to fix. 1200
    # tasks and copy pretraining first: on 146 demos it memorized each task's k (no variation to explore), and
    # without copy pretraining 1066 demos left it at chance for 600 steps. Corpus seed 2002. Its model is the
    # in-house shape (a Mixtral of one key head per query head), not the shipped Qwen3-MoE: the test's margin was
    # set on it, and on the Qwen3-MoE shape one of two CI runs rose 0.35 < 0.5 (2026-12-02, docs/results.md)
    "micro": Recipe(
        name="micro",
        model=MoEConfig(),
        families=("touchsome",),
        tasks=1200,
        task_seed=2002,
        sft=SFTConfig(steps=300, lr=2e-3, warmup_steps=10, batch_tokens=2048, seed=0, copy_steps=300),
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ConfigError(f"unknown warm-start recipe {name!r}; known: {', '.join(RECIPES)}")
    return RECIPES[name]


def cache_dir(recipe: Recipe, cache_root: Path | None = None) -> Path:
    from t1async.model.weights import default_cache_root

    return (cache_root or default_cache_root()) / "warm-start" / f"{recipe.name}-{recipe.digest()}"


def is_built(recipe: Recipe, cache_root: Path | None = None) -> bool:
    d = cache_dir(recipe, cache_root)
    return all((d / f).is_file() for f in ("config.json", "model.safetensors", "recipe.json", PROMPT_FILE))


def system_prompt_of(model_dir: str | Path) -> str | None:
    """The system prompt a model dir was trained with (``system_prompt.txt``), or None (the default one)."""
    f = Path(model_dir) / PROMPT_FILE
    return f.read_text() if f.is_file() else None


def _demos(recipe: Recipe, root: Path, concurrency: int) -> tuple[list, int]:
    """The recipe's demonstrations (oracle runs of the train split of its corpus) and the number of train
    tasks; cached beside the builds by a hash of (families, tasks, task seed), so a recipe that changes only
    the model or the SFT settings does not rerun hundreds of oracles."""
    import anyio

    from sandbox_agent.synth import generate
    from sandbox_agent.tasks.task import load_task
    from t1async.recipes.sft import Demo, collect_demos

    parts: list = [RECIPE_VERSION, SPLIT_VERSION, list(recipe.families), recipe.tasks, recipe.task_seed]
    if recipe.data_version != 1:
        parts.append(recipe.data_version)
    if recipe.fold is not None:
        parts.append([recipe.fold, recipe.folds])
    key = hashlib.sha256(json.dumps(parts).encode())
    f = root / f"demos-{key.hexdigest()[:16]}.json"
    if f.is_file():
        doc = json.loads(f.read_text())
        return [Demo(d["task"], d["instruction"], tuple(tuple(t) for t in d["turns"])) for d in doc["demos"]], doc[
            "tasks"
        ]
    with tempfile.TemporaryDirectory(prefix="t1-warmstart-tasks-") as tmp:
        paths = generate(
            Path(tmp),
            recipe.tasks,
            seed=recipe.task_seed,
            families=list(recipe.families),
            fold=recipe.fold,
            folds=recipe.folds,
        )
        tasks = [t for t in (load_task(p) for p in paths) if t.split == "train"]
        demos = anyio.run(lambda: collect_demos(tasks, concurrency=concurrency), backend="trio")
    root.mkdir(parents=True, exist_ok=True)
    tmpf = f.with_suffix(".tmp")
    tmpf.write_text(json.dumps({"tasks": len(tasks), "demos": [dataclasses.asdict(d) for d in demos]}))
    tmpf.replace(f)
    log.info("warmstart.demos", tasks=len(tasks), demos=len(demos), file=str(f))
    return demos, len(tasks)


def build(recipe: Recipe, cache_root: Path | None = None, *, concurrency: int = 2, threads: int = 1) -> Path:
    """The recipe's model directory: found in the cache, or built into it (atomically)."""
    import torch

    from t1async.model.moe import MoETransformer
    from t1async.model.tokenizer import ChatTokenizer
    from t1async.model.weights import default_model_dir, save_pretrained
    from t1async.recipes.sft import copy_examples, demo_loss, demo_tokens, sft_train

    dest = cache_dir(recipe, cache_root)
    if is_built(recipe, cache_root):
        log.info("warmstart.cached", recipe=recipe.name, dir=str(dest))
        return dest
    torch.set_num_threads(max(1, threads))
    torch.manual_seed(recipe.sft.seed)
    t0 = time.perf_counter()
    tok = ChatTokenizer.load(default_model_dir())
    demos, n_tasks = _demos(recipe, dest.parent, concurrency)
    t_demos = time.perf_counter() - t0
    if len(demos) < n_tasks // 2:
        raise T1Error(
            f"warm start {recipe.name}: only {len(demos)} of {n_tasks} oracle runs resolved; "
            "the sandbox is broken (try: python -m sandbox_agent check)"
        )
    examples = [demo_tokens(d, tok, recipe.system_prompt) for d in demos]
    model = MoETransformer(recipe.model)  # the seeded init (MoEConfig.seed)
    probe = examples[:: max(1, len(examples) // 32)]  # the loss before/after on a fixed sample (cheap)
    before = demo_loss(model, probe, pad_id=tok.pad_id)
    copy_losses: list[float] = []
    if recipe.sft.copy_steps:  # copy pretraining first (its own optimizer and lr schedule)
        rows = recipe.sft.copy_steps * max(1, recipe.sft.batch_tokens // 24)
        pool = {int(t) for e in examples for t in e.tokens[e.loss_mask]}  # the replies' tokens
        copies = copy_examples(
            rows,
            recipe.model.vocab_size,
            tok.special_ids,
            seed=recipe.sft.seed,
            min_len=4,
            max_len=16,
            pool=sorted(pool),
        )
        copy_losses = sft_train(
            model,
            copies,
            dataclasses.replace(recipe.sft, steps=recipe.sft.copy_steps),
            pad_id=tok.pad_id,
            event="sft.copy_step",
        )
    losses = sft_train(model, examples, recipe.sft, pad_id=tok.pad_id)
    after = demo_loss(model, probe, pad_id=tok.pad_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmpd = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        save_pretrained(model, tmpd, tok)
        (tmpd / PROMPT_FILE).write_text(recipe.system_prompt)
        metrics = {
            "recipe": recipe.name,
            "digest": recipe.digest(),
            "tasks": n_tasks,
            "demos": len(demos),
            "loss_tokens": int(sum(int(e.loss_mask.sum()) for e in examples)),
            "loss_before": before,
            "loss_after": after,
            "losses_every_50": losses[::50] + losses[-1:],
            "copy_losses_every_50": copy_losses[::50] + copy_losses[-1:],
            "t_demos_s": round(t_demos, 1),
            "t_total_s": round(time.perf_counter() - t0, 1),
            "params": int(sum(p.numel() for p in model.parameters())),
        }
        (tmpd / "sft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (tmpd / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2) + "\n")
        if dest.exists():  # a half-built or foreign dir (no recipe.json): replace it
            shutil.rmtree(dest)
        tmpd.rename(dest)
    finally:
        shutil.rmtree(tmpd, ignore_errors=True)
    log.info("warmstart.built", dir=str(dest), **{k: v for k, v in metrics.items() if not isinstance(v, list)})
    return dest


def main(argv: list[str] | None = None) -> int:
    from t1async.log import configure

    p = argparse.ArgumentParser(prog="python -m t1async.recipes.warmstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="learn", help=f"recipe name (known: {', '.join(RECIPES)})")
    p.add_argument("--cache", type=Path, default=None, help="cache root (default: $T1ASYNC_CACHE or ~/.cache/t1async)")
    p.add_argument(
        "--print-dir", action="store_true", help="print the model dir and whether it is built; build nothing"
    )
    p.add_argument("--steps", type=int, default=None, help="override the recipe's SFT steps (another recipe hash)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a busy 2-core box two threads waited on each other)",
    )
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    configure(level=args.log_level)
    try:
        recipe = get_recipe(args.recipe)
        if args.steps is not None:
            recipe = dataclasses.replace(recipe, sft=dataclasses.replace(recipe.sft, steps=args.steps))
        if args.print_dir:
            print(f"{cache_dir(recipe, args.cache)} {'built' if is_built(recipe, args.cache) else 'not built'}")
            return 0
        t0 = time.perf_counter()
        d = build(recipe, args.cache, threads=args.threads)
    except T1Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"warm start {recipe.name}: {d} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
