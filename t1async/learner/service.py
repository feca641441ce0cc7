"""The learner service: consume trajectories, serve credits, train, publish weights (design §1, §7).

    ingest  ─ T1_TRAJ (durable consumer) → validated → journal (fsync) → ack → credits delivered → TITO
              assembly; a record no step could use goes to t1.dead.<reason> instead (ingest/stage.py)
    credits ─ t1.credit: held until the staleness rule grants (credits/)
    train   ─ wait for B turns and the step's due credits → step inputs (learner/stepinputs.py) →
              PPO step (R3) → checkpoint →
              /update_weights_from_disk on every sampler → t1.policy → t1.metrics.learner

A restarted learner loads its newest full checkpoint, trains again the steps it recorded since up to the
newest version it pushed (an export: learner/stepinputs.py), so no version the samplers saw goes back; then
it replays its journal to rebuild every episode's context and skips the turns trained into those weights: no
admitted turn is lost, none is trained twice.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import numpy as np

from t1async.credits.ledger import CreditGate, CreditLedger, StalenessHistogram
from t1async.credits.liveness import ActorLiveness, watch_actors
from t1async.credits.server import CreditServer
from t1async.credits.settle import Key, Settler, StepLog, loss_turns, read_step_log
from t1async.curves import Curves, learner_scalars
from t1async.ingest.assembly import Assembler
from t1async.ingest.journal import Journal
from t1async.ingest.poison import PoisonBook
from t1async.ingest.stage import Ingest
from t1async.ingest.tito import Segment
from t1async.ingest.validate import ModelLimits
from t1async.learner import malloc
from t1async.learner.checkpoint import CheckpointInfo, checkpoint_dir, latest_checkpoint, list_exports, weight_diff
from t1async.learner.distributed import RankFailedError
from t1async.learner.pushcheck import PushCheck, PushCheckError
from t1async.learner.settings import LearnerConfig
from t1async.learner.state import LearnerState
from t1async.learner.stepinputs import (
    StepInputs,
    load_step_inputs,
    prune_step_inputs,
    recorded_steps,
    save_step_inputs,
)
from t1async.learner.trainer import Trainer
from t1async.learner.trainer_config import TrainerConfig, torch_device
from t1async.log import get_logger
from t1async.model.tokenizer import ChatTokenizer
from t1async.model.weights import default_model_dir, load_pretrained
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError
from t1async.sampler.client import SGLangClient
from t1async.transport.base import Transport, traj_subject

log = get_logger("t1async.learner")


def routes_missing(segments: list[Segment]) -> int:
    """Loss tokens predicted from a position with no recorded route in some layer (a token's log-prob comes from
    the forward at the position before it), so trained on the learner's own routing there (design §6). The last
    position of a sequence has no route by construction, and predicts nothing that is trained."""
    n = 0
    for s in segments:
        if s.routing is None:
            n += int(s.loss_mask.sum())
        else:
            routeless = np.asarray((s.routing < 0).any(axis=(1, 2)), dtype=bool)
            before = np.concatenate([[True], routeless[:-1]])
            n += int((s.loss_mask & before).sum())
    return n


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (no bytes copied), or a copy where the file system has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class Learner:
    """Composes ingest (``Ingest``: journal, poison, assembly), the credits (gate, server, settler, actors'
    liveness) and the trainer; owns the policy version, the trained-turns state and the step loop."""

    def __init__(
        self,
        config: LearnerConfig,
        transport: Transport,
        samplers: SGLangClient | None,
        *,
        make_trainer: Callable[[Path, TrainerConfig], Trainer] | None = None,
    ) -> None:
        if config.run_dir is None:
            raise ConfigError("the learner needs a run dir: LearnerConfig(run_dir=...), learner serve --run-dir DIR")
        run_dir = config.run_dir
        self.cfg, self.transport, self.samplers = config, transport, samplers
        ckpt = latest_checkpoint(config.checkpoints)
        # a state is only ever paired with the checkpoint of its version: a state saved just before a crash
        # that lost its checkpoint names turns whose training never reached the weights
        self.state = LearnerState()
        model_dir = config.model or default_model_dir()
        src = ckpt.path if ckpt else model_dir
        if make_trainer is None:  # fp32 weights (--train-dtype bfloat16 autocasts the forward) on --device
            self.trainer = Trainer(load_pretrained(src).to(torch_device(config.device)), config)
        else:  # learner.ranks.make_trainer: every rank reads its own shards of src (design §10)
            self.trainer = make_trainer(src, config)
        if config.kl_ref_coef > 0:  # the anchor is RL's start, also when resuming from a later checkpoint
            self.trainer.load_reference(model_dir)  # at N ranks each reads its own shards
        self.model = self.trainer.model
        if config.hf_format and not self.model.cfg.architecture:  # the in-house model is a Mixtral of its shape
            self.model.cfg = dataclasses.replace(self.model.cfg, architecture=config.hf_format)
            self.trainer.mcfg = self.model.cfg  # the format its checkpoints and pushes are written in
        self.tokenizer = ChatTokenizer.load(model_dir)
        self.resumed_from: CheckpointInfo | None = None
        self.inputs_dir = run_dir / "learner" / "inputs"  # each step's segments since the last checkpoint
        self._saved_version = ckpt.policy_version if ckpt else 0  # the newest checkpoint's (0: the initial weights)
        self._exported_version: int | None = None  # the version of the newest push-only export
        if ckpt is not None:
            self.trainer.load(ckpt.path)
            self.state = LearnerState.load(config.checkpoints, ckpt.policy_version)
            self.resumed_from = ckpt
        self._resume_pushed()
        self.policy_version = self.state.policy_version
        self.gate = CreditGate(
            CreditLedger(config.max_staleness, config.batch_turns, config.lease, self.policy_version)
        )
        self.liveness = ActorLiveness(config.actor_timeout)
        self.credits = CreditServer(self.gate, transport, on_actor=self.liveness.seen)
        self.settler = Settler(self.gate, self.credits, lambda ep, t: self.state.was_trained(ep, t))
        self.step_log = StepLog(run_dir / "learner" / "steps.jsonl")
        self.ingest = Ingest(
            run_dir / "learner",
            ModelLimits.of(self.model.cfg),
            transport,
            settler=self.settler,
            gate=self.gate,
            credits=self.credits,
            liveness=self.liveness,
            policy_version=lambda: self.policy_version,
            durable=config.durable,
            journal_file_bytes=config.journal_file_bytes,
        )
        self.inputs = StepInputs(self.ingest, self.gate, self.settler, config.max_staleness)
        self.untrained = self.settler.untrained  # delivered, not settled: (episode, turn) -> oldest version
        self.hist = StalenessHistogram()
        self.last_step: dict = {}
        self.t0 = time.monotonic()
        self.weight_pusher: Any = None  # --weight-sync distributed: a learner.weightpush.DistributedPusher
        hint = ""
        if getattr(samplers, "engine", "") == "vllm":
            from t1async.sampler.vllm_client import cpu_head_dim_hint

            hint = cpu_head_dim_hint(self.model.cfg.head_dim)
        self.push_check = (
            PushCheck(samplers, config.push_check, self.model.cfg.vocab_size, hint)
            # HTTP samplers only: an in-process sampler (tests' MemorySampler) has no server to probe
            if getattr(samplers, "urls", None) and config.push_check_every > 0
            else None
        )
        self.r3_missing_tokens = 0  # loss tokens trained without the sampler's routes (learner's own routing)
        self.busy_s = 0.0  # seconds spent in steps (train, checkpoint, push) since start: the dashboard's busy share
        self.curves = None
        if config.tensorboard:
            self.curves = Curves(run_dir / "tensorboard" / "learner", wandb=config.wandb, name=run_dir.name)

    # ingest's, named here too: what tests and tools read of a learner
    @property
    def journal(self) -> Journal:
        return self.ingest.journal

    @property
    def poison(self) -> PoisonBook:
        return self.ingest.poison

    @property
    def assembler(self) -> Assembler:
        return self.ingest.assembler

    @property
    def stale_masked_tokens(self) -> int:
        return self.inputs.stale_masked_tokens

    # ------------------------------------------------------------------------------------------ the loop

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        for s in self.ingest.replay():  # bad records found replaying the journal
            await self.ingest.dead_letter(s)
        self.liveness.restart_clocks()
        await self._sync_samplers()
        async with anyio.create_task_group() as tg:
            await tg.start(self.credits.serve)
            await tg.start(watch_actors, self.liveness, self.transport, self._release_actor, self._release_orphans)
            await tg.start(self.ingest.run)
            tg.start_soon(self._metrics_loop)
            task_status.started()
            log.info(
                "learner.ready",
                policy_version=self.policy_version,
                eta=self.cfg.max_staleness,
                batch_turns=self.cfg.batch_turns,
                resumed=str(self.resumed_from.path) if self.resumed_from else None,
            )
            try:
                while not self.cfg.steps or self.state.step < self.cfg.steps:
                    await self._wait_for_batch()
                    await self._train_step()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._save_at_exit()
            await self._publish_metrics()
            tg.cancel_scope.cancel()
        log.info("learner.done", steps=self.state.step, policy_version=self.policy_version)

    async def _wait_for_batch(self) -> None:
        while True:
            if len(self.untrained) >= self.cfg.batch_turns:
                await self.gate.wait_trainable(self.policy_version)
                if len(self.untrained) >= self.cfg.batch_turns:
                    return
            await self._next_arrival()

    async def _next_arrival(self, timeout_s: float = 1.0) -> None:
        arrived = self.ingest.arrived
        with anyio.move_on_after(timeout_s):
            await arrived.wait()

    async def _train_step(self) -> None:
        segments = self.inputs.take(self.policy_version, self.state.trained)
        if not segments:  # nothing trainable yet (a turn waits for an earlier one): wait for more to arrive
            await self._next_arrival()
            return
        v = self.policy_version
        missing = routes_missing(segments) if self.model.cfg.n_experts > 1 else 0
        if missing and self.cfg.require_routes:
            raise ConfigError(
                f"{missing} loss tokens of this step's turns came without the sampler's MoE routes, and "
                "--require-routes refuses them: start the sampler with routes (SGLang/vLLM "
                "--enable-return-routed-experts, GPU only for vLLM) or drop --require-routes"
            )
        self.r3_missing_tokens += missing
        t_start = time.monotonic()
        t_ckpt = t_push = 0.0
        checked: dict[str, float] = {}
        self.credits.set_training(True)
        try:
            self._exported_version = None  # the weights leave the version they held
            # a stop waits for the step and its save (the thread runs on anyway): the weights then hold a version
            with anyio.CancelScope(shield=True):
                self.step_log.write(v, segments)  # what this step trains, before it trains it (settle.StepLog)
                if self.cfg.checkpoint_every > 1:  # and its segments, for a restart to train again (stepinputs)
                    await anyio.to_thread.run_sync(save_step_inputs, self.inputs_dir, v, segments)
                try:
                    m = await anyio.to_thread.run_sync(
                        lambda: self.trainer.step(segments, v, drift=self.ingest.drift())
                    )
                except RankFailedError:  # a rank of the distributed learner died: not the segments' fault, stop
                    raise
                except Exception as exc:  # noqa: BLE001 - no step may take the learner down: its segments go dead
                    await self._step_failed(segments, v, exc)
                    return
                await anyio.to_thread.run_sync(malloc.trim)  # the step's freed heap goes back to the kernel
                trained = loss_turns(segments)
                for s in segments:
                    self.hist.record(v, s.versions[s.loss_mask])
                self.policy_version = v + 1
                self.state = self.state.after_step(self.policy_version, self.state.step + 1, trained, m.loss_tokens)
                # a checkpoint every --checkpoint-every steps and at the last; between them a push-only export
                t_ckpt = time.monotonic()
                full = self.state.step % self.cfg.checkpoint_every == 0 or self.state.step == self.cfg.steps
                ckpt = await self._save(full)
                t_ckpt = time.monotonic() - t_ckpt
            self.settler.settle(trained, "trained")
            self.inputs.forget_unreachable()
            if self.weight_pusher is not None:  # the same weights as the checkpoint, over the group
                t_push = time.monotonic()
                await self.weight_pusher.push(self.trainer.export_model(), self.policy_version)  # gathered by save
                t_push = time.monotonic() - t_push
            elif self.samplers is not None:
                t_push = time.monotonic()
                await self.samplers.update_weights_from_disk(str(ckpt.path), self.policy_version)
                t_push = time.monotonic() - t_push
            checked = await self._check_push(ckpt.path)
            self.gate.on_version(self.policy_version)
        finally:
            self.credits.set_training(False)
        wall = time.monotonic() - t_start
        self.busy_s += wall
        self.last_step = {
            **m.to_dict(),
            "turns_trained_step": len(trained),
            "t_checkpoint_s": t_ckpt,
            "t_push_s": t_push,
            "t_step_wall_s": wall,
            "r3_missing_tokens_step": missing,
            **checked,
        }
        await self.transport.publish(
            "t1.policy", wire.PolicyRecord(self.policy_version, self.state.step, str(ckpt.path))
        )
        log.info(
            "learner.step",
            step=self.state.step,
            policy_version=self.policy_version,
            turns=len(trained),
            loss=round(m.loss, 4),
            dlogp=round(m.mean_abs_dlogp, 5),
            mismatch=round(m.mismatch, 5),
            policy_shift=round(m.policy_shift, 5),
            routing_drift=round(m.routing_drift, 4),
            max_staleness=self.hist.max,
        )
        await self._publish_metrics()
        if self.curves is not None:  # the step's curves in TensorBoard (t1async.curves), at the version it made
            self.curves.scalars(self.policy_version, learner_scalars(self.last_step, self.metrics()))
        if self._saved_version == self.policy_version:  # only turns a checkpoint holds leave the journal
            await self.ingest.compact()

    async def _save(self, full: bool) -> CheckpointInfo:
        """A checkpoint of this version (with ``full``: its state first, as a checkpoint is only ever loaded
        together with the state of its version), else a push-only export. The journal keeps every turn trained
        since the last checkpoint (``_train_step`` compacts only after one), so a crash between checkpoints
        replays and trains them again from it."""
        if full:
            self.state.save(self.cfg.checkpoints, keep=self.cfg.keep_checkpoints + 1)
        ckpt = await anyio.to_thread.run_sync(
            lambda: self.trainer.save(
                self.cfg.checkpoints,
                self.policy_version,
                tokenizer=self.tokenizer,
                keep=self.cfg.keep_checkpoints,
                full=full,
            )
        )
        if full:
            self._saved_version = self.policy_version
            prune_step_inputs(self.inputs_dir, self.policy_version)  # this checkpoint holds their training
        else:
            self._exported_version = self.policy_version
        return ckpt

    # ------------------------------------------------------------------------------------------ resume

    def _resume_pushed(self) -> None:
        """At start-up, after loading the newest full checkpoint (version c; 0 and the initial weights when
        there is none): train again the recorded steps c .. e-1 (learner/stepinputs.py), e being the newest
        push-only export, so the learner goes on from the version the samplers were last pushed, not an older
        one. A step recorded without its export was in flight at the crash: superseded, as before. Then a full
        checkpoint of e (the restart is done once), its weights compared with the export's: bit-equal on one
        CPU rank; a difference past what AdamW could move them in those steps is logged as a warning."""
        root, c = self.cfg.checkpoints, self.state.policy_version
        for side in root.glob(".tmp-replayed-*") if root.is_dir() else []:  # left by a crash during this
            shutil.rmtree(side, ignore_errors=True)
        e = max((int(p.name[1:]) for p in list_exports(root) if int(p.name[1:]) > c), default=None)
        if e is None:
            return
        missing = sorted(set(range(c, e)) - set(recorded_steps(self.inputs_dir)))
        if missing:
            log.warning(
                "learner.resume_replay_missing",
                checkpoint_version=c,
                pushed_version=e,
                missing_steps=missing[:5],
                hint=f"the samplers were pushed version {e}, this learner goes on from {c}: the steps recorded "
                f"under {self.inputs_dir} do not reach it",
            )
            return
        t0 = time.monotonic()
        logged = read_step_log(self.cfg.run_dir / "learner" / "steps.jsonl") if self.cfg.run_dir else {}
        state = self.state
        for v, trained, tokens in self._train_recorded(c, e):
            if [[ep, t] for ep, t in trained] != logged.get(v, {}).get("turns"):
                log.error("learner.resume_replay_mismatch", policy_version=v, hint="steps.jsonl names other turns")
            state = state.after_step(v + 1, state.step + 1, trained, tokens)
        # the replayed turns were trained before this process: not its throughput
        self.state = dataclasses.replace(state, session_turns=0, session_tokens=0)
        side = root / f".tmp-replayed-v{e:06d}-{os.getpid()}"  # the export, hard-linked: the checkpoint replaces it
        shutil.copytree(checkpoint_dir(root, e), side, copy_function=_link_or_copy)
        self.state.save(root, keep=self.cfg.keep_checkpoints + 1)
        ckpt = self.trainer.save(root, e, tokenizer=self.tokenizer, keep=self.cfg.keep_checkpoints, full=True)
        self._saved_version, self.resumed_from = e, ckpt
        prune_step_inputs(self.inputs_dir, e)
        lr = max(self.cfg.lr, self.cfg.value_lr or 0.0)  # AdamW moves a weight by about lr a step at most
        diff = weight_diff(side, ckpt.path, tol=2 * lr * (e - c))
        shutil.rmtree(side, ignore_errors=True)
        log.info(
            "learner.resume_replayed",
            checkpoint_version=c,
            policy_version=e,
            steps=e - c,
            **diff,
            t_s=round(time.monotonic() - t0, 2),
        )
        if diff["beyond"]:
            log.warning(
                "learner.resume_replay_differs",
                policy_version=e,
                **diff,
                hint="the replayed weights are not those pushed: another --lr, model or batch than the run's, "
                "or state the checkpoint lacks (--critic-warmup's fit, a GPU's nondeterministic kernels); "
                "the samplers get the replayed weights",
            )

    def _train_recorded(self, first: int, upto: int) -> list[tuple[int, list[Key], int]]:
        """Train the recorded steps ``first .. upto-1`` in order, from weights at ``first``: each step's
        (version, turns trained, loss tokens)."""
        out = []
        for v in range(first, upto):
            segments = load_step_inputs(self.inputs_dir, v)
            m = self.trainer.step(segments, v)
            out.append((v, loss_turns(segments), m.loss_tokens))
        return out

    async def _save_at_exit(self) -> None:
        """At shutdown: a checkpoint of the version the weights hold, when its step saved only an export."""
        if self._exported_version == self.policy_version != self._saved_version:
            await self._save(True)
            log.info("learner.checkpoint_at_exit", policy_version=self.policy_version)

    # ------------------------------------------------------------------------------------------ failures

    async def _step_failed(self, segments: list[Segment], policy_version: int, exc: Exception) -> None:
        """Trainer.step raised despite validation: ingest dead-letters the step's segments and poisons their
        episodes (so no restart retries it); then the weights go back to ``policy_version`` (it may have stepped),
        and the learner goes on."""
        await self.ingest.step_failed(segments, policy_version, exc)
        # after the poison book: if restoring fails too, the restarted learner loads the checkpoint itself and
        # never retries this step
        restored = await anyio.to_thread.run_sync(self._restore, policy_version)
        log.info("learner.weights_restored", policy_version=policy_version, source=restored)
        await self._publish_metrics()

    def _restore(self, policy_version: int) -> str:
        """The weights and AdamW state back at ``policy_version``: its checkpoint, else the newest one (or the
        initial weights) and the steps recorded since trained again. Returns what it loaded."""
        initial = self.cfg.model or default_model_dir()
        ckpt = latest_checkpoint(self.cfg.checkpoints)
        c = ckpt.policy_version if ckpt is not None else 0
        if c == policy_version or set(range(c, policy_version)) - set(recorded_steps(self.inputs_dir)):
            return self.trainer.restore(self.cfg.checkpoints, policy_version, initial)
        source = self.trainer.restore(self.cfg.checkpoints, c, initial)
        self._train_recorded(c, policy_version)
        return f"{source} + {policy_version - c} recorded steps"

    async def _release_actor(self, actor: str) -> None:
        """``actor`` went silent: free its running credits now and end its open episodes as ``aborted`` (the
        end goes through the stream like an actor's own, so it is journaled and assembled in order)."""
        freed = self.gate.release_actor(actor)
        self.credits.forget(actor=actor)
        episodes = self.liveness.episodes_of(actor)
        await self._abort(episodes, f"the learner ended it: actor {actor} silent for {self.liveness.timeout_s:g} s")
        if episodes or freed:
            self.liveness.timeouts += 1
            log.warning(
                "learner.actor_silent",
                actor=actor,
                credits_released=freed,
                episodes_aborted=len(episodes),
                timeout_s=self.liveness.timeout_s,
            )

    async def _release_orphans(self, actor: str, episodes: list[str]) -> None:
        """``actor`` restarted (a heartbeat from a newer process): the open episodes its earlier process left
        are ended as ``aborted`` now and their credits freed, as for a silent actor but at once."""
        freed = sum(self.gate.release_episode(ep) for ep in episodes)
        self.credits.forget(episodes=set(episodes))
        await self._abort(episodes, f"the learner ended it: actor {actor} restarted")
        log.warning("learner.actor_restarted", actor=actor, credits_released=freed, episodes_aborted=len(episodes))

    async def _abort(self, episodes: list[str], why: str) -> None:
        """End each open episode as ``aborted`` through the stream (journaled and assembled in order, like an
        actor's own end); one that ended but lacks a turn before its end is stopped there instead."""
        for ep in episodes:
            a = self.ingest.assembler.open.get(ep)
            if a is not None and a.end_record is not None:  # ended, but a turn before its end never came: stop
                self.ingest.stop(ep, a.next_turn)  # there (a restart stops it again)
                continue
            end = wire.EndRecord(ep, a.next_turn if a is not None else 0, wire.EndReason.ABORTED, 0, 0, False, why)
            await self.transport.publish(traj_subject(ep), end)

    # ------------------------------------------------------------------------------------------ weights & metrics

    async def _check_push(self, path: Path | str) -> dict[str, float]:
        """The verified push (learner/pushcheck.py): what the samplers now serve against what was pushed; a
        failed check pushes once more by the same path, then stops the learner with PushCheckError."""
        if self.push_check is None:
            return {}

        async def repush() -> None:
            if self.weight_pusher is not None:
                await self.weight_pusher.push(self.trainer.export_model(), self.policy_version)
            elif self.samplers is not None:
                await self.samplers.update_weights_from_disk(str(path), self.policy_version)

        return await self.push_check.after_push(self.trainer.export_model(), self.policy_version, repush)

    async def _sync_samplers(self) -> None:
        """At start-up: make every sampler serve the checkpoint this learner continues from (after a resume), or
        check that it serves the learner's starting weights (a fresh run; vLLM's are labelled version 0 then)."""
        if self.samplers is not None and self.resumed_from is None and self.push_check is not None:
            got = await self.push_check.measure(self.trainer.export_model(), strict=True)
            bound = self.cfg.push_check.bound
            bad = {u: d for u, d in got.items() if d > bound}
            if bad:
                raise PushCheckError(
                    f"the sampler(s) {', '.join(bad)} serve other weights than the learner starts from "
                    f"({self.cfg.model or 'the shipped model'}): mean |Δlogp| "
                    f"{', '.join(f'{d:.4g}' for d in bad.values())} on the probe, bound {bound:g}; "
                    "start them on the same --model (or raise --push-check-bound for a bf16 sampler)"
                )
            set_version = getattr(self.samplers, "set_weight_version", None)
            if set_version is not None:  # vLLM: its version is a label the learner owns
                await set_version(self.policy_version)
            log.info("learner.samplers_checked", policy_version=self.policy_version, dlogp=got)
        if self.weight_pusher is not None and self.resumed_from is not None:
            model = await anyio.to_thread.run_sync(self.trainer.export_model)  # the full weights, on every rank
            await self.weight_pusher.push(model, self.policy_version)
            log.info("learner.samplers_synced", policy_version=self.policy_version, path="distributed")
        elif self.samplers is not None and self.resumed_from is not None:
            await self.samplers.update_weights_from_disk(str(self.resumed_from.path), self.policy_version)
            log.info("learner.samplers_synced", policy_version=self.policy_version, path=str(self.resumed_from.path))

    def metrics(self) -> dict:
        el = max(time.monotonic() - self.t0, 1e-9)
        ended = list(self.ingest.ended)
        drift = self.ingest.assembler.stats().as_dict()
        turns_trained = self.state.turns_trained
        return {
            "r3_missing_tokens": self.r3_missing_tokens,
            **{
                k: v
                for k, v in self.last_step.items()
                if isinstance(v, (int, float)) and k not in ("step", "policy_version")
            },
            "turns_trained": turns_trained,
            "t_busy_s": self.busy_s,
            "learner_ranks": int(getattr(self.trainer, "world", 1)),  # learner serve --nproc
            "turns_per_s": self.state.session_turns / el,
            "tokens_per_s": self.state.session_tokens / el if self.state.session_tokens else 0.0,
            "max_staleness": self.hist.max,
            "staleness_hist": self.hist.as_dict(),
            "eta": self.cfg.max_staleness,
            "drift": {k: int(drift.get(k, 0)) for k in ("clean", "realign", "fork")},
            "compactions": int(drift.get("compactions", 0)),  # context-policy compactions (FORKs by construction)
            "drift_detail": {k: v for k, v in drift.items() if isinstance(v, (int, float))},
            "episodes_ended": len(ended),
            "training": bool(self.credits.training),  # a step is running now (the dashboard's learner state)
            "untrained_turns": len(self.untrained),
            "journal_bytes": self.ingest.journal.size_bytes(),
            "rss_gb": malloc.rss_bytes() / 2**30,  # the learner process's resident memory now
            "journal_files": self.ingest.journal.files,
            "journal_blocked_s": self.ingest.blocked_s(),  # > 0: a full disk; ingest holds its batch unacked
            "poison": self.ingest.poison.metrics(),
            "stale_masked_tokens": self.inputs.stale_masked_tokens,
            "settled": dict(self.settler.counts),  # delivered turns settled, by reason (design §7)
            "ledger_size": self.gate.ledger.size,
            "actors_timed_out": self.liveness.timeouts,
            "policy_shift_by_staleness": dict(self.last_step.get("policy_shift_by_staleness", {})),
            "credits": self.gate.ledger.snapshot(),
            # over nothing there is no mean: absent until an episode has ended
            **(
                {
                    "reward_mean": float(np.mean([e.tests_passed for e in ended])),
                    "resolved_rate": float(np.mean([e.resolved for e in ended])),
                }
                if ended
                else {}
            ),
        }

    async def _publish_metrics(self) -> None:
        rec = wire.MetricsRecord("learner", self.state.step, self.policy_version, self.metrics())
        await self.transport.publish("t1.metrics.learner", rec)

    async def _metrics_loop(self) -> None:
        while True:
            await anyio.sleep(self.cfg.metrics_every_s)
            await self._publish_metrics()
